import dataclasses
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


def same_bits(a, b) -> bool:
    """Two tensors equal bit for bit: dtype, shape and every byte (NaNs and -0.0 included). A
    tensor's lazy conj/neg bit is not applied (tests that need it have their own: test_capture_hostile's
    raw, test_root_wrapper_hostile's plain)."""
    import torch

    a, b = a.detach(), b.detach()
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return a.contiguous().reshape(-1).view(torch.uint8).equal(b.contiguous().reshape(-1).view(torch.uint8))


@pytest.fixture(params=["native", "python"])
def kind(request, monkeypatch):
    """The Dumper's wrappers in C++ (native, the default) or all in Python (``_native_wrappers``
    False: torch.compile's path). A test module with other kinds defines its own."""
    if request.param == "python":
        monkeypatch.setattr("fastdump.capture.wrappers._native_wrappers", False)
    return request.param


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


def write_rank_dir(path, passes, *, role="target", rank=None, status="closed", stats=None, segment_passes=2,
                   pass_meta=lambda pass_id: {}):
    """A rank directory written by the real ChannelWriter from ``{pass_id: {name: tensor}}``: the
    tests' crafted dumps (tests then damage them, or read them back)."""
    import torch

    from fastdump import dtypes
    from fastdump.writer.channel_writer import ChannelWriter

    rank = rank or {"tp_rank": 0, "tp_size": 1, "pp_rank": 0, "pp_size": 1, "rank": 0}
    writer = ChannelWriter({"op": "open", "channel": 0, "dir": str(path), "role": role, "rank": rank,
                            "pid": 100, "host": "h", "device": {}, "config": {"segment_passes": segment_passes}})
    names = {}
    for pass_id, tensors in passes.items():
        writer.on_begin(pass_id, pass_meta(pass_id))
        for name, t in tensors.items():
            if name not in names:
                names[name] = len(names)
                writer.on_name(names[name], name)
            data = t.contiguous().reshape(-1).view(torch.uint8).numpy().copy()
            writer.on_tensor(names[name], pass_id, dtypes.code_of(t.dtype), tuple(t.shape), data)
        writer.on_end(pass_id, {}, 0, [], sent=len(tensors))  # (the count a producer's end record carries)
    writer.close(stats or {}, status=status)
    return path


def mount_small_tmpfs(tmp_path, size: str):
    """A tmpfs of ``size`` (e.g. "512k") under tmp_path to fill up: yields its path; skips, saying
    why, where mounting needs a root this test does not have."""
    import subprocess

    mnt = tmp_path / "small"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mnt)], capture_output=True,
                       text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs to fill (needs root): {r.stderr.strip()}")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)])


def restamp_tables(path) -> None:
    """Recompute a segment's ``tables_crc32c`` after a test rewrote its tables: the file then looks
    like one a faulty writer wrote consistently, which the structural checks must catch on their
    own (a table changed on disk without this is caught by the checksum first)."""
    import h5py
    import numpy as np

    from fastdump import format as fmt

    with h5py.File(path, "r+") as f:
        if f.attrs.get("format_version", 0) < 3:
            return
        value = fmt.tables_crc32c(f[fmt.NAMES][()], f[fmt.INDEX][()], f[fmt.PASSES][()], f[fmt.PASS_META][()])
        f.attrs[fmt.ATTR_TABLES_CRC] = np.int64(value)


def flatten_output(name, value, into: dict) -> None:
    """fastdump's naming of one module output, as clones into ``into``: a tensor under ``name``,
    tuple/list parts ``.i``, dict (and ModelOutput) keys ``.key``, dataclass fields ``.field``."""
    import torch

    if isinstance(value, torch.Tensor):
        into[name] = value.detach().clone()
    elif isinstance(value, (tuple, list)):
        for i, v in enumerate(value):
            flatten_output(f"{name}.{i}", v, into)
    elif isinstance(value, dict):
        for k, v in value.items():
            flatten_output(f"{name}.{k}", v, into)
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for f in dataclasses.fields(value):
            flatten_output(f"{name}.{f.name}", getattr(value, f.name), into)


def read_rank_json(rank_dir) -> dict:
    """A rank directory's rank.json with its segment list under ``"segments"`` whatever the format
    (from format 5 the list is segments.jsonl's committed lines): what tests edit."""
    from fastdump import fsutil, segment_list

    info = fsutil.load_json(os.path.join(rank_dir, "rank.json"))
    if segment_list.appended(info):
        entries, problem, _ = segment_list.read(str(rank_dir), info)
        assert problem is None, problem
        info["segments"] = entries
    return info


def write_rank_json(rank_dir, info) -> None:
    """Write back ``info`` (read_rank_json's, edited) as its format keeps it: from format 5, its
    ``"segments"`` as segments.jsonl, committed (lines, bytes, CRC32C) in rank.json, as the writer
    does; so an edited list reads as one a faulty writer wrote, not as a damaged file."""
    import json

    from fastdump import _C, segment_list
    from fastdump import format as fmt

    info = dict(info)
    if segment_list.appended(info):
        data = b"".join(json.dumps(entry).encode("ascii") + b"\n" for entry in info.pop("segments"))
        with open(os.path.join(rank_dir, fmt.SEGMENT_LIST_FILE), "wb") as f:
            f.write(data)
        info.update({fmt.LIST_COUNT: data.count(b"\n"), fmt.LIST_BYTES: len(data), fmt.LIST_CRC: _C.crc32c(data)})
    with open(os.path.join(rank_dir, "rank.json"), "w") as f:
        json.dump(info, f)


def as_format_4(rank_dir) -> None:
    """Turn a rank directory the writer wrote (format 5) into the format-4 directory it was before
    format 5: the list back in rank.json, segments.jsonl gone, every file saying version 4 (segment
    files are laid out as in 4; the version attribute is covered by no checksum)."""
    import h5py

    from fastdump import format as fmt

    info = read_rank_json(rank_dir)
    for key in (fmt.LIST_COUNT, fmt.LIST_BYTES, fmt.LIST_CRC):
        del info[key]
    info["format_version"] = 4
    os.unlink(os.path.join(rank_dir, fmt.SEGMENT_LIST_FILE))
    write_rank_json(rank_dir, info)
    for name in os.listdir(rank_dir):
        if fmt.segment_number(name) is not None:
            with h5py.File(os.path.join(rank_dir, name), "r+") as f:
                f.attrs["format_version"] = 4


def open_fds_where(test) -> list:
    """The numbers of this process's open descriptors whose target path passes ``test``. A descriptor
    another thread closes while we look (a writer thread's segment) is skipped, not an error."""
    held = []
    for n in os.listdir("/proc/self/fd"):
        try:
            target = os.path.realpath(f"/proc/self/fd/{n}")
        except OSError:  # (closed meanwhile: /proc/self/fd/N is gone)
            continue
        if test(target):
            held.append(int(n))
    return held
