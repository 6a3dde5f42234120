"""Read a dump: ``fastdump.open(root) -> DumpSet``.

    ds = fastdump.open("/tmp/dump")
    ds.roles                              # ['draft', 'target']
    ds.ranks("target")                    # ['TP0_PP0_Rank0_pid1234_<session>', ...]: one per session
    ds.passes("target", 0)                # rank given by number when one session matches
    ds.load("target", 0, 5)               # {name: tensor} in dump order, original dtype/shape
    ds.load("target", 0, 5, session=s)    # several sessions of rank 0: pick one (or give the dir name)
    ds.load("target", 0, 5, check=True)   # also verify each tensor's CRC32C (format 2)
    ds.series("target", 0, "model.norm")  # {pass_id: tensor}

Only visible ``seg-*.h5`` files are read: they are complete by construction (the writer renames
them into place), so a dump can be read while it is still being written. Each segment's small
tables (names, row index, passes) are read once and cached, and only when needed: one pass's
segments are found through the segment list's pass ranges (_Rank.segments_of_pass). Tensors are read by
slicing their rows out of the block dataset, so loading one pass never reads other passes' data. Nothing here
unpickles or evaluates anything from the dump. torch is imported only to build tensors.

A dump may come from someone else, so nothing in it is trusted: index rows are checked against
their block before any tensor is returned, a block is read only if it is stored inside its own
file as the writer stores it (no external storage, links or virtual datasets) and its size fits
the file, and only regular files and directories are opened (no symbolic links, FIFOs, devices).
Anything else is a ``DumpError`` (a ValueError) naming the file and what is wrong.
"""

from __future__ import annotations

import bisect
import collections
import difflib
import functools
import json
import math
import os
import re
import socket
import stat
import threading
import warnings

import h5py
import numpy as np
from h5py import h5a, h5d, h5i, h5l, h5o, h5t

from . import _C, dtypes, fsutil, protocol, segment_list
from . import format as fmt

_MAX_OPEN_FILES = 16
_INT64 = np.iinfo(np.int64)


class DumpError(ValueError):
    """A file of the dump is damaged or crafted: its path and what is wrong are in the message."""


class Problem(str):
    """One entry of ``DumpSet.problems``: its text ("path: what is wrong"), with the ``path`` it is
    about and its ``kind``, so that a tool can act on a kind without matching the text:
    ``UNLISTABLE`` (a directory that cannot be listed: what it holds is missing),
    ``UNREADABLE_SEGMENT`` (a segment skipped whole), ``BAD_FILE`` (a JSON file of the dump),
    ``BAD_PASS_META`` (a segment's pass metadata, ignored: its tensors read), ``REPEATED_PASS``,
    ``LOST_ROLE`` and ``LOST_SESSION`` (a role or session the root records as attached whose
    directory is gone, replaced or emptied: :func:`lost_roles`, :func:`lost_sessions`),
    ``WRONG_RANK`` (a rank directory whose name's TP/PP/rank numbers are not its rank.json's:
    renamed, or another rank's rank.json; read by number it is refused, as in ``_refuse_mislabelled``).
    rank.json's rank numbers of the wrong type or range are a ``BAD_FILE``."""

    UNLISTABLE, UNREADABLE_SEGMENT, BAD_FILE, BAD_PASS_META = ("unlistable", "unreadable segment", "bad file",
                                                               "bad pass meta")
    REPEATED_PASS = "repeated pass"  # a pass found whole in one segment and again in another: not read
    # the root records a role (session) as attached whose dump is not there (lost_roles, lost_sessions):
    # what `fastdump verify` fails on, found at open() and refresh()
    LOST_ROLE, LOST_SESSION = "lost role", "lost session"
    WRONG_RANK = "wrong rank"  # what `fastdump verify` fails on as mixed (rank_dir_mismatch)
    path: str
    kind: str

    def __new__(cls, path: str, kind: str, what: str):
        problem = super().__new__(cls, f"{path}: {what}")
        problem.path, problem.kind = path, kind
        return problem


# How the writer stores datasets: in the file itself, contiguous (or compact, HDF5's choice for
# tiny ones). External storage, virtual datasets and filters could make a read touch other files
# or allocate far more than the file holds.
_SAFE_LAYOUTS = (h5d.CONTIGUOUS, h5d.COMPACT)


def check_link(group, name: str, where: str) -> None:
    """``group[name]`` must be a hard link (soft and external links can point anywhere)."""
    try:  # (the low-level call: ~2 us instead of ~30 us, paid once per block of a wide pass)
        if group.id.links.get_info(name.encode("utf-8")).type == h5l.TYPE_HARD:
            return
    except (KeyError, RuntimeError, ValueError):  # missing: said below
        pass
    link = group.get(name, getlink=True)
    if link is None:
        raise DumpError(f"{where}: missing {name!r}")
    if not isinstance(link, h5py.HardLink):
        raise DumpError(f"{where}: {name!r} is a {type(link).__name__}, not an object stored in this file")


def check_dataset(dataset, file_size: int, where: str) -> tuple:
    """Refuse a dataset the writer could not have written: external or virtual storage, filters,
    or a size claim larger than the file (a 15 KB file claiming 1 GiB). ``dataset``: an h5py
    Dataset or its low-level DatasetID (what ``SegmentIndex`` keeps of a block). Returns its
    ``(shape, dtype)`` as checked (each asked of HDF5 makes a new id: callers reuse these; a null
    dataspace's shape is ``()``)."""
    dataset = dataset.id if isinstance(dataset, h5py.Dataset) else dataset
    plist = dataset.get_create_plist()
    layout = plist.get_layout()
    if layout not in _SAFE_LAYOUTS:
        kind = {h5d.CHUNKED: "chunked", getattr(h5d, "VIRTUAL", -1): "virtual"}.get(layout, f"layout {layout}")
        raise DumpError(f"{where}: {kind} dataset (fastdump writes contiguous datasets only)")
    if plist.get_external_count():
        raise DumpError(f"{where}: dataset stored in external files")
    if plist.get_nfilters():
        raise DumpError(f"{where}: dataset has filters")
    shape, dtype = dataset.shape or (), _file_type(dataset)[0]
    claimed = math.prod(shape) * dtype.itemsize
    if claimed > file_size:
        raise DumpError(f"{where}: claims {claimed} bytes, more than the file's {file_size}")
    if layout == h5d.CONTIGUOUS and claimed:
        offset = dataset.get_offset()
        if offset is None or offset + claimed > file_size:
            raise DumpError(f"{where}: data at offset {offset} + {claimed} bytes lies outside the file "
                            f"({file_size} bytes)")
    return shape, dtype


def read_attrs(obj, file_size: int, where: str) -> dict:
    """The attributes of an HDF5 object, each checked against the file's size before it is read
    (an attribute, like a dataset, can claim any size). ``obj``: an h5py object or its low-level id.
    Each attribute is opened once, and closed before the next one is opened: HDF5 looks through
    every open attribute of the file at each open, so held ones would make this quadratic."""
    oid = obj.id if isinstance(obj, h5py.HLObject) else obj
    names: list = []
    h5a.iterate(oid, names.append)
    values = {}
    for raw_name in names:
        try:  # (as h5py names them: the bytes when they are not UTF-8)
            name = raw_name.decode("utf-8")
        except UnicodeDecodeError:
            name = raw_name
        attr = h5a.open(oid, raw_name)
        shape = attr.shape  # (a new HDF5 id: asked once)
        dtype, vlen_str = _file_type(attr)
        claimed = math.prod(shape or ()) * dtype.itemsize
        if claimed > file_size:
            raise DumpError(f"{where}: attribute {name!r} claims {claimed} bytes, more than the file's {file_size}")
        value = _attr_value(attr, shape, dtype, vlen_str)
        values[name] = _attr_str(value) if isinstance(value, (bytes, str)) else \
            value.item() if getattr(value, "size", 0) == 1 else value
    return values


# File types of attributes and blocks already met, as (type, numpy dtype, variable-length str?): a
# wide pass's blocks carry the same three or four attribute types and a few dtypes, and converting
# each one to numpy (h5py's ``attr.dtype``, ``dataset.dtype``) cost about as much as reading an
# attribute's value. A type is found here by HDF5's own comparison (H5Tequal: class, size, order,
# sign, character set, padding, tag), so only an identical type takes a cached conversion. Plain
# types only, a bounded number, and copies (a committed type would hold its file open).
_ATTR_TYPES: list = []
_MAX_ATTR_TYPES = 32


def _file_type(oid) -> tuple:
    """(numpy dtype, variable-length string?) of an open attribute's or dataset's values."""
    file_type = oid.get_type()
    for known, dtype, vlen_str in _ATTR_TYPES:
        if file_type.equal(known):
            return dtype, vlen_str
    dtype = file_type.dtype
    string_info = h5t.check_string_dtype(dtype.subdtype[0] if dtype.subdtype is not None else dtype)
    found = (dtype, bool(string_info) and string_info.length is None)
    if (len(_ATTR_TYPES) < _MAX_ATTR_TYPES and dtype.fields is None and dtype.subdtype is None
            and not file_type.committed()):
        _ATTR_TYPES.append((file_type.copy(), *found))
    return found


_MEMORY_TYPES: dict = {}  # plain numpy dtype -> its HDF5 memory type, made once (a block has 3-4 attributes)


def _memory_type(dtype):
    """``h5t.py_create(dtype)``, kept for plain dtypes (no fields, no subarray): the same few types
    are read from every block of a wide pass. The key holds the metadata, which tells h5py's
    variable-length str from bytes."""
    if dtype.fields is not None or dtype.subdtype is not None:
        return h5t.py_create(dtype)
    key = dtype if dtype.metadata is None else (dtype.str, repr(dtype.metadata))
    htype = _MEMORY_TYPES.get(key)
    if htype is None:
        htype = _MEMORY_TYPES[key] = h5t.py_create(dtype)
    return htype


def _attr_value(attr, shape, dtype, vlen_str: bool):
    """An open attribute's value as ``h5py``'s ``obj.attrs[name]`` gives it (same code, on the id
    already open: ``attrs[name]`` costs a second open and ~60 us of wrapping per attribute).
    ``shape``, ``dtype``, ``vlen_str``: the attribute's, as read_attrs asked them."""
    if shape is None:  # an empty dataspace
        return h5py.Empty(dtype)
    htype = _memory_type(dtype)
    if dtype.subdtype is not None:  # numpy has no top-level array types: read the array's elements
        dtype, subshape = dtype.subdtype
        shape = shape + subshape
    value = np.zeros(shape, dtype=dtype, order="C")
    attr.read(value, mtype=htype)
    if vlen_str:  # variable-length strings: bytes to str
        if value.ndim == 0:  # (the common case: a block's dtype and encoding)
            return value[()].decode("utf-8", "surrogateescape")
        value = np.array([b.decode("utf-8", "surrogateescape") for b in value.flat], dtype=dtype).reshape(value.shape)
    return value[()] if value.ndim == 0 else value


def row_checksum(rows: np.ndarray) -> int:
    """CRC32C of rows as read, i.e. of the stored bytes (format 2 index column ``crc32c``)."""
    return _C.crc32c(np.ascontiguousarray(rows))


def check_tables(attrs: dict, names_text, index, passes, pass_meta, where: str) -> None:
    """Raise DumpError unless a format-3 segment's tables match their CRC32C: a relabelled index
    row keeps its data's CRC, so without this it would hand one pass's tensor to another."""
    stored = attrs.get(fmt.ATTR_TABLES_CRC)
    if not isinstance(stored, int):
        raise DumpError(f"{where}: no {fmt.ATTR_TABLES_CRC!r} attribute (format 3 requires one)")
    try:
        found = fmt.tables_crc32c(names_text, index, passes, pass_meta)
    except (TypeError, ValueError) as exc:
        raise DumpError(f"{where}: tables not laid out as format 3 says ({exc})") from None
    if found != stored:
        raise DumpError(f"{where}: the names, index, passes and pass_meta tables have CRC32C {found:08x}, "
                        f"written as {stored & 0xFFFFFFFF:08x}: a table changed after it was written")


def check_block_crc(attrs: dict, number: int, dtype_name: str, encoding: str, scalar: bool, row_shape,
                    where: str) -> None:
    """Raise DumpError unless a format-4 block's attributes and row shape match its CRC32C: they say
    how its bytes read back, and the rows' own CRC covers only the bytes."""
    stored = attrs.get(fmt.ATTR_BLOCK_CRC)
    stored = int(stored) if isinstance(stored, np.integer) else stored
    if not isinstance(stored, int) or isinstance(stored, bool):
        raise DumpError(f"{where}: no {fmt.ATTR_BLOCK_CRC!r} attribute (format 4 requires one)")
    found = fmt.block_crc32c(number, dtype_name, encoding, scalar, row_shape)
    if found != stored:
        raise DumpError(f"{where}: dtype {dtype_name!r}, encoding {encoding!r}, scalar {int(scalar)}, rows of "
                        f"{tuple(row_shape)} have CRC32C {found:08x}, written as {stored & 0xFFFFFFFF:08x}: the "
                        "block's attributes or shape changed after it was written")


def open_segment(path: str) -> h5py.File:
    """Open a segment read-only with HDF5's default locking (so that h5py.File(path) elsewhere in
    the process still works), falling back to no locking on filesystems without lock support:
    visible segments are immutable, so locking protects nothing here. Only a regular file is
    opened (a FIFO would hang; a symbolic link may point out of the dump)."""
    if not fsutil.is_regular_file(path):
        try:
            os.lstat(path)
        except OSError as exc:  # (a directory without search permission: not a FIFO, as was said)
            raise DumpError(f"{path}: cannot read ({exc.strerror or exc})") from None
        raise DumpError(f"{path}: not a regular file (symbolic links, FIFOs and devices are not read)")
    try:
        return h5py.File(path, "r")
    except OSError as exc:
        if "lock" not in str(exc).lower():
            raise
        return h5py.File(path, "r", locking=False)


@functools.lru_cache(maxsize=1 << 16)  # (sorting a role's rank directories at every call)
def _rank_dir_key(name: str):
    """Order rank directories by global rank, then session start (then pid); other names
    naturally ('x10' after 'x2')."""
    parsed = fmt.parse_rank_dir(name)
    if parsed:
        tp, pp, rank, pid, session = parsed
        return (0, rank, tp, pp, session or "", pid)
    return (1, [(0, int(part)) if part.isdecimal() else (1, part) for part in re.split(r"(\d+)", name)])


def _is_rank_number(rank) -> bool:
    """A rank given by number (an int or numpy integer, not a bool); anything else is a directory name."""
    return isinstance(rank, (int, np.integer)) and not isinstance(rank, (bool, np.bool_))


def _attr_str(value) -> str:
    return value.decode("utf-8") if isinstance(value, bytes) else str(value)


def _listed_segments(listed: list) -> dict:
    """{file: entry} of the listed segments (``_Rank.listed_segments``) with integer first_pass
    and last_pass."""
    return {e.get("file"): e for e in listed if isinstance(e, dict) and isinstance(e.get("file"), str)
            and isinstance(e.get("first_pass"), int) and isinstance(e.get("last_pass"), int)}


def _kind_bounds(low: np.ndarray, high: np.ndarray, known: list) -> tuple:
    """(last eager pass, first replay) each file may hold, from the pass ranges the segment list gives
    (``known``; the others may hold any pass). A file holding eager passes and CUDA-graph replays
    has a range spanning both kinds; each kind runs in file order, so a file's eager passes end
    at the next file's first one (the same pass, continued, at most) and its replays start at the
    last replay of the file before."""
    base = protocol.GRAPH_PASS_BASE
    eager_high, replay_low = np.minimum(high, base - 1), np.maximum(low, base)
    following = _INT64.max  # the first eager pass of the files after
    for k in reversed(range(len(known))):
        if known[k] and low[k] < base:
            eager_high[k], following = min(eager_high[k], following), low[k]
    preceding = _INT64.min  # the last replay of the files before
    for k in range(len(known)):
        if known[k] and high[k] >= base:
            replay_low[k], preceding = max(replay_low[k], preceding), high[k]
    return eager_high, replay_low


def _known_range(entry):
    """(first pass, last pass) of a segment list entry, or None when it gives none usable."""
    if entry is None:
        return None
    first, last = entry["first_pass"], entry["last_pass"]
    return (first, last) if _INT64.min <= first <= last <= _INT64.max else None


def read_block_rows(fd, blocks_id, number: int, offset, row_shape: tuple, storage: np.dtype,
                    first: int, count: int, where: str) -> np.ndarray:
    """Rows ``first .. first+count`` of ``blocks/<number>``, a block ``check_dataset`` passed
    (contiguous, unfiltered, inside the file; ``offset``: its ``get_offset()``), read with
    ``preadv`` straight into the array returned, through ``fd``, the descriptor HDF5 opened the
    file with (``vfd``): the writer wrote these bytes there the same way (segment_file.write_at),
    and h5py's ``dataset[a:b]`` cost ~0.2 ms of wrapping per read and a handle per block. A
    compact block (stored in its object header: no offset), a file without a descriptor (``fd``
    None), or a platform without ``os.preadv``, is read through HDF5 (``blocks_id``: the file's
    blocks group)."""
    rows = np.empty((count, *row_shape), dtype=storage)
    if rows.nbytes == 0:
        return rows
    if offset is None or fd is None or not hasattr(os, "preadv"):  # (preadv: not on every platform)
        dataset = h5py.Dataset(h5o.open(blocks_id, str(number).encode()), readonly=True)
        dataset.read_direct(rows, np.s_[first:first + count])
        return rows
    view, at = memoryview(rows).cast("B"), offset + first * rows[0].nbytes
    while len(view):
        done = os.preadv(fd, [view], at)
        if done <= 0:  # (its size was checked: only a file cut short since ends here)
            raise DumpError(f"{where}: the file ends at byte {at}, inside the block's rows")
        view, at = view[done:], at + done
    return rows


class _BlockLayout(collections.namedtuple("_BlockLayout", "dtype_name scalar storage row_shape")):
    """How a checked block's rows read back: torch dtype name, scalar rows?, numpy storage dtype,
    the shape of one row."""

    __slots__ = ()


def vfd(h5file):
    """The file descriptor HDF5 reads ``h5file`` through (its default driver), or None."""
    try:
        fd = h5file.id.get_vfd_handle()
    except Exception:  # (another driver, or a closed file)
        return None
    return fd if isinstance(fd, int) and fd >= 0 else None


def _file_identity(info: os.stat_result) -> tuple:
    return info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns


class SegmentIndex:
    """The tables of one segment file (no tensor data), checked against each other.

    Construction raises ``DumpError`` (file and row named) when the tables cannot be trusted: rows
    naming no name, a name listed twice, rows of two names in one block, rows overlapping or leaving
    gaps in their block, rows disagreeing with the pass table. Blocks themselves are checked when
    first read (``block``: present, stored in this file, as many rows as the index covers), before
    any of their data is read; a missing or bad block fails the reads that need it, not the rest of
    the segment.
    A bad ``pass_meta`` entry only loses that pass's metadata: it is listed in ``problems``.
    """

    def __init__(self, path: str, h5file: h5py.File):
        self.path = path
        self.file_name = os.path.basename(path)
        self.number = fmt.segment_number(self.file_name)
        self.problems: list = []
        fd = vfd(h5file)  # (the file open, not whatever the path names now)
        info = os.fstat(fd) if fd is not None else os.stat(path)
        self.file_size = info.st_size
        self.attrs = read_attrs(h5file, self.file_size, path)
        if self.attrs.get("format") != fmt.FORMAT_NAME:
            raise DumpError(f"{path}: not a fastdump segment (format attribute {self.attrs.get('format')!r})")
        version = self.attrs.get("format_version", 0)
        if not isinstance(version, int) or version not in fmt.READABLE_VERSIONS:
            raise DumpError(f"{path}: format version {version!r} is not one this reader reads "
                            f"{list(fmt.READABLE_VERSIONS)}")
        self.version = version
        for name in (fmt.NAMES, fmt.INDEX, fmt.PASSES, fmt.PASS_META, fmt.BLOCKS):
            check_link(h5file, name, path)
        tables = {}  # each opened once: a segment's index costs ms in h5py calls, paid per segment
        for name in (fmt.NAMES, fmt.INDEX, fmt.PASSES, fmt.PASS_META):
            tables[name] = h5file[name]
            if not isinstance(tables[name], h5py.Dataset):
                raise DumpError(f"{path}: {name!r} is not a dataset")
            check_dataset(tables[name], self.file_size, f"{path} {name!r}")
        if not isinstance(h5file[fmt.BLOCKS], h5py.Group):
            raise DumpError(f"{path}: {fmt.BLOCKS!r} is not a group")
        names_text = tables[fmt.NAMES][()]
        names = json.loads(_attr_str(names_text))
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise DumpError(f"{path}: the name table is not a list of strings")
        if len(set(names)) != len(names):  # two slots, one name: load() and tensor() would disagree
            raise DumpError(f"{path}: the name table lists a name twice")
        self.names: list = names
        self.index: np.ndarray = tables[fmt.INDEX][()]
        self.passes: np.ndarray = tables[fmt.PASSES][()]
        if self.index.dtype != fmt.INDEX_DTYPES[version] or self.index.ndim != 1:
            raise DumpError(f"{path}: index table has layout {self.index.dtype}, expected {fmt.INDEX_DTYPES[version]}")
        if self.passes.dtype != fmt.PASS_DTYPE or self.passes.ndim != 1:
            raise DumpError(f"{path}: passes table has layout {self.passes.dtype}, expected {fmt.PASS_DTYPE}")
        pass_meta = tables[fmt.PASS_META][()]
        if version >= 3:
            check_tables(self.attrs, names_text, self.index, self.passes, pass_meta, path)
        self.has_checksums = "crc32c" in self.index.dtype.names
        self._said_unchecked = False
        self._block_rows = self._check_rows()
        self.pass_meta: list = self._parse_pass_meta(pass_meta)
        self._slot_of_name = {name: slot for slot, name in enumerate(self.names)}
        self._rows_of_pass = None
        self._position_of = None  # see position_of
        # block number -> (_BlockLayout, file offset of its rows) of every block checked. No HDF5
        # handle is kept: a checked block's rows are read at their offset (read_rows). Handles held
        # ~14 KB each in HDF5 (a 100k-name pass: 1.4 GB), and an LRU of them, smaller than a wide
        # pass, closed and reopened every block of every pass (12k names: ~0.5 ms a block a pass).
        self._checked: dict = {}
        self._layouts: dict = {}  # each distinct _BlockLayout once: a wide pass has a few
        # the file blocks were last read from, its blocks group and descriptor (vfd)
        self._blocks_file = self._blocks_group = self._blocks_fd = None
        self._identity = _file_identity(info) if fd is not None else None
        self._long_rows = None  # see _blocks_with_long_rows

    def _check_rows(self) -> dict:
        """Check every index row against the name table, the pass table and its block's other
        rows; return {block number: the rows its index entries tile}."""
        index, where = self.index, self.path

        def bad(positions, text):
            row = int(positions[0]) if len(positions) else -1
            raise DumpError(f"{where}: index row {row}: {text}")

        bad_name = np.flatnonzero((index["name"] < 0) | (index["name"] >= len(self.names)))
        if len(bad_name):
            bad(bad_name, f"name slot {int(index['name'][bad_name[0]])} outside the name table ({len(self.names)} names)")
        bad_block = np.flatnonzero(index["block"] < 0)
        if len(bad_block):
            bad(bad_block, f"block {int(index['block'][bad_block[0]])} cannot exist")
        negative = np.flatnonzero((index["first_row"] < 0) | (index["rows"] < 0))
        if len(negative):
            bad(negative, "negative row range")
        pass_ids = self.passes["pass"]
        if len(np.unique(pass_ids)) != len(pass_ids):
            raise DumpError(f"{where}: a pass id appears twice in the passes table")
        known = np.isin(index["pass"], pass_ids)
        if not known.all():
            stray = np.flatnonzero(~known)
            bad(stray, f"pass {int(index['pass'][stray[0]])} is not in the passes table")
        counts = dict(zip(*np.unique(index["pass"], return_counts=True)))
        for row in self.passes:
            if int(counts.get(row["pass"], 0)) != int(row["tensors"]):
                raise DumpError(f"{where}: pass {int(row['pass'])}: {int(counts.get(row['pass'], 0))} index rows, "
                                f"the passes table says {int(row['tensors'])}")
        # Within a block, rows must tile [0, total) exactly: an overlap would return the same data
        # twice under two names or passes, a gap data no row accounts for.
        order = np.lexsort((index["first_row"], index["block"]))
        blocks, firsts = index["block"][order], index["first_row"][order]
        stops = firsts + index["rows"][order]
        starts_block = np.ones(len(order), dtype=bool)
        starts_block[1:] = blocks[1:] != blocks[:-1]
        expected = np.where(starts_block, 0, np.concatenate([[0], stops[:-1]]))
        wrong = np.flatnonzero(firsts != expected)
        if len(wrong):
            i = wrong[0]
            bad([order[i]], f"rows {int(firsts[i])}..{int(stops[i])} of block {int(blocks[i])} "
                            f"{'overlap the previous tensor' if firsts[i] < expected[i] else 'leave a gap'}")
        # One block holds one name (its layout's): rows naming another would return its data.
        names = index["name"][order]
        other = np.flatnonzero(~starts_block[1:] & (names[1:] != names[:-1])) + 1
        if len(other):
            bad([order[other[0]]], f"block {int(blocks[other[0]])} holds rows of more than one name")
        last_of_block = np.flatnonzero(np.append(blocks[1:] != blocks[:-1], True)) if len(order) else []
        block_rows = {int(blocks[i]): int(stops[i]) for i in last_of_block}
        return block_rows

    def _parse_pass_meta(self, texts) -> list:
        empty = {"meta": {}, "skipped": []}
        if len(texts) != len(self.passes):
            self.problems.append(Problem(self.path, Problem.BAD_PASS_META, f"{len(texts)} pass_meta entries for "
                                         f"{len(self.passes)} passes; pass metadata ignored"))
            return [dict(empty) for _ in range(len(self.passes))]
        parsed = []
        for position, text in enumerate(texts):
            try:
                entry = json.loads(_attr_str(text))
                if not isinstance(entry, dict) or not isinstance(entry.get("meta", {}), dict) \
                        or not isinstance(entry.get("skipped", []), list):
                    raise ValueError("not {\"meta\": {...}, \"skipped\": [...]}")
                parsed.append({**entry, "meta": entry.get("meta") or {},  # other keys: incomplete, mixed
                               "skipped": [s for s in entry.get("skipped") or [] if isinstance(s, dict)]})
            except (ValueError, TypeError, RecursionError) as exc:
                self.problems.append(Problem(self.path, Problem.BAD_PASS_META,
                                             f"pass_meta of pass {int(self.passes['pass'][position])} "
                                             f"unreadable ({exc}); its metadata is ignored"))
                parsed.append(dict(empty))
        return parsed

    def rows_of_pass(self, pass_id: int) -> np.ndarray:
        """Positions in ``index`` of a pass's tensors, in the order they were dumped."""
        if self._rows_of_pass is None:
            order = np.argsort(self.index["pass"], kind="stable")  # stable: keeps the dump order
            pass_ids, starts = np.unique(self.index["pass"][order], return_index=True)
            stops = np.append(starts[1:], len(order))
            self._rows_of_pass = {int(p): order[a:b] for p, a, b in zip(pass_ids, starts, stops)}
        return self._rows_of_pass.get(pass_id, np.empty(0, dtype=np.int64))

    def position_of(self, pass_id: int, name: str):
        """Position in ``index`` of ``name``'s first row in ``pass_id``, or None. A dict built once:
        scanning the pass per name made reading a wide pass tensor by tensor quadratic."""
        if self._position_of is None:
            found: dict = {}
            for position, key in enumerate(zip(self.index["pass"].tolist(), self.index["name"].tolist())):
                found.setdefault(key, position)
            self._position_of = found
        return self._position_of.get((pass_id, self.slot_of(name)))

    def slot_of(self, name: str) -> int:
        """Position of ``name`` in this segment's name table, -1 when absent."""
        return self._slot_of_name.get(name, -1)

    def rows_of_name(self, name: str) -> np.ndarray:
        return np.flatnonzero(self.index["name"] == self.slot_of(name))

    def pass_record(self, pass_id: int):
        """(row of ``passes``, its JSON metadata) or None."""
        hits = np.flatnonzero(self.passes["pass"] == pass_id)
        if len(hits) == 0:
            return None
        return self.passes[hits[0]], self.pass_meta[hits[0]]

    def begins_with(self, pass_id: int) -> bool:
        """``pass_id`` is this segment's first pass of its kind (eager passes and CUDA-graph replays
        each run in order): the one pass that may have begun in the segment before."""
        ids = self.passes["pass"]
        replay = pass_id >= protocol.GRAPH_PASS_BASE
        ids = ids[(ids >= protocol.GRAPH_PASS_BASE) == replay]
        return len(ids) > 0 and int(ids.min()) == pass_id

    def block(self, h5file: h5py.File, number: int):
        """(_BlockLayout, file offset of its rows or None) of ``blocks/<number>``, checked before
        first use (``_check_block``); the checks of a block are made once per segment index."""
        if self._blocks_file is not h5file:
            fd = vfd(h5file)
            self._same_file(fd)
            self._blocks_file, self._blocks_group, self._blocks_fd = h5file, h5file[fmt.BLOCKS], fd
        found = self._checked.get(number)
        if found is None:
            found = self._checked[number] = self._check_block(h5file, number)
        return found

    def _same_file(self, fd) -> None:
        """DumpError unless ``fd`` (of a file opened again after its handle was closed) is the file
        this index was read from: a checked block's rows are read at the offset found then."""
        if self._identity is None or fd is None:
            return  # (no descriptor to ask: blocks are read through HDF5, checked against the file open)
        if _file_identity(os.fstat(fd)) != self._identity:
            raise DumpError(f"{self.path}: the file changed after its index was read (reopen the dump)")

    def read_rows(self, h5file: h5py.File, number: int, first: int, count: int) -> np.ndarray:
        """Rows ``first .. first+count`` of block ``number``, checked first (``block``), read at their
        offset (``read_block_rows``)."""
        layout, offset = self.block(h5file, number)
        if first < 0 or count < 0 or first + count > self._block_rows.get(number, 0):
            raise DumpError(f"{self.path} block {number}: rows {first}..{first + count} outside its rows")
        return read_block_rows(self._blocks_fd, self._blocks_group.id, number, offset, layout.row_shape, layout.storage,
                               first, count, f"{self.path} block {number}")

    def forget_blocks(self) -> None:
        """Forget the file the blocks were last read from (when it is closed); their checks stay."""
        self._blocks_file = self._blocks_group = self._blocks_fd = None

    def _blocks_with_long_rows(self) -> set:
        """Blocks having an index row of other than one row (which a scalar block may not have),
        found in one pass over the index: per block, it made a wide pass of scalars quadratic."""
        if self._long_rows is None:
            self._long_rows = set(np.unique(self.index["block"][self.index["rows"] != 1]).tolist())
        return self._long_rows

    def _check_block(self, h5file: h5py.File, number: int):
        # Low-level calls throughout: a wide pass has a block per name (20k names: 20k blocks), and
        # h5py's high-level objects cost ~0.5 ms a block in wrapping alone.
        where = f"{self.path} block {number}"
        group = self._blocks_group
        check_link(group, str(number), f"{self.path} {fmt.BLOCKS!r}")
        dataset = h5o.open(group.id, str(number).encode())
        if h5i.get_type(dataset) != h5i.DATASET:
            raise DumpError(f"{where}: not a dataset")
        shape, storage = check_dataset(dataset, self.file_size, where)
        attrs = read_attrs(dataset, self.file_size, where)
        ndim = len(shape)
        dtype_name = _attr_str(attrs.get(fmt.ATTR_DTYPE, ""))
        code = dtypes.CODE_BY_NAME.get(dtype_name)
        if code is None:
            raise DumpError(f"{where}: unknown dtype attribute {dtype_name!r}")
        if storage != dtypes.STORAGE[code]:
            raise DumpError(f"{where}: stored as {storage}, expected {dtypes.STORAGE[code]} for {dtype_name}")
        scalar = attrs.get(fmt.ATTR_SCALAR, 0)
        if not isinstance(scalar, int):
            raise DumpError(f"{where}: attribute {fmt.ATTR_SCALAR!r} is not an integer")
        scalar = bool(scalar)
        if ndim == 0 or (scalar and ndim != 1):
            raise DumpError(f"{where}: shape {shape} does not fit {'scalar ' if scalar else ''}rows")
        encoding = _attr_str(attrs.get(fmt.ATTR_ENCODING, ""))
        if self.version >= 4:
            check_block_crc(attrs, number, dtype_name, encoding, scalar, shape[1:], where)
        if encoding and encoding != dtypes.ENCODING[code]:
            raise DumpError(f"{where}: encoding {encoding!r}, expected {dtypes.ENCODING[code]!r} for {dtype_name}")
        rows = self._block_rows.get(number, 0)
        if shape[0] != rows:
            raise DumpError(f"{where}: {shape[0]} rows, but its index rows cover {rows}")
        if scalar and number in self._blocks_with_long_rows():
            raise DumpError(f"{where}: a scalar block's index rows must span one row each")
        offset = dataset.get_offset() if math.prod(shape) else None  # (closed when ``dataset`` goes)
        layout = _BlockLayout(dtype_name, scalar, storage, tuple(shape[1:]))
        return self._layouts.setdefault(layout, layout), offset

    def check_rows(self, position: int, rows: np.ndarray) -> None:
        """Raise DumpError when ``rows`` (index row ``position``'s data) fail their CRC32C."""
        if not self.has_checksums:
            if not self._said_unchecked:
                self._said_unchecked = True
                warnings.warn(f"fastdump: {self.path} is format {self.version}: it has no checksums, "
                              "its tensors are returned unchecked", stacklevel=4)
            return
        entry = self.index[position]
        found = row_checksum(rows)
        if found != int(entry["crc32c"]):
            raise DumpError(f"{self.path}: index row {position} (pass {int(entry['pass'])}, "
                            f"{self.names[int(entry['name'])]!r}): checksum {found:08x}, stored "
                            f"{int(entry['crc32c']):08x}: the data changed after it was written")


def _to_tensor(rows: np.ndarray, dtype_name: str, scalar: bool):
    """``rows`` as read from the file, which nothing else holds (a pass's whole rows, or one of the
    disjoint parts of rows read for a series): the tensor keeps that memory, no copy."""
    shape = () if scalar else rows.shape
    if rows.size == 0:
        # h5py hands back empty arrays with zero strides; give users ordinary contiguous strides.
        import torch

        return torch.empty(shape, dtype=getattr(torch, dtype_name))
    tensor = dtypes.to_torch(rows, dtype_name, copy=False)
    # (a scalar block's row is 1-d: restore the 0-d shape)
    return tensor.reshape(shape)


class _Rank:
    """One rank directory: its rank.json and the index of every visible segment."""

    def __init__(self, dumpset: "DumpSet", role: str, name: str):
        self.dumpset = dumpset
        self.role = role
        self.name = name
        self.path = os.path.join(dumpset.root, role, name)
        self._segments = None
        self._paths = None  # the visible segment files when ``segments`` was built
        self._passes = None  # pass id -> [SegmentIndex, ...] containing it
        self._read: dict = {}  # segment path -> its SegmentIndex, or None when not read (see _read_segment)
        self._facts = None  # (rank.json, the segments it lists with a pass range), read once for indexing
        self._lookup = None  # what finds one pass's segments without indexing them all (segments_of_pass)
        self.unreadable: list = []  # segment paths that could not be read
        self.repeated: set = set()  # pass ids found whole in one segment and again in another (pass_map)
        self.partial: dict = {}  # pass id -> why a part of it may be in a segment not read (pass_map)

    @property
    def info(self) -> dict:
        """rank.json ({} when missing; {} and a problem when it is not a JSON object; a
        ``WRONG_RANK`` problem when its rank numbers are damaged or not the directory name's)."""
        info = self.dumpset._json_object(os.path.join(self.path, fmt.RANK_FILE))
        if "rank" in info:  # (what verify fails on; ls, show and diff say it as a warning)
            rank_file = os.path.join(self.path, fmt.RANK_FILE)
            try:
                mismatch = fmt.rank_dir_mismatch(self.name, fmt.check_rank_numbers(info["rank"]))
            except ValueError as exc:
                self.dumpset._problem(Problem(rank_file, Problem.BAD_FILE, str(exc)))
            else:
                if mismatch:
                    self.dumpset._problem(Problem(self.path, Problem.WRONG_RANK, mismatch))
        return fmt.merge_producer_error(info, self.producer_error)

    @property
    def producer_error(self):
        """producer_error.json (the serving process stopped dumping and could not tell the
        writer), or None when there is none; a damaged one is a problem and reads as an error."""
        path = os.path.join(self.path, fmt.PRODUCER_ERROR_FILE)
        try:
            record = fsutil.load_json(path)
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:
            self.dumpset._problem(Problem(path, Problem.BAD_FILE, str(exc)))
            return {"status": "error", "error": f"unreadable {fmt.PRODUCER_ERROR_FILE}: {exc}"}
        return record if isinstance(record, dict) else {"status": "error", "error": f"{record!r:.80}"}

    @property
    def session(self):
        parsed = fmt.parse_rank_dir(self.name)
        return parsed[4] if parsed else None

    def segment_paths(self) -> list:
        """Visible segment files, in order. Anything but a regular file under a segment's name (a
        link, a FIFO) is listed too: reading it fails with a clear error instead of following it."""
        numbered = []
        for entry in os.listdir(self.path):
            number = fmt.segment_number(entry)
            if number is not None:
                numbered.append((number, os.path.join(self.path, entry)))
        return [path for _, path in sorted(numbered)]

    def _indexing_facts(self) -> tuple:
        """(rank.json, {file: entry} of the listed segments with a pass range), read once while
        indexing: a long run lists thousands of segments."""
        if self._facts is None:
            self._facts = (self.info, _listed_segments(self.listed_segments()))
        return self._facts

    def _read_segment(self, path: str):
        """The checked index of one segment file, or None when it cannot be read or is another
        session's (then listed in ``unreadable`` and ``problems``). Each file is read once."""
        if path in self._read:
            return self._read[path]
        segment = None
        try:
            segment = self.dumpset._segment_index(path)
        except Exception as exc:  # one damaged file must not hide the rest of the dump
            detail = str(exc) if isinstance(exc, DumpError) else f"{type(exc).__name__}: {exc}"
            detail = detail[len(path) + 2:] if detail.startswith(path + ": ") else detail
            self.unreadable.append(path)
            self.dumpset._problem(Problem(path, Problem.UNREADABLE_SEGMENT,
                                          f"unreadable segment ({detail}); skipped"), warn=True)
        else:
            for text in segment.problems:
                self.dumpset._problem(text, warn=True)
            info = self._indexing_facts()[0]
            expected = fmt.expected_session(self.name, info)
            foreign = fmt.foreign_session(segment.attrs.get(fmt.ATTR_SESSION), expected,
                                          fmt.session_required(info, segment.version))
            if foreign:
                self.unreadable.append(path)
                self.dumpset._problem(Problem(path, Problem.UNREADABLE_SEGMENT, f"{foreign}; skipped"), warn=True)
                segment = None
        self._read[path] = segment
        return segment

    @property
    def segments(self) -> list:
        if self._segments is None:
            self._paths = self.segment_paths()
            self._segments = [segment for segment in map(self._read_segment, self._paths) if segment is not None]
        return self._segments

    def segments_of_pass(self, pass_id: int):
        """The readable segments holding ``pass_id``, in file order, having read only those whose
        pass range in the segment list holds it, those the list leaves out, and the files either side
        (indexing every segment cost ~3 ms each: 14 s to load one pass of a 4000-segment rank).
        None when this does not settle it: no segment holds the pass, one that may is unreadable,
        a file's passes are not the range the list gives it, or the pass is split oddly (repeated,
        parts not in consecutive files, renamed files). The full index (``pass_map``) then decides,
        with its errors. Trusted: that a file the list names holds no pass outside the range it
        gives, and that eager passes and CUDA-graph replays each run in file order (a pass the
        writer flushed unfinished goes on in the next file); ``fastdump verify`` checks both."""
        if self._passes is not None or not _INT64.min <= pass_id <= _INT64.max:
            return None
        if self._lookup is None:
            listed = self._indexing_facts()[1]  # before listing the files: a file it lists is there
            paths = self.segment_paths()
            names = [os.path.basename(path) for path in paths]
            ranges = [_known_range(listed.get(name)) or (_INT64.min, _INT64.max) for name in names]
            visible = set(names)
            missing = [_known_range(entry) for name, entry in listed.items() if name not in visible]
            low = np.array([r[0] for r in ranges], dtype=np.int64).reshape(-1)
            high = np.array([r[1] for r in ranges], dtype=np.int64).reshape(-1)
            self._lookup = (paths, np.array([fmt.segment_number(name) for name in names], dtype=np.int64),
                            low, high, *_kind_bounds(low, high, [name in listed for name in names]),
                            [r for r in missing if r is not None], listed)
        paths, numbers, low, high, eager_high, replay_low, missing, listed = self._lookup
        if any(first <= pass_id <= last for first, last in missing):  # listed, gone: the full index says so
            return None

        def read(k):  # the file's index, when it is read and holds what rank.json (and the order) say
            segment = self._read_segment(paths[k])
            if segment is None or len(segment.passes) == 0:
                return None
            ids = segment.passes["pass"]
            expected = _known_range(listed.get(segment.file_name))
            replays = ids >= protocol.GRAPH_PASS_BASE
            if expected not in (None, (int(ids.min()), int(ids.max()))) \
                    or (~replays).any() and int(ids[~replays].max()) > eager_high[k] \
                    or replays.any() and int(ids[replays].min()) < replay_low[k]:
                return None
            return segment

        if pass_id < protocol.GRAPH_PASS_BASE:
            may_hold = (low <= pass_id) & (pass_id <= eager_high)
        else:
            may_hold = (replay_low <= pass_id) & (pass_id <= high)
        parts = []
        for k in np.flatnonzero(may_hold).tolist():
            segment = read(k)
            if segment is None:
                return None
            if segment.pass_record(pass_id) is not None:
                parts.append((k, segment))
        if not parts:
            return None
        first, last = parts[0][0], parts[-1][0]
        if last - first + 1 != len(parts) or numbers[last] - numbers[first] != last - first:
            return None  # a file between its parts without it, or a number missing there
        if (numbers[first] > 0 and (first == 0 or numbers[first - 1] != numbers[first] - 1)) \
                or (last + 1 < len(paths) and numbers[last + 1] != numbers[last] + 1):
            return None  # a file either side is gone: the full index tells whether it may hold a part
        # A part in a file either side would be there had rank.json given that file's range right.
        if any(read(k) is None for k in (first - 1, last + 1) if 0 <= k < len(paths)):
            return None
        segments = [segment for _, segment in parts]
        if any(segment.pass_record(pass_id)[0]["complete"] for segment in segments[:-1]):
            return None  # whole in one and found again: repeated
        if len(segments) > 1 and any(fmt.renamed_segment(segment.attrs.get(fmt.ATTR_SEGMENT), segment.number)
                                     for segment in segments):
            return None
        return segments

    @property
    def pass_map(self) -> dict:
        if self._passes is None:
            found: dict = {}
            for segment in self.segments:
                for pass_id in segment.passes["pass"].tolist():
                    found.setdefault(pass_id, []).append(segment)
            self._passes = dict(sorted(found.items()))
            self._find_missing_listed()
            for pass_id, segments in self._passes.items():
                # A pass continues in a later segment only when the writer flushed it unfinished
                # (complete = 0 in every part but the last). One whole already is two copies, or
                # two sessions' passes: which tensors are whose cannot be told, so it is not read.
                whole = [k for k, s in enumerate(segments[:-1]) if s.pass_record(pass_id)[0]["complete"]]
                if whole:
                    self.repeated.add(pass_id)
                    first, again = segments[whole[0]], segments[whole[0] + 1]
                    self.dumpset._problem(Problem(self.path, Problem.REPEATED_PASS, (
                        f"pass {pass_id} is whole in {first.file_name} and appears again in {again.file_name}: "
                        "not read (copied or mixed segments)")), warn=True)
            self._find_partial_passes()
        return self._passes

    def _find_missing_listed(self) -> None:
        """Segments the segment list names that are not on disk: their passes are lost. Listed as
        unreadable (a pass they held was read as "no pass", and ls/passes showed none missing)."""
        for name, entry in self._indexing_facts()[1].items():
            path = os.path.join(self.path, name)
            if fmt.segment_number(name) is not None and path not in self._paths and not os.path.lexists(path):
                self.unreadable.append(path)
                self.dumpset._problem(Problem(path, Problem.UNREADABLE_SEGMENT, (
                    f"listed as holding passes {entry['first_pass']}..{entry['last_pass']}, but missing")), warn=True)

    def _find_partial_passes(self) -> None:
        """Passes a part of which may lie in a segment that is not read (one between its parts that
        is unreadable or missing, or one the segment list names as holding a part before or after
        the parts read), or whose parts lie in renamed files. Merging the parts read would return the pass
        without that part's tensors, or its parts in another order."""
        numbers = sorted(segment.number for segment in self.segments)
        read = set(numbers)
        listed = self._indexing_facts()[1]
        lost = {os.path.basename(path) for path in self.unreadable}
        # A file rank.json does not list (the writer was killed before listing it, or a full disk
        # left rank.json without its list) has no known range when it is unreadable, or gone (a
        # number below the highest, the writer numbering files one by one): it may hold the start
        # of the pass that begins the file after it, or the rest of the pass the one before left
        # unfinished.
        visible = {fmt.segment_number(os.path.basename(path)) for path in self._paths}
        highest = max(visible, default=-1)
        listed_numbers = {fmt.segment_number(name) for name in listed}
        unreadable = {fmt.segment_number(name) for name in lost}

        def unknown(number):
            return number not in listed_numbers and 0 <= number and (
                number in unreadable or (number not in visible and number < highest))
        lost |= {name for name in listed if fmt.segment_number(name) is not None
                 and fmt.segment_number(name) not in read and not os.path.lexists(os.path.join(self.path, name))}
        # (number, first pass, last pass, whether its last pass ended there) of each listed one
        lost = [(fmt.segment_number(name), listed[name]["first_pass"], listed[name]["last_pass"],
                 listed[name].get("complete") is not False) for name in sorted(lost) if name in listed]
        for pass_id, segments in self._passes.items():
            first, last = segments[0].number, segments[-1].number
            gaps = last - first + 1 - (bisect.bisect_right(numbers, last) - bisect.bisect_left(numbers, first))
            where = [] if not gaps else [f"{gaps} segments numbered {first + 1}..{last - 1}"] if gaps > 4 \
                else [fmt.segment_name(n) for n in range(first + 1, last) if n not in read]
            where += [fmt.segment_name(number) for number, low, high, whole in lost
                      if low <= pass_id <= high and fmt.segment_name(number) not in where
                      and ((number < first and pass_id == high and not whole)
                           or (number > last and not segments[-1].pass_record(pass_id)[0]["complete"]))]
            if unknown(first - 1) and segments[0].begins_with(pass_id):
                where.append(fmt.segment_name(first - 1))
            if unknown(last + 1) and not segments[-1].pass_record(pass_id)[0]["complete"]:
                where.append(fmt.segment_name(last + 1))
            if len(segments) > 1:  # its parts are merged in file-number order: a renamed file's is unknown
                where += [f"{segment.file_name} ({why})" for segment in segments
                          if (why := fmt.renamed_segment(segment.attrs.get(fmt.ATTR_SEGMENT), segment.number))]
            if where:
                self.partial[pass_id] = (f"{self.path}: pass {pass_id}: part of it may be in {', '.join(where)} "
                                         "(unreadable, missing or renamed): not read")

    def listed_segments(self) -> list:
        """The segment list (segments.jsonl's committed lines; before format 5, rank.json's
        ``segments``); [] and a problem when that list cannot be trusted."""
        entries, problem, _ = segment_list.read(self.path, self.info)
        if problem:
            self.dumpset._problem(Problem(self.path, Problem.BAD_FILE, problem))
        return entries

    def rank_number(self):
        parsed = fmt.parse_rank_dir(self.name)
        if parsed:
            return parsed[2]
        rank = self.info.get("rank")
        number = rank.get("rank") if isinstance(rank, dict) else None
        return number if isinstance(number, int) and not isinstance(number, bool) else None


def _locked(method):
    """Run a DumpSet method under its lock: threads share its open files (an LRU that closes the
    oldest) and its cached indexes, so one thread must not close a file another is reading."""
    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        with self._lock:
            return method(self, *args, **kwargs)

    return wrapper


class DumpSet:
    """A dump directory (``<root>/<role>/<rank dir>/seg-*.h5``). Use as a context manager or ``close()``.
    One DumpSet may be read from several threads (calls are serialized) and after ``fork``."""

    @property
    def _lock(self):
        # A child forked while another thread held the lock would wait for it forever: a new
        # process gets a new lock.
        if self._lock_pid != os.getpid():
            self._lock_pid, self._lock_obj = os.getpid(), threading.RLock()
        return self._lock_obj

    def __init__(self, root):
        self.root = os.path.abspath(os.fspath(root))
        why = fsutil.why_not_a_directory(self.root)  # (what is there instead, or why it cannot be read)
        if why:
            raise FileNotFoundError(f"no dump directory at {self.root}: {why}")
        self.problems: list = []  # Problems met so far: unreadable files and directories
        self._files: collections.OrderedDict = collections.OrderedDict()  # path -> open h5py.File (LRU)
        self._ranks: dict = {}  # (role, rank dir) -> _Rank
        # (role, entry) found to be a rank directory: each is listed once, not at every call (a
        # root of R sessions made each call list R directories; ls, R calls: R² listings)
        self._rank_dir_names: set = set()
        # path -> (file identity, SegmentIndex): kept across refresh() (see _segment_index)
        self._segment_indexes: dict = {}
        self._lock_pid, self._lock_obj = os.getpid(), threading.RLock()
        self._note_lost_records()

    def _note_lost_records(self) -> None:
        """The roles and sessions the root records as attached that are not here, as problems:
        what ``fastdump verify`` fails on is in ``problems`` too (it listed only what a read met)."""
        try:
            roles = lost_roles(self.root)
            sessions = lost_sessions(self.root, {os.path.basename(path) for path, _ in roles})
        except OSError as exc:  # (a record that cannot be listed: what it records cannot be checked)
            self._problem(Problem(os.path.join(self.root, fmt.SESSIONS_DIR), Problem.UNLISTABLE,
                                  f"cannot check the records of the roles and sessions attached ({exc})"))
            return
        for kind, found in ((Problem.LOST_ROLE, roles), (Problem.LOST_SESSION, sessions)):
            for path, text in found:
                self._problem(Problem(path, kind, text))
        for role in recorded_roles(self.root):  # (lost_roles leaves a link to verify, which fails every link)
            path = os.path.join(self.root, role)
            if os.path.islink(path):
                self._problem(Problem(path, Problem.LOST_ROLE, f"role {role!r} was attached here "
                                      f"({os.path.join(fmt.ROLES_DIR, role)}) but this is a symbolic link, "
                                      "not followed (it may point out of the dump): that role's dump is not read"))

    # ---------------------------------------------------------------- directory level

    @property
    @_locked
    def manifest(self) -> dict:
        """fastdump.json ({} when missing; {} and a problem when unreadable or not an object)."""
        return self._json_object(os.path.join(self.root, fmt.MANIFEST_FILE))

    def _json_object(self, path: str) -> dict:
        """A JSON object file of the dump (fastdump.json, rank.json): {} when missing; {} and a
        ``BAD_FILE`` problem when it is unreadable, damaged or not an object."""
        try:
            obj = fsutil.load_json(path)
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as exc:
            self._problem(Problem(path, Problem.BAD_FILE, str(exc)))
            return {}
        if not isinstance(obj, dict):
            self._problem(Problem(path, Problem.BAD_FILE, f"not a JSON object ({type(obj).__name__})"))
            return {}
        return obj

    @property
    @_locked
    def roles(self) -> list:
        return sorted(role for role in os.listdir(self.root) if self._rank_dirs(role))

    @_locked
    def ranks(self, role: str = None) -> list:
        """Rank directory names of a role: one per dumping session (a process may have several)."""
        return list(self._role_and_rank_dirs(role)[1])

    @_locked
    def sessions(self, role: str = None, rank=None) -> list:
        """Rank directory names matching ``rank`` (a number, or None for all), in start order."""
        role, names = self._role_and_rank_dirs(role)
        if rank is None:
            return names
        if not _is_rank_number(rank):  # a directory name, as every other method takes
            if str(rank) not in names:
                raise KeyError(f"no rank {str(rank)!r} in role {role!r} (ranks: {names})")
            return [str(rank)]
        return [n for n in names if self._rank_obj(role, n).rank_number() == int(rank)]

    @_locked
    def rank_path(self, role: str = None, rank=None, *, session: str = None) -> str:
        """The rank directory's path (as MultiDumpSet.rank_path: each rank under its own root)."""
        return self._rank(role, rank, session).path

    @_locked
    def rank_info(self, role: str = None, rank=None, *, session: str = None) -> dict:
        """rank.json of a rank directory ({} when missing)."""
        return self._rank(role, rank, session).info

    @_locked
    def segments(self, role: str = None, rank=None, *, session: str = None) -> list:
        """Paths of the visible segment files, in order."""
        return self._rank(role, rank, session).segment_paths()

    # ---------------------------------------------------------------- passes and tensors

    @_locked
    def passes(self, role: str = None, rank=None, *, session: str = None) -> list:
        return list(self._rank(role, rank, session).pass_map)

    @_locked
    def summary(self, role: str = None, rank=None, *, session: str = None) -> dict:
        """Totals of a rank from its readable segments (what ``fastdump ls`` prints)."""
        entry = self._rank(role, rank, session)
        segments = entry.segments
        # (a pass whole in one segment and found again in another is not read: not counted)
        passes = [p for p in entry.pass_map if p not in entry.repeated]
        incomplete, nested, suspended = set(), set(), set()
        for segment in segments:
            for row, meta in zip(segment.passes, segment.pass_meta):
                if not row["complete"]:
                    incomplete.add(int(row["pass"]))
                else:
                    incomplete.discard(int(row["pass"]))
                user_meta = meta.get("meta") if isinstance(meta, dict) else None
                if isinstance(user_meta, dict):  # (passes of two roles nested on one thread)
                    if user_meta.get("nested_in"):
                        nested.add(int(row["pass"]))
                    if user_meta.get("suspended_for"):
                        suspended.add(int(row["pass"]))
        return {
            "passes": len(passes),
            "first_pass": passes[0] if passes else None,
            "last_pass": passes[-1] if passes else None,
            "incomplete_passes": sorted(incomplete),
            # passes run inside another role's pass (meta nested_in), and passes that were suspended
            # while another role's forward ran inside them (meta suspended_for)
            "nested_passes": len(nested),
            "suspended_passes": len(suspended),
            "segments": len(segments),
            "unreadable_segments": len(entry.unreadable),
            "repeated_passes": sorted(entry.repeated),  # in two segments: not read (copied or mixed)
            "tensors": sum(len(segment.index) for segment in segments),
            "bytes": sum(int(segment.passes["bytes"].sum()) for segment in segments),
        }

    @_locked
    def names(self, role: str = None, rank=None, *, session: str = None) -> list:
        """Every tensor name of a rank, in order of first appearance."""
        seen: dict = {}
        for segment in self._rank(role, rank, session).segments:
            used = np.unique(segment.index["name"])
            for slot in sorted(used.tolist()):
                seen.setdefault(segment.names[slot], None)
        return list(seen)

    @_locked
    def meta(self, role: str = None, rank=None, pass_id: int = None, *, session: str = None) -> dict:
        """Pass metadata as given by the capture side, plus ``complete``, ``dropped``, ``skipped``,
        ``tensors`` and ``bytes`` (these five keys are fastdump's own), and, for a pass the capture
        side marked incomplete, ``incomplete`` (the reason) and ``mixed`` (several threads' forwards)."""
        merged, complete, dropped, skipped, tensors, nbytes = {}, True, 0, [], 0, 0
        reported = {}  # why the capture side marked the pass incomplete, if it did
        for segment in self._segments_of_pass(role, rank, pass_id, session):
            row, meta = segment.pass_record(pass_id)
            merged.update(meta.get("meta") or {})
            reported.update({key: meta[key] for key in fmt.INCOMPLETE_META_KEYS if meta.get(key)})
            complete = bool(row["complete"])  # a pass split over segments counts as its last part says
            dropped += int(row["dropped"])
            skipped.extend(meta.get("skipped") or [])
            tensors += int(row["tensors"])
            nbytes += int(row["bytes"])
        return {**merged, "complete": complete, "dropped": dropped, "skipped": skipped,
                "tensors": tensors, "bytes": nbytes, **reported}

    @_locked
    def structure(self, role: str = None, rank=None, pass_id: int = None, *, session: str = None) -> dict:
        """The container structure of the pass's outputs whose stored names do not tell it:
        ``{call name: {"kinds": {part path: kind}, "after": n}}`` (docs/FORMAT.md, "Output
        structure"); {} for a pass without one, or written before fastdump recorded it. An entry
        that is not of that form is left out; ``format.STRUCTURE_LOST`` as a key: the capture side
        could not send the record (the pass's outputs are then known by their names only)."""
        found: dict = {}
        for segment in self._segments_of_pass(role, rank, pass_id, session):
            _, entry = segment.pass_record(pass_id)
            record = entry.get(fmt.PASS_STRUCTURE)
            if isinstance(record, dict):
                found.update({name: value for name, value in record.items() if _structure_entry_ok(name, value)})
        return found

    @_locked
    def load(self, role: str = None, rank=None, pass_id: int = None, select=None, *, session: str = None,
             check: bool = False) -> dict:
        """{name: tensor} of one pass, in the order the tensors were dumped.

        ``select``: optional predicate on the name; tensors it rejects are not read at all.
        ``check``: verify each tensor's CRC32C (DumpError on a mismatch; format-1 segments have
        no checksums and are returned unchecked). ``session``: see ``sessions``.
        """
        result: dict = {}
        taken = None  # the pass's real names, which a renamed duplicate avoids: read only if one occurs
        for segment in self._segments_of_pass(role, rank, pass_id, session):
            h5file = self._file(segment.path)
            for position in segment.rows_of_pass(pass_id).tolist():
                name = segment.names[int(segment.index["name"][position])]
                if select is not None and not select(name):
                    continue
                if name in result:  # the capture layer makes names unique per pass; never lose one
                    if taken is None:
                        taken = set(self.pass_names(role, rank, pass_id, session=session))
                    name = self._unique(result, name, taken)
                result[name] = self._read_row(segment, h5file, position, check)
        return result

    @_locked
    def pass_names(self, role: str = None, rank=None, pass_id: int = None, *, session: str = None) -> list:
        """Tensor names of one pass in the order they were dumped, without reading tensor data."""
        names = []
        for segment in self._segments_of_pass(role, rank, pass_id, session):
            slots = segment.index["name"][segment.rows_of_pass(pass_id)]
            names.extend(segment.names[int(slot)] for slot in slots)
        return names

    @_locked
    def tensor(self, role: str = None, rank=None, name: str = None, pass_id: int = None, *,
               session: str = None, check: bool = False):
        """One tensor by name and pass (KeyError when that pass has no such tensor)."""
        for segment in self._segments_of_pass(role, rank, pass_id, session):
            position = segment.position_of(pass_id, name)
            if position is not None:
                return self._read_row(segment, self._file(segment.path), position, check)
        names = list(dict.fromkeys(self.pass_names(role, rank, pass_id, session=session)))
        near = difflib.get_close_matches(name, names, n=3) if isinstance(name, str) else []
        raise KeyError(f"no tensor {name!r} in pass {pass_id}"
                       + (f" (did you mean {', '.join(map(repr, near))}?)" if near else f" ({len(names)} names)"))

    @_locked
    def series(self, role: str = None, rank=None, name: str = None, *, session: str = None,
               check: bool = False) -> dict:
        """{pass_id: tensor} of one name across all passes (each block read once per segment)."""
        result: dict = {}
        directory = self._rank(role, rank, session)
        _ = directory.pass_map  # finds the repeated passes, which are not read
        repeated = directory.repeated
        for segment in directory.segments:
            positions = segment.rows_of_name(name)
            if len(positions) == 0:
                continue
            h5file = self._file(segment.path)
            entries = segment.index[positions]
            for block_number in np.unique(entries["block"]).tolist():
                in_block = entries[entries["block"] == block_number]
                layout = segment.block(h5file, block_number)[0]
                start = int(in_block["first_row"].min())
                stop = int((in_block["first_row"] + in_block["rows"]).max())
                rows = segment.read_rows(h5file, block_number, start, stop - start)
                for position, entry in zip(positions[entries["block"] == block_number].tolist(), in_block):
                    if int(entry["pass"]) in repeated or int(entry["pass"]) in directory.partial:
                        continue
                    first = int(entry["first_row"]) - start
                    part = rows[first:first + int(entry["rows"])]
                    if check:
                        segment.check_rows(position, part)
                    result.setdefault(int(entry["pass"]), _to_tensor(part, layout.dtype_name, layout.scalar))
        return dict(sorted(result.items()))

    # ---------------------------------------------------------------- housekeeping

    @_locked
    def refresh(self) -> None:
        """Forget cached indexes, to see segments and sessions written since (a dump being
        written). A segment file whose identity is unchanged keeps its index: only new files are read."""
        self._ranks.clear()
        self._rank_dir_names.clear()
        self._note_lost_records()

    @_locked
    def close(self) -> None:
        while self._files:
            self._close_file(*self._files.popitem())

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self.close()

    def __repr__(self) -> str:
        return f"DumpSet({self.root!r}, roles={self.roles})"

    # ---------------------------------------------------------------- internals

    def _problem(self, text: Problem, warn: bool = False) -> None:
        if text not in self.problems:
            self.problems.append(text)
            if warn:
                warnings.warn(f"fastdump: {text}", stacklevel=4)

    def _rank_dirs(self, role: str) -> list:
        """Rank directories of a role. Symbolic links (to a role or rank directory) are not
        followed: they may point out of the dump."""
        if not isinstance(role, str) or role in ("", ".", "..") or "/" in role or "\0" in role:
            return []  # a role is one entry of the root: never a path out of it
        if role in fmt.ROOT_NAMES:
            return []  # fastdump's own records at the root (their markers are named as rank directories)
        role_path = os.path.join(self.root, role)
        if not fsutil.is_real_dir(role_path):
            return []
        found, known = [], self._rank_dir_names
        for entry in self._listdir(role_path):
            if (role, entry) in known:
                found.append(entry)
                continue
            path = os.path.join(role_path, entry)
            if fsutil.is_real_dir(path) and any(
                name in (fmt.RANK_FILE, fmt.PRODUCER_ERROR_FILE) or fmt.segment_number(name) is not None
                for name in self._listdir(path)
            ):
                known.add((role, entry))
                found.append(entry)
        return sorted(found, key=_rank_dir_key)

    def _listdir(self, path: str) -> list:
        """Entries of a directory; one that cannot be listed (no permission) is a problem, and empty."""
        try:
            return os.listdir(path)
        except OSError as exc:
            self._problem(Problem(path, Problem.UNLISTABLE, f"cannot list ({exc.strerror or exc}); skipped"), warn=True)
            return []

    def _role_and_rank_dirs(self, role) -> tuple:
        """The role meant (``role``, or the only one when None) and its rank directories, listed once."""
        if role is not None:
            names = self._rank_dirs(role)
            if not names:
                roles = self.roles
                if not roles:  # (a role or rank directory given as the root: the message names the root)
                    raise KeyError(f"no role {role!r}: {no_rank_dirs_message(self.root)}")
                raise KeyError(f"no role {role!r} in {self.root} (roles: {roles})")
            return role, names
        roles = self.roles
        if not roles:
            raise KeyError(no_rank_dirs_message(self.root))
        if len(roles) != 1:
            raise ValueError(f"role must be given: {self.root} holds roles {roles}")
        return roles[0], self._rank_dirs(roles[0])

    def _rank(self, role, rank, session=None) -> _Rank:
        """The one rank directory meant: by directory name, or by rank number (+ ``session``).
        Several sessions matching a number is a ValueError listing them: a reader never mixes
        two sessions."""
        role, names = self._role_and_rank_dirs(role)
        if rank is not None and not _is_rank_number(rank):
            name = str(rank)
            if name not in names:
                raise KeyError(f"no rank {name!r} in role {role!r} (ranks: {names})")
            if session is not None and self._rank_obj(role, name).session != session:
                raise KeyError(f"rank directory {name!r} is not session {session!r}")
            return self._rank_obj(role, name)
        if rank is not None:
            self._refuse_mislabelled(role, names, int(rank))
        matches = names if rank is None else [n for n in names if self._rank_obj(role, n).rank_number() == int(rank)]
        if session is not None:
            matches = [n for n in matches if self._rank_obj(role, n).session == session]
        if not matches:
            what = f"rank {rank}" if rank is not None else "rank"
            raise KeyError(f"{what}{f' session {session!r}' if session else ''} missing in role {role!r} "
                           f"(rank directories: {names})")
        if len(matches) > 1:
            if rank is None:
                raise ValueError(f"rank must be given: role {role!r} has rank directories {matches}; "
                                 "pass one as rank (fastdump show: --rank DIR)")
            raise ValueError(f"rank {rank} of role {role!r} has {len(matches)} sessions: {matches}; "
                             "pass the directory name as rank, or session= (fastdump show: --rank DIR or --session S)")
        return self._rank_obj(role, matches[0])

    def _refuse_mislabelled(self, role: str, names: list, number: int) -> None:
        """DumpError when a directory named as rank ``number`` is another rank by its rank.json:
        asked for rank 0, a reader handed back rank 1's tensors, its directory renamed to rank 0's
        (``format.rank_dir_mismatch``). rank.json as read for indexing (once per directory)."""
        for name in names:
            if (fmt.parse_rank_dir(name) or (None, None, None))[2] != number:
                continue
            mismatch = fmt.rank_dir_mismatch(name, self._rank_obj(role, name)._indexing_facts()[0].get("rank"))
            if mismatch:
                raise DumpError(f"{os.path.join(self.root, role, name)}: {mismatch}; not read as rank {number} "
                                "(give the directory name to read it as it is)")

    def _rank_obj(self, role: str, name: str) -> _Rank:
        key = (role, name)
        if key not in self._ranks:
            self._ranks[key] = _Rank(self, role, name)
        return self._ranks[key]

    def _segments_of_pass(self, role, rank, pass_id, session=None) -> list:
        if pass_id is None:  # (load("target", 0) said "no pass None: a pass id is an integer")
            raise KeyError("a pass id must be given: load(role, rank, pass_id); passes(role, rank) lists them")
        if not isinstance(pass_id, (int, np.integer)) or isinstance(pass_id, (bool, np.bool_)):
            # True == 1 and 2.0 == 2 as dict keys: they would read passes 1 and 2
            raise KeyError(f"no pass {pass_id!r}: a pass id is an integer")
        entry = self._rank(role, rank, session)
        segments = entry.segments_of_pass(int(pass_id))  # without indexing every segment, where it can
        if segments is not None:
            return segments
        segments = entry.pass_map.get(pass_id)
        if pass_id in entry.repeated:
            raise DumpError("; ".join(p for p in self.problems if p.path == entry.path
                                      and p.kind == Problem.REPEATED_PASS and f"pass {pass_id} " in p))
        if pass_id in entry.partial:
            raise DumpError(entry.partial[pass_id])
        if not segments:
            if entry.unreadable:  # the pass may be in a segment that could not be read
                raise DumpError(f"no pass {pass_id} in the readable segments of {entry.path}; unreadable: "
                                + "; ".join(p for p in self.problems if p.path.startswith(entry.path)))
            raise KeyError(f"no pass {pass_id} in {entry.role}/{entry.name}: {_pass_ids_text(list(entry.pass_map))}"
                           + open_segment_hint(entry.info))
        return segments

    def _segment_index(self, path: str) -> SegmentIndex:
        """A segment's checked index. A segment file is written whole and renamed into place, never
        changed: while the same file is there, the index read before a refresh() is the index.
        (Re-reading every segment at each refresh made a reader following a live dump spend
        O(segments) a refresh: ~2.5 s for 114 segments, hours for a week-long run's.)"""
        try:
            info = os.lstat(path)
        except OSError:
            info = None
        identity = (info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns) \
            if info is not None and stat.S_ISREG(info.st_mode) else None
        cached = self._segment_indexes.get(path)
        if identity is not None and cached is not None and cached[0] == identity:
            return cached[1]
        segment = SegmentIndex(path, self._file(path))
        if identity is not None:
            self._segment_indexes[path] = (identity, segment)
        return segment

    def _file(self, path: str) -> h5py.File:
        h5file = self._files.pop(path, None)
        if h5file is None:
            h5file = open_segment(path)
            while len(self._files) >= _MAX_OPEN_FILES:
                self._close_file(*self._files.popitem(last=False))
        self._files[path] = h5file
        return h5file

    def _close_file(self, path: str, h5file: h5py.File) -> None:
        cached = self._segment_indexes.get(path)
        if cached is not None and cached[1]._blocks_file is h5file:
            cached[1].forget_blocks()
        h5file.close()

    @staticmethod
    def _unique(existing: dict, name: str, taken=()) -> str:
        """``name#dupK``, K the first free one: neither returned already nor a real name of the pass."""
        k = 1
        while f"{name}#dup{k}" in existing or f"{name}#dup{k}" in taken:
            k += 1
        return f"{name}#dup{k}"

    @staticmethod
    def _read_row(segment: SegmentIndex, h5file: h5py.File, position: int, check: bool = False):
        entry = segment.index[position]
        try:
            number = int(entry["block"])
            rows = segment.read_rows(h5file, number, int(entry["first_row"]), int(entry["rows"]))
            layout = segment.block(h5file, number)[0]
        except DumpError:
            raise
        except (OSError, RuntimeError, KeyError, ValueError, TypeError) as exc:  # HDF5's own: a damaged file
            raise DumpError(f"{segment.path}: block {int(entry['block'])} cannot be read "
                            f"({type(exc).__name__}: {exc})") from None
        if check:
            segment.check_rows(position, rows)
        return _to_tensor(rows, layout.dtype_name, layout.scalar)


def pid_gone(info: dict) -> bool:
    """True when rank.json names a process on this host that no longer exists: no process has its
    pid, or (``pid_identity``) the one that has it now is another (the pid reused: a running rank
    read as still being written, its lost open segment as pending)."""
    pid = info.get("pid")
    if info.get("host") != socket.gethostname() or not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
        return False
    return not fsutil.pid_alive(pid, info.get("pid_identity"))


def open_segment_hint(info: dict) -> str:
    """Why a pass may be absent although the model ran it: a running rank keeps its ended passes in
    its open segment until the segment is full or closed ('no pass 0' alone read as never dumped)."""
    pending = info.get("pending_passes", 0)
    if info.get("status") != "running" or not isinstance(pending, int) or isinstance(pending, bool) or pending <= 0:
        return ""
    if pid_gone(info):
        return f" ({pending} ended pass(es) were in the open segment of a writer whose process is gone: lost)"
    return (f" (the rank is still being written: {pending} ended pass(es) are in its open segment, not yet in a "
            f"file; they are readable once the segment is full or the Dumper is closed)")


def _pass_ids_text(ids: list) -> str:
    """What a rank holds, for a 'no pass N' error: "its passes are 0..4", "it holds no pass"."""
    ids = sorted(ids)
    if not ids:
        return "it holds no pass in a segment file"
    if ids[-1] - ids[0] + 1 == len(ids):
        return f"its passes are {ids[0]}..{ids[-1]}" if len(ids) > 1 else f"its only pass is {ids[0]}"
    shown = ", ".join(map(str, ids[:10])) + (", ..." if len(ids) > 10 else "")
    return f"its {len(ids)} passes are {shown} (last {ids[-1]})"


def _is_rank_dir(path: str) -> bool:
    """A directory holding what a session's writer writes (rank.json, producer_error.json, a segment)."""
    try:
        return fsutil.is_real_dir(path) and any(
            name in (fmt.RANK_FILE, fmt.PRODUCER_ERROR_FILE) or fmt.segment_number(name) is not None
            for name in os.listdir(path))
    except OSError:
        return False


def _looks_like_root(path: str) -> bool:
    """fastdump.json, or a role directory holding a rank directory (format 1 has no fastdump.json)."""
    if os.path.isfile(os.path.join(path, fmt.MANIFEST_FILE)):
        return True
    try:
        roles = [os.path.join(path, role) for role in sorted(os.listdir(path))[:_HINT_LISTING]]
        return any(_is_rank_dir(os.path.join(role, rank))
                   for role in roles if fsutil.is_real_dir(role)
                   for rank in sorted(os.listdir(role))[:_HINT_LISTING])
    except OSError:
        return False


_HINT_LISTING = 64  # entries looked at per directory: a hint must stay instant in a large directory


def wrong_root_hint(root) -> str:
    """Why ``root``, a directory without rank directories, is probably not the dump root meant, and
    which one is: a role or rank directory names its root, a parent names the roots below it
    (``fastdump ls dumps`` for ``dumps/demo``). "" when there is nothing to point at."""
    root = os.path.abspath(os.fspath(root))
    parent = os.path.dirname(root)
    if _is_rank_dir(root):
        return f"{root} is a rank directory; its dump root is {os.path.dirname(parent)}"
    try:
        entries = sorted(os.listdir(root))[:_HINT_LISTING]
    except OSError:
        return ""
    if any(fmt.parse_rank_dir(e) and _is_rank_dir(os.path.join(root, e)) for e in entries):
        return f"{root} is a role directory; its dump root is {parent}"
    below = []
    for entry in entries:
        path = os.path.join(root, entry)
        if not fsutil.is_real_dir(path):
            continue
        if _looks_like_root(path):
            below.append(path)
            continue
        try:
            below += [os.path.join(path, e) for e in sorted(os.listdir(path))[:_HINT_LISTING]
                      if fsutil.is_real_dir(os.path.join(path, e)) and _looks_like_root(os.path.join(path, e))]
        except OSError:
            pass
    if below:
        shown = ", ".join(below[:5]) + (f" and {len(below) - 5} more" if len(below) > 5 else "")
        return f"dump roots below {root}: {shown}"
    return ""


def no_rank_dirs_message(root) -> str:
    """The one message for a directory that holds no rank directory, with ``wrong_root_hint``."""
    hint = wrong_root_hint(root)
    return (f"no rank directories in {os.path.abspath(os.fspath(root))} (expected <root>/<role>/<rank>/rank.json)"
            + (f"; {hint}" if hint else ""))


def recorded_roles(root) -> list:
    """The roles the root records as attached (``fastdump.roles/<role>``, one marker per role), sorted;
    [] for a root written before the record existed, or whose record is no directory (``lost_roles``
    says so). Temporary files (an attach killed mid-write) are not markers."""
    directory = os.path.join(os.fspath(root), fmt.ROLES_DIR)
    if not fsutil.is_real_dir(directory):
        return []
    try:
        return sorted(name for name in os.listdir(directory) if not fsutil.is_temp_name(name))
    except OSError:
        return []


def lost_roles(root) -> list:
    """(path, what is wrong) for each role the root records as attached whose dump is not there:
    its entry is gone, is not a directory, or holds no rank directory (no entry named as one, nor a
    directory holding what a writer writes, as a renamed one: every session removed); and
    for a record that is there but not a directory. A symbolic link in a role's place is left to the
    caller (``verify`` reports every link in a root). A root without the record (written before it
    existed) has nothing to check: []."""
    root = os.fspath(root)
    record = os.path.join(root, fmt.ROLES_DIR)
    if os.path.lexists(record) and not fsutil.is_real_dir(record):
        return [(record, "not a directory: the root's record of the roles attached is not here")]
    out = []
    for role in recorded_roles(root):
        path = os.path.join(root, role)
        marker = os.path.join(fmt.ROLES_DIR, role)
        if not os.path.lexists(path):
            out.append((path, f"role {role!r} was attached here ({marker}) but its directory is gone: "
                              "that role's dump is not here"))
        elif os.path.islink(path):
            continue
        elif not os.path.isdir(path):
            out.append((path, f"role {role!r} was attached here ({marker}) but this is not a directory: "
                              "that role's dump is not here"))
        else:
            try:
                names = os.listdir(path)
            except OSError:
                continue  # (unlistable: the caller says so)
            if not any(fmt.parse_rank_dir(name) or _is_rank_dir(os.path.join(path, name)) for name in names):
                out.append((path, f"role {role!r} was attached here ({marker}) but its directory holds no rank "
                                  "directory: its sessions were removed"))
    return out


def lost_sessions(root, roles_lost=()) -> list:
    """(path, what is wrong) for each session the root records as attached
    (``fastdump.sessions/<role>/<rank directory>``) whose rank directory is not in its role's
    directory: neither under its name nor, renamed, as a directory whose rank.json names its
    session. Roles in ``roles_lost`` (already reported whole by :func:`lost_roles`) are passed
    over. A root without the record (written before it existed) has nothing to check: []."""
    root = os.fspath(root)
    record = os.path.join(root, fmt.SESSIONS_DIR)
    if not os.path.lexists(record):
        return []
    if not fsutil.is_real_dir(record):
        return [(record, "not a directory: the root's record of the sessions attached is not here")]
    out = []
    for role in sorted(os.listdir(record)):
        role_record = os.path.join(record, role)
        role_path = os.path.join(root, role)
        if role in roles_lost or fsutil.is_temp_name(role) or not fsutil.is_real_dir(role_path):
            continue  # (a role's directory gone or replaced: lost_roles or verify's walk says so)
        if not fsutil.is_real_dir(role_record):
            out.append((role_record, "not a directory: the root's record of this role's sessions is not here"))
            continue
        try:
            markers = sorted(n for n in os.listdir(role_record) if not fsutil.is_temp_name(n))
            entries = os.listdir(role_path)
        except OSError:
            continue  # (unlistable: the caller says so)
        present = None  # sessions of the role's directories, read once, only when a name is missing
        for name in markers:
            if name in entries and fsutil.is_real_dir(os.path.join(role_path, name)):
                continue
            if present is None:
                present = set()
                for entry in entries:
                    path = os.path.join(role_path, entry)
                    if not fsutil.is_real_dir(path):
                        continue
                    try:
                        info = fsutil.load_json(os.path.join(path, fmt.RANK_FILE))
                    except (OSError, ValueError):
                        info = None
                    present.add(fmt.expected_session(entry, info))
            parsed = fmt.parse_rank_dir(name)
            if parsed and parsed[4] and parsed[4] in present:
                continue  # renamed during the run (its rank.json names the session): read as it is
            out.append((os.path.join(role_path, name),
                        f"session attached here ({os.path.join(fmt.SESSIONS_DIR, role, name)}) but its rank "
                        "directory is gone: that session's dump is not here"))
    return out


def lost_records(root) -> list:
    """:func:`lost_roles`, then :func:`lost_sessions` of the roles still there."""
    roles = lost_roles(root)
    lost = {os.path.basename(path) for path, _ in roles}
    return roles + lost_sessions(root, lost)


def open(root):  # noqa: A001
    """Open one dump directory for reading. ``fastdump.open`` (``multiroot.open``) also takes a list
    of directories; this module sits below ``multiroot`` and never imports it."""
    if isinstance(root, (list, tuple)):
        raise TypeError("reader.open takes one dump root; use fastdump.open for a list of roots")
    return DumpSet(root)


def _structure_entry_ok(name, value) -> bool:
    """Whether a structure record's entry is what the capture side writes (DumpSet.structure)."""
    if name == fmt.STRUCTURE_LOST:
        return True
    if not (isinstance(name, str) and isinstance(value, dict) and isinstance(value.get("kinds"), dict)):
        return False
    after = value.get("after", 0)
    return (all(isinstance(k, str) and isinstance(v, str) for k, v in value["kinds"].items())
            and isinstance(after, int) and not isinstance(after, bool) and after >= 0)
