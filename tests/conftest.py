import os
import signal
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))


def pytest_collection_modifyitems(config, items):
    try:
        import torch

        have_gpu = torch.cuda.is_available()
    except ImportError:
        have_gpu = False
    skip = pytest.mark.skip(reason="needs a CUDA GPU (none visible to torch)")
    for item in items:
        if "cuda" in item.keywords and not have_gpu:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _no_leaked_writers():
    """Every test leaves no engine behind (a leak would bleed into the next test)."""
    yield
    from fastdump.staging.engine import Engine

    eng = Engine._current
    if eng is not None and not eng.closed and eng.pid == os.getpid():
        eng.shutdown()
        Engine._current = None
        pytest.fail("a test left a fastdump engine running (a Dumper was not closed)")


# --- shared helpers (import them: ``from conftest import doc_example``) ---------------------------

DOCS = Path(__file__).resolve().parents[1] / "docs"


def doc_example(name, page="INTEGRATIONS.md"):
    """The python block after ``<!-- example: name -->`` in docs/<page>: tests run the docs' code."""
    import re

    m = re.search(rf"<!-- example: {name} -->\s*```python\n(.*?)```", (DOCS / page).read_text(), re.S)
    assert m, f"example {name!r} missing from {DOCS / page}"
    return m.group(1)


def require_o_direct(directory) -> None:
    """Skip (saying why) when ``directory``'s filesystem refuses O_DIRECT (tmpfs, some overlays)."""
    path = os.path.join(directory, "o_direct_probe")
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_DIRECT))
    except (OSError, AttributeError):
        pytest.skip(f"{directory} refuses O_DIRECT")
    os.unlink(path)


@pytest.fixture
def o_direct_bytes(monkeypatch):
    """A list that gets, for every segment file closed, the bytes it wrote with O_DIRECT."""
    from fastdump.writer import segment_file

    recorded = []
    real_close_fd = segment_file.OpenSegment.close_fd

    def recording_close_fd(self):
        if self._fd is not None:
            recorded.append(self.direct_bytes)
        real_close_fd(self)

    monkeypatch.setattr(segment_file.OpenSegment, "close_fd", recording_close_fd)
    return recorded
