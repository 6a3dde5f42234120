"""Read a dump: ``fastdump.open(root) -> DumpSet``.

    ds = fastdump.open("/tmp/dump")
    ds.roles                              # ['draft', 'target']
    ds.ranks("target")                    # ['TP0_PP0_Rank0_pid1234', ...]
    ds.passes("target", 0)                # rank given by number when unambiguous
    ds.load("target", 0, 5)               # {name: tensor} in dump order, original dtype/shape
    ds.series("target", 0, "model.norm")  # {pass_id: tensor}

Only visible ``seg-*.h5`` files are read: they are complete by construction (the writer renames
them into place), so a dump can be read while it is still being written. Each segment's small
tables (names, row index, passes) are read once and cached; tensors are read by slicing their rows
out of the block dataset, so loading one pass never reads other passes' data. Nothing here
unpickles or evaluates anything from the dump. torch is imported only to build tensors.
"""

from __future__ import annotations

import collections
import json
import os
import re
import warnings

import h5py
import numpy as np

from . import dtypes, fsutil
from .writer import format as fmt

_MAX_OPEN_FILES = 16


def open_segment(path: str) -> h5py.File:
    """Open a segment read-only with HDF5's default locking (so that h5py.File(path) elsewhere in
    the process still works), falling back to no locking on filesystems without lock support:
    visible segments are immutable, so locking protects nothing here."""
    try:
        return h5py.File(path, "r")
    except OSError as exc:
        if "lock" not in str(exc).lower():
            raise
        return h5py.File(path, "r", locking=False)


def _rank_dir_key(name: str):
    """Order rank directories by global rank (then pid); other names naturally ('x10' after 'x2')."""
    match = fmt.RANK_DIR_RE.match(name)
    if match:
        tp, pp, rank, pid = (int(group) for group in match.groups())
        return (0, rank, tp, pp, pid)
    return (1, [(0, int(part)) if part.isdigit() else (1, part) for part in re.split(r"(\d+)", name)])


def _attr_str(value) -> str:
    return value.decode("utf-8") if isinstance(value, bytes) else str(value)


class SegmentIndex:
    """The tables of one segment file (no tensor data)."""

    def __init__(self, path: str, h5file: h5py.File):
        self.path = path
        self.file_name = os.path.basename(path)
        self.number = fmt.segment_number(self.file_name)
        self.attrs = {key: (_attr_str(v) if isinstance(v, (bytes, str)) else v.item() if hasattr(v, "item") else v)
                      for key, v in h5file.attrs.items()}
        if self.attrs.get("format") != fmt.FORMAT_NAME:
            raise ValueError(f"{path}: not a fastdump segment (format attribute {self.attrs.get('format')!r})")
        if int(self.attrs.get("format_version", 0)) > fmt.FORMAT_VERSION:
            raise ValueError(f"{path}: format version {self.attrs['format_version']} is newer than this reader")
        self.names: list = json.loads(_attr_str(h5file[fmt.NAMES][()]))
        self.index: np.ndarray = h5file[fmt.INDEX][()]
        self.passes: np.ndarray = h5file[fmt.PASSES][()]
        self.pass_meta: list = [json.loads(_attr_str(text)) for text in h5file[fmt.PASS_META][()]]
        self._slot_of_name = {name: slot for slot, name in enumerate(self.names)}
        self._rows_of_pass = None
        self._blocks: dict = {}  # block number -> (dataset, torch dtype name, scalar rows?)
        self._blocks_file = None

    def rows_of_pass(self, pass_id: int) -> np.ndarray:
        """Positions in ``index`` of a pass's tensors, in the order they were dumped."""
        if self._rows_of_pass is None:
            order = np.argsort(self.index["pass"], kind="stable")  # stable: keeps the dump order
            pass_ids, starts = np.unique(self.index["pass"][order], return_index=True)
            stops = np.append(starts[1:], len(order))
            self._rows_of_pass = {int(p): order[a:b] for p, a, b in zip(pass_ids, starts, stops)}
        return self._rows_of_pass.get(pass_id, np.empty(0, dtype=np.int64))

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

    def block(self, h5file: h5py.File, number: int):
        """(dataset, torch dtype name, scalar rows?) of ``blocks/<number>``."""
        if self._blocks_file is not h5file:  # dataset handles die with the file they came from
            self._blocks_file, self._blocks = h5file, {}
        info = self._blocks.get(number)
        if info is None:
            dataset = h5file[fmt.BLOCKS][str(number)]
            attrs = dataset.attrs
            info = (dataset, _attr_str(attrs[fmt.ATTR_DTYPE]), bool(attrs.get(fmt.ATTR_SCALAR, 0)))
            self._blocks[number] = info
        return info


def _to_tensor(rows: np.ndarray, dtype_name: str, scalar: bool):
    shape = () if scalar else rows.shape
    if rows.size == 0:
        # h5py hands back empty arrays with zero strides; give users ordinary contiguous strides.
        import torch

        return torch.empty(shape, dtype=getattr(torch, dtype_name))
    tensor = dtypes.to_torch(rows, dtype_name)
    # to_torch goes through np.ascontiguousarray, which turns 0-d into 1-d: restore the shape.
    return tensor.reshape(shape)


class _Rank:
    """One rank directory: its rank.json and the index of every visible segment."""

    def __init__(self, dumpset: "DumpSet", role: str, name: str):
        self.dumpset = dumpset
        self.role = role
        self.name = name
        self.path = os.path.join(dumpset.root, role, name)
        self._segments = None
        self._passes = None  # pass id -> [SegmentIndex, ...] containing it

    @property
    def info(self) -> dict:
        return fsutil.read_json(os.path.join(self.path, fmt.RANK_FILE), default={}) or {}

    def segment_paths(self) -> list:
        numbered = []
        for entry in os.listdir(self.path):
            number = fmt.segment_number(entry)
            if number is not None:
                numbered.append((number, os.path.join(self.path, entry)))
        return [path for _, path in sorted(numbered)]

    @property
    def segments(self) -> list:
        if self._segments is None:
            segments = []
            for path in self.segment_paths():
                try:
                    segments.append(SegmentIndex(path, self.dumpset._file(path)))
                except Exception as exc:  # one damaged file must not hide the rest of the dump
                    message = f"{path}: unreadable segment ({type(exc).__name__}: {exc})"
                    self.dumpset.problems.append(message)
                    warnings.warn(f"fastdump: skipping {message}", stacklevel=3)
            self._segments = segments
        return self._segments

    @property
    def pass_map(self) -> dict:
        if self._passes is None:
            found: dict = {}
            for segment in self.segments:
                for pass_id in segment.passes["pass"].tolist():
                    found.setdefault(pass_id, []).append(segment)
            self._passes = dict(sorted(found.items()))
        return self._passes

    def rank_number(self):
        match = fmt.RANK_DIR_RE.match(self.name)
        if match:
            return int(match.group(3))
        number = (self.info.get("rank") or {}).get("rank")
        return int(number) if isinstance(number, int) else None


class DumpSet:
    """A dump directory (``<root>/<role>/<rank dir>/seg-*.h5``). Use as a context manager or ``close()``."""

    def __init__(self, root):
        self.root = os.path.abspath(os.fspath(root))
        if not os.path.isdir(self.root):
            raise FileNotFoundError(f"no dump directory at {self.root}")
        self.problems: list = []  # unreadable segments met so far
        self._files: collections.OrderedDict = collections.OrderedDict()  # path -> open h5py.File (LRU)
        self._ranks: dict = {}  # (role, rank dir) -> _Rank

    # ---------------------------------------------------------------- directory level

    @property
    def manifest(self) -> dict:
        return fsutil.read_json(os.path.join(self.root, fmt.MANIFEST_FILE), default={}) or {}

    @property
    def roles(self) -> list:
        return sorted(role for role in os.listdir(self.root) if self._rank_dirs(role))

    def ranks(self, role: str = None) -> list:
        return self._rank_dirs(self._role(role))

    def rank_info(self, role: str = None, rank=None) -> dict:
        """rank.json of a rank directory ({} when missing)."""
        return self._rank(role, rank).info

    def segments(self, role: str = None, rank=None) -> list:
        """Paths of the visible segment files, in order."""
        return self._rank(role, rank).segment_paths()

    # ---------------------------------------------------------------- passes and tensors

    def passes(self, role: str = None, rank=None) -> list:
        return list(self._rank(role, rank).pass_map)

    def summary(self, role: str = None, rank=None) -> dict:
        """Totals of a rank from its readable segments (what ``fastdump ls`` prints)."""
        entry = self._rank(role, rank)
        segments = entry.segments
        passes = list(entry.pass_map)
        incomplete = set()
        for segment in segments:
            for row in segment.passes:
                if not row["complete"]:
                    incomplete.add(int(row["pass"]))
                else:
                    incomplete.discard(int(row["pass"]))
        return {
            "passes": len(passes),
            "first_pass": passes[0] if passes else None,
            "last_pass": passes[-1] if passes else None,
            "incomplete_passes": sorted(incomplete),
            "segments": len(segments),
            "unreadable_segments": len(entry.segment_paths()) - len(segments),
            "tensors": sum(len(segment.index) for segment in segments),
            "bytes": sum(int(segment.passes["bytes"].sum()) for segment in segments),
        }

    def names(self, role: str = None, rank=None) -> list:
        """Every tensor name of a rank, in order of first appearance."""
        seen: dict = {}
        for segment in self._rank(role, rank).segments:
            used = np.unique(segment.index["name"])
            for slot in sorted(used.tolist()):
                seen.setdefault(segment.names[slot], None)
        return list(seen)

    def meta(self, role: str = None, rank=None, pass_id: int = None) -> dict:
        """Pass metadata as given by the capture side, plus ``complete``, ``dropped``, ``skipped``,
        ``tensors`` and ``bytes`` (these five keys are fastdump's own), and, for a pass the capture
        side marked incomplete, ``incomplete`` (the reason) and ``mixed`` (several threads' forwards)."""
        merged, complete, dropped, skipped, tensors, nbytes = {}, True, 0, [], 0, 0
        reported = {}  # why the capture side marked the pass incomplete, if it did
        for segment in self._segments_of_pass(role, rank, pass_id):
            row, meta = segment.pass_record(pass_id)
            merged.update(meta.get("meta") or {})
            reported.update({key: meta[key] for key in ("incomplete", "mixed") if meta.get(key)})
            complete = bool(row["complete"])  # a pass split over segments counts as its last part says
            dropped += int(row["dropped"])
            skipped.extend(meta.get("skipped") or [])
            tensors += int(row["tensors"])
            nbytes += int(row["bytes"])
        return {**merged, "complete": complete, "dropped": dropped, "skipped": skipped,
                "tensors": tensors, "bytes": nbytes, **reported}

    def load(self, role: str = None, rank=None, pass_id: int = None, select=None) -> dict:
        """{name: tensor} of one pass, in the order the tensors were dumped.

        ``select``: optional predicate on the name; tensors it rejects are not read at all.
        """
        result: dict = {}
        for segment in self._segments_of_pass(role, rank, pass_id):
            h5file = self._file(segment.path)
            for position in segment.rows_of_pass(pass_id).tolist():
                name = segment.names[int(segment.index["name"][position])]
                if select is not None and not select(name):
                    continue
                if name in result:  # the capture layer makes names unique per pass; never lose one
                    name = self._unique(result, name)
                result[name] = self._read_row(segment, h5file, position)
        return result

    def pass_names(self, role: str = None, rank=None, pass_id: int = None) -> list:
        """Tensor names of one pass in the order they were dumped, without reading tensor data."""
        names = []
        for segment in self._segments_of_pass(role, rank, pass_id):
            slots = segment.index["name"][segment.rows_of_pass(pass_id)]
            names.extend(segment.names[int(slot)] for slot in slots)
        return names

    def tensor(self, role: str = None, rank=None, name: str = None, pass_id: int = None):
        """One tensor by name and pass (KeyError when that pass has no such tensor)."""
        for segment in self._segments_of_pass(role, rank, pass_id):
            in_pass = segment.rows_of_pass(pass_id)
            hits = in_pass[segment.index["name"][in_pass] == segment.slot_of(name)]
            if len(hits):
                return self._read_row(segment, self._file(segment.path), int(hits[0]))
        raise KeyError(f"no tensor {name!r} in pass {pass_id}")

    def series(self, role: str = None, rank=None, name: str = None) -> dict:
        """{pass_id: tensor} of one name across all passes (each block read once per segment)."""
        result: dict = {}
        for segment in self._rank(role, rank).segments:
            positions = segment.rows_of_name(name)
            if len(positions) == 0:
                continue
            h5file = self._file(segment.path)
            entries = segment.index[positions]
            for block_number in np.unique(entries["block"]).tolist():
                in_block = entries[entries["block"] == block_number]
                dataset, dtype_name, scalar = segment.block(h5file, block_number)
                start = int(in_block["first_row"].min())
                stop = int((in_block["first_row"] + in_block["rows"]).max())
                rows = dataset[start:stop]
                for entry in in_block:
                    first = int(entry["first_row"]) - start
                    part = rows[first:first + int(entry["rows"])]
                    result.setdefault(int(entry["pass"]), _to_tensor(part, dtype_name, scalar))
        return dict(sorted(result.items()))

    # ---------------------------------------------------------------- housekeeping

    def refresh(self) -> None:
        """Forget cached indexes, to see segments written since (a dump being written)."""
        self._ranks.clear()

    def close(self) -> None:
        while self._files:
            _, h5file = self._files.popitem()
            h5file.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self.close()

    def __repr__(self) -> str:
        return f"DumpSet({self.root!r}, roles={self.roles})"

    # ---------------------------------------------------------------- internals

    def _rank_dirs(self, role: str) -> list:
        role_path = os.path.join(self.root, role)
        if not os.path.isdir(role_path):
            return []
        found = []
        for entry in os.listdir(role_path):
            path = os.path.join(role_path, entry)
            if os.path.isdir(path) and any(
                name == fmt.RANK_FILE or fmt.segment_number(name) is not None for name in os.listdir(path)
            ):
                found.append(entry)
        return sorted(found, key=_rank_dir_key)

    def _role(self, role):
        if role is not None:
            if not self._rank_dirs(role):
                raise KeyError(f"no role {role!r} in {self.root} (roles: {self.roles})")
            return role
        roles = self.roles
        if len(roles) != 1:
            raise ValueError(f"role must be given: {self.root} holds roles {roles}")
        return roles[0]

    def _rank(self, role, rank) -> _Rank:
        role = self._role(role)
        names = self._rank_dirs(role)
        if rank is None:
            if len(names) != 1:
                raise ValueError(f"rank must be given: role {role!r} has ranks {names}")
            name = names[0]
        elif isinstance(rank, (int, np.integer)) and not isinstance(rank, bool):
            matches = [n for n in names if self._rank_obj(role, n).rank_number() == int(rank)]
            if len(matches) != 1:
                raise KeyError(f"rank {rank} of role {role!r} is {'ambiguous' if matches else 'missing'}: "
                               f"{matches or names}")
            name = matches[0]
        else:
            name = str(rank)
            if name not in names:
                raise KeyError(f"no rank {name!r} in role {role!r} (ranks: {names})")
        return self._rank_obj(role, name)

    def _rank_obj(self, role: str, name: str) -> _Rank:
        key = (role, name)
        if key not in self._ranks:
            self._ranks[key] = _Rank(self, role, name)
        return self._ranks[key]

    def _segments_of_pass(self, role, rank, pass_id) -> list:
        segments = self._rank(role, rank).pass_map.get(pass_id)
        if not segments:
            raise KeyError(f"no pass {pass_id}")
        return segments

    def _file(self, path: str) -> h5py.File:
        h5file = self._files.pop(path, None)
        if h5file is None:
            h5file = open_segment(path)
            while len(self._files) >= _MAX_OPEN_FILES:
                self._files.popitem(last=False)[1].close()
        self._files[path] = h5file
        return h5file

    @staticmethod
    def _unique(existing: dict, name: str) -> str:
        k = 1
        while f"{name}#dup{k}" in existing:
            k += 1
        return f"{name}#dup{k}"

    @staticmethod
    def _read_row(segment: SegmentIndex, h5file: h5py.File, position: int):
        entry = segment.index[position]
        dataset, dtype_name, scalar = segment.block(h5file, int(entry["block"]))
        first = int(entry["first_row"])
        return _to_tensor(dataset[first:first + int(entry["rows"])], dtype_name, scalar)


def open(root):  # noqa: A001 - exported as fastdump.open
    """Open a dump directory for reading; a list of directories (one per host of a multi-node run)
    reads as one dump with the ranks merged (see ``fastdump.multiroot``)."""
    if isinstance(root, (list, tuple)):
        from .multiroot import MultiDumpSet

        return MultiDumpSet(root)
    return DumpSet(root)

