"""On-disk names and table layouts shared by the segment writer, the reader and ``fastdump verify``.

docs/FORMAT.md is the prose version of this module; change both together (and bump FORMAT_VERSION
when an old reader could misread the new layout).
"""

from __future__ import annotations

import re

import numpy as np

FORMAT_NAME = "fastdump-segment"
FORMAT_VERSION = 1

MANIFEST_FILE = "fastdump.json"
RANK_FILE = "rank.json"

SEGMENT_RE = re.compile(r"^seg-(\d+)\.h5$")
RANK_DIR_RE = re.compile(r"^TP(\d+)_PP(\d+)_Rank(\d+)_pid(\d+)$")


def segment_name(number: int) -> str:
    return f"seg-{number:06d}.h5"


def segment_temp_name(number: int) -> str:
    """Where a segment is built; starts with '.' so no ``seg-*.h5`` glob ever matches it."""
    return f".{segment_name(number)}.tmp"


def segment_number(file_name: str):
    """Number of a visible segment file name, or None for anything else."""
    match = SEGMENT_RE.match(file_name)
    return int(match.group(1)) if match else None


# Objects inside a segment file.
NAMES = "names"  # scalar string: JSON array of tensor names (JSON keeps any character, NUL included)
INDEX = "index"  # one row per stored tensor, in the order tensors arrived
PASSES = "passes"  # one row per pass
PASS_META = "pass_meta"  # per pass (same order as PASSES): JSON {"meta": {...}, "skipped": [...]}
BLOCKS = "blocks"  # group of datasets "0", "1", ...: rows of one name with one dtype and row shape

# Dataset attributes.
ATTR_DTYPE = "dtype"  # torch dtype name, e.g. "bfloat16"
ATTR_ENCODING = "encoding"  # "native" or "raw-bits" (see fastdump/dtypes.py)
ATTR_SCALAR = "scalar"  # 1 on blocks whose rows are 0-d tensors (each index entry then has rows == 1)

INDEX_DTYPE = np.dtype(
    [
        ("pass", "<i8"),  # pass id
        ("name", "<i4"),  # position in NAMES
        ("block", "<i4"),  # dataset BLOCKS/<block>
        ("first_row", "<i8"),  # first row of this tensor in the block
        ("rows", "<i8"),  # rows it spans: shape[0], or 1 for a 0-d tensor
    ]
)

PASS_DTYPE = np.dtype(
    [
        ("pass", "<i8"),
        ("complete", "u1"),  # 0: the pass never ended before the writer closed (what arrived is kept)
        ("dropped", "<i8"),  # tensors of this pass dropped by the ring (policy "drop")
        ("tensors", "<i8"),  # index rows of this pass in this segment
        ("bytes", "<i8"),  # payload bytes of those tensors
    ]
)
