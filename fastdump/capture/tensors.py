"""Tensor facts the capture path needs: torch (imported once, here), the dtypes the hot path
stages without checks, a tensor's true dtype and layout, storage checks, lazy conj/neg
bits, and tensors that wrap others (DTensor, functional collectives, torch.func).

A helper of the Dumper's modules (fastdump/capture/dumper.py); see docs/INTERNALS.md.
"""

from __future__ import annotations

from .. import _C, dtypes as _dtypes


try:  # torch is a dependency of every model we dump; import it once, here
    import torch as _torch

    _Tensor = _torch.Tensor
    _TensorType = _torch.Tensor  # exact type: subclasses (Parameter, DTensor...) take the general path
    _strided = _torch.strided
except ImportError:  # pragma: no cover - fastdump.open and the CLI work without torch
    _torch = None
    _Tensor = _TensorType = type("NoTensor", (), {})
    _strided = None


def _fast_codes() -> dict:
    """dtype -> (wire code, element size) for the dtypes the hot path stages without further checks.

    Complex dtypes are left out: their lazy conj/neg bits must be resolved first.
    """
    if _torch is None:
        return {}
    codes = {}
    for name in _dtypes.NAMES:
        dtype = getattr(_torch, name, None)
        if isinstance(dtype, _torch.dtype) and not dtype.is_complex:
            codes[dtype] = (_dtypes.CODE_BY_NAME[name], dtype.itemsize)
    return codes


_FAST_CODES = _fast_codes()


def _true_facts(t) -> tuple:
    """(dtype, layout, is_conj, is_neg) of ``t`` as its TensorImpl holds them. A subclass's Python
    overrides and torch function modes are not asked (as channel.host_layout does for the shape and
    address): a ``dtype`` claimed wider than the elements had the copy read the storage's next
    bytes as that type, dumped as such (the attribute path, without the tensor reader). An exact
    torch.Tensor has no overrides: its attributes are read directly (a third of the cost)."""
    if type(t) is _TensorType:
        return t.dtype, t.layout, t.is_conj(), t.is_neg()
    with _torch._C.DisableTorchFunction():
        return _TensorType.dtype.__get__(t), _TensorType.layout.__get__(t), _TensorType.is_conj(t), \
            _TensorType.is_neg(t)


def _true_nbytes(t) -> int:
    """``t``'s size in bytes as its TensorImpl holds it. Read after ``t`` was staged: a subclass's
    ``nbytes`` (its __torch_function__ may answer a string, or raise) made a staged tensor a
    recorded skip too, under a wrong reason, and left its bytes out of the totals."""
    if type(t) is _TensorType:
        return t.nbytes
    with _torch._C.DisableTorchFunction():
        return _TensorType.nbytes.__get__(t)


def _true_is_nested(t) -> bool:
    """Whether ``t`` is a nested tensor, as its TensorImpl says (a subclass's answer may be any
    truthy object: "layout junk" was reported as a nested tensor)."""
    with _torch._C.DisableTorchFunction():
        return bool(_TensorType.is_nested.__get__(t))


def _check_storage(t) -> None:
    """ValueError (the tensor's recorded skip) unless ``t``'s storage holds every element ``t``
    addresses. torch lets a storage be freed or shrunk under its tensors (``untyped_storage().
    resize_(0)``, as FSDP does), and its own copies do not check: resolving a lazy conj/neg view of
    such a storage crashed the served process (SIGSEGV) or read another allocation. The check the
    tensor reader and ChannelStager make before their copies, for the copy made before them.
    Called with torch function modes off."""
    T = _TensorType
    sizes, strides = T.size(t), T.stride(t)
    if 0 in sizes:
        return
    try:
        storage = T.untyped_storage(t)
    except RuntimeError:  # a wrapper subclass: no storage of its own
        raise ValueError(_C.NO_DATA) from None
    last = sum((n - 1) * s for n, s in zip(sizes, strides))
    if storage.data_ptr() == 0 or (T.storage_offset(t) + last + 1) * T.element_size(t) > storage.nbytes():
        raise ValueError(_C.STORAGE_SHORT)


def _resolve_lazy_bits(t):
    """``t`` with its conj/neg bits applied to a copy of its bytes, at the cost of the storage range
    it addresses when that is smaller than its shape: a broadcast view (``expand``) of one complex
    element resolves one element, not every element of the shape (a 1 GiB copy on the model's
    thread, for a tensor the ring might not even take). Called with torch function and dispatch
    modes off (see _stage_checked)."""
    T = _TensorType
    sizes, strides = T.size(t), T.stride(t)
    numel = T.numel(t)
    extent = 1 + sum((n - 1) * s for n, s in zip(sizes, strides))  # elements from the first to the last
    if numel == 0 or extent >= numel:  # (a dense or sparse-strided tensor: resolving it whole costs least)
        return T.resolve_neg(T.resolve_conj(t))
    span = T.resolve_neg(T.resolve_conj(T.as_strided(t, (extent,), (1,))))  # t's range of its storage
    return T.as_strided(span, sizes, strides, 0)


def _is_dtensor(value) -> bool:
    """A torch.distributed DTensor: a wrapper without storage of its own, whose data is its local
    shard (``to_local()``, no communication). Imported only when a tensor by that name shows up."""
    try:
        from torch.distributed.tensor import DTensor
    except Exception:  # pragma: no cover - a torch without torch.distributed
        return False
    return isinstance(value, DTensor)


def _in_a_transform(value) -> bool:
    """A tensor torch.func made inside a transform (vmap's batched tensor, grad's and jvp's
    wrappers, functionalize's): its TensorImpl holds no data, only the level's wrapped value."""
    try:
        return isinstance(value, _Tensor) and _torch._C._functorch.is_functorch_wrapped_tensor(value)
    except Exception:  # (a torch without functorch; a subclass that refuses)
        return False


def _is_async_collective(value) -> bool:
    """A functional collective's result (``torch.distributed._functional_collectives``: what
    torch-native tensor parallelism and a DTensor's ``to_local()`` after a redistribute return): a
    wrapper without storage whose data is the collective's output once waited for. Waiting is what
    the tensor's first use does anyway (on CUDA the current stream waits for the collective's, no
    host synchronisation), so the dump is the value the next module receives."""
    try:
        from torch.distributed._functional_collectives import AsyncCollectiveTensor
    except Exception:  # pragma: no cover - a torch without torch.distributed
        return False
    return isinstance(value, AsyncCollectiveTensor)
