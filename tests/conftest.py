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
