"""CUDA staging glue: torch CUDA tensors, ``__cuda_array_interface__`` and DLPack arrays -> ``_C.CudaStager``.

Imported lazily (the first time a CUDA tensor or a foreign array is dumped), never by ``import
fastdump``. The C++ side (csrc/cuda_staging.cu, docs/CUDA.md) snapshots each tensor on its producer
stream into a device ring and drains it to the pinned shared-memory host ring on a side stream; this
module only turns Python objects into (pointer, shape, strides, device, stream) and keeps the per-call
Python cost small.

When CUDA staging is unusable (fastdump built without a toolkit, no driver/GPU at run time) CUDA
tensors still get dumped, through a synchronous ``.cpu()`` copy into the host ring: correct, slow, and
said once in the log; never while the tensor's stream is being captured into a CUDA graph (the copy
would break the capture): such a tensor is refused as CAPTURING, as the C++ stager refuses it. When
only a GPU's device ring cannot be allocated (a serving engine took the memory), that GPU's tensors
are dropped and counted instead (RING_UNAVAILABLE): a synchronous copy per tensor would stall the
server; the reason is recorded in rank.json.
"""

from __future__ import annotations

import collections
import functools
import itertools
import ctypes
import logging
import sys
import threading
import weakref

from .. import _C, fsutil
from .. import dtypes as _dtypes
from ..devices import cuda_info  # noqa: F401 - part of this module's face (status, usable)

log = logging.getLogger("fastdump")

STAGED = _C.STAGED
DROPPED = _C.DROPPED
DISABLED = _C.DISABLED
TOO_LARGE = _C.TOO_LARGE
#: stage() result when the producer stream is being captured into a CUDA graph: nothing was staged
#: (hooks do not run on graph replay anyway); count the tensor as skipped, not as a failure.
CAPTURING = _C.CAPTURING
#: stage_tensor() result when the tensor's GPU has no device ring (allocation failed): nothing was
#: staged; the caller counts the tensor as dropped and records ring_failure(stager) once.
RING_UNAVAILABLE = _C.RING_UNAVAILABLE  # was 7 here, the value of _C.TORN: a torn CUDA tensor read as this

_lock = threading.Lock()
_warned = set()
# The stagers made in this process (status()), held weakly: each holds its engine's host ring (a
# 256 MiB shared mapping, pinned) and was kept for the process's life, so every engine started
# after the last one shut down (attach, close, attach again: a benchmark script's loop) left
# another ring mapped for good.
_stagers = weakref.WeakValueDictionary()  # made-order number -> stager (status() lists them in that order)
_stager_numbers = itertools.count()


def _warn_once(key: str, msg: str, *args) -> None:
    if key not in _warned:
        _warned.add(key)
        log.warning(msg, *args)


# ------------------------------------------------------------------------------------------------
# What this build and machine can do


def usable() -> bool:
    info = cuda_info()
    return bool(info.get("compiled")) and int(info.get("device_count", 0)) > 0


def unusable_reason() -> str:
    info = cuda_info()
    if not info.get("compiled"):
        return info.get("reason") or "fastdump was built without CUDA"
    if not info.get("device_count"):
        return info.get("reason") or "no CUDA device visible"
    return ""


def status() -> dict:
    """For ``fastdump info`` and rank.json: build facts, GPUs, and each stager's counters.

    The first call on a machine where CUDA is compiled in but unusable logs a warning (once).
    """
    info = dict(cuda_info())
    info["usable"] = usable()
    if info.get("compiled") and not info["usable"]:
        _warn_once("unusable", "fastdump: CUDA staging is compiled in but unusable here (%s); "
                   "CUDA tensors are copied synchronously through .cpu()", unusable_reason())
    stagers = []
    for s in list(_stagers.values()):
        try:
            stagers.append(s.stats())
        except Exception as exc:
            stagers.append({"error": str(exc)})
    info["stagers"] = stagers
    return info


# ------------------------------------------------------------------------------------------------
# The stager


class HostFallbackStager:
    """Stands in for ``_C.CudaStager`` when CUDA staging is unusable: ``.cpu()`` then the host ring."""

    def __init__(self, producer, reason: str):
        self.producer = producer
        self.reason = reason
        self._stats = {"fallback": True, "reason": reason, "tensors": 0, "bytes": 0, "capturing_skipped": 0}

    def stage_tensor(self, channel, name_id, pass_id, dtype_code, tensor, block, timeout_s=-1.0) -> int:
        _check_storage(tensor, tensor.data_ptr())  # .cpu() reads what the tensor addresses, unchecked
        if _stream_capturing(tensor) or _capture_forbids_sync_copies():
            # A synchronous copy on a capturing stream is illegal and invalidates the user's graph,
            # and so is one on any stream while a global-mode capture runs on another thread (the
            # copy's cudaStreamSynchronize is a "potentially unsafe" call): refused like the C++
            # stager refuses a capturing stream (the caller counts CAPTURING as a skip).
            self._stats["capturing_skipped"] += 1
            return CAPTURING
        host = _to_host(tensor)
        status = self.producer.stage_host(channel, name_id, pass_id, dtype_code, host.element_size(),
                                          host.shape, host.stride(), host.data_ptr(), block, timeout_s)
        if status == STAGED:
            self._stats["tensors"] += 1
            self._stats["bytes"] += host.numel() * host.element_size()
        return status

    def flush(self, timeout_s: float = 600.0) -> bool:
        return True  # every copy was synchronous

    def register_host(self) -> float:
        return 0.0

    def stats(self) -> dict:
        return dict(self._stats)

    def close(self, timeout_s: float = 60.0) -> None:
        pass


def get_stager(producer, device_ring_mb: float):
    """The process's stager for ``producer``: a ``_C.CudaStager`` with the host ring pinned, or a
    ``HostFallbackStager`` (logged once, with the reason) when CUDA staging cannot run here.

    ``device_ring_mb``: the engine's (``EngineOptions.device_ring_mb``, where its default lives).
    Call once per engine (pinning costs ~0.1-1 s per GiB); the engine caches the result.
    """
    if not usable():
        reason = unusable_reason()
        _warn_once("unusable", "fastdump: CUDA staging unavailable (%s); CUDA tensors are copied "
                   "synchronously through .cpu()", reason)
        watch_graph_captures()  # (the fallback's copies must know of torch's captures)
        return _kept(HostFallbackStager(producer, reason))
    ring_bytes = int(float(device_ring_mb) * (1 << 20))
    try:
        stager = _C.CudaStager(producer, ring_bytes)
    except Exception as exc:
        _warn_once("create", "fastdump: cannot start CUDA staging (%s); CUDA tensors are copied "
                   "synchronously through .cpu()", exc)
        watch_graph_captures()
        return _kept(HostFallbackStager(producer, str(exc)))
    try:
        seconds = stager.register_host()
        log.info("fastdump: pinned the %.0f MiB host ring in %.3f s", producer.capacity / (1 << 20), seconds)
    except Exception as exc:
        # Still correct: D2H copies into pageable memory are staged by the driver (slower).
        _warn_once("pin", "fastdump: cudaHostRegister of the host ring failed (%s); device-to-host "
                   "copies will be slower", exc)
    _kept(stager)
    watch_graph_captures()
    return stager


def _kept(stager):
    """``stager``, listed (weakly, in made order) for status()."""
    _stagers[next(_stager_numbers)] = stager
    return stager


def watch_graph_captures() -> bool:
    """Have torch's ``CUDAGraph.capture_begin`` tell the extension before each capture begins, so a
    lean lane that checked its stream once per pass checks it again at its next tensor: a capture
    begun mid-pass on that very stream is then seen, its tensors go to the graph recorder, and the
    snapshots queued before it are kept (docs/CUDA.md, "The eager path"). Installed once per
    process; a capture begun outside torch (raw cudaStreamBeginCapture) is not seen this way
    (FASTDUMP_CUDA_CHECK_EACH_TENSOR=1 covers it). True once installed."""
    global _capture_hook
    if _capture_hook is not None:
        return True
    try:
        import torch

        graph_cls = torch.cuda.CUDAGraph
    except Exception:  # no torch, or a torch without CUDA graphs: nothing to watch
        return False
    original = graph_cls.__dict__.get("capture_begin") or getattr(graph_cls, "capture_begin")
    note = _C.note_capture_begin
    gate = _C.capture_gate

    @functools.wraps(original)
    def capture_begin(self, *args, **kwargs):
        note()
        _new_generation(self)
        if not _open_captures:  # (slots are not given back under another capture of a recorder)
            for call in before_capture:
                call()  # graphs.reclaim_dead_graphs: slots of graphs reset or collected go to this capture
        _capturing.graph = _GraphToken(self)
        # Held around torch's cudaStreamBeginCapture: a lean batch sealed by another thread (the
        # drain's hold timer) checks the capture state and records its event on one side of it.
        gate(True)
        try:
            result = original(self, *args, **kwargs)
        except BaseException:
            _capturing.graph = None
            raise
        finally:
            gate(False)
        mode = kwargs.get("capture_error_mode", args[1] if len(args) > 1 else "global")
        _open_captures[id(self)] = (str(mode), threading.get_ident())
        return result

    capture_begin.__fastdump_original__ = original
    graph_cls.capture_begin = capture_begin
    for name in ("capture_end", "reset"):
        method = graph_cls.__dict__.get(name) or getattr(graph_cls, name, None)
        if method is not None:
            setattr(graph_cls, name, _wrap_graph_method(method, name))
    _capture_hook = capture_begin
    return True


_capture_hook = None

# Called as a torch capture begins while no other is open. graphs.py puts its reclaim_dead_graphs
# here when it first uses this module (a list, so that this module imports no module of its layer
# that imports it).
before_capture: list = []
# Called with the torch CUDAGraph whose capture is about to end (its capture_end, before torch's):
# graphs.py puts its capture_ending here, for a graph whose pass has not ended inside the capture.
before_capture_end: list = []

# Which torch CUDAGraph each thread is capturing (between its capture_begin and capture_end), so the
# graph recorder knows which graphs write into its device memory: free_device_memory refuses while
# one of them still exists (staging/graphs.py). A graph's generation grows at each capture_begin
# and reset(): a token of an older generation is a graph that no longer exists.
_capturing = threading.local()
# The torch CUDAGraphs between capture_begin and capture_end: id() -> (capture_error_mode, thread).
_open_captures: dict = {}


def _capture_forbids_sync_copies() -> bool:
    """Whether a torch capture now open forbids this thread (in the default, global capture mode)
    the "potentially unsafe" calls of a synchronous ``.cpu()`` copy (cudaStreamSynchronize, an
    allocation): another thread's global-mode capture, or a non-relaxed capture of this thread's
    own (CUDA: cudaThreadExchangeStreamCaptureMode). Such a call would fail and invalidate that
    capture. Captures begun outside torch (raw cudaStreamBeginCapture, CuPy) are not known here."""
    if not _open_captures:
        return False
    me = threading.get_ident()
    for mode, thread in list(_open_captures.values()):
        if (thread == me and mode != "relaxed") or (thread != me and mode == "global"):
            return True
    return False
_generations = None  # weakref.WeakKeyDictionary: torch CUDAGraph -> generation


def _new_generation(graph) -> None:
    global _generations
    if _generations is None:
        _generations = weakref.WeakKeyDictionary()
    try:
        _generations[graph] = _generations.get(graph, 0) + 1
    except TypeError:  # (not weakly referable: such a graph is not tracked)
        pass


def _wrap_graph_method(method, name):
    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        if name == "reset":  # the graph is destroyed: its tokens are dead
            _new_generation(self)
            _open_captures.pop(id(self), None)  # (a capture that never ended)
            return method(self, *args, **kwargs)
        if id(self) in _open_captures:  # (capture_end of a capture fastdump saw begin)
            for call in before_capture_end:
                call(self)  # graphs.capture_ending: a graph whose pass is still open gets a done event
        try:
            return method(self, *args, **kwargs)
        finally:
            _capturing.graph = None  # the capture ended (or failed to)
            _open_captures.pop(id(self), None)

    wrapper.__fastdump_original__ = method
    return wrapper


class _GraphToken:
    """One capture of a torch CUDAGraph: ``alive()`` while that graph may still be replayed (the
    object exists and has neither been reset nor captured again since)."""

    __slots__ = ("_ref", "_generation")

    def __init__(self, graph):
        try:
            self._ref = weakref.ref(graph)
        except TypeError:
            self._ref = None
        self._generation = _generations.get(graph) if (_generations is not None and self._ref) else None

    def is_capture_of(self, graph) -> bool:
        """Whether this token names ``graph``'s current capture."""
        return self._ref is not None and self._ref() is graph and self.alive()

    def alive(self) -> bool:
        if self._ref is None:
            return True  # not trackable: assume it may be replayed
        graph = self._ref()
        return graph is not None and _generations is not None and _generations.get(graph) == self._generation


def capturing_graph():
    """The token of the torch CUDAGraph this thread is capturing, or None (no torch capture: a raw
    cudaStreamBeginCapture, CuPy's graphs; fastdump cannot tell when such a graph is destroyed)."""
    return getattr(_capturing, "graph", None)


# ------------------------------------------------------------------------------------------------
# torch tensors (the hot path)

def _current_stream(device: int):
    """(raw cudaStream_t, torch stream object) of ``device``'s current stream."""
    import torch

    stream = torch.cuda.current_stream(device)
    return stream.cuda_stream, stream


_default_current_stream = _current_stream


def _capture_running() -> bool:
    """Whether the current GPU's current stream is being captured into a CUDA graph (without an
    initialized CUDA, none is). Asked at the begin of a pass the Dumper's selection leaves out: a
    graph captured in it must still be recorded, or none of its replays is ever dumped. A seam:
    the mock-runtime tests replace it."""
    torch_cuda = sys.modules.get("torch.cuda")
    if not getattr(torch_cuda, "_initialized", False):  # (no call: asked at every pass left out)
        return False
    try:
        return torch_cuda.is_initialized() and torch_cuda.is_current_stream_capturing()
    except RuntimeError:  # the legacy stream while a blocking stream captures: it never captures itself
        return False


def lane_stream_functions():
    """(raw_stream(device), stream_object(device)) for ``ChannelStager.set_cuda``: the current
    stream as a raw int (asked per tensor; torch answers from a thread-local without a CUDA call)
    and its stream object for ``record_stream`` (asked only when the raw stream changes). Through
    ``_current_stream`` when that seam was replaced (tests drive the mock runtime through it)."""
    if _current_stream is _default_current_stream:
        import torch

        return torch._C._cuda_getCurrentRawStream, torch.cuda.current_stream
    return (lambda device: _current_stream(device)[0]), (lambda device: _current_stream(device)[1])


_ring_failures: dict = {}  # id(stager) -> why its device ring could not be had


def ring_failure(stager) -> str:
    """Why ``stager`` has no device ring for some GPU ('' when it has every ring it was asked for)."""
    return _ring_failures.get(id(stager), "")


def _is_ring_failure(exc: Exception) -> bool:
    return "device staging ring" in str(exc)


def prepare(stager, device: int) -> str:
    """Allocate ``device``'s device ring now (at attach, before a serving engine sizes its KV cache to
    the free memory). Returns '' or the reason it cannot be had (then that GPU's tensors are dropped)."""
    if stager.__class__ is HostFallbackStager:
        return ""
    try:
        stager.prepare(int(device))
    except (RuntimeError, ValueError) as exc:
        _ring_failures[id(stager)] = str(exc)
        _warn_once(f"prepare:{exc}", "fastdump: %s; tensors on GPU %d will be dropped and counted", exc, device)
        return str(exc)
    return ""


def stage_tensor(stager, channel: int, name_id: int, pass_id: int, dtype_code: int, tensor, block: bool,
                 timeout_s: float = -1.0) -> int:
    """Stage a torch CUDA tensor; returns STAGED, DROPPED, TIMED_OUT, TORN, RING_TOO_SMALL, DISABLED,
    TOO_LARGE, CAPTURING or RING_UNAVAILABLE. ``block`` waits up to ``timeout_s`` (< 0: no limit) for
    host-ring space.

    The snapshot is enqueued on the tensor's device's *current* stream (the stream the module just
    ran on), so kernels launched after this call cannot change what is dumped. Assumption (as for
    any consumer on that stream, e.g. the next module): the tensor's producing work is ordered before
    the current stream's position. ``record_stream`` tells the caching allocator that the current
    stream uses the block, so a tensor allocated on another stream is not handed out again before
    the snapshot has read it. The caller resolves lazy conj/neg bits and checks the layout.
    """
    if stager.__class__ is HostFallbackStager:
        return stager.stage_tensor(channel, name_id, pass_id, dtype_code, tensor, block, timeout_s)
    return stage_on_device(stager, channel, name_id, pass_id, dtype_code, tensor, block, timeout_s)


def stage_on_device(stager, channel: int, name_id: int, pass_id: int, dtype_code: int, tensor, block: bool,
                    timeout_s: float = -1.0) -> int:
    """``stage_tensor`` for a stager known to be a ``_C.CudaStager`` (a Channel decides that once)."""
    ptr = tensor.data_ptr()
    _check_storage(tensor, ptr)  # (the stager copies the range shape and strides give, unchecked)
    device = tensor.get_device()
    raw, stream = _current_stream(device)
    try:
        status = stager.stage(channel, name_id, pass_id, dtype_code, tensor.element_size(), tensor.shape,
                              tensor.stride(), ptr, device, raw, block, timeout_s=timeout_s)
    except (RuntimeError, ValueError) as exc:
        if _is_ring_failure(exc):
            _ring_failures[id(stager)] = str(exc)
            return RING_UNAVAILABLE

        # Raised before anything of this tensor was staged (bad arguments, device ring allocation
        # failed, a CUDA error): keep the dump correct through the slow path (which refuses a
        # capturing stream, as stage() does).
        _warn_once(f"stage:{type(exc).__name__}:{exc}", "fastdump: CUDA staging failed (%s); "
                   "falling back to a synchronous copy", exc)
        return HostFallbackStager(stager.producer, str(exc)).stage_tensor(
            channel, name_id, pass_id, dtype_code, tensor, block, timeout_s)
    if status == STAGED:
        try:
            tensor.record_stream(stream)
        except RuntimeError as exc:  # memory torch's allocator does not own: nothing to protect
            _warn_once(f"record_stream:{exc}", "fastdump: record_stream failed (%s); the snapshot relies on "
                       "the tensor staying allocated until the current stream reached it", exc)
    return status


def _check_storage(tensor, ptr: int) -> None:
    """ValueError (the tensor's recorded skip) unless ``tensor``'s storage holds every element it
    addresses from ``ptr``. torch lets a storage be freed or shrunk under its tensors
    (``untyped_storage().resize_(0)``, as FSDP does): a null pointer faults the copy (on the device,
    or through the synchronous fallback on the host), a shrunk storage has it read the memory after
    it (another tensor's: dumped as this one's). The check the tensor reader and the host path make."""
    shape, strides = tuple(tensor.shape), tuple(tensor.stride())
    if 0 in shape:
        return
    if not ptr:
        raise ValueError(_C.NO_DATA)
    storage = tensor.untyped_storage()
    base, nbytes, itemsize = storage.data_ptr(), storage.nbytes(), tensor.element_size()
    last = sum((n - 1) * st for n, st in zip(shape, strides))  # (torch's strides are not negative)
    if not base or ptr < base or ptr - base + (last + 1) * itemsize > nbytes:
        raise ValueError(_C.STORAGE_SHORT)


def _stream_capturing(tensor) -> bool:
    """Whether the stream a ``.cpu()`` copy of ``tensor`` runs on (its GPU's current stream) is
    being captured into a CUDA graph."""
    device = tensor.get_device()
    if device < 0:
        return False  # a host tensor: its copy is no CUDA work
    import torch

    try:
        if device == torch.cuda.current_device():
            return torch.cuda.is_current_stream_capturing()
        with torch.cuda.device(device):
            return torch.cuda.is_current_stream_capturing()
    except RuntimeError:
        # cudaErrorStreamCaptureImplicit: the current stream is the legacy one and a blocking stream
        # of the GPU captures (other code's). A copy on the legacy stream would invalidate that capture.
        return True


_INT_BY_SIZE = None


def _to_host(tensor):
    """A CPU copy of a (CUDA) tensor with the same bytes, for any dtype (bit types included)."""
    global _INT_BY_SIZE
    import torch

    t = tensor.detach()
    try:
        return t.to("cpu")
    except (RuntimeError, TypeError):
        # Some shell dtypes have no copy kernel: move the bytes as an integer type of the same size.
        if _INT_BY_SIZE is None:
            _INT_BY_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
        return t.view(_INT_BY_SIZE[t.element_size()]).to("cpu").view(t.dtype)


# ------------------------------------------------------------------------------------------------
# __cuda_array_interface__ and DLPack

# CAI typestr (kind + itemsize, byte order stripped) -> torch dtype name.
_CAI_TYPES = {
    "b1": "bool",
    "i1": "int8", "i2": "int16", "i4": "int32", "i8": "int64",
    "u1": "uint8", "u2": "uint16", "u4": "uint32", "u8": "uint64",
    "f2": "float16", "f4": "float32", "f8": "float64",
    "c8": "complex64", "c16": "complex128",
}

# DLPack (type code, bits, lanes) -> torch dtype name. Codes from dlpack.h (DLDataTypeCode).
_DL_INT, _DL_UINT, _DL_FLOAT, _DL_BFLOAT, _DL_COMPLEX, _DL_BOOL = 0, 1, 2, 4, 5, 6
_DLPACK_TYPES = {
    (_DL_INT, 8, 1): "int8", (_DL_INT, 16, 1): "int16", (_DL_INT, 32, 1): "int32", (_DL_INT, 64, 1): "int64",
    (_DL_UINT, 8, 1): "uint8", (_DL_UINT, 16, 1): "uint16", (_DL_UINT, 32, 1): "uint32",
    (_DL_UINT, 64, 1): "uint64",
    (_DL_FLOAT, 16, 1): "float16", (_DL_FLOAT, 32, 1): "float32", (_DL_FLOAT, 64, 1): "float64",
    (_DL_BFLOAT, 16, 1): "bfloat16",
    (_DL_COMPLEX, 32, 1): "complex32", (_DL_COMPLEX, 64, 1): "complex64", (_DL_COMPLEX, 128, 1): "complex128",
    (_DL_BOOL, 8, 1): "bool",
    (10, 8, 1): "float8_e4m3fn", (11, 8, 1): "float8_e4m3fnuz", (12, 8, 1): "float8_e5m2",
    (13, 8, 1): "float8_e5m2fnuz", (14, 8, 1): "float8_e8m0fnu",
    (17, 4, 2): "float4_e2m1fn_x2",  # two packed e2m1 values per byte, as torch exports it
}

_DL_CPU, _DL_CUDA, _DL_CUDA_HOST, _DL_CUDA_MANAGED = 1, 2, 3, 13


def cai_dtype_code(typestr: str) -> int:
    """Wire code for a ``__cuda_array_interface__`` typestr ('<f4', '|b1', ...). ValueError if unknown."""
    if len(typestr) < 3 or typestr[0] not in "<>|=":
        raise ValueError(f"unsupported typestr {typestr!r}")
    key = typestr[1:]
    if typestr[0] == ">" and key[1:] != "1":
        raise ValueError(f"big-endian typestr {typestr!r} is not supported")
    name = _CAI_TYPES.get(key)
    if name is None:
        raise ValueError(f"unsupported typestr {typestr!r} (pass dtype_code= for raw types such as bfloat16)")
    return _dtypes.CODE_BY_NAME[name]


def dlpack_dtype_code(code: int, bits: int, lanes: int = 1) -> int:
    """Wire code for a DLPack dtype (type code, bits, lanes). ValueError if unknown."""
    name = _DLPACK_TYPES.get((int(code), int(bits), int(lanes)))
    if name is None:
        raise ValueError(f"unsupported DLPack dtype (code={code}, bits={bits}, lanes={lanes})")
    return _dtypes.CODE_BY_NAME[name]


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice), ("ndim", ctypes.c_int32),
                ("dtype", _DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


class _DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", ctypes.c_void_p)]


class _DLPackVersion(ctypes.Structure):
    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32)]


class _DLManagedTensorVersioned(ctypes.Structure):
    _fields_ = [("version", _DLPackVersion), ("manager_ctx", ctypes.c_void_p), ("deleter", ctypes.c_void_p),
                ("flags", ctypes.c_uint64), ("dl_tensor", _DLTensor)]


_capsule_api = None


def _capsule_fns():
    global _capsule_api
    if _capsule_api is None:
        get_name = ctypes.pythonapi.PyCapsule_GetName
        get_name.restype = ctypes.c_char_p
        get_name.argtypes = [ctypes.py_object]
        get_ptr = ctypes.pythonapi.PyCapsule_GetPointer
        get_ptr.restype = ctypes.c_void_p
        get_ptr.argtypes = [ctypes.py_object, ctypes.c_char_p]
        _capsule_api = (get_name, get_ptr)
    return _capsule_api


def dlpack_view(capsule) -> dict:
    """Read a DLPack capsule without consuming it (its destructor still frees it).

    Returns {ptr, device_type, device_id, code, bits, lanes, shape, strides (elements)}.
    """
    get_name, get_ptr = _capsule_fns()
    name = get_name(capsule)
    if name == b"dltensor":
        managed = _DLManagedTensor.from_address(get_ptr(capsule, name))
        t = managed.dl_tensor
    elif name == b"dltensor_versioned":
        managed = _DLManagedTensorVersioned.from_address(get_ptr(capsule, name))
        if managed.version.major != 1:
            raise ValueError(f"DLPack major version {managed.version.major} is not supported")
        t = managed.dl_tensor
    else:
        raise ValueError(f"not an unconsumed DLPack capsule (name {name!r})")
    ndim = int(t.ndim)
    shape = [int(t.shape[i]) for i in range(ndim)]
    if ndim and t.strides:
        strides = [int(t.strides[i]) for i in range(ndim)]
    else:  # before DLPack 1.2, NULL strides meant compact C order
        strides, step = [0] * ndim, 1
        for i in range(ndim - 1, -1, -1):
            strides[i] = step
            step *= shape[i]
    return {"ptr": int(t.data or 0) + int(t.byte_offset), "device_type": int(t.device.device_type),
            "device_id": int(t.device.device_id), "code": int(t.dtype.code), "bits": int(t.dtype.bits),
            "lanes": int(t.dtype.lanes), "shape": shape, "strides": strides}


def _dlpack_capsule(array, stream):
    try:
        return array.__dlpack__(stream=stream, max_version=(1, 0))
    except TypeError:  # producers older than DLPack 2023.12 take no max_version
        return array.__dlpack__(stream=stream)


def _elem_size(code: int) -> int:
    return _dtypes.ITEMSIZE[code]


def stage_array(engine, device_ring_mb, channel: int, name_id: int, pass_id: int, array, block: bool,
                dtype_code: int | None = None, stream: int | None = None, timeout_s: float = -1.0):
    """Stage a CuPy/Numba (``__cuda_array_interface__``) or DLPack array. Returns (status, nbytes);
    status RING_UNAVAILABLE when the array's GPU has no device ring (the caller counts a drop).
    ``block`` waits up to ``timeout_s`` (< 0: no limit) for ring space.

    Stream protocol: for the CUDA array interface, the array's own ``stream`` entry is the stream the
    snapshot is ordered on (absent: legacy default stream). For DLPack, fastdump is the consumer:
    it passes ``stream`` (default 1, the legacy default stream) to ``__dlpack__``, the producer makes
    that stream wait for its pending work, and the snapshot is enqueued on that same stream.
    ``dtype_code`` overrides the dtype mapping (e.g. bfloat16 exposed as '<V2').
    """
    cai = getattr(array, "__cuda_array_interface__", None)
    if cai is not None:
        return _stage_cai(engine, device_ring_mb, channel, name_id, pass_id, array, cai, block, dtype_code,
                          timeout_s)
    if not hasattr(array, "__dlpack__"):
        raise TypeError(f"{type(array).__name__} has neither __cuda_array_interface__ nor __dlpack__")
    device_type, device_id = (int(x) for x in array.__dlpack_device__())
    if device_type in (_DL_CPU, _DL_CUDA_HOST):
        capsule = _dlpack_capsule(array, None)
        v = dlpack_view(capsule)
        code = dtype_code if dtype_code is not None else dlpack_dtype_code(v["code"], v["bits"], v["lanes"])
        size = _elem_size(code)
        status = engine.producer.stage_host(channel, name_id, pass_id, code, size, v["shape"], v["strides"],
                                            v["ptr"], block, timeout_s)
        del capsule
        return status, _numel(v["shape"]) * size
    if device_type not in (_DL_CUDA, _DL_CUDA_MANAGED):
        raise TypeError(f"DLPack device type {device_type} is not supported")
    consumer_stream = 1 if stream is None else int(stream)
    capsule = _dlpack_capsule(array, consumer_stream)
    v = dlpack_view(capsule)
    code = dtype_code if dtype_code is not None else dlpack_dtype_code(v["code"], v["bits"], v["lanes"])
    size = _elem_size(code)
    nbytes = _numel(v["shape"]) * size
    stager = engine.cuda_stager(device_ring_mb)
    if stager.__class__ is HostFallbackStager:
        status = stager.stage_tensor(channel, name_id, pass_id, code, _torch_from_dlpack_capsule(capsule), block,
                                     timeout_s)
    else:
        status = _stage_or_ring_failure(stager, channel, name_id, pass_id, code, size, v["shape"], v["strides"],
                                        v["ptr"], v["device_id"], consumer_stream, block, timeout_s)
        if status == STAGED:
            # Releasing the capsule lets the producer free (and its allocator reuse) the memory,
            # ordered on the producer's stream only: keep it until the snapshot has read it.
            hold_until_read(stager, v["device_id"], capsule)
    del capsule
    return status, nbytes


def _stage_or_ring_failure(stager, channel, name_id, pass_id, code, size, shape, strides, ptr, device, stream,
                           block, timeout_s) -> int:
    """``stager.stage`` for a foreign array; RING_UNAVAILABLE (noted for ring_failure) when the GPU has
    no device ring, as ``stage_on_device`` answers for a torch tensor: the caller counts a drop."""
    try:
        return stager.stage(channel, name_id, pass_id, code, size, shape, strides, ptr, device, stream, block,
                            timeout_s=timeout_s)
    except (RuntimeError, ValueError) as exc:
        if not _is_ring_failure(exc):
            raise
        _ring_failures[id(stager)] = str(exc)
        return RING_UNAVAILABLE


_held = collections.deque()  # (stager, device, ticket, object): sources still read by a snapshot
_held_lock = threading.Lock()
fsutil.renew_locks_at_fork(sys.modules[__name__], "_lock", "_held_lock")  # (a forked child never uses the parent's CUDA, but attaches)


def hold_until_read(stager, device: int, obj) -> None:
    """Keep ``obj`` alive until every record staged so far on ``device`` has been copied out."""
    ticket = stager.submitted(device)
    with _held_lock:
        _held.append((stager, device, ticket, obj))
    release_read()


def release_read() -> int:
    """Drop the references whose snapshots have completed (in order per stager and device);
    returns how many are still held."""
    with _held_lock:
        while _held:
            stager, device, ticket, _ = _held[0]
            if stager.completed(device) < ticket:
                break  # later entries were staged after it: checked next time
            _held.popleft()
        return len(_held)


def _stage_cai(engine, device_ring_mb, channel, name_id, pass_id, array, cai, block, dtype_code, timeout_s=-1.0):
    code = dtype_code if dtype_code is not None else cai_dtype_code(cai["typestr"])
    size = _elem_size(code)
    shape = [int(d) for d in cai["shape"]]
    strides_b = cai.get("strides")
    if strides_b is None:
        strides, step = [0] * len(shape), 1
        for i in range(len(shape) - 1, -1, -1):
            strides[i] = step
            step *= shape[i]
    else:
        strides = []
        for s in strides_b:
            if int(s) % size:
                raise ValueError(f"stride {s} bytes is not a multiple of the element size {size}")
            strides.append(int(s) // size)
    ptr = int(cai["data"][0])
    nbytes = _numel(shape) * size
    # CAI v3: `stream` absent/None means the data is ready; 1 = legacy default, 2 = per-thread default.
    stream = cai.get("stream")
    stream = 0 if stream is None else int(stream)
    stager = engine.cuda_stager(device_ring_mb)
    if stager.__class__ is HostFallbackStager:
        import torch

        return stager.stage_tensor(channel, name_id, pass_id, code, torch.as_tensor(array, device="cuda"),
                                   block, timeout_s), nbytes
    device = _cai_device(array, ptr)
    status = _stage_or_ring_failure(stager, channel, name_id, pass_id, code, size, shape, strides, ptr, device,
                                    stream, block, timeout_s)
    if status == STAGED:
        # As a DLPack capsule: the caller may drop the array as soon as this returns, and its pool
        # (CuPy's is per stream) may hand the memory to a kernel on another stream before the
        # snapshot on `stream` has read it. Kept until the snapshot completed.
        hold_until_read(stager, device, array)
    return status, nbytes


def _cai_device(array, ptr: int) -> int:
    dev = getattr(array, "device", None)
    dev_id = getattr(dev, "id", None)  # CuPy: cupy.cuda.Device
    if isinstance(dev_id, int):
        return dev_id
    if ptr == 0:
        return 0
    device = _C.cuda_pointer_device(ptr)
    return device if device >= 0 else 0


def _torch_from_dlpack_capsule(capsule):
    import torch

    return torch.utils.dlpack.from_dlpack(capsule)


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n
