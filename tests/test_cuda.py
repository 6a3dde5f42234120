"""The CUDA staging path.

Three layers:
  * CPU unit tests of fastdump/staging/cuda.py (dtype mapping for the CUDA array interface and DLPack,
    capsule parsing, fallbacks, status): run everywhere.
  * The real csrc/cuda_staging.cu compiled against a mock CUDA runtime (tests/cuda_mock: streams are
    threads with random delays, events are stream tickets): exercises ring allocation, chunking,
    stream ordering of the snapshot, publish order, drop/block, writer death, failure paths and
    teardown on machines without a GPU. Needs a C++ compiler (skipped otherwise).
  * GPU tests (marked ``cuda``) through the public API; skipped without a GPU or without CUDA
    compiled into fastdump._C.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import fastdump
from fastdump import _C, devices, dtypes

from conftest import same_bits

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE / "cuda_mock"))


def torch_dtypes():
    """(name, torch dtype) for every fastdump dtype this torch has."""
    out = []
    for name in dtypes.NAMES:
        dt = getattr(torch, name, None)
        if isinstance(dt, torch.dtype):
            out.append((name, dt))
    return out


SEEDS = [1, 2, 3, 7, 11]  # for the tests whose outcome depends on stream timing in the mock

_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def raw_bytes(t: torch.Tensor) -> bytes:
    """C-order bytes of any CPU tensor (shell dtypes such as uint1 have no copy kernel)."""
    size = t.element_size()
    if size in _INT_OF_SIZE and t.dtype not in _INT_OF_SIZE.values():
        t = t.view(_INT_OF_SIZE[size])
    return t.contiguous().numpy().tobytes()


def random_tensor(dt, shape, device="cpu", seed=0):
    """Random bits of any dtype (bit types and float8 included) with the given shape."""
    g = torch.Generator().manual_seed(seed)
    size = torch.empty(0, dtype=dt).element_size()
    n = int(np.prod(shape)) if shape else 1
    raw = torch.randint(0, 256, (n * size,), dtype=torch.uint8, generator=g)
    if dt == torch.bool:
        raw = raw % 2
    t = raw.view(dt).reshape(shape)
    return t.to(device) if device != "cpu" else t


# =================================================================================================
# CPU unit tests of fastdump/staging/cuda.py


def test_importing_fastdump_does_not_import_cuda_glue():
    code = ("import sys, fastdump, fastdump.capture, fastdump.staging.engine; "
            "assert 'fastdump.staging.cuda' not in sys.modules, 'fastdump.staging.cuda imported eagerly'; "
            "assert 'fastdump.devices' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


@pytest.mark.parametrize("typestr,name", [
    ("<f4", "float32"), ("<f8", "float64"), ("<f2", "float16"), ("|b1", "bool"), ("|i1", "int8"),
    ("<i1", "int8"), ("|u1", "uint8"), ("<i2", "int16"), ("<u2", "uint16"), ("<i4", "int32"),
    ("<u4", "uint32"), ("<i8", "int64"), ("<u8", "uint64"), ("<c8", "complex64"), ("<c16", "complex128"),
    ("=f4", "float32"), (">u1", "uint8"),
])
def test_cai_typestr_to_code(typestr, name):
    from fastdump.staging import cuda

    assert cuda.cai_dtype_code(typestr) == dtypes.CODE_BY_NAME[name]


@pytest.mark.parametrize("typestr", [">f4", "<V2", "|O8", "<M8", "f4", ""])
def test_cai_typestr_refused(typestr):
    from fastdump.staging import cuda

    with pytest.raises(ValueError):
        cuda.cai_dtype_code(typestr)


def test_cai_typestrs_of_numpy_match_fastdump_codes():
    from fastdump.staging import cuda

    for name in ["float16", "float32", "float64", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32",
                 "uint64", "bool", "complex64", "complex128"]:
        assert cuda.cai_dtype_code(np.dtype(name).str) == dtypes.CODE_BY_NAME[name], name


def test_dlpack_codes_of_every_torch_dtype():
    """Every dtype torch exports through DLPack maps back to its own fastdump code."""
    from fastdump.staging import cuda

    checked = []
    for name, dt in torch_dtypes():
        t = random_tensor(dt, (3, 4))
        try:
            capsule = t.__dlpack__()
        except (RuntimeError, BufferError, TypeError):
            continue  # bit types: torch refuses to export them
        v = cuda.dlpack_view(capsule)
        if name in ("uint1", "uint2", "uint3", "uint4", "uint5", "uint6", "uint7"):
            assert cuda.dlpack_dtype_code(v["code"], v["bits"], v["lanes"]) == dtypes.CODE_BY_NAME["uint8"]
            continue
        if name in ("int1", "int2", "int3", "int4", "int5", "int6", "int7"):
            assert cuda.dlpack_dtype_code(v["code"], v["bits"], v["lanes"]) == dtypes.CODE_BY_NAME["int8"]
            continue
        assert cuda.dlpack_dtype_code(v["code"], v["bits"], v["lanes"]) == dtypes.code_of(dt), name
        assert v["shape"] == [3, 4] and v["strides"] == [4, 1]
        assert v["ptr"] == t.data_ptr() and v["device_type"] == 1
        checked.append(name)
    for must in ("float32", "bfloat16", "float16", "bool", "float8_e4m3fn", "float8_e5m2", "complex64", "int64"):
        assert must in checked


def test_dlpack_view_strides_offsets_and_versioned_capsules():
    from fastdump.staging import cuda

    base = torch.arange(60, dtype=torch.float32).reshape(5, 12)
    view = base[1:4, 2::3]
    v = cuda.dlpack_view(view.__dlpack__())
    assert v["shape"] == [3, 4] and v["strides"] == [12, 3]
    assert v["ptr"] == view.data_ptr()
    try:
        capsule = view.__dlpack__(max_version=(1, 0))
    except TypeError:
        pytest.skip("this torch has no versioned DLPack export")
    v2 = cuda.dlpack_view(capsule)
    assert v2["ptr"] == view.data_ptr() and v2["shape"] == [3, 4] and v2["strides"] == [12, 3]


def test_dlpack_unknown_dtype_refused():
    from fastdump.staging import cuda

    with pytest.raises(ValueError):
        cuda.dlpack_dtype_code(3, 64, 1)  # opaque handle
    with pytest.raises(ValueError):
        cuda.dlpack_dtype_code(2, 32, 4)  # float32x4 vector


class _FakeEngine:
    """What stage_array needs from fastdump.staging.engine.Engine: .producer and .cuda_stager(mb)."""

    def __init__(self, producer, stager=None):
        self.producer = producer
        self.stager = stager
        self.asked = []

    def cuda_stager(self, device_ring_mb):
        self.asked.append(device_ring_mb)
        return self.stager


class Ring:
    """A producer/consumer pair of any _C module (the real one or the mock build)."""

    def __init__(self, mod, capacity=4 << 20, chunk=0):
        self.mod = mod
        self.producer = mod.Producer(f"/fdtest-{os.getpid()}-{id(self)}", capacity, chunk)
        self.consumer = mod.Consumer(self.producer.name)
        self.producer.unlink()

    def read(self, timeout=0.3):
        """{(channel, name_id, pass_id): (dtype, shape, bytes)} of complete tensors, plus their order."""
        parts, order = {}, []
        while True:
            r = self.consumer.next(timeout)
            if r is None:
                break
            kind, channel, name_id, pass_id, dtype, shape, payload, seq, off, total = r
            if kind == self.mod.KIND_TENSOR:
                key = (channel, name_id, pass_id)
                if key not in parts:
                    parts[key] = [dtype, tuple(shape), bytearray(total), 0]
                    order.append(key)
                entry = parts[key]
                entry[2][off:off + len(payload)] = bytes(payload)
                entry[3] += len(payload)
            self.consumer.release()
        out = {}
        for key, (dtype, shape, data, filled) in parts.items():
            assert filled == len(data), f"{key}: torn tensor ({filled} of {len(data)} bytes)"
            out[key] = (dtype, shape, bytes(data))
        return out, order


def test_stage_array_numpy_through_dlpack_cpu():
    from fastdump.staging import cuda

    ring = Ring(_C)
    eng = _FakeEngine(ring.producer)
    arrays = [np.arange(24, dtype=np.float32).reshape(4, 6)[:, ::2], np.array([True, False, True]),
              (np.arange(12) * 1j).astype(np.complex64).reshape(3, 4).T, np.full((), 3.5)]
    for i, a in enumerate(arrays):
        status, nbytes = cuda.stage_array(eng, 64, 0, i, 7, a, True)
        assert status == _C.STAGED and nbytes == a.nbytes
    got, _ = ring.read()
    for i, a in enumerate(arrays):
        dtype, shape, data = got[(0, i, 7)]
        assert dtypes.NAMES[dtype] == a.dtype.name and shape == a.shape
        assert data == np.ascontiguousarray(a).tobytes()
    assert eng.asked == []  # host arrays never start CUDA staging


def test_numpy_arrays_through_the_public_api(tmp_path):
    """Dumper.dump of DLPack host arrays goes through cuda.stage_array and comes back bit for bit."""
    arrays = {"f32": np.arange(24, dtype=np.float32).reshape(4, 6)[:, 1::2],
              "bool": np.array([[True, False], [False, True]]).T,
              "c128": (np.arange(6) * (1 - 1j)).reshape(2, 3)}
    with fastdump.attach(None, tmp_path, tp_rank=0, tp_size=1, strict=True) as d:
        d.begin_pass()
        for name, a in arrays.items():
            d.dump(name, a)
        d.end_pass()
    got = fastdump.open(tmp_path).load("target", 0, 0)
    for name, a in arrays.items():
        assert np.array_equal(got[name].numpy(), a) and got[name].numpy().dtype == a.dtype, name


def test_status_warns_once_when_compiled_but_unusable(monkeypatch, caplog):
    from fastdump.staging import cuda

    monkeypatch.setattr(devices, "_cuda_info", {"compiled": True, "device_count": 0, "devices": [],
                                        "reason": "cudaErrorNoDevice (no CUDA-capable device is detected)"})
    monkeypatch.setattr(cuda, "_warned", set())
    with caplog.at_level(logging.WARNING, logger="fastdump"):
        s1 = cuda.status()
        s2 = cuda.status()
    assert s1["usable"] is False and s2["compiled"] is True
    warnings = [r for r in caplog.records if "unusable" in r.getMessage()]
    assert len(warnings) == 1 and "no CUDA-capable device" in warnings[0].getMessage()


def test_get_stager_falls_back_to_host_copies_when_unusable(monkeypatch, caplog):
    from fastdump.staging import cuda

    monkeypatch.setattr(devices, "_cuda_info", {"compiled": False, "reason": "built without a CUDA toolkit"})
    monkeypatch.setattr(cuda, "_warned", set())
    ring = Ring(_C)
    with caplog.at_level(logging.WARNING, logger="fastdump"):
        stager = cuda.get_stager(ring.producer, 8)
    assert isinstance(stager, cuda.HostFallbackStager) and "without a CUDA toolkit" in stager.reason
    assert any("unavailable" in r.getMessage() for r in caplog.records)
    t = random_tensor(torch.bfloat16, (5, 7)).t()
    assert cuda.stage_tensor(stager, 1, 2, 3, dtypes.code_of(t.dtype), t, True) == _C.STAGED
    assert stager.flush(1.0) and stager.stats()["tensors"] == 1
    got, _ = ring.read()
    assert got[(1, 2, 3)][2] == t.contiguous().view(torch.uint16).numpy().tobytes()
    stager.close()


class _Capture:
    """torch's view of the current stream's capture state, switched by the test (no GPU needed)."""

    def __init__(self, monkeypatch, capturing=True, current_device=0):
        self.capturing = capturing
        self.entered = []  # devices made current to ask (torch.cuda.device)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: current_device)
        monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: self.capturing)
        monkeypatch.setattr(torch.cuda, "device", self._device)

    def _device(self, index):
        import contextlib

        self.entered.append(index)
        return contextlib.nullcontext()


def _count_host_copies(monkeypatch):
    from fastdump.staging import cuda

    copies, real = [], cuda._to_host
    monkeypatch.setattr(cuda, "_to_host", lambda t: copies.append(t) or real(t))
    return copies


def _stand_in_cuda(cpu, device=0):
    """A tensor that says it is on a GPU; the host fallback copies its CPU bytes."""
    return FakeCudaTensor(cpu, cpu.data_ptr(), device)


@pytest.mark.parametrize("device", [0, 1])
def test_host_fallback_never_copies_while_the_stream_captures(monkeypatch, device):
    """Review finding 4: the fallback's .cpu() on a capturing stream would invalidate the user's
    CUDA graph. It refuses the tensor as CAPTURING (counted, as the C++ stager counts it), copies
    nothing, and copies it again once the capture is over. The capture state asked is that of the
    tensor's GPU (the stream the copy would run on)."""
    from fastdump.staging import cuda

    capture = _Capture(monkeypatch)
    copies = _count_host_copies(monkeypatch)
    ring = Ring(_C)
    stager = cuda.HostFallbackStager(ring.producer, "test")
    cpu = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    t, code = _stand_in_cuda(cpu, device), dtypes.code_of(cpu.dtype)
    assert cuda.stage_tensor(stager, 0, 1, 0, code, t, True) == cuda.CAPTURING
    assert copies == [] and ring.producer.used_bytes() == 0
    assert stager.stats()["capturing_skipped"] == 1 and stager.stats()["tensors"] == 0
    assert capture.entered == ([] if device == 0 else [1])
    capture.capturing = False
    assert cuda.stage_tensor(stager, 0, 1, 1, code, t, True) == _C.STAGED
    assert len(copies) == 1
    got, _ = ring.read()
    assert set(got) == {(0, 1, 1)} and got[(0, 1, 1)][2] == cpu.numpy().tobytes()


def test_host_fallback_never_copies_on_the_legacy_stream_while_a_blocking_stream_captures(monkeypatch):
    """torch's capture query on the legacy default stream raises (cudaErrorStreamCaptureImplicit)
    while another thread's blocking stream captures: a .cpu() copy on the legacy stream then would
    invalidate that capture. The fallback takes the error for capturing: CAPTURING, nothing copied.
    A pass the Dumper's selection leaves out asks the same question (``_capture_running``): there the
    legacy stream itself captures nothing, so the pass stays left out."""
    from fastdump.staging import cuda

    capture = _Capture(monkeypatch)

    def implicit():
        if capture.capturing:
            raise RuntimeError("CUDA error: operation would make the legacy stream depend on a capturing "
                               "blocking stream")
        return False

    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", implicit)
    copies = _count_host_copies(monkeypatch)
    ring = Ring(_C)
    stager = cuda.HostFallbackStager(ring.producer, "test")
    cpu = torch.arange(6, dtype=torch.int32)
    t, code = _stand_in_cuda(cpu), dtypes.code_of(cpu.dtype)
    assert cuda.stage_tensor(stager, 0, 1, 0, code, t, True) == cuda.CAPTURING
    assert copies == [] and ring.producer.used_bytes() == 0
    monkeypatch.setattr(torch.cuda, "_initialized", True, raising=False)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    assert cuda._capture_running() is False
    capture.capturing = False
    assert cuda.stage_tensor(stager, 0, 1, 1, code, t, True) == _C.STAGED and len(copies) == 1


@pytest.mark.parametrize("how", ["freed", "shrunk", "one_element_short"])
def test_a_cuda_tensor_whose_storage_was_freed_or_shrunk_is_refused_by_both_python_paths(monkeypatch, how):
    """torch lets a storage be freed or shrunk under its tensors (``resize_(0)``, as FSDP does). The
    host fallback's .cpu() copied such a CUDA tensor unchecked (a null pointer faults; a shrunk
    storage has the copy read the memory after it, another tensor's, dumped as this one's), and the
    device path checked the null pointer only. Both refuse it now with the reason (the Dumper records
    the skip), nothing copied; a view inside its storage is still staged."""
    from fastdump.staging import cuda

    _Capture(monkeypatch, capturing=False)
    copies = _count_host_copies(monkeypatch)
    ring = Ring(_C)
    stager = cuda.HostFallbackStager(ring.producer, "test")
    cpu = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    t, code = _stand_in_cuda(cpu), dtypes.code_of(cpu.dtype)
    if how == "freed":
        t._ptr, reason = 0, _C.NO_DATA
    elif how == "shrunk":
        t._storage, reason = FakeStorage(cpu.data_ptr(), 8 * 4), _C.STORAGE_SHORT  # 8 of its 12 floats
    else:  # the last element lies past the storage's end: still refused (the bound is exact)
        t._storage, reason = FakeStorage(cpu.data_ptr(), 11 * 4), _C.STORAGE_SHORT
    with pytest.raises(ValueError) as refused:
        cuda.stage_tensor(stager, 0, 1, 0, code, t, True)
    assert str(refused.value) == reason
    with pytest.raises(ValueError) as refused:
        cuda.stage_on_device(None, 0, 0, 0, code, t, True)
    assert str(refused.value) == reason
    assert copies == [] and ring.producer.used_bytes() == 0
    view = cpu[1:, ::2]
    assert cuda.stage_tensor(stager, 0, 1, 1, code, _stand_in_cuda(view), True) == _C.STAGED
    got, _ = ring.read()
    assert got[(0, 1, 1)][2] == view.contiguous().numpy().tobytes()


@pytest.mark.parametrize("mode,where,refused", [
    ("global", "other", True),          # another thread's global capture forbids our unsafe calls
    ("thread_local", "other", False),   # ... a thread-local or relaxed one does not
    ("relaxed", "other", False),
    ("global", "mine", True),           # this thread's own non-relaxed capture (on another stream)
    ("thread_local", "mine", True),
    ("relaxed", "mine", False),
])
def test_host_fallback_never_copies_during_a_capture_that_forbids_it(monkeypatch, mode, where, refused):
    """The fallback's .cpu() copy (cudaMemcpyAsync + cudaStreamSynchronize, "potentially unsafe")
    while a torch capture is open in global mode on another thread, or in a non-relaxed mode on
    this thread but another stream: the current stream is not capturing, so the copy ran, failed
    with cudaErrorStreamCaptureUnsupported and invalidated the user's capture. It is refused as
    CAPTURING now (counted, nothing copied), as CUDA's capture-mode rules say, and copied once the
    capture has ended."""
    import threading

    from fastdump.staging import cuda

    class FakeGraph:
        def capture_begin(self, pool=None, capture_error_mode="global"):
            pass

        def capture_end(self):
            pass

    monkeypatch.setattr(torch.cuda, "CUDAGraph", FakeGraph)
    monkeypatch.setattr(cuda, "_capture_hook", None)
    monkeypatch.setattr(cuda, "_open_captures", {})
    monkeypatch.setattr(cuda, "before_capture", [])
    monkeypatch.setattr(_C, "note_capture_begin", lambda: None, raising=False)
    monkeypatch.setattr(_C, "capture_gate", lambda enter: None, raising=False)
    assert cuda.watch_graph_captures()
    _Capture(monkeypatch, capturing=False)  # the tensor's current stream itself does not capture
    copies = _count_host_copies(monkeypatch)
    ring = Ring(_C)
    stager = cuda.HostFallbackStager(ring.producer, "test")
    cpu = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    t, code = _stand_in_cuda(cpu), dtypes.code_of(cpu.dtype)
    graph = FakeGraph()
    if where == "mine":
        graph.capture_begin(capture_error_mode=mode)
    else:
        th = threading.Thread(target=lambda: graph.capture_begin(None, mode))
        th.start()
        th.join()
    status = cuda.stage_tensor(stager, 0, 1, 0, code, t, True)
    assert status == (cuda.CAPTURING if refused else _C.STAGED)
    assert len(copies) == (0 if refused else 1)
    assert stager.stats()["capturing_skipped"] == int(refused)
    graph.capture_end()
    assert cuda.stage_tensor(stager, 0, 1, 1, code, t, True) == _C.STAGED
    got, _ = ring.read()
    assert got[(0, 1, 1)][2] == cpu.numpy().tobytes()


def test_stage_error_fallback_never_copies_while_the_stream_captures(monkeypatch):
    """Review finding 4, the other fallback: stage() raising before it staged anything (a CUDA error)
    falls back to a synchronous copy, but not on a capturing stream."""
    from fastdump.staging import cuda

    class RaisingStager:
        def __init__(self, producer):
            self.producer = producer

        def stage(self, *args, **kwargs):
            raise RuntimeError("fastdump CUDA staging: cudaErrorUnknown (test)")

    capture = _Capture(monkeypatch)
    copies = _count_host_copies(monkeypatch)
    monkeypatch.setattr(cuda, "_current_stream", lambda device: (0, FakeStream(0)))
    monkeypatch.setattr(cuda, "_warned", set())
    ring = Ring(_C)
    stager = RaisingStager(ring.producer)
    cpu = torch.arange(6, dtype=torch.int64)
    t, code = _stand_in_cuda(cpu), dtypes.code_of(cpu.dtype)
    assert cuda.stage_on_device(stager, 0, 2, 0, code, t, True) == cuda.CAPTURING
    assert copies == [] and ring.producer.used_bytes() == 0
    capture.capturing = False
    assert cuda.stage_on_device(stager, 0, 2, 1, code, t, True) == _C.STAGED
    assert len(copies) == 1 and ring.read()[0][(0, 2, 1)][2] == cpu.numpy().tobytes()


@pytest.fixture
def attribute_reads():
    """The tensor reader off for the test: FakeCudaTensor is a GPU tensor only in its Python
    attributes, and the reader reads a subclass's TensorImpl (a CPU one here)."""
    from fastdump.staging import tensor_reader

    was_on = tensor_reader.install()["reader"] == "torch"
    tensor_reader.set_enabled(False)
    try:
        yield
    finally:
        if was_on:
            tensor_reader.set_enabled(True)


@pytest.mark.parametrize("cuda_graphs", ["record", "skip"])
def test_dumper_with_host_fallback_skips_tensors_hooked_during_a_capture(monkeypatch, tmp_path, cuda_graphs,
                                                                           attribute_reads):
    """Through the Dumper: a tensor hooked while its stream captures is recorded as skipped in the
    pass (as with the C++ stager's CAPTURING; `verify` and stats see it), never copied; the next
    pass, outside the capture, dumps it through the synchronous copy. In record mode the graph that
    capture makes will replay with nobody to dump it (no CUDA staging, no recorder): a graph not
    dumped, and verify fails saying so; `skip` asked for exactly this, and verify passes."""
    from fastdump.staging import cuda

    monkeypatch.setattr(devices, "_cuda_info", {"compiled": False, "reason": "built without a CUDA toolkit"})
    monkeypatch.setattr(cuda, "_warned", set())
    monkeypatch.setattr(cuda, "_current_stream", lambda device: (0, FakeStream(0)))
    capture = _Capture(monkeypatch)
    copies = _count_host_copies(monkeypatch)
    cpu = torch.arange(20, dtype=torch.float32).reshape(4, 5)
    t = _stand_in_cuda(cpu)
    d = _attach(tmp_path, writer="thread", cuda_graphs=cuda_graphs)
    _dump_pass(d, [("h", t)])
    assert copies == []
    capture.capturing = False
    _dump_pass(d, [("h", t)])
    stats = d.close()
    assert len(copies) == 1 and stats["skipped"] == 1 and stats["tensors"] == 1
    ds = fastdump.open(tmp_path)
    (skip,) = ds.meta("target", 0, 0)["skipped"]
    assert skip["name"] == "h" and "capture" in skip["reason"], skip
    assert "h" not in ds.load("target", 0, 0)
    assert same_bits(torch.as_tensor(ds.load("target", 0, 1)["h"]), cpu)
    (rank_json,) = tmp_path.glob("target/*/rank.json")
    info = json.loads(rank_json.read_text())
    assert info["skipped"] == 1 and list(info["skipped_reasons"]) == [skip["reason"]]
    r = subprocess.run([sys.executable, "-m", "fastdump", "verify", "--data", str(tmp_path)], capture_output=True,
                       text=True)
    if cuda_graphs == "skip":
        assert r.returncode == 0, r.stdout + r.stderr  # the skip accounts for the tensor the pass lacks
        assert stats["graphs_not_dumped"] == 0
    else:
        assert r.returncode == 1 and stats["graphs_not_dumped"] == 1, r.stdout + r.stderr
        assert ("1 CUDA graph(s) captured while dumping cannot be dumped: their replays ran unseen" in r.stdout
                and "no recorder: CUDA staging is not available" in r.stdout), r.stdout


def test_cuda_info_reports_build_and_reason():
    info = _C.cuda_info()
    assert isinstance(info["compiled"], bool)
    if not info["compiled"]:
        assert info.get("reason")
        return
    assert info["built_with"].count(".") == 1 and info["runtime_version"] > 0
    assert isinstance(info["devices"], list) and info["device_count"] == len(info["devices"])
    if info["device_count"] == 0:
        assert info.get("reason")  # e.g. no driver: said, not raised
        with pytest.raises(RuntimeError, match="unavailable"):
            _C.CudaStager(Ring(_C).producer, 1 << 20)


# =================================================================================================
# The real staging code against the mock CUDA runtime


@pytest.fixture(scope="module")
def mock():
    if not (os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")):
        pytest.skip("no C++ compiler for the mock CUDA build")
    import build as mock_build

    mod = mock_build.load(mock_build.build())
    yield mod


_KNOBS = dict(device_count=2, max_delay_us=0, seed=0, device_free=1 << 34, fail_batch=0, fail_event_query=0,
              fail_malloc=0, capturing=0, graph_node_us=0, external_record_captures=0)


@pytest.fixture
def m(mock, monkeypatch):
    """The mock module, its knobs reset around each test; device buffers made by to_device freed after."""
    monkeypatch.delenv("FASTDUMP_CUDA_BATCH", raising=False)
    monkeypatch.delenv("FASTDUMP_CUDA_REGISTER_PIECE_MB", raising=False)
    for k, v in _KNOBS.items():
        mock._mock.set(k, v)
    mock._mock.reset()
    mock.device_buffers = []
    MOCK_MODULE[0] = mock
    yield mock
    mock._mock.reset()
    for k, v in _KNOBS.items():
        mock._mock.set(k, v)
    free_device_buffers(mock)


def free_device_buffers(m):
    for p in m.device_buffers:
        assert m._mock.free(p) == 0
    m.device_buffers = []


def device_buffer(m, nbytes, device=0):
    """Mock device memory (a PROT_NONE range: only stream work can touch it), freed after the test."""
    prev = m._mock.get_device()
    m._mock.set_device(device)
    p = m._mock.malloc(max(int(nbytes), 1))
    m._mock.set_device(prev)
    m.device_buffers.append(p)
    return p


def to_device(m, t, device=0):
    """Upload the storage behind a CPU tensor (view) to mock device memory; returns the device
    address of the view's first element."""
    storage = t.untyped_storage()
    base = storage.data_ptr()
    p = device_buffer(m, storage.nbytes(), device)
    if storage.nbytes():
        assert m._mock.upload(p, base, storage.nbytes()) == 0
    return p + (t.data_ptr() - base)


def stage_ptr(stager, ptr, t, *, name_id=0, pass_id=0, channel=0, device=0, stream=0, block=True, code=None,
              **kw):
    """Stage the device memory at `ptr`, with t's dtype, shape and strides."""
    code = dtypes.code_of(t.dtype) if code is None else code
    return stager.stage(channel, name_id, pass_id, code, t.element_size(), list(t.shape), list(t.stride()),
                        ptr, device, stream, block, **kw)


def stage(stager, t, *, device=0, **kw):
    """Stage a copy of a CPU tensor (view) uploaded to the mock device memory."""
    return stage_ptr(stager, to_device(MOCK_MODULE[0], t, device), t, device=device, **kw)


MOCK_MODULE = [None]  # the m fixture's module, for stage()


def layouts():
    base = torch.arange(2 * 3 * 5 * 7, dtype=torch.float32).reshape(2, 3, 5, 7)
    wide = torch.arange(64 * 300, dtype=torch.int32).reshape(64, 300)
    return {
        "contiguous": base,
        "transposed": base.transpose(1, 3),
        "sliced": base[:, 1:, ::2, 3:],
        "expanded": torch.arange(7.0).expand(4, 3, 7),
        "scalar": torch.tensor(3.25),
        "empty": torch.empty(0, 5),
        "one_element": base[1:2, 2:3, 4:5, 6:7],
        "channels_last": base.contiguous(memory_format=torch.channels_last),
        "many_dims": torch.arange(2 ** 10, dtype=torch.int16).reshape([2] * 10).permute(*range(9, -1, -1)),
        "wide_rows": wide[:, 100:280],         # rows of 720 bytes: the 2-D copy path
        "narrow_rows": wide[::2, :5],
        "odd_bytes": torch.arange(3 * 5 * 7, dtype=torch.uint8).reshape(3, 5, 7)[:, ::2, 1::3],
        "complex": (torch.arange(24) * (1 + 2j)).to(torch.complex128).reshape(4, 6).t(),
    }


def test_mock_layouts_bit_exact(m):
    base = m._mock.counters()
    ring = Ring(m, capacity=4 << 20, chunk=8 << 10)  # 8 KiB records: most tensors are chunked
    stager = m.CudaStager(ring.producer, 1 << 20)
    stager.register_host()
    cases = layouts()
    for i, t in enumerate(cases.values()):
        assert stage(stager, t, name_id=i) == m.STAGED
    assert stager.flush(10)
    got, order = ring.read()
    for i, (name, t) in enumerate(cases.items()):
        dtype, shape, data = got[(0, i, 0)]
        assert dtype == dtypes.code_of(t.dtype) and shape == tuple(t.shape), name
        assert data == t.contiguous().numpy().tobytes(), name
    assert order == [(0, i, 0) for i in range(len(cases))]  # ring order = staging order
    st = stager.stats()
    assert st["snapshot_kernels"] >= 6 and st["snapshot_2d"] >= 1 and st["batch_api"]
    assert st["published"] == st["records"] and st["cancelled"] == 0 and st["last_error"] == ""
    c = m._mock.counters()
    assert c["crossing_copies"] == base["crossing_copies"] and c["unpinned_copies"] == base["unpinned_copies"]
    stager.close()


def test_mock_every_dtype_bit_exact(m):
    ring = Ring(m)
    stager = m.CudaStager(ring.producer, 1 << 20)
    stager.register_host()
    cases = [(name, random_tensor(dt, (6, 10), seed=i)) for i, (name, dt) in enumerate(torch_dtypes())]
    for i, (name, t) in enumerate(cases):
        assert stage(stager, t.t(), name_id=i) == m.STAGED, name  # transposed: the gather kernel
    assert stager.flush(10)
    got, _ = ring.read()
    for i, (name, t) in enumerate(cases):
        assert got[(0, i, 0)][2] == raw_bytes(t.t()), name
    stager.close()


@pytest.mark.parametrize("seed", SEEDS)
def test_mock_snapshot_is_ordered_on_the_producer_stream(m, seed):
    """The bytes at hook time: produced by earlier work on the stream, overwritten right after."""
    m._mock.set("seed", seed)
    m._mock.set("max_delay_us", 200)
    ring = Ring(m)
    stager = m.CudaStager(ring.producer, 1 << 20)
    stager.register_host()
    stream = m._mock.stream_create()
    try:
        n = 1 << 16
        buf = device_buffer(m, n)
        produced = torch.randint(0, 256, (n,), dtype=torch.uint8)
        flipped = produced.flip(0)
        src1, src2 = to_device(m, produced), to_device(m, flipped)
        like = torch.empty(n, dtype=torch.uint8)
        m._mock.enqueue_sleep(stream, 0.05)  # a slow kernel still running when the hook fires
        m._mock.enqueue_copy(stream, buf, src1, n)
        assert stage_ptr(stager, buf, like, stream=stream) == m.STAGED
        m._mock.enqueue_fill(stream, buf, n, 0xEE)  # the next, in-place kernel
        view = like.view(256, 256)[::2, 1::3]
        m._mock.enqueue_copy(stream, buf, src2, n)
        expect_view = flipped.view(256, 256)[::2, 1::3].contiguous()
        assert stage_ptr(stager, buf + view.data_ptr() - like.data_ptr(), view, name_id=1, stream=stream) == m.STAGED
        m._mock.enqueue_fill(stream, buf, n, 0x11)
        assert stager.flush(10)
        got, _ = ring.read()
        assert got[(0, 0, 0)][2] == produced.numpy().tobytes()
        assert got[(0, 1, 0)][2] == expect_view.numpy().tobytes()
        m._mock.sync(stream)
    finally:
        stager.close()
        m._mock.stream_destroy(stream)


def test_mock_tensor_larger_than_both_rings(m):
    # The host ring is larger than the device ring (both far below the tensor): records are reserved
    # in it at stage time, so with a host ring no larger it filled first and the device ring's
    # wait depended on timing (whether the drain had freed host space by then).
    ring = Ring(m, capacity=2 << 20, chunk=64 << 10)
    stager = m.CudaStager(ring.producer, 1 << 20)  # segments of 512 KiB
    stager.register_host()
    t = torch.randint(-2 ** 31, 2 ** 31 - 1, (3 << 20,), dtype=torch.int32)  # 12 MiB
    stream = m._mock.stream_create()
    # The stream's copies wait behind a gate, opened only once the stager waits for device-ring
    # space: the ring is certainly full while the big tensor is staged. (A sleep of 1.5 s ended, on
    # a loaded machine, before the device ring was full: no wait, and the test failed.)
    gate = m._mock.enqueue_gate(stream)

    def open_when_the_stager_waits():
        deadline = time.monotonic() + 60
        while stager.stats()["device_ring_full_waits"] == 0 and time.monotonic() < deadline:
            time.sleep(0.001)
        m._mock.open_gate(gate)

    result = {}
    reader = threading.Thread(target=lambda: result.update(ring.read(timeout=2)[0]))
    opener = threading.Thread(target=open_when_the_stager_waits)
    reader.start()  # the writer must consume while we stage: the host ring holds 2 MiB
    opener.start()
    try:
        assert stage(stager, t.view(-1, 1024).t(), stream=stream) == m.STAGED
        opener.join()
        assert stager.flush(30)
        reader.join()
        assert result[(0, 0, 0)][2] == t.view(-1, 1024).t().contiguous().numpy().tobytes()
        st = stager.stats()
        assert st["snapshots"] >= 24 and st["device_ring_full_waits"] > 0
    finally:
        m._mock.open_gate(gate)  # (False when already open) a shut gate would hang stream_destroy
        opener.join()
        stager.close()
        m._mock.stream_destroy(stream)


def test_mock_drop_policy_counts_and_keeps_the_rest_intact(m):
    ring = Ring(m, capacity=8 << 20)
    stager = m.CudaStager(ring.producer, 1 << 20)
    stager.register_host()
    stream = m._mock.stream_create()
    try:
        m._mock.enqueue_sleep(stream, 0.3)  # nothing can complete for a while: the device ring fills
        tensors = [torch.full((64 << 10,), i, dtype=torch.int32) for i in range(12)]  # 256 KiB each
        statuses = [stage(stager, t, name_id=i, stream=stream, block=False) for i, t in enumerate(tensors)]
        dropped = statuses.count(m.DROPPED)
        assert dropped > 0 and statuses.count(m.STAGED) + dropped == len(tensors)
        assert ring.producer.stats()["dropped"] == dropped == stager.stats()["dropped"]
        assert stager.flush(10)
        got, _ = ring.read()
        for i, (t, s) in enumerate(zip(tensors, statuses)):
            if s == m.STAGED:
                assert got[(0, i, 0)][2] == t.numpy().tobytes()
            else:
                assert (0, i, 0) not in got
    finally:
        stager.close()
        m._mock.stream_destroy(stream)


def test_mock_stopped_writer_never_stalls_drop_or_bounded_block(m):
    """Nobody consumes the host ring (a stopped writer): multi-record tensors are staged whole or
    dropped whole under `drop` (before: later records waited for the writer forever), and `block`
    gives up after timeout_s (TIMED_OUT, counted as dropped). Nothing torn reaches the ring."""
    ring = Ring(m, capacity=1 << 20, chunk=64 << 10)
    stager = m.CudaStager(ring.producer, 1 << 20)
    stager.register_host()
    try:
        tensors = [torch.full((96 << 10,), i, dtype=torch.int32) for i in range(8)]  # 384 KiB: 6 records
        t0 = time.monotonic()
        statuses = [stage(stager, t, name_id=i, block=False) for i, t in enumerate(tensors)]
        assert time.monotonic() - t0 < 10
        assert statuses[:2] == [m.STAGED, m.STAGED] and set(statuses[2:]) == {m.DROPPED}
        t0 = time.monotonic()
        assert stage(stager, tensors[0], name_id=9, timeout_s=0.5) == m.TIMED_OUT
        assert 0.4 < time.monotonic() - t0 < 10
        too_big = torch.zeros(1 << 20, dtype=torch.int32)  # 4 MiB: cannot be in a 1 MiB ring at once
        assert stage(stager, too_big, name_id=10, block=False) == m.RING_TOO_SMALL
        assert ring.producer.stats()["dropped"] == 7 == stager.stats()["dropped"]
        assert stager.flush(10)
        got, _ = ring.read()  # asserts that no tensor is torn
        assert set(got) == {(0, 0, 0), (0, 1, 0)}
        for i in (0, 1):
            assert got[(0, i, 0)][2] == tensors[i].numpy().tobytes()
    finally:
        stager.close()


def test_mock_block_timeout_bounds_each_host_ring_wait_not_a_tensor_larger_than_the_ring(m):
    """A tensor 4 times the host ring, a writer that takes a record every 20 ms: each wait for host
    space is short, the whole tensor takes longer than timeout_s. It was TORN at timeout_s after its
    first record (one deadline for the whole tensor); it is STAGED whole."""
    ring = Ring(m, capacity=1 << 20, chunk=64 << 10)
    stager = m.CudaStager(ring.producer, 1 << 20)
    stager.register_host()
    t = torch.randint(-2 ** 31, 2 ** 31 - 1, (1 << 20,), dtype=torch.int32)  # 4 MiB: 64 records
    parts = bytearray(t.numel() * 4)
    done = threading.Event()

    def slow_writer():
        while not done.is_set():
            r = ring.consumer.next(0.05)
            if r is None:
                continue
            payload, off = r[6], r[8]
            parts[off:off + len(payload)] = bytes(payload)
            ring.consumer.release()
            time.sleep(0.02)

    reader = threading.Thread(target=slow_writer)
    reader.start()
    try:
        t0 = time.monotonic()
        assert stage(stager, t, timeout_s=0.5) == m.STAGED
        assert time.monotonic() - t0 > 0.5  # (it did take longer than the timeout)
        assert stager.flush(30)
        deadline = time.monotonic() + 30
        while ring.producer.used_bytes() and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        done.set()
        reader.join()
        stager.close()
    assert bytes(parts) == t.numpy().tobytes()


def test_mock_blocking_waits_release_the_gil(m):
    ring = Ring(m, capacity=8 << 20)
    stager = m.CudaStager(ring.producer, 1 << 20)
    stager.register_host()
    stream = m._mock.stream_create()
    ticks = []
    try:
        m._mock.enqueue_sleep(stream, 0.3)
        tensors = [torch.full((128 << 10,), i, dtype=torch.int32) for i in range(4)]  # 512 KiB each
        done = []

        def worker():
            done.extend(stage(stager, t, name_id=i, stream=stream, block=True) for i, t in enumerate(tensors))

        th = threading.Thread(target=worker)
        th.start()
        t0 = time.monotonic()
        while th.is_alive() and time.monotonic() - t0 < 10:
            ticks.append(time.monotonic())  # runs only if the waiting stage() gave up the GIL
            time.sleep(0.005)
        th.join()
        assert done == [m.STAGED] * 4
        assert len(ticks) > 10
        assert stager.stats()["device_ring_full_waits"] > 0
        assert stager.flush(10)
        got, _ = ring.read()
        assert all(got[(0, i, 0)][2] == t.numpy().tobytes() for i, t in enumerate(tensors))
    finally:
        stager.close()
        m._mock.stream_destroy(stream)


def test_mock_writer_death_never_hangs_stage(m):
    ring = Ring(m, capacity=1 << 20)
    r, w = os.pipe()
    ring.producer.set_writer_fd(r)
    stager = m.CudaStager(ring.producer, 4 << 20)
    stager.register_host()
    t = torch.ones(32 << 10, dtype=torch.float32)  # 128 KiB: the host ring holds a few
    statuses = []

    def worker():
        for i in range(64):  # nobody reads: the host ring fills, then the writer "dies"
            statuses.append(stage(stager, t, name_id=i, block=True))
            if statuses[-1] != m.STAGED:
                break

    th = threading.Thread(target=worker, daemon=True)
    th.start()
    time.sleep(0.3)
    assert th.is_alive()  # blocked on the full ring, as `block` asks
    os.close(w)           # the writer process exits
    th.join(5)
    assert not th.is_alive(), "stage() hung after the writer died"
    assert statuses[-1] == m.DISABLED
    assert stage(stager, t, name_id=99) == m.DISABLED
    assert stager.flush(5)
    stager.close()
    os.close(r)


def test_mock_close_while_a_stage_call_waits(m):
    ring = Ring(m, capacity=8 << 20)
    stager = m.CudaStager(ring.producer, 1 << 20)
    stager.register_host()
    stream = m._mock.stream_create()
    try:
        m._mock.enqueue_sleep(stream, 0.5)  # the device ring stays full for a while
        tensors = [torch.full((128 << 10,), i, dtype=torch.int32) for i in range(6)]
        statuses = []
        th = threading.Thread(target=lambda: statuses.extend(
            stage(stager, t, name_id=i, stream=stream, block=True) for i, t in enumerate(tensors)))
        th.start()
        time.sleep(0.1)
        stager.close(10)  # the waiting stage() gives up; what was staged is still delivered
        th.join(5)
        assert not th.is_alive()
        assert m.DISABLED in statuses and statuses[0] == m.STAGED
        got, _ = ring.read()
        for i, st in enumerate(statuses):
            if st == m.STAGED:
                assert got[(0, i, 0)][2] == tensors[i].numpy().tobytes()
            else:
                assert (0, i, 0) not in got
    finally:
        m._mock.stream_destroy(stream)


def test_mock_forked_child_leaves_the_stager_alone(m):
    ring = Ring(m)
    stager = m.CudaStager(ring.producer, 1 << 20)
    t = torch.arange(16, dtype=torch.float32)
    ptr = to_device(m, t)  # before fork: the child has no stream threads (CUDA is unusable there)
    pid = os.fork()
    if pid == 0:  # child: no drain thread here; staging refused, close() must not hang
        code = 3
        try:
            code = 0 if stage_ptr(stager, ptr, t) == m.DISABLED else 1
            stager.close(1)
        except BaseException:
            code = 2
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
    assert stage(stager, t) == m.STAGED and stager.flush(10)  # the parent is unaffected
    assert ring.read()[0][(0, 0, 0)][2] == t.numpy().tobytes()
    stager.close()


def test_mock_capture_is_refused_without_touching_the_rings(m):
    ring = Ring(m)
    stager = m.CudaStager(ring.producer, 1 << 20)
    m._mock.set("capturing", 1)
    assert stage(stager, torch.ones(10)) == m.CAPTURING
    m._mock.set("capturing", 0)
    assert stager.stats()["capturing_skipped"] == 1 and stager.stats()["records"] == 0
    assert ring.producer.used_bytes() == 0
    stager.close()


def test_mock_batch_api_refused_falls_back_to_memcpy(m):
    ring = Ring(m)
    stager = m.CudaStager(ring.producer, 1 << 20)
    stager.register_host()
    m._mock.set("fail_batch", 1)
    t = torch.arange(1000, dtype=torch.float64)
    assert stage(stager, t) == m.STAGED and stager.flush(10)
    got, _ = ring.read()
    assert got[(0, 0, 0)][2] == t.numpy().tobytes()
    st = stager.stats()
    # Recorded in a stat of its own, not as an error: staging goes on per copy.
    assert not st["batch_api"] and "cudaMemcpyBatchAsync" in st["batch_api_fallback"], st
    assert st["last_error"] == "" and not st["broken"], st
    stager.close()


def test_mock_unpinned_ring_uses_plain_copies(m):
    ring = Ring(m)
    stager = m.CudaStager(ring.producer, 1 << 20)  # register_host() not called
    t = torch.arange(1000, dtype=torch.int64)
    before = m._mock.counters()["batch_calls"]
    assert stage(stager, t) == m.STAGED and stager.flush(10)
    assert m._mock.counters()["batch_calls"] == before
    assert ring.read()[0][(0, 0, 0)][2] == t.numpy().tobytes()
    assert not stager.stats()["batch_api"]
    stager.close()


def test_mock_drain_failure_stops_staging_without_hanging_the_writer(m):
    ring = Ring(m)
    stager = m.CudaStager(ring.producer, 1 << 20)
    stager.register_host()
    m._mock.set("fail_event_query", 1)
    t = torch.arange(4096, dtype=torch.float32)
    assert stage(stager, t) == m.STAGED
    assert stager.flush(10)  # the failed record was published or turned into padding
    deadline = time.monotonic() + 5
    while stager.stats()["last_error"] == "" and time.monotonic() < deadline:
        time.sleep(0.01)
    assert "cudaEventQuery" in stager.stats()["last_error"]
    assert stage(stager, t, name_id=1) == m.DISABLED
    got, _ = ring.read()  # the reader is not stuck behind an unpublished record
    assert (0, 1, 0) not in got
    if (0, 0, 0) in got:
        assert got[(0, 0, 0)][2] == t.numpy().tobytes()
    stager.close()


def test_mock_device_ring_allocation_failure_is_an_exception_once(m):
    ring = Ring(m)
    stager = m.CudaStager(ring.producer, 1 << 20)
    t = torch.ones(4)
    p0, p1 = to_device(m, t, 0), to_device(m, t, 1)
    m._mock.set("fail_malloc", 1)
    with pytest.raises(RuntimeError, match="device staging ring"):
        stage_ptr(stager, p0, t)
    m._mock.set("fail_malloc", 0)
    with pytest.raises(RuntimeError, match="device staging ring"):  # remembered: no retry per tensor
        stage_ptr(stager, p0, t)
    assert stage_ptr(stager, p1, t, device=1) == m.STAGED  # other GPUs are unaffected
    stager.close()


def test_mock_no_device(m):
    m._mock.set("device_count", 0)
    info = m.cuda_info()
    assert info["device_count"] == 0 and "cudaErrorNoDevice" in info["reason"]
    with pytest.raises(RuntimeError, match="unavailable"):
        m.CudaStager(Ring(m).producer, 1 << 20)


def test_mock_registration_pieces_and_teardown(m, monkeypatch):
    monkeypatch.setenv("FASTDUMP_CUDA_REGISTER_PIECE_MB", "1")
    base = m._mock.counters()
    ring = Ring(m, capacity=6 << 20, chunk=1536 << 10)  # records straddle the 1 MiB pieces
    stager = m.CudaStager(ring.producer, 4 << 20)
    stager.register_host()
    assert m._mock.counters()["registered_ranges"] == base["registered_ranges"] + 6
    assert stager.register_host() == 0.0  # once
    for i in range(8):
        t = torch.randint(0, 1 << 30, (400_000,), dtype=torch.int32)
        assert stage(stager, t, name_id=i) == m.STAGED
        assert stager.flush(10)
        assert ring.read()[0][(0, i, 0)][2] == t.numpy().tobytes()
    c = m._mock.counters()
    assert c["crossing_copies"] == base["crossing_copies"] and c["unpinned_copies"] == base["unpinned_copies"]
    assert stager.stats()["registered_bytes"] == 6 << 20
    stager.close()
    free_device_buffers(m)
    c = m._mock.counters()
    for k in ("registered_ranges", "live_allocs", "live_events", "live_streams"):
        assert c[k] == base[k], k
    assert stage(stager, torch.ones(2)) == m.DISABLED  # closed


def test_mock_threads_devices_and_streams(m):
    m._mock.set("max_delay_us", 50)
    ring = Ring(m, capacity=2 << 20, chunk=32 << 10)
    stager = m.CudaStager(ring.producer, 512 << 10)
    stager.register_host()
    streams = []
    for k in range(4):
        m._mock.set_device(k % 2)
        streams.append(m._mock.stream_create())
    m._mock.set_device(0)
    want = {}
    result = {}
    reader = threading.Thread(target=lambda: result.update(ring.read(timeout=1.0)[0]))
    reader.start()

    def worker(k):
        g = torch.Generator().manual_seed(k)
        for i in range(40):
            t = torch.randint(0, 255, (int(torch.randint(1, 60_000, (1,), generator=g)),), dtype=torch.uint8,
                              generator=g)
            v = t[:: 1 + i % 3]
            want[(k, i, 0)] = v.contiguous().numpy().tobytes()
            ptr = to_device(m, v, device=k % 2)
            assert stage_ptr(stager, ptr, v, channel=k, name_id=i, device=k % 2, stream=streams[k]) == m.STAGED
            m._mock.enqueue_fill(streams[k], ptr, t.numel(), 0)  # overwritten right after

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert stager.flush(30)
    reader.join()
    assert {k: result[k][2] for k in want} == want
    stager.close()
    for s in streams:
        m._mock.stream_destroy(s)


def test_mock_stage_array_cuda_array_interface_and_dlpack(m):
    """cuda.stage_array's CAI and DLPack paths hand the right pointer, strides and stream to stage()."""
    from fastdump.staging import cuda

    ring = Ring(m)
    stager = m.CudaStager(ring.producer, 1 << 20)
    stager.register_host()
    eng = _FakeEngine(ring.producer, stager)
    host = np.arange(48, dtype=np.float32).reshape(6, 8)
    view = host[1:5, ::2]
    view_dev = to_device(m, torch.from_numpy(host)[1:5, ::2], device=1)

    class Device:
        id = 1

    class CaiArray:
        device = Device()
        __cuda_array_interface__ = {"shape": view.shape, "typestr": view.dtype.str, "strides": view.strides,
                                    "data": (view_dev, False), "version": 3, "stream": 1}

    status, nbytes = cuda.stage_array(eng, 32, 0, 0, 0, CaiArray(), True)
    assert status == m.STAGED and nbytes == view.nbytes and eng.asked == [32]

    seen = {}
    t = torch.arange(30, dtype=torch.bfloat16).reshape(5, 6).t()
    t_dev = to_device(m, t)

    class DlpackOnGpu:
        def __dlpack_device__(self):
            return (2, 0)  # kDLCUDA

        def __dlpack__(self, stream=None, max_version=None):
            seen["stream"] = stream
            return DeviceCapsule(t_dev, t).take()

    status, nbytes = cuda.stage_array(eng, 32, 0, 1, 0, DlpackOnGpu(), True)
    assert status == m.STAGED and nbytes == t.numel() * 2
    assert seen["stream"] == 1  # fastdump consumes on the legacy default stream
    assert stager.flush(10)
    got, _ = ring.read()
    assert got[(0, 0, 0)][2] == np.ascontiguousarray(view).tobytes()
    assert got[(0, 1, 0)][0] == dtypes.CODE_BY_NAME["bfloat16"]
    assert got[(0, 1, 0)][2] == t.contiguous().view(torch.uint16).numpy().tobytes()
    stager.close()


# -------------------------------------------------------------------------------------------------
# The double itself: what it must refuse or reorder the way a GPU would

H2H, H2D, D2H, D2D, DEFAULT = 0, 1, 2, 3, 4
ERR = {"InvalidValue": 1, "StreamCaptureUnsupported": 900, "StreamCaptureInvalidated": 901,
       "StreamCaptureMerge": 902, "StreamCaptureUnmatched": 903, "StreamCaptureUnjoined": 904,
       "StreamCaptureIsolation": 905, "StreamCaptureImplicit": 906, "CapturedEvent": 907,
       "StreamCaptureWrongThread": 908, "IllegalAddress": 700, "Unknown": 999}
GLOBAL, THREAD_LOCAL, RELAXED = 0, 1, 2


def download(m, ptr, n):
    out = torch.empty(n, dtype=torch.uint8)
    assert m._mock.download(out.data_ptr(), ptr, n) == 0
    return out


def test_double_host_dereference_of_device_memory_faults(mock):
    code = ("import sys; sys.path.insert(0, %r); import build; m = build.load(build.build()); "
            "p = m._mock.malloc(64); print('read', m._mock.host_read(p))") % str(HERE / "cuda_mock")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == -11, (r.returncode, r.stdout, r.stderr)  # SIGSEGV, nothing printed
    assert "read" not in r.stdout


def test_double_copy_kinds_pointers_and_pinning(m):
    dev = device_buffer(m, 4096, device=1)
    host = torch.arange(4096, dtype=torch.int32).to(torch.uint8)
    out = torch.zeros(4096, dtype=torch.uint8)
    s = m._mock.stream_create()
    try:
        assert m._mock.pointer_device(dev) == 1 and m._mock.pointer_device(host.data_ptr()) == -1
        # Wrong kinds and swapped pointers are refused, not silently copied.
        assert m._mock.memcpy_async(dev, host.data_ptr(), 4096, D2H, s) == ERR["InvalidValue"]
        assert m._mock.memcpy_async(host.data_ptr(), dev, 4096, H2D, s) == ERR["InvalidValue"]
        assert m._mock.memcpy_async(dev, host.data_ptr(), 4096, D2D, s) == ERR["InvalidValue"]
        assert m._mock.memcpy_async(dev, host.data_ptr(), 8192, H2D, s) == ERR["InvalidValue"]  # past the block
        assert m._mock.memcpy_async(dev, host.data_ptr(), 4096, DEFAULT, s) == 0  # inferred
        # Pageable destination: the "async" copy is done when it returns (as in real CUDA).
        m._mock.enqueue_sleep(s, 0.2)
        assert m._mock.memcpy_async(out.data_ptr(), dev, 4096, D2H, s) == 0
        assert out.equal(host)
        # Pinned destination: really asynchronous, so the bytes are not there yet.
        pinned = torch.zeros(4096, dtype=torch.uint8)
        assert m._mock.host_register(pinned.data_ptr(), 4096) == 0
        m._mock.enqueue_sleep(s, 0.3)
        assert m._mock.memcpy_async(pinned.data_ptr(), dev, 4096, D2H, s) == 0
        assert not pinned.equal(host)
        m._mock.sync(s)
        assert pinned.equal(host)
        assert m._mock.host_unregister(pinned.data_ptr()) == 0
    finally:
        m._mock.stream_destroy(s)


@pytest.mark.parametrize("seed", SEEDS)
def test_double_streams_run_apart_unless_an_event_orders_them(m, seed):
    m._mock.set("seed", seed)
    m._mock.set("max_delay_us", 300)
    a, b = m._mock.stream_create(), m._mock.stream_create()
    n = 1 << 12
    buf, copy = device_buffer(m, n), device_buffer(m, n)
    try:
        # Without a wait, b's copy runs before a's fill: a is held at a gate (a sleep there let a
        # loaded machine run a's fill first, and the test failed once under load).
        m._mock.enqueue_fill(a, buf, n, 0)
        m._mock.sync(a)
        gate = m._mock.enqueue_gate(a)
        try:
            m._mock.enqueue_fill(a, buf, n, 7)
            m._mock.enqueue_copy(b, copy, buf, n)
            m._mock.sync(b)
            assert download(m, copy, n)[0] == 0  # b did not wait for a
        finally:
            m._mock.open_gate(gate)
        m._mock.sync(a)
        assert download(m, buf, n)[0] == 7  # a ran its fill once let through
        # With an event, b runs after a's work, whatever the delays.
        ev = m._mock.event_create()
        m._mock.enqueue_sleep(a, 0.02)
        m._mock.enqueue_fill(a, buf, n, 9)
        assert m._mock.event_record(ev, a) == 0
        assert m._mock.stream_wait_event(b, ev) == 0
        m._mock.enqueue_copy(b, copy, buf, n)
        m._mock.sync(b)
        assert bool((download(m, copy, n) == 9).all())
        m._mock.event_destroy(ev)
    finally:
        m._mock.sync(a)
        m._mock.stream_destroy(a)
        m._mock.stream_destroy(b)


def test_double_legacy_stream_synchronizes_with_blocking_streams_only(m):
    n = 256
    buf = device_buffer(m, n)
    blocking = m._mock.stream_create_flags(0)
    nonblocking = m._mock.stream_create_flags(1)
    try:
        m._mock.enqueue_fill(0, buf, n, 0)
        m._mock.sync(0)
        m._mock.enqueue_sleep(blocking, 0.1)
        m._mock.enqueue_fill(blocking, buf, n, 5)
        m._mock.enqueue_increment(0, buf, n)  # legacy: waits for the blocking stream's fill
        m._mock.sync(0)
        assert bool((download(m, buf, n) == 6).all())
        m._mock.enqueue_sleep(nonblocking, 0.1)
        m._mock.enqueue_fill(nonblocking, buf, n, 1)
        m._mock.enqueue_fill(0, buf, n, 2)  # legacy: does not wait for a non-blocking stream
        m._mock.sync(0)
        m._mock.sync(nonblocking)
        assert bool((download(m, buf, n) == 1).all())
        # cudaStreamPerThread (2) is a blocking stream of the calling thread: ordered after legacy work.
        m._mock.enqueue_sleep(0, 0.1)
        m._mock.enqueue_fill(0, buf, n, 3)
        m._mock.enqueue_increment(2, buf, n)
        m._mock.sync(2)
        assert bool((download(m, buf, n) == 4).all())
    finally:
        m._mock.stream_destroy(blocking)
        m._mock.stream_destroy(nonblocking)


def test_double_contexts_devices_per_thread(m):
    m._mock.reset_contexts()
    seen = {}

    def worker():
        seen["device"] = m._mock.get_device()  # 0 on a new thread, and no context made by asking
        seen["contexts"] = m._mock.contexts()
        m._mock.set_device(1)
        seen["after"] = m._mock.contexts()

    m._mock.set_device(1)
    th = threading.Thread(target=worker)
    th.start()
    th.join()
    assert seen == {"device": 0, "contexts": [0, 1], "after": [0, 1]}
    assert m._mock.get_device() == 1
    m._mock.set_device(0)
    assert m._mock.contexts() == [1, 1]


def test_double_capture_records_and_replays_a_graph(m):
    n = 512
    buf, out = device_buffer(m, n), device_buffer(m, n)
    s, side = m._mock.stream_create(), m._mock.stream_create()
    fork, join = m._mock.event_create(), m._mock.event_create()
    try:
        m._mock.enqueue_fill(s, buf, n, 0)
        m._mock.sync(s)
        assert m._mock.begin_capture(s, GLOBAL) == 0
        err, status, cid = m._mock.capture_info(s)
        assert err == 0 and status == 1 and cid > 0
        m._mock.enqueue_increment(s, buf, n)
        assert m._mock.event_record(fork, s) == 0
        assert m._mock.stream_wait_event(side, fork) == 0  # side joins the capture
        assert m._mock.capture_info(side)[1] == 1
        m._mock.enqueue_copy(side, out, buf, n)
        assert m._mock.event_record(join, side) == 0
        assert m._mock.stream_wait_event(s, join) == 0     # ... and is joined back
        err, graph = m._mock.end_capture(s)
        assert err == 0 and graph
        assert m._mock.capture_info(side)[1] == 0
        m._mock.sync(s)
        assert bool((download(m, buf, n) == 0).all())  # captured work did not run
        exe = m._mock.graph_instantiate(graph)
        for k in (1, 2, 3):
            assert m._mock.graph_launch(exe, s) == 0
            m._mock.sync(s)
            assert bool((download(m, out, n) == k).all())
        m._mock.graph_exec_destroy(exe)
        m._mock.graph_destroy(graph)
        # A fork never joined back: EndCapture fails.
        assert m._mock.begin_capture(s, GLOBAL) == 0
        m._mock.event_record(fork, s)
        m._mock.stream_wait_event(side, fork)
        m._mock.enqueue_increment(side, buf, n)
        assert m._mock.end_capture(s) == (ERR["StreamCaptureUnjoined"], 0)
    finally:
        for e in (fork, join):
            m._mock.event_destroy(e)
        m._mock.stream_destroy(s)
        m._mock.stream_destroy(side)


@pytest.mark.parametrize("capture_mode,caller_mode,other_thread,expect", [
    (GLOBAL, GLOBAL, True, "StreamCaptureUnsupported"),    # another thread's global capture forbids it
    (GLOBAL, RELAXED, True, None),                         # ... unless this thread is relaxed
    (GLOBAL, THREAD_LOCAL, True, None),                    # thread-local only cares about its own captures
    (THREAD_LOCAL, GLOBAL, True, None),
    (THREAD_LOCAL, GLOBAL, False, "StreamCaptureUnsupported"),
    (RELAXED, GLOBAL, False, None),
])
def test_double_unsafe_calls_during_capture(m, capture_mode, caller_mode, other_thread, expect):
    s = m._mock.stream_create()
    result = {}

    def unsafe():
        old = m._mock.capture_mode(caller_mode)
        try:
            result["malloc"] = m._mock.malloc(64)
        except RuntimeError as exc:
            result["error"] = str(exc)
        finally:
            m._mock.capture_mode(old)

    try:
        assert m._mock.begin_capture(s, capture_mode) == 0
        if other_thread:
            th = threading.Thread(target=unsafe)
            th.start()
            th.join()
        else:
            unsafe()
        err, graph = m._mock.end_capture(s)
        if expect is None:
            assert "malloc" in result and err == 0
            m._mock.free(result["malloc"])
            m._mock.graph_destroy(graph)
        else:
            assert result.get("error") == "cudaError" + expect
            assert err == ERR["StreamCaptureInvalidated"] and graph == 0
    finally:
        m._mock.stream_destroy(s)


def test_double_capture_errors(m):
    s = m._mock.stream_create_flags(0)  # blocking: the legacy stream would depend on it
    other = m._mock.stream_create()
    ev = m._mock.event_create()
    try:
        assert m._mock.begin_capture(0, GLOBAL) == ERR["StreamCaptureUnsupported"]  # legacy stream
        # Legacy-stream work while a blocking stream captures: implicit dependency.
        small = device_buffer(m, 16)  # before: cudaMalloc during a global capture is itself unsafe
        assert m._mock.begin_capture(s, GLOBAL) == 0
        assert m._mock.enqueue_fill(0, small, 16, 0) == ERR["StreamCaptureImplicit"]
        assert m._mock.capture_info(s)[1] == 2  # invalidated
        assert m._mock.end_capture(s)[0] == ERR["StreamCaptureInvalidated"]
        # Synchronizing a capturing stream; querying a captured event; waiting on outside work.
        assert m._mock.begin_capture(s, RELAXED) == 0
        assert m._mock.event_record(ev, s) == 0
        assert m._mock.event_query(ev) == ERR["CapturedEvent"]
        assert m._mock.stream_synchronize(s) == ERR["StreamCaptureUnsupported"]
        assert m._mock.end_capture(s)[0] == ERR["StreamCaptureInvalidated"]
        assert m._mock.begin_capture(s, GLOBAL) == 0
        outside = m._mock.event_create()
        assert m._mock.event_record(outside, other) == 0
        assert m._mock.stream_wait_event(s, outside) == ERR["StreamCaptureIsolation"]
        assert m._mock.end_capture(other)[0] == 401  # not capturing: cudaErrorIllegalState
        result = {}
        th = threading.Thread(target=lambda: result.update(end=m._mock.end_capture(s)))
        th.start()
        th.join()
        assert result["end"][0] == ERR["StreamCaptureWrongThread"]
        assert m._mock.end_capture(s)[0] == ERR["StreamCaptureInvalidated"]
        m._mock.event_destroy(outside)
    finally:
        m._mock.event_destroy(ev)
        m._mock.stream_destroy(s)
        m._mock.stream_destroy(other)


def test_double_sticky_error_reported_at_the_next_synchronizing_call(m):
    m._mock.set_device(1)
    s = m._mock.stream_create()  # on device 1
    try:
        m._mock.enqueue_sleep(s, 0.05)
        assert m._mock.enqueue_fault(s, ERR["IllegalAddress"]) == 0  # the launch itself succeeds
        assert m._mock.stream_synchronize(s) == ERR["IllegalAddress"]
        with pytest.raises(RuntimeError, match="cudaErrorIllegalAddress"):
            m._mock.malloc(16)
        m._mock.set_device(0)
        m._mock.free(m._mock.malloc(16))  # other devices are unaffected
        # Non-sticky: one injected failure, then the call works again.
        m._mock.fail("cudaMalloc", 1, ERR["Unknown"])
        with pytest.raises(RuntimeError, match="cudaErrorUnknown"):
            m._mock.malloc(16)
        m._mock.free(m._mock.malloc(16))
    finally:
        m._mock.reset()
        m._mock.set_device(0)
        m._mock.stream_destroy(s)


@pytest.mark.parametrize("api", ["cudaMalloc", "cudaStreamCreateWithPriority", "cudaEventCreateWithFlags",
                                 "cudaDeviceGetStreamPriorityRange", "cudaStreamIsCapturing", "cudaMemcpyAsync",
                                 "kernel", "cudaEventRecord", "cudaStreamWaitEvent", "cudaMemcpyBatchAsync",
                                 "cudaEventQuery", "cudaHostRegister", "cudaMemcpy2DAsync", "cudaSetDevice",
                                 "cudaStreamSynchronize", "cudaFree", "cudaHostUnregister"])
def test_double_injected_failure_of_every_staging_api_is_handled(m, api):
    """Each runtime call the staging code makes, failing once: an exception before anything is staged,
    a recorded fallback, or DISABLED with the error recorded; never a hang or a torn record."""
    ring = Ring(m)
    stager = m.CudaStager(ring.producer, 1 << 20)
    cases = [torch.arange(600, dtype=torch.float32), torch.arange(600, dtype=torch.float32).view(20, 30).t(),
             torch.arange(64 * 300, dtype=torch.int32).view(64, 300)[:, 100:280]]
    ptrs = [to_device(m, t) for t in cases]
    m._mock.last_error()  # (cleared: an earlier test's mock call may have failed on this thread)
    m._mock.fail(api, 1, ERR["Unknown"])
    statuses = []
    if api == "cudaHostRegister":
        with pytest.raises(RuntimeError, match="cudaHostRegister"):
            stager.register_host()
    else:
        stager.register_host()
    # A failure the stager handled (raised, fell back, recorded) is not left as this thread's last
    # error: on a GPU the next launch check on this thread (cudaGetLastError after the gather
    # kernel's launch: a later tensor's, or one of the same stage() call) took it for its own, and
    # failed that tensor, or stopped staging when it came mid-tensor.
    assert m._mock.last_error() == 0, (api, "register_host")
    for i, (p, t) in enumerate(zip(ptrs, cases)):
        try:
            statuses.append(stage_ptr(stager, p, t, name_id=i))
        except RuntimeError as exc:
            statuses.append(str(exc))
        assert m._mock.last_error() == 0, (api, i, statuses[-1])
    assert stager.flush(10)
    got, _ = ring.read()
    for i, (st, t) in enumerate(zip(statuses, cases)):
        if st == m.STAGED and (0, i, 0) in got:
            assert got[(0, i, 0)][2] == t.contiguous().numpy().tobytes(), (api, i)
        elif isinstance(st, str):
            assert "cudaErrorUnknown" in st and (0, i, 0) not in got
    stats = stager.stats()
    if m.DISABLED in statuses or stats["broken"]:
        assert stats["broken"] and "cudaErrorUnknown" in stats["last_error"]
    stager.close()
    assert m._mock.last_error() == 0, (api, "close")


# -------------------------------------------------------------------------------------------------
# Defects the review found (issue 11 item 3), caught by the double


def test_review_no_stray_context_on_gpu0(m):
    """A process that uses only GPU 1: staging (from a thread that never chose a device), pinning and
    teardown must not create a primary context on GPU 0 (~500 MiB there, per process)."""
    t = torch.arange(1000, dtype=torch.float32)
    p = to_device(m, t, device=1)
    ring = Ring(m)
    m._mock.reset_contexts()  # from here on: a process whose framework initialized GPU 1 only
    th = threading.Thread(target=lambda: m._mock.set_device(1))
    th.start()
    th.join()
    result = {}

    def serve():  # a fresh thread: cudaGetDevice says 0, and GPU 0 has no context
        stager = m.CudaStager(ring.producer, 1 << 20)
        stager.register_host()
        result["status"] = stage_ptr(stager, p, t, device=1)
        result["flushed"] = stager.flush(10)
        stager.close()

    th = threading.Thread(target=serve)
    th.start()
    th.join()
    assert result == {"status": m.STAGED, "flushed": True}
    assert ring.read()[0][(0, 0, 0)][2] == t.numpy().tobytes()
    assert m._mock.contexts() == [0, 1]


@pytest.mark.parametrize("seed", SEEDS)
def test_review_snapshot_waits_for_the_producing_stream(m, seed):
    """A tensor produced on another stream than the snapshot's: stage(producer_stream=) orders the
    snapshot after the producing work, whatever the streams' timing."""
    m._mock.set("seed", seed)
    m._mock.set("max_delay_us", 200)
    ring = Ring(m)
    stager = m.CudaStager(ring.producer, 1 << 20)
    stager.register_host()
    producer, current = m._mock.stream_create(), m._mock.stream_create()
    n = 1 << 14
    buf, src = device_buffer(m, n), to_device(m, torch.full((n,), 7, dtype=torch.uint8))
    like = torch.empty(n, dtype=torch.uint8)
    try:
        m._mock.enqueue_sleep(producer, 0.05)
        m._mock.enqueue_copy(producer, buf, src, n)       # the producing kernel, still queued
        assert stage_ptr(stager, buf, like, stream=current, producer_stream=producer) == m.STAGED
        m._mock.enqueue_fill(current, buf, n, 0xEE)       # the next kernel on the current stream
        assert stager.flush(10)
        assert ring.read()[0][(0, 0, 0)][2] == bytes([7]) * n
    finally:
        m._mock.sync(producer)
        stager.close()
        m._mock.stream_destroy(producer)
        m._mock.stream_destroy(current)


class FakeCudaTensor(torch.Tensor):
    """A torch tensor that says it lives on a (mock) GPU: dtype, shape and strides of a CPU tensor,
    data_ptr() in mock device memory, a device index; record_stream() calls are remembered, as the
    caching allocator would."""

    @staticmethod
    def __new__(cls, cpu, ptr, device=0):
        t = torch.Tensor._make_subclass(cls, cpu)
        t._ptr, t._device, t.recorded = ptr, device, []
        storage = cpu.untyped_storage()  # to_device uploads the whole storage
        t._storage = FakeStorage(ptr - (cpu.data_ptr() - storage.data_ptr()), storage.nbytes())
        return t

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))

    is_cuda = property(lambda self: True)
    is_cpu = property(lambda self: False)

    def data_ptr(self):
        return self._ptr

    def untyped_storage(self):
        return self._storage

    def get_device(self):
        return self._device

    def record_stream(self, stream):
        self.recorded.append(stream)


class FakeStorage:
    """A fake CUDA tensor's storage: the mock device memory its CPU storage was uploaded to."""

    def __init__(self, ptr, nbytes):
        self.ptr, self.size = ptr, nbytes

    def data_ptr(self):
        return self.ptr

    def nbytes(self):
        return self.size


class FakeStream:
    def __init__(self, raw):
        self.cuda_stream = raw


@pytest.fixture
def glue(m, monkeypatch):
    """fastdump's Python CUDA path (engine, capture, cuda.py) running on the double: the engine's
    ring and stager come from the mock build; the current stream is a mock stream on device 0 and
    the legacy stream elsewhere (as in torch, a stream belongs to one device: the mock refuses an
    event or a kernel on another device's stream)."""
    from fastdump.staging import cuda, engine

    monkeypatch.setattr(engine, "_C", m)
    monkeypatch.setattr(cuda, "_C", m)
    monkeypatch.setattr(devices, "_C", m)  # cuda_info (cached in devices) asks the double too
    monkeypatch.setattr(devices, "_cuda_info", None)
    monkeypatch.setattr(cuda, "_ring_failures", {})
    current = m._mock.stream_create()
    monkeypatch.setattr(cuda, "_current_stream",
                        lambda device: (current, FakeStream(current)) if device == 0 else (0, FakeStream(0)))
    monkeypatch.setattr(engine, "_exact_tensor_type", lambda: FakeCudaTensor)  # staged in C, as on a GPU
    yield current
    m._mock.sync(current)
    m._mock.stream_destroy(current)
    cuda.release_read()


def fake_cuda(m, t, device=0):
    return FakeCudaTensor(t, to_device(m, t, device), device)


def test_glue_capture_to_stage_tensor_on_the_double(m, glue, tmp_path):
    """Dumper.dump → capture's is_cuda branch → cuda.stage_tensor → the stager, bit-exact, with the
    current stream recorded on each staged tensor for the caching allocator."""
    cases = {"contiguous": torch.arange(3 * 5 * 7, dtype=torch.float32).reshape(3, 5, 7),
             "transposed": torch.arange(64, dtype=torch.int64).reshape(8, 8).t(),
             "bf16_view": torch.arange(600, dtype=torch.float32).to(torch.bfloat16).reshape(20, 30)[2:, ::3],
             "on_gpu1": torch.arange(10, dtype=torch.int16)}
    fakes = {k: fake_cuda(m, v, device=1 if k == "on_gpu1" else 0) for k, v in cases.items()}
    d = _attach(tmp_path, writer="thread", device="cuda:0")
    for p in range(2):
        _dump_pass(d, list(fakes.items()))
    d.close()
    for p in range(2):
        got = _load(tmp_path, pass_id=p)
        for k, v in cases.items():
            assert same_bits(torch.as_tensor(got[k]) if not isinstance(got[k], torch.Tensor) else got[k], v), k
    for k, f in fakes.items():
        assert [s.cuda_stream for s in f.recorded] == [0 if k == "on_gpu1" else glue] * 2, k


def test_review_caching_allocator_reuse_waits_for_the_snapshot(m, glue, tmp_path):
    """A tensor allocated on stream A, hooked while stream C is current: when it is freed, the caching
    allocator reuses its block on A at once unless C was recorded (record_stream)."""
    from fastdump.staging import cuda

    alloc = m._mock.stream_create()
    t = torch.arange(1 << 12, dtype=torch.int32)
    f = fake_cuda(m, t)
    ring = Ring(m)
    stager = m.CudaStager(ring.producer, 1 << 20)
    stager.register_host()
    try:
        m._mock.enqueue_sleep(glue, 0.1)  # the current stream is busy: the snapshot runs late
        assert cuda.stage_tensor(stager, 0, 0, 0, dtypes.code_of(t.dtype), f, True) == m.STAGED
        # The module's output is freed; the allocator hands the block to the next kernel on A.
        for s in f.recorded:
            ev = m._mock.event_create()
            m._mock.event_record(ev, s.cuda_stream)
            m._mock.stream_wait_event(alloc, ev)
            m._mock.event_destroy(ev)
        m._mock.enqueue_fill(alloc, f.data_ptr(), t.numel() * 4, 0xEE)
        assert stager.flush(10)
        assert ring.read()[0][(0, 0, 0)][2] == t.numpy().tobytes()
    finally:
        m._mock.sync(alloc)
        stager.close()
        m._mock.stream_destroy(alloc)


def test_review_dlpack_capsule_kept_until_the_snapshot_read_it(m, glue):
    """DLPack: releasing the capsule lets the producer free and reuse the memory; fastdump keeps it
    until the snapshot has completed."""
    from fastdump.staging import cuda

    ring = Ring(m)
    stager = m.CudaStager(ring.producer, 1 << 20)
    stager.register_host()
    eng = _FakeEngine(ring.producer, stager)
    t = torch.arange(1 << 12, dtype=torch.float32)
    ptr = to_device(m, t)
    reuse = m._mock.stream_create()
    released = []

    def on_release():  # the producer's deleter: its allocator reuses the block on its own stream
        released.append(time.monotonic())
        m._mock.enqueue_fill(reuse, ptr, t.numel() * 4, 0xEE)

    class Producer:
        def __dlpack_device__(self):
            return (2, 0)

        def __dlpack__(self, stream=None, max_version=None):
            return DeviceCapsule(ptr, t, on_release=on_release).take()

    try:
        m._mock.enqueue_sleep(1, 0.1)  # the consumer stream (legacy) is busy: the snapshot runs late
        status, _ = cuda.stage_array(eng, 32, 0, 0, 0, Producer(), True)
        assert status == m.STAGED
        assert stager.flush(10)
        assert cuda.release_read() == 0 and released
        assert ring.read()[0][(0, 0, 0)][2] == t.numpy().tobytes()
    finally:
        m._mock.sync(reuse)
        stager.close()
        m._mock.stream_destroy(reuse)


def test_review_device_ring_allocated_at_attach(m, glue, tmp_path):
    from fastdump.staging import cuda

    d = _attach(tmp_path, writer="thread", device="cuda:1")
    try:
        stager = d._engine.cuda_stager(d.device_ring_mb)
        stats = stager.stats()
        assert [x["device"] for x in stats["devices"]] == [1]  # before any tensor
        assert stats["devices"][0]["ring_bytes"] == int(d.device_ring_mb) << 20
        assert cuda.ring_failure(stager) == ""
    finally:
        d.close()


def test_review_no_device_ring_drops_and_records_instead_of_synchronous_copies(m, glue, tmp_path):
    """Memory taken by a serving engine before the first tensor: the ring is tried at attach; when it
    cannot be had, tensors are dropped and counted (no synchronous .cpu()), the reason in rank.json."""
    from fastdump.staging import cuda

    m._mock.set("device_free", 64 << 20)  # less than the 256 MiB ring
    calls = []
    real = cuda.HostFallbackStager.stage_tensor
    try:
        cuda.HostFallbackStager.stage_tensor = lambda *a, **k: calls.append(a) or real(*a, **k)
        d = _attach(tmp_path, writer="thread", device="cuda:0")
        t = torch.arange(100, dtype=torch.float32)
        _dump_pass(d, [("x", fake_cuda(m, t))])
        d.close()
    finally:
        cuda.HostFallbackStager.stage_tensor = real
    assert calls == []
    info = json.loads(next(tmp_path.rglob("rank.json")).read_text())
    assert info["cuda_staging"]["device_ring"] == "unavailable"
    assert "device staging ring" in info["cuda_staging"]["reason"]
    got = _load(tmp_path, pass_id=0)
    assert "x" not in got
    assert d._totals["dropped"] == 1


def test_review_disabled_stager_records_its_own_error(m, glue, tmp_path):
    d = _attach(tmp_path, writer="thread", device="cuda:0")
    t = torch.arange(1000, dtype=torch.float32)
    m._mock.fail("cudaEventQuery", 1, ERR["Unknown"])  # the drain fails: staging stops for good
    _dump_pass(d, [("a", fake_cuda(m, t))])
    stager = d._engine.cuda_stager(d.device_ring_mb)
    deadline = time.monotonic() + 10
    while not stager.stats()["broken"] and time.monotonic() < deadline:
        time.sleep(0.01)
    _dump_pass(d, [("b", fake_cuda(m, t))])
    assert d.status == "error"
    assert "cudaEventQuery" in d.error and "writer stopped" not in d.error
    d.close()
    info = json.loads(next(tmp_path.rglob("rank.json")).read_text())
    assert "cudaEventQuery" in info["error"]


def test_review_drain_timer_slack(m):
    """The drain's 5 us waits must not become ~60-100 us sleeps: its thread sets a 1 ns timer slack."""
    ring = Ring(m)
    stager = m.CudaStager(ring.producer, 1 << 20)
    deadline = time.monotonic() + 5
    while stager.stats()["drain_timer_slack_ns"] < 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert 0 < stager.stats()["drain_timer_slack_ns"] <= 1000
    stager.close()


def test_review_staging_beside_a_global_capture_on_another_thread(m):
    """torch.cuda.graph captures in global mode: the stager's first use (ring allocation, pinning),
    its snapshots on other streams and its drain must not invalidate that capture."""
    capture_stream = m._mock.stream_create_flags(0)  # blocking, like a torch side stream
    work = device_buffer(m, 256)
    t = torch.arange(5000, dtype=torch.float32)
    p = to_device(m, t)
    mine = m._mock.stream_create()
    ring = Ring(m)
    began, staged, result = threading.Event(), threading.Event(), {}

    def capture():
        result["begin"] = m._mock.begin_capture(capture_stream, GLOBAL)
        m._mock.enqueue_increment(capture_stream, work, 256)
        began.set()
        staged.wait(30)
        m._mock.enqueue_increment(capture_stream, work, 256)
        result["end"] = m._mock.end_capture(capture_stream)

    th = threading.Thread(target=capture)
    th.start()
    began.wait(30)
    stager = m.CudaStager(ring.producer, 1 << 20)
    stager.register_host()
    statuses = [stage_ptr(stager, p, t, name_id=0, stream=mine),
                stage_ptr(stager, p, t, name_id=1, stream=0)]  # legacy: would depend on the capture
    assert stager.flush(10)
    staged.set()
    th.join()
    assert result["begin"] == 0 and result["end"][0] == 0, result
    assert statuses == [m.STAGED, m.CAPTURING]
    assert ring.read()[0][(0, 0, 0)][2] == t.numpy().tobytes()
    stager.close()
    m._mock.graph_destroy(result["end"][1])
    m._mock.stream_destroy(mine)
    m._mock.stream_destroy(capture_stream)


def test_double_stage_during_a_capture_on_the_same_thread(m):
    """Hooks run while torch.cuda.graph captures (global mode, same thread): the stager's first use
    (ring allocation, pinning) and a snapshot on another stream must not invalidate the capture; a
    tensor on the capturing stream, or produced on it, is refused (CAPTURING) without touching the rings."""
    capture_stream, other = m._mock.stream_create(), m._mock.stream_create()
    t = torch.arange(3000, dtype=torch.int32)
    p = to_device(m, t)
    ring = Ring(m)
    stager = m.CudaStager(ring.producer, 1 << 20)
    try:
        assert m._mock.begin_capture(capture_stream, GLOBAL) == 0
        stager.register_host()
        statuses = [stage_ptr(stager, p, t, name_id=0, stream=capture_stream),
                    stage_ptr(stager, p, t, name_id=1, stream=other, producer_stream=capture_stream),
                    stage_ptr(stager, p, t, name_id=2, stream=other)]
        err, graph = m._mock.end_capture(capture_stream)
        assert err == 0 and graph, m._mock.error_name(err)
        m._mock.graph_destroy(graph)
        assert statuses == [m.CAPTURING, m.CAPTURING, m.STAGED]
        assert stager.flush(10)
        got, _ = ring.read()
        assert list(got) == [(0, 2, 0)] and got[(0, 2, 0)][2] == t.numpy().tobytes()
        assert stager.stats()["capturing_skipped"] == 2
    finally:
        stager.close()
        m._mock.stream_destroy(capture_stream)
        m._mock.stream_destroy(other)


_CAPSULE_KEEP = []


class DeviceCapsule:
    """An unversioned DLPack capsule ("dltensor") describing mock device memory like `t`; `on_release`
    runs when the capsule is destroyed (the producer frees its memory then)."""

    _DESTRUCTOR = ctypes.CFUNCTYPE(None, ctypes.c_void_p)  # not py_object: the capsule is being freed

    def __init__(self, ptr, t, device=0, on_release=None):
        from fastdump.staging import cuda

        nd = t.dim()
        self.shape = (ctypes.c_int64 * max(nd, 1))(*t.shape)
        self.strides = (ctypes.c_int64 * max(nd, 1))(*t.stride())
        code, bits = {torch.bfloat16: (4, 16), torch.float32: (2, 32), torch.uint8: (1, 8)}[t.dtype]
        self.managed = cuda._DLManagedTensor()
        dl = self.managed.dl_tensor
        dl.data, dl.device = ptr, cuda._DLDevice(2, device)
        dl.ndim, dl.dtype = nd, cuda._DLDataType(code, bits, 1)
        dl.shape, dl.strides, dl.byte_offset = self.shape, self.strides, 0
        _CAPSULE_KEEP.append(self)  # the ctypes memory and callback outlive the capsule (test code)

        def destroy(_capsule):
            if on_release is not None:
                on_release()

        self._destroy = self._DESTRUCTOR(destroy)
        new = ctypes.pythonapi.PyCapsule_New
        new.restype = ctypes.py_object
        new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
        self._capsule = new(ctypes.addressof(self.managed), b"dltensor", ctypes.cast(self._destroy, ctypes.c_void_p))

    def take(self):
        """The capsule; this object keeps no reference to it (its destructor runs when the consumer lets go)."""
        capsule, self._capsule = self._capsule, None
        return capsule


def mock_driver(name, cuda_sources, opt):
    """tests/cuda_mock/<name>.cpp built against the mock runtime (build.driver); skips without a compiler."""
    import build as mock_build

    try:
        return mock_build.driver(name, cuda_sources, opt)
    except RuntimeError as exc:
        pytest.skip(str(exc))


@pytest.mark.slow
def test_mock_stress_threads_random_layouts():
    """The C++ stress driver (random layouts, element sizes, streams, delays; 3 modes)."""
    out = mock_driver("stress", ["csrc/cuda_staging.cu"], "-O2")
    for mode in ("", "nobatch", "fail"):
        r = subprocess.run([str(out), "300", "4", mode], capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, f"mode {mode!r}:\n{r.stdout}\n{r.stderr}"


def test_mock_no_device_space_held_while_waiting_for_host_ring():
    """tests/cuda_mock/ring_cycle.cpp: the stress driver's rare hang, made deterministic. stage() must
    hold no device-ring space while it waits for the host ring or its lock (a tensor larger than the
    host ring, staged record by record; a `drop` reservation finding the ring's lock taken), else
    device ring -> host ring -> writer -> a thread's reserved records -> device ring is a cycle."""
    out = mock_driver("ring_cycle", ["csrc/cuda_staging.cu"], "-O1")
    r = subprocess.run([str(out)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, f"{r.stdout}\n{r.stderr}"


# =================================================================================================
# On a GPU, through the public API

CUDA_READY = bool(getattr(_C, "cuda_compiled", lambda: False)()) and torch.cuda.is_available()
needs_cuda_build = pytest.mark.skipif(not CUDA_READY, reason="needs a CUDA GPU and fastdump._C built with CUDA "
                                      "(CUDA_HOME=... pip install -e .)")


def _attach(root, **kw):
    kw.setdefault("tp_rank", 0)
    kw.setdefault("tp_size", 1)
    kw.setdefault("strict", True)
    return fastdump.attach(None, root, **kw)


def _dump_pass(d, items):
    d.begin_pass()
    for name, t in items:
        d.dump(name, t)
    d.end_pass()


def _load(root, pass_id=0, role="target"):
    return fastdump.open(root).load(role, 0, pass_id)


@pytest.mark.cuda
@needs_cuda_build
def test_gpu_every_dtype_bit_exact(tmp_path):
    items = []
    for i, (name, dt) in enumerate(torch_dtypes()):
        try:
            t = random_tensor(dt, (4, 8), device="cuda", seed=i)
        except (RuntimeError, TypeError):
            continue  # no CUDA copy kernel for this shell dtype
        items.append((name, t))
    with _attach(tmp_path) as d:
        _dump_pass(d, items)
        torch.cuda.synchronize()
    got = _load(tmp_path)
    for name, t in items:
        assert same_bits(got[name], t.cpu()), name
    assert {"float32", "bfloat16", "float8_e4m3fn", "bool", "complex64"} <= set(got)


class _Produce(torch.nn.Module):
    def __init__(self, n):
        super().__init__()
        self.lin = torch.nn.Linear(n, n)

    def forward(self, x):
        return self.lin(x)


class _InPlaceNext(torch.nn.Module):
    """The next kernel overwrites its input in place (like a fused add + RMSNorm)."""

    def forward(self, x):
        return x.mul_(-3).add_(1)


class _Chain(torch.nn.Module):
    def __init__(self, n=2048):
        super().__init__()
        self.heavy = torch.nn.Linear(n, n)  # keeps the stream busy when the hook fires
        self.produce = _Produce(n)
        self.inplace = _InPlaceNext()

    def forward(self, x):
        for _ in range(8):
            x = torch.tanh(self.heavy(x))
        return self.inplace(self.produce(x))


@pytest.mark.cuda
@needs_cuda_build
@pytest.mark.parametrize("side_stream", [False, True])
def test_gpu_in_place_overwrite_after_hook_and_output_unchanged(tmp_path, side_stream):
    """produce.lin's output is overwritten in place by the next module right after its hook: the
    dump must hold its value at hook time (a clone taken by a forward hook in the same run)."""
    torch.manual_seed(0)
    model = _Chain().cuda()
    x = torch.randn(64, 2048, device="cuda")
    stream = torch.cuda.Stream() if side_stream else torch.cuda.current_stream()
    # torch's pooled streams are non-blocking: without this wait the side stream may read x (and
    # the weights) before the default stream's randn and copies have written them.
    stream.wait_stream(torch.cuda.current_stream())
    with torch.no_grad(), torch.cuda.stream(stream):
        plain = model(x.clone())
    clones = {}
    h = model.produce.lin.register_forward_hook(lambda mod, i, o: clones.setdefault("lin", o.clone()))
    d = fastdump.attach(model, tmp_path, tp_rank=0, tp_size=1, strict=True)
    with torch.no_grad(), torch.cuda.stream(stream):
        dumped_out = model(x.clone())
    stream.synchronize()
    d.close()
    h.remove()
    assert torch.equal(plain, dumped_out)  # dumping does not change what the model computes
    got = _load(tmp_path)
    assert same_bits(got["produce.lin"], clones["lin"].cpu())  # before mul_/add_, not after
    assert same_bits(got["inplace"], dumped_out.cpu())
    assert not torch.equal(got["produce.lin"], got["inplace"])
    assert "heavy#7" in got  # the 8th call of `heavy` in the pass


@pytest.mark.cuda
@needs_cuda_build
def test_gpu_non_contiguous_and_odd_layouts(tmp_path):
    cases = {name: t.cuda() for name, t in layouts().items()}
    cases["bf16_t"] = random_tensor(torch.bfloat16, (33, 17), device="cuda").t()
    cases["fp8_slice"] = random_tensor(torch.float8_e4m3fn, (64, 96), device="cuda")[3:, 5::7]
    with _attach(tmp_path) as d:
        _dump_pass(d, cases.items())
        torch.cuda.synchronize()
    got = _load(tmp_path)
    for name, t in cases.items():
        assert same_bits(got[name], t.cpu()), name


@pytest.mark.cuda
@needs_cuda_build
def test_gpu_tensor_larger_than_device_ring(tmp_path):
    t = torch.randn(20 << 20, device="cuda")  # 80 MiB through a 4 MiB device ring and 16 MiB host ring
    with _attach(tmp_path, ring_mb=16, device_ring_mb=4) as d:
        _dump_pass(d, [("big", t), ("big_t", t.view(4096, -1).t())])
        torch.cuda.synchronize()
    got = _load(tmp_path)
    assert same_bits(got["big"], t.cpu())
    assert same_bits(got["big_t"], t.view(4096, -1).t().cpu())


@pytest.mark.cuda
@needs_cuda_build
def test_gpu_drop_policy_counts_under_tiny_rings(tmp_path):
    tensors = [torch.full((256 << 10,), float(i), device="cuda") for i in range(64)]  # 1 MiB each
    busy = torch.randn(8192, 8192, device="cuda")
    with _attach(tmp_path, policy="drop", ring_mb=2, device_ring_mb=2) as d:
        d.begin_pass()
        for _ in range(20):
            busy = busy @ busy  # the stream is busy: snapshots wait, the small rings fill
            busy = busy / busy.norm()
        for i, t in enumerate(tensors):
            d.dump(f"t{i}", t)
        d.end_pass()
        torch.cuda.synchronize()
        stats = d.stats()
    assert stats["dropped"] > 0
    got = _load(tmp_path)
    assert len(got) + stats["dropped"] == len(tensors)
    for name, t in got.items():
        assert same_bits(t, tensors[int(name[1:])].cpu()), name


@pytest.mark.cuda
@needs_cuda_build
def test_gpu_two_devices(tmp_path):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    a = random_tensor(torch.float16, (128, 64), device="cuda:0", seed=1)
    b = random_tensor(torch.float16, (128, 64), device="cuda:1", seed=2)
    with _attach(tmp_path) as d:
        d.begin_pass()
        d.dump("a", a)
        with torch.cuda.device(1):
            d.dump("b", b.t())
        d.dump("a_t", a.t())
        d.end_pass()
        torch.cuda.synchronize(0)
        torch.cuda.synchronize(1)
    got = _load(tmp_path)
    assert same_bits(got["a"], a.cpu()) and same_bits(got["b"], b.t().cpu()) and same_bits(got["a_t"], a.t().cpu())


@pytest.mark.cuda
@needs_cuda_build
def test_gpu_cupy_array(tmp_path):
    cp = pytest.importorskip("cupy")
    x = cp.arange(6 * 10, dtype=cp.float32).reshape(6, 10)[:, ::3]
    with _attach(tmp_path) as d:
        _dump_pass(d, [("cupy", x), ("cupy_i8", cp.arange(17, dtype=cp.int8))])
        cp.cuda.get_current_stream().synchronize()
    got = _load(tmp_path)
    assert np.array_equal(got["cupy"].numpy(), cp.asnumpy(x))
    assert np.array_equal(got["cupy_i8"].numpy(), np.arange(17, dtype=np.int8))


@pytest.mark.cuda
@needs_cuda_build
def test_gpu_stager_direct_and_graph_capture_is_refused(tmp_path, record_property):
    """The C++ stager alone (no engine): stats, pinning, batch copies, and CUDA-graph capture."""
    from fastdump.staging import cuda

    ring = Ring(_C, capacity=64 << 20, chunk=4 << 20)
    stager = cuda.get_stager(ring.producer, 32)
    assert not isinstance(stager, cuda.HostFallbackStager)
    tensors = [random_tensor(torch.float32, (n,), device="cuda", seed=n) for n in (1, 1000, 3 << 20)]
    for i, t in enumerate(tensors):
        assert cuda.stage_tensor(stager, 0, i, 0, dtypes.code_of(t.dtype), t, True) == _C.STAGED
    assert stager.flush(30)
    got, _ = ring.read()
    for i, t in enumerate(tensors):
        assert got[(0, i, 0)][2] == t.cpu().numpy().tobytes()
    st = stager.stats()
    assert st["registered_bytes"] >= 64 << 20, st
    assert st["last_error"] == "" and not st["broken"], st
    # Which D2H path ran is reported, not asserted: a driver may refuse the batch API, and the
    # per-copy path it falls back to is as correct (the bytes are checked above).
    path = ("cudaMemcpyBatchAsync" if st["batch_api"] else
            f"cudaMemcpyAsync per copy ({st['batch_api_fallback'] or 'batch API not in use'})")
    record_property("d2h_path", path)  # in the junit XML
    print(f"\nD2H copies: {path}")

    g = torch.cuda.CUDAGraph()
    static = torch.zeros(1000, device="cuda")
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        static.add_(1)  # warm up on the capture stream
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(g):
        out = static * 2
        status = cuda.stage_tensor(stager, 0, 9, 0, dtypes.code_of(out.dtype), out, True)
    assert status == cuda.CAPTURING
    g.replay()  # the capture is intact
    torch.cuda.synchronize()
    assert torch.equal(out, static * 2)
    assert stager.stats()["capturing_skipped"] == 1
    stager.close()


@pytest.mark.cuda
@needs_cuda_build
def test_gpu_status_reports_devices():
    from fastdump.staging import cuda

    st = cuda.status()
    assert st["usable"] and st["device_count"] == torch.cuda.device_count()
    dev = st["devices"][0]
    assert dev["name"] == torch.cuda.get_device_name(0)
    assert dev["uuid"].startswith("GPU-") and dev["pci_bus_id"].count(":") == 2
    assert dev["total_memory"] == torch.cuda.get_device_properties(0).total_memory


def test_an_engine_shut_down_leaves_its_host_ring_unmapped(m, glue, tmp_path):
    """Every CUDA stager was kept in a module list for the process's life, and with it its engine's
    256 MiB host ring (a shared mapping, pinned): each engine started after the last one shut down
    (attach, close, attach again) left another ring mapped. The test suite ran out of memory on it."""
    import gc

    def mapped():
        with open("/proc/self/maps") as f:
            return {line.split()[-2] if line.rstrip().endswith("(deleted)") else line.split()[-1]
                    for line in f if "/fastdump-" in line}

    rings = []
    for k in range(3):
        d = _attach(tmp_path / str(k), writer="thread", device="cuda:0")
        d._engine.cuda_stager(d.device_ring_mb)  # (made at attach for a CUDA device: the same one)
        rings.append(d._engine.producer.name)
        assert any(path.endswith(rings[-1]) for path in mapped())
        d.close()
        del d
        gc.collect()
        assert not any(path.endswith(name) for path in mapped() for name in rings), (rings, mapped())


def test_pointer_device_on_a_fresh_thread_makes_no_context_on_gpu0(m):
    """A process that uses GPU 1 only asks, from a thread that never chose a device (a
    ``__cuda_array_interface__`` array without a device attribute, dumped from a worker thread),
    which GPU a pointer is on: cudaPointerGetAttributes ran with device 0 current and the runtime
    made GPU 0's primary context (~500 MiB on a GPU the process never used). The call runs on a
    GPU already in use now, and the answer is the same."""
    import threading

    buf = device_buffer(m, 256, device=1)
    m._mock.reset_contexts()
    out = {}
    t = threading.Thread(target=lambda: out.setdefault("set", m._mock.set_device(1)))  # the process's GPU
    t.start()
    t.join()
    assert out["set"] == 0 and m._mock.contexts() == [0, 1]
    t = threading.Thread(target=lambda: out.setdefault("device", m.cuda_pointer_device(buf)))  # a fresh thread
    t.start()
    t.join()
    assert out["device"] == 1
    assert m._mock.contexts() == [0, 1], "a primary context was created on GPU 0"
