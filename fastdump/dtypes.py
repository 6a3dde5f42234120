"""Element types: torch dtype <-> wire code <-> on-disk storage.

Every record on the ring carries a small integer code; this table turns it into the dtype's name,
its element size and the way it is stored in HDF5. The writer process uses the table without
importing torch (it only needs numpy), the capture side and the reader map names to torch dtypes.

On-disk encoding (attribute ``encoding`` on each dataset, ``dtype`` holds the torch name):
  * ``native``   - the numpy/h5py type of the same name (float32, int64, bool, complex64, ...).
  * ``raw-bits`` - types h5py cannot represent losslessly (bfloat16, the float8/float4 families,
                   complex32, bits*, sub-byte ints): the exact bytes, stored as the unsigned integer of
                   the same width. The reader views them back as the torch dtype, bit for bit.
"""

from __future__ import annotations

import numpy as np

# (torch dtype name, element size in bytes, numpy storage dtype, encoding). The order is the wire
# code and is append-only: never reorder, a dump records codes only inside a running session but
# keeping them stable costs nothing.
_TABLE = [
    ("float32", 4, "float32", "native"),
    ("float64", 8, "float64", "native"),
    ("float16", 2, "float16", "native"),
    ("bfloat16", 2, "uint16", "raw-bits"),
    ("int8", 1, "int8", "native"),
    ("int16", 2, "int16", "native"),
    ("int32", 4, "int32", "native"),
    ("int64", 8, "int64", "native"),
    ("uint8", 1, "uint8", "native"),
    ("uint16", 2, "uint16", "native"),
    ("uint32", 4, "uint32", "native"),
    ("uint64", 8, "uint64", "native"),
    ("bool", 1, "bool", "native"),
    ("complex64", 8, "complex64", "native"),
    ("complex128", 16, "complex128", "native"),
    ("complex32", 4, "uint32", "raw-bits"),
    ("float8_e4m3fn", 1, "uint8", "raw-bits"),
    ("float8_e5m2", 1, "uint8", "raw-bits"),
    ("float8_e4m3fnuz", 1, "uint8", "raw-bits"),
    ("float8_e5m2fnuz", 1, "uint8", "raw-bits"),
    ("float8_e8m0fnu", 1, "uint8", "raw-bits"),
    ("float4_e2m1fn_x2", 1, "uint8", "raw-bits"),
    ("bits8", 1, "uint8", "raw-bits"),
    ("bits16", 2, "uint16", "raw-bits"),
    ("bits1x8", 1, "uint8", "raw-bits"),
    ("bits2x4", 1, "uint8", "raw-bits"),
    ("bits4x2", 1, "uint8", "raw-bits"),
] + [(f"{kind}{bits}", 1, "uint8", "raw-bits") for kind in ("uint", "int") for bits in range(1, 8)]

NAMES = [row[0] for row in _TABLE]
CODE_BY_NAME = {name: code for code, name in enumerate(NAMES)}
ITEMSIZE = [row[1] for row in _TABLE]
STORAGE = [np.dtype(row[2]) for row in _TABLE]
ENCODING = [row[3] for row in _TABLE]

# Quantized tensors carry scale/zero-point outside their bytes: a raw copy would be silently wrong.
UNSUPPORTED_REASON = {
    "qint8": "quantized tensor (scale/zero point are not part of its bytes)",
    "quint8": "quantized tensor (scale/zero point are not part of its bytes)",
    "qint32": "quantized tensor (scale/zero point are not part of its bytes)",
    "quint4x2": "quantized tensor (scale/zero point are not part of its bytes)",
    "quint2x4": "quantized tensor (scale/zero point are not part of its bytes)",
}


def storage_dtype(name: str) -> np.dtype:
    """The numpy dtype a tensor of torch dtype ``name`` is stored as."""
    return STORAGE[CODE_BY_NAME[name]]


def encoding(name: str) -> str:
    return ENCODING[CODE_BY_NAME[name]]


def torch_name(dtype) -> str:
    """'torch.bfloat16' -> 'bfloat16'."""
    return str(dtype).rpartition(".")[2]


_TORCH_CODES: dict = {}


def code_of(dtype) -> int:
    """Wire code of a torch dtype; -1 when it cannot be dumped (see ``UNSUPPORTED_REASON``)."""
    code = _TORCH_CODES.get(dtype)
    if code is None:
        code = CODE_BY_NAME.get(torch_name(dtype), -1)
        _TORCH_CODES[dtype] = code
    return code


def to_torch(array: np.ndarray, name: str, copy: bool = True):
    """Rebuild the torch tensor from its stored array (bit for bit). ``copy=False``: the array is the
    caller's alone (just read from the file), so the tensor shares its memory when it can, instead
    of needing twice a tensor's size to load it."""
    import torch

    dtype = getattr(torch, name)
    if copy or not (array.flags.c_contiguous and array.flags.writeable):
        array = np.array(array, copy=True, order="C")  # keeps 0-d as 0-d
    tensor = torch.from_numpy(array)
    if tensor.dtype != dtype:
        tensor = tensor.view(dtype)
    return tensor
