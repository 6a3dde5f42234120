"""``fastdump ls / verify / show``: look at a dump from the command line.

``fastdump.cli`` registers these through ``add_arguments``; ``python -m fastdump.cli.dump`` runs
them alone. ``verify`` checks files with h5py directly (not through the reader, which tolerates
damage) so that it reports every problem instead of stopping at the first.
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import os
import re
import sys
import warnings

import numpy as np

from .. import dtypes, fsutil, protocol, segment_list
from .. import format as fmt
from ..format import printable as _printable

# rank.json statuses for which a leftover temporary file is what a kill leaves, not damage.
_UNFINISHED_STATUSES = ("running", "incomplete")


_ROOT_HELP = "dump root: the directory given to fastdump.attach (holds fastdump.json and <role>/ directories)"


def add_arguments(subparsers) -> None:
    ls_help = ("roles, ranks, passes, segments, sizes and status of a dump (exit 1 when ROOT is no dump: missing, "
               "or neither fastdump.json nor a rank directory; a dump with nothing in it yet, or damaged, lists "
               "with exit 0: whether it is whole is verify's question)")
    p = subparsers.add_parser("ls", help=ls_help, description=ls_help)
    p.add_argument("root", help=_ROOT_HELP)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_ls)

    p = subparsers.add_parser("verify", help="check segments against their index and rank.json (exit 1 on a problem)")
    p.add_argument("root", help=_ROOT_HELP)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--data", action="store_true", help="also read every tensor byte and check every CRC32C (catches I/O errors and flipped bits)")
    p.set_defaults(func=cmd_verify)

    p = subparsers.add_parser("show", help="tensors of one pass: dtype, shape, summary statistics")
    p.add_argument("root", help=_ROOT_HELP)
    p.add_argument("--role", default=None, help="role directory (optional when there is one)")
    p.add_argument("--rank", default=None, help="rank directory name or global rank number (optional when one)")
    p.add_argument("--session", default=None, help="session id, when several sessions dumped that rank number")
    p.add_argument("--pass", dest="pass_id", type=int, required=True, help="pass id")
    p.add_argument("--name", default=None, help="only names matching this regular expression (re.search)")
    p.set_defaults(func=cmd_show)


def _rank_arg(text):
    return int(text) if text is not None and text.isdigit() else text


def _is_count(value) -> bool:
    """An integer >= 0 (JSON's true, 4.0 and -5 are not)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _count(value) -> int:
    """A count from rank.json, or 0 when it is not a non-negative integer (a damaged file)."""
    return value if _is_count(value) else 0


def _pid_gone(info: dict) -> bool:
    """True when rank.json names a process on this host that no longer exists."""
    from ..reader import pid_gone

    return pid_gone(info)


def _size(nbytes: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if nbytes < 1024 or unit == "TiB":
            return f"{nbytes:.0f}{unit}" if unit == "B" else f"{nbytes:.1f}{unit}"
        nbytes /= 1024


def _table(header: list, rows: list) -> str:
    widths = [max(len(str(cell)) for cell in column) for column in zip(header, *rows)]
    lines = []
    for row in [header] + rows:
        lines.append("  ".join(str(cell).ljust(width) for cell, width in zip(row, widths)).rstrip())
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------- ls


def list_dump(root: str) -> dict:
    """Every rank directory (one per session) with its status and totals. A damaged rank.json or
    segment is reported in ``problems`` (path: reason) and the listing goes on."""
    from .. import reader

    with reader.open(root) as ds:
        ranks = []
        for role in ds.roles:
            for rank in ds.ranks(role):
                info = ds.rank_info(role, rank)
                _damaged_counts(ds, os.path.join(ds.root, role, rank), info)
                status = info.get("status", "unknown")
                error = info.get("error")
                gone = _pid_gone(info)
                entry = {
                    "role": role,
                    "rank": rank,
                    "status": status if isinstance(status, str) else f"unknown ({type(status).__name__})",
                    "error": None if error is None else str(error),
                    "dropped": _count(info.get("dropped", 0)),
                    "dropped_passes": _count(info.get("dropped_passes", 0)),
                    "skipped": _count(info.get("skipped", 0)),
                    "producer_gone": gone,
                    # ended passes the writer still holds in its open segment (a running rank whose
                    # process lives: once it is gone, they were never written)
                    "pending_passes": _count(info.get("pending_passes", 0)) if status == "running" and not gone else 0,
                    "lost_pending_passes": _count(info.get("pending_passes", 0)) if status == "running" and gone else 0,
                }
                try:
                    entry.update(ds.summary(role, rank))
                except Exception as exc:  # never a traceback: say which rank and why, go on
                    ds.problems.append(f"{os.path.join(ds.root, role, rank)}: {type(exc).__name__}: {exc}")
                    entry.update(passes=0, first_pass=None, last_pass=None, incomplete_passes=[], segments=0,
                                 unreadable_segments=0, repeated_passes=[], tensors=0, bytes=0,
                                 nested_passes=0, suspended_passes=0)
                ranks.append(entry)
        wrong = {p.path for p in ds.problems if getattr(p, "kind", None) == reader.Problem.WRONG_RANK}
        for entry in ranks:  # (rank_info read each rank.json above: its problems are known now)
            entry["wrong_rank"] = os.path.join(ds.root, entry["role"], entry["rank"]) in wrong
        manifest = ds.manifest
        problems = list(ds.problems)  # (with the roles and sessions lost: DumpSet finds them at open)
        return {"root": ds.root, "manifest": manifest, "ranks": ranks, "problems": problems}


_LISTED_COUNTS = ("dropped", "dropped_passes", "skipped", "pending_passes")


def _damaged_counts(ds, path: str, info: dict) -> None:
    """A count ls shows that rank.json holds as no count (NaN, -5, 2.0, "3") is listed as 0: a
    problem says so, with verify's words, rather than a clean-looking 0 (verify fails on it)."""
    from ..reader import Problem

    for key in _LISTED_COUNTS:
        if key in info and not _is_count(info[key]):
            ds.problems.append(Problem(path, Problem.BAD_FILE, f"{fmt.RANK_FILE} {key} is "
                                       f"{_printable(json.dumps(info[key]))[:40]}, not a count (an integer >= 0)"))


def _print_warnings(problems: list, caught: list) -> None:
    """The reader's problems as ``warning:`` lines, then what else it warned of (its Python warnings
    repeat each problem: those are not printed twice, nor with a source line)."""
    said = {f"fastdump: {text}" for text in problems}
    for text in problems:
        print(f"warning: {_printable(text)}", file=sys.stderr)
    for w in caught:
        if str(w.message) not in said:
            print(f"warning: {_printable(str(w.message).removeprefix('fastdump: '))}", file=sys.stderr)


def cmd_ls(args) -> int:
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            listing = list_dump(args.root)
    except OSError as exc:  # a missing or unlistable root
        print(f"fastdump ls: {_printable(exc)}", file=sys.stderr)
        if args.json:  # (a script reading stdout got nothing to parse: the same object as for no dump)
            print(json.dumps({"root": os.path.abspath(args.root), "manifest": {}, "ranks": [], "problems": [],
                              "not_a_dump": str(exc)}, indent=2, default=str))
        return 1
    hint, not_a_dump = "", False
    if not listing["ranks"]:
        from ..reader import wrong_root_hint

        hint = wrong_root_hint(listing["root"])
        # (a root being started has fastdump.json; without it this is no dump: a wrong path)
        not_a_dump = bool(hint) or not listing["manifest"]
    if args.json:
        print(json.dumps(dict(listing, not_a_dump=hint or not_a_dump) if not_a_dump else listing, indent=2,
                         default=str))
        return 1 if not_a_dump else 0
    manifest = listing["manifest"]
    version = manifest.get("fastdump_version") or manifest.get("version")
    print(_printable(listing["root"]) + (f"  (fastdump {_printable(version)})" if version else ""))
    _print_warnings(listing["problems"], caught)
    if not listing["ranks"]:
        if not_a_dump:
            print("no rank directories" + (f"; {_printable(hint)}" if hint else ""))
            return 1
        # A dump root (fastdump.json) with nothing listed: a run starting, or one whose rank
        # directories were removed (then the warnings above name the roles). Exit 0, as for any
        # dump ls can list: whether it is whole is verify's question.
        print(f"no rank directories: {fmt.MANIFEST_FILE} says a Dumper attached here, but no session has "
              f"written its {fmt.RANK_FILE} (a run still starting, or its rank directories were removed: "
              "fastdump verify fails then)")
        return 0
    rows = []
    for r in listing["ranks"]:
        span = "-" if r["first_pass"] is None else f"{r['first_pass']}..{r['last_pass']}"
        status = r["status"] + (f" ({r['error']})" if r["error"] else "")
        if r["status"] == "running" and r["producer_gone"]:
            status += " [its process is gone: unfinished]"
        if r.get("wrong_rank"):
            status += " [its rank.json is another rank's: see the warning]"
        if r["unreadable_segments"]:
            status += f" [{r['unreadable_segments']} unreadable segment(s)]"
        if r["incomplete_passes"]:
            status += f" [{len(r['incomplete_passes'])} incomplete pass(es)]"
        if r.get("nested_passes"):
            status += f" [{r['nested_passes']} pass(es) ran inside another role's: meta nested_in]"
        if r.get("suspended_passes"):
            status += f" [{r['suspended_passes']} pass(es) suspended for another role's: meta suspended_for]"
        if r["pending_passes"]:
            status += f" [+{r['pending_passes']} pass(es) in the open segment]"
        if r.get("repeated_passes"):
            status += f" [{len(r['repeated_passes'])} pass(es) in two segments: not read]"
        if r["lost_pending_passes"]:
            status += f" [{r['lost_pending_passes']} pass(es) of the open segment lost with its process]"
        dropped = str(r["dropped"]) + (f" +{r['dropped_passes']} passes" if r["dropped_passes"] else "")
        rows.append([_printable(r["role"]), _printable(r["rank"]), r["passes"], span, r["segments"], r["tensors"],
                     _size(r["bytes"]), dropped, r["skipped"], _printable(status)])
    print(_table(["ROLE", "RANK", "PASSES", "RANGE", "SEGMENTS", "TENSORS", "BYTES", "DROPPED", "SKIPPED", "STATUS"],
                 rows))
    return 0


# ----------------------------------------------------------------------------------------- verify


class _Report:
    def __init__(self):
        self.problems: list = []
        self.warnings: list = []

    def problem(self, where: str, text: str) -> None:
        self.problems.append(f"{where}: {text}")

    def warning(self, where: str, text: str) -> None:
        self.warnings.append(f"{where}: {text}")


def _check_block(report: _Report, where: str, block: tuple, rows: tuple, number: int, version: int) -> int:
    """Check one block against the index rows pointing at it; return its row byte size. ``block``:
    its ``(attributes, shape, storage dtype)`` as ``_check_objects`` read them; ``rows``: what
    ``_index_rows_by_block`` found of its index rows."""
    from ..reader import DumpError, check_block_crc

    attrs, shape, storage = block[:3]
    dtype_name = attrs.get(fmt.ATTR_DTYPE)
    code = dtypes.CODE_BY_NAME.get(dtype_name) if isinstance(dtype_name, str) else None
    if code is None:
        report.problem(where, f"unknown dtype attribute {dtype_name!r}")
        return 0
    encoding = attrs.get(fmt.ATTR_ENCODING)
    if encoding != dtypes.ENCODING[code]:
        report.problem(where, f"encoding {encoding!r}, expected {dtypes.ENCODING[code]!r} for {dtype_name}")
    if storage != dtypes.STORAGE[code]:
        report.problem(where, f"stored as {storage}, expected {dtypes.STORAGE[code]} for {dtype_name}")
    if len(shape) == 0:
        report.problem(where, "block has no row axis")
        return 0
    scalar = bool(attrs.get(fmt.ATTR_SCALAR, 0))
    if version >= 4:  # how the bytes read back: the rows' CRC covers only the bytes
        try:
            check_block_crc(attrs, number, dtype_name, encoding or "", scalar, shape[1:], where)
        except DumpError as exc:
            report.problem(where, str(exc).removeprefix(where + ": "))
    count, one_name, tiled, stop, long_rows = rows
    if scalar and (len(shape) != 1 or long_rows):
        report.problem(where, "scalar block must be 1-D with one row per tensor")
    if count == 0:
        report.problem(where, "block not referenced by the index")
    elif not one_name:
        report.problem(where, "index rows of one block name different tensors")
    if not tiled or (count and stop != shape[0]):
        report.problem(where, f"index rows do not tile the block's {shape[0]} rows exactly")
    return math.prod(shape[1:]) * dtypes.ITEMSIZE[code]


_NO_ROWS = (0, True, True, 0, False)  # _index_rows_by_block's facts of a block no index row names


def _index_rows_by_block(index: np.ndarray) -> dict:
    """{block number: (index rows naming it, all of one name?, do they tile rows 0..stop with no
    negative count?, stop, any of other than one row?)}, for every block the index names, in one
    pass over the index: per block, masks and sorts of its rows cost ~25 us each, most of verify's
    own time on a wide pass (100k blocks). Rows are taken by first row within a block, ties in
    index order, as the reader tiles them."""
    if not len(index):
        return {}
    order = np.lexsort((index["first_row"], index["block"]))  # (stable: ties keep index order)
    blocks, firsts, rows = index["block"][order], index["first_row"][order], index["rows"][order]
    names = index["name"][order]
    stops = firsts + rows
    starts_block = np.ones(len(order), dtype=bool)
    starts_block[1:] = blocks[1:] != blocks[:-1]
    first_of, group = np.flatnonzero(starts_block), np.cumsum(starts_block) - 1
    expected = np.where(starts_block, 0, np.concatenate([[0], stops[:-1]]))

    def any_of_block(mask, groups=group):  # per block: whether any of its rows has mask set
        return np.bincount(groups[mask], minlength=len(first_of)) > 0

    wrong = any_of_block((firsts != expected) | (rows < 0))
    other_name = any_of_block(~starts_block[1:] & (names[1:] != names[:-1]), group[1:])
    long_rows = any_of_block(rows != 1)
    last_of = np.append(first_of[1:], len(order)) - 1
    counts = np.diff(np.append(first_of, len(order)))
    return {number: (count, not other, not bad, stop, long)
            for number, count, other, bad, stop, long in zip(
                blocks[first_of].tolist(), counts.tolist(), other_name.tolist(), wrong.tolist(),
                stops[last_of].tolist(), long_rows.tolist())}


def check_segment(report: _Report, path: str, read_data: bool = False):
    """Check one segment file; return its summary dict (None when it cannot be opened)."""
    from ..reader import DumpError, open_segment

    where = path
    try:
        h5file = open_segment(path)
    except DumpError as exc:
        report.problem(where, f"cannot open ({exc})")
        return None
    except Exception as exc:
        report.problem(where, f"cannot open ({type(exc).__name__}: {exc})")
        return None
    try:
        with h5file:
            return _check_open_segment(report, where, h5file, read_data)
    except DumpError as exc:  # refused before reading: links, external storage, size claims
        report.problem(where, f"refused: {exc}")
        return None
    except Exception as exc:  # damage the structural checks did not anticipate
        report.problem(where, f"unreadable ({type(exc).__name__}: {exc})")
        return None


def _check_objects(h5file, where: str) -> dict:
    """Raise DumpError for anything that would make reading touch data outside this file or
    allocate more than it holds: links other than hard links, external or virtual storage,
    filters, size claims beyond the file (checked before any table or block is read). Return
    ``{block key: (attributes, shape, storage dtype, file offset of its rows)}``, each asked of HDF5 once, with h5py's
    low-level calls as the reader does (a wide pass has a block per name, and h5py's ``blocks[key]``
    and ``attrs[name]`` cost ~0.4 ms a block in wrapping and second opens; each shape or dtype asked
    makes a new HDF5 id). The blocks are not kept open: 20k open datasets held ~280 MB of HDF5
    memory."""
    from h5py import h5i, h5o

    from ..reader import DumpError, check_dataset, check_link, read_attrs

    file_size = os.stat(h5file.filename).st_size
    for name in (fmt.NAMES, fmt.INDEX, fmt.PASSES, fmt.PASS_META):
        check_link(h5file, name, where)
        check_dataset(h5file[name], file_size, f"{where} {name!r}")
    check_link(h5file, fmt.BLOCKS, where)
    blocks = h5file[fmt.BLOCKS]
    attributes = {}
    for key in blocks:
        block_where = f"{where} block {key}"
        check_link(blocks, key, f"{where} {fmt.BLOCKS!r}")
        block = h5o.open(blocks.id, key.encode("utf-8"))
        if h5i.get_type(block) != h5i.DATASET:
            raise DumpError(f"{block_where}: not a dataset")
        shape, storage = check_dataset(block, file_size, block_where)
        # (+ where its rows lie, for --data: read there, not through a second handle per block)
        offset = block.get_offset() if math.prod(shape) else None
        attributes[key] = (read_attrs(block, file_size, block_where), shape, storage, offset)
    return attributes


def _check_open_segment(report: _Report, where: str, h5file, read_data: bool):
    from ..reader import DumpError, check_tables, read_attrs, read_block_rows, vfd

    attrs = read_attrs(h5file, os.stat(h5file.filename).st_size, where)  # sizes checked first
    fmt_name = attrs.get("format")
    if fmt_name != fmt.FORMAT_NAME:
        report.problem(where, f"not a fastdump segment (format attribute {fmt_name!r})")
        return None
    version = attrs.get("format_version")
    if not isinstance(version, int) or version not in fmt.READABLE_VERSIONS:
        report.problem(where, f"format version {version!r} is not one of {list(fmt.READABLE_VERSIONS)}")
        return None
    for needed in (fmt.NAMES, fmt.INDEX, fmt.PASSES, fmt.PASS_META, fmt.BLOCKS):
        if needed not in h5file:
            report.problem(where, f"missing {needed!r}")
            return None
    block_facts = _check_objects(h5file, where)
    if read_data and version < 2:
        report.warning(where, f"format {version}: no checksums, data read but not checked")
    names_text = h5file[fmt.NAMES][()]
    names = json.loads(names_text)
    index = h5file[fmt.INDEX][()]
    passes = h5file[fmt.PASSES][()]
    pass_meta = h5file[fmt.PASS_META][()]
    if index.dtype != fmt.INDEX_DTYPES[version] or passes.dtype != fmt.PASS_DTYPE:
        report.problem(where, "index or passes table has an unexpected layout")
        return None
    if version >= 3:  # the tables say which data is whose; a relabelled row keeps its data's CRC
        try:
            check_tables(attrs, names_text, index, passes, pass_meta, where)
        except DumpError as exc:
            report.problem(where, str(exc).removeprefix(where + ": "))
    else:
        report.warning(where, f"format {version}: the tables carry no checksum (a relabelled index row "
                              "would go unseen)")
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        report.problem(where, "the name table is not a JSON list of strings")
        return None
    repeated = [n for n, count in collections.Counter(names).items() if count > 1]
    if repeated:  # two slots, one name: their tensors are mixed under that name
        report.problem(where, f"the name table lists {repeated[0]!r} more than once")
    if len(pass_meta) != len(passes):
        report.problem(where, f"{len(pass_meta)} pass_meta entries for {len(passes)} passes")
    explained = set()  # passes stored not complete whose capture side said why
    sent = {}  # pass id -> (its end record's count of the tensors sent, those the writer did not store,
    #                        whether the capture side said it is not whole)
    for row, text in zip(passes, pass_meta):
        try:
            entry = json.loads(text)
        except (ValueError, RecursionError):
            report.problem(where, "pass_meta entry is not JSON")
            break
        _check_pass_reports(report, where, int(row["pass"]), entry)
        if isinstance(entry, dict) and entry.get("incomplete"):
            explained.add(int(row["pass"]))
        counted = _sent_count(report, where, int(row["pass"]), entry, bool(row["complete"]), version)
        if counted is not None:
            sent[int(row["pass"])] = counted
    if len(index) and (index["name"].min() < 0 or index["name"].max() >= len(names)):
        report.problem(where, "index refers to a name outside the name table")

    # (only keys as the writer spells numbers: '01' or '²' would not name block 1 or 2)
    block_numbers = sorted(int(key) for key in block_facts if key.isascii() and key.isdigit() and str(int(key)) == key)
    blocks_id = h5file[fmt.BLOCKS].id
    if len(block_numbers) != len(block_facts) or block_numbers != list(range(len(block_numbers))):
        report.problem(where, "blocks are not numbered 0..n-1")
    unknown = set(np.unique(index["block"]).tolist()) - set(block_numbers)
    if unknown:
        report.problem(where, f"index refers to missing block(s) {sorted(unknown)[:5]}")
    rows_by_block = _index_rows_by_block(index)
    positions_of = None  # each block's index positions, ascending: grouped once, for --data only
    if read_data:
        fd = vfd(h5file)  # (what the rows are read through)
        by_block = np.argsort(index["block"], kind="stable")
        numbers, starts = np.unique(index["block"][by_block], return_index=True)
        positions_of = dict(zip(numbers.tolist(), np.split(by_block, starts[1:])))
    row_bytes_of = np.zeros(len(block_numbers), dtype=np.int64)
    for k, number in enumerate(block_numbers):
        before = len(report.problems)
        row_bytes_of[k] = _check_block(report, f"{where} block {number}", block_facts[str(number)],
                                       rows_by_block.get(number, _NO_ROWS), number, version)
        if read_data and len(report.problems) == before:  # rows known to lie inside the block
            _, shape, storage, offset = block_facts[str(number)]

            def read_rows(start, stop, number=number, shape=shape, storage=storage, offset=offset):
                return read_block_rows(fd, blocks_id, number, offset, shape[1:], storage, start, stop - start,
                                       f"{where} block {number}")
            _read_block(report, f"{where} block {number}", read_rows, row_bytes_of[k], index,
                        positions_of.get(number, np.empty(0, dtype=np.int64)))
    # each index row's bytes: its rows times its block's row size (0 for a block not there)
    numbers = np.array(block_numbers, dtype=np.int64)
    at = np.minimum(np.searchsorted(numbers, index["block"]), max(len(numbers) - 1, 0))
    known = (numbers[at] == index["block"]) if len(numbers) else np.zeros(len(index), dtype=bool)
    entry_bytes = np.where(known, index["rows"] * (row_bytes_of[at] if len(numbers) else 0), 0).astype(np.int64)

    pass_ids = passes["pass"].tolist()
    if len(set(pass_ids)) != len(pass_ids):
        report.problem(where, "a pass id appears twice in the passes table")
    _check_unique_names(report, where, index, names)
    stray = set(np.unique(index["pass"]).tolist()) - set(pass_ids)
    if stray:
        report.problem(where, f"tensors of passes missing from the passes table: {sorted(stray)[:5]}")
    # each pass's index rows and bytes, in one pass over the index (a mask per pass was O(passes x rows))
    index_passes, inverse = np.unique(index["pass"], return_inverse=True)
    pass_bytes = np.zeros(len(index_passes), dtype=np.int64)
    np.add.at(pass_bytes, inverse.reshape(-1), entry_bytes)  # (integers: a float sum would round)
    tensors_of = dict(zip(index_passes.tolist(),
                          np.bincount(inverse.reshape(-1), minlength=len(index_passes)).tolist()))
    bytes_of = dict(zip(index_passes.tolist(), pass_bytes.tolist()))
    for row in passes:
        pass_id = int(row["pass"])
        tensors, nbytes = tensors_of.get(pass_id, 0), bytes_of.get(pass_id, 0)
        if tensors != int(row["tensors"]) or nbytes != int(row["bytes"]):
            report.problem(where, f"pass {pass_id}: {tensors} tensors / {nbytes} bytes in the index, table says "
                                  f"{int(row['tensors'])} / {int(row['bytes'])}")
    summary = {
        "first_pass": min(pass_ids) if pass_ids else None,
        "last_pass": max(pass_ids) if pass_ids else None,
        "passes": len(pass_ids),
        "tensors": len(index),
        "bytes": int(passes["bytes"].sum()),
        "incomplete": [int(row["pass"]) for row in passes if not row["complete"]],
    }
    stored_summary = dict(summary)
    summary["pass_ids"] = pass_ids
    summary["unexplained"] = set(summary["incomplete"]) - explained
    summary["pass_tensors"] = {pass_id: tensors_of.get(pass_id, 0) for pass_id in pass_ids}
    summary["sent"] = sent
    summary["session"] = attrs.get(fmt.ATTR_SESSION)
    summary["version"] = version  # (whether that attribute must be there: format.session_required)

    def names_of(pass_id):  # a pass the writer flushed unfinished continues in the next segment
        slots = index["name"][index["pass"] == pass_id].tolist()
        return [names[s] if 0 <= s < len(names) else s for s in slots]

    summary["names_of"] = names_of
    number = fmt.segment_number(os.path.basename(where))
    stored = attrs.get("segment", number)
    if not isinstance(stored, int) or stored != number:  # a renamed or copied-in file
        report.problem(where, f"attribute segment={_printable(repr(stored)):.80} but the file name says {number}")
    for key in ("first_pass", "last_pass", "passes", "tensors", "bytes"):
        stored = attrs.get(key)
        if isinstance(stored, int) and stored_summary[key] is not None and int(stored) != stored_summary[key]:
            report.problem(where, f"attribute {key}={int(stored)} but the tables say {summary[key]}")
    return summary


def _check_pass_reports(report: _Report, where: str, pass_id: int, entry) -> None:
    """What the capture side said about a pass: mixed tensors of concurrent forwards fail the dump
    (they cannot be told apart); other reasons a pass is incomplete (a forward that raised, a
    dangling manual pass) are reported, and so is pass metadata the capture side could not keep."""
    if not isinstance(entry, dict):
        return
    meta = entry.get("meta")
    if isinstance(meta, dict) and meta.get("fastdump_meta_error"):
        report.warning(where, f"pass {pass_id}: metadata not kept: {_printable(str(meta['fastdump_meta_error']))}")
    if not entry.get("incomplete"):
        return
    reason = _printable(str(entry["incomplete"]))
    if entry.get("mixed"):
        report.problem(where, f"pass {pass_id} mixes tensors of several forwards: {reason}")
    else:
        report.warning(where, f"pass {pass_id} is incomplete: {reason}")


def _sent_count(report: _Report, where: str, pass_id: int, entry, complete: bool, version: int):
    """(the count of tensors its producer sent that a pass's end record gave, fmt.PASS_SENT; the
    tensors the writer recorded as not stored, fmt.not_stored_by_writer; whether the capture side
    marked the pass incomplete), or None where the pass
    has none to be held to: a segment before format 6 (checked as before), a pass whose end never
    reached the writer (stored complete = 0 without a reason: a part flushed unfinished, a lost or
    interrupted end). In a format-6 segment a pass that ended without one is a problem: the count
    was taken out (with tensors added or removed, it would leave nothing to hold them to)."""
    if not isinstance(entry, dict):
        return None
    count = entry.get(fmt.PASS_SENT)
    if count is None:
        if version >= fmt.PASS_SENT_VERSION and (complete or entry.get("incomplete")):
            report.problem(where, f"pass {pass_id} ended without a count of the tensors its producer sent: a "
                                  f"format-{version} writer stores one with every pass that ended; taken out")
        return None
    if not _is_count(count):
        report.problem(where, f"pass {pass_id}: its count of the tensors sent is "
                              f"{_printable(json.dumps(count))[:40]}, not a count (an integer >= 0)")
        return None
    skipped = entry.get("skipped") if isinstance(entry.get("skipped"), list) else []
    not_stored = sum(1 for e in skipped if isinstance(e, dict) and fmt.not_stored_by_writer(str(e.get("reason", ""))))
    return count, not_stored, bool(entry.get("incomplete"))


def _check_sent_counts(report: _Report, path: str, on_disk: list, summaries: dict) -> None:
    """Each pass's rows on disk (its parts' in every segment: a pass flushed unfinished continues in
    the next) against its end record's count of the tensors its producer sent. More: tensors it
    never sent were written into it (crafted, or leaked from elsewhere), with rows and CRCs that pass
    every other check. Fewer, beyond those the writer recorded as not stored: tensors were lost.
    A pass the capture side marked incomplete gets a warning instead: its end may have been sent
    while a tensor was still being staged into it (close() from another thread inside its forward,
    forwards of several threads, Ctrl-C between a tensor's staging and its count), and the pass is
    reported as not whole already."""
    stored, counts = collections.Counter(), {}
    for _, name in on_disk:
        summary = summaries.get(name)
        if summary is not None:
            stored.update(summary["pass_tensors"])
            counts.update(summary["sent"])  # (the part its end reached: the last)
    for pass_id, (sent, not_stored, incomplete) in sorted(counts.items()):
        have = stored[pass_id]
        said = f"pass {pass_id}: {have} tensors on disk, but its producer sent {sent} (its end record's count)"
        say = report.warning if incomplete else report.problem
        if have > sent:
            say(path, f"{said}: tensors it never sent were written into it" + _NOT_WHOLE * incomplete)
        elif have + not_stored < sent:
            kept_out = f", {not_stored} of them not stored by the writer (its skipped list says why)"
            say(path, f"{said}{kept_out if not_stored else ''}: tensors were lost" + _NOT_WHOLE * incomplete)


_NOT_WHOLE = (" (the pass is marked incomplete: a tensor staged as its end was sent, by another thread or "
              "around a Ctrl-C, is counted on one side only)")


def _read_block(report: _Report, where: str, read_rows, row_bytes: int, index: np.ndarray, positions: np.ndarray,
                read_bytes: int = 64 << 20) -> None:
    """Read every byte of a block (catches I/O errors) and check each tensor's CRC32C (format 2),
    a few tensors per read so that memory stays bounded by ``read_bytes`` plus one tensor.
    ``read_rows(start, stop)``: the block's rows start..stop as stored."""
    from ..reader import row_checksum

    has_crc = "crc32c" in index.dtype.names
    row_bytes = max(1, int(row_bytes))
    positions = positions[np.argsort(index["first_row"][positions], kind="stable")]
    i = 0
    while i < len(positions):
        j, start = i, int(index["first_row"][positions[i]])
        stop = start
        while j < len(positions) and (j == i or (stop - start) * row_bytes < read_bytes):
            stop = int(index["first_row"][positions[j]] + index["rows"][positions[j]])
            j += 1
        rows = read_rows(start, stop)
        if has_crc:
            for position in positions[i:j].tolist():
                first = int(index["first_row"][position]) - start
                part = rows[first:first + int(index["rows"][position])]
                if row_checksum(part) != int(index["crc32c"][position]):
                    report.problem(where, f"index row {position} (pass {int(index['pass'][position])}): "
                                          "checksum mismatch: the data changed after it was written")
        i = j


def _check_status(report: _Report, path: str, info: dict) -> str:
    """Only ``closed`` (written only once everything was on disk) passes. Returns the status."""
    status = info.get("status", "unknown")
    if not isinstance(status, str):
        report.problem(path, f"{fmt.RANK_FILE} status is not a string: {status!r}")
        return "unknown"
    error = info.get("error")
    if status == "error":
        report.problem(path, f"writer status error: {_printable(error)}")
    elif status in fmt.UNFINISHED_STATUS_WHY:
        gone = " (its process is gone)" if status == "running" and _pid_gone(info) else ""
        report.problem(path, f"status {status}{gone}: {fmt.UNFINISHED_STATUS_WHY[status]}")
    elif status != "closed":
        report.problem(path, f"status {_printable(status)!r}: not a finished dump")
    if error and status != "error":
        report.problem(path, f"status {_printable(status)}, but an error was recorded: {_printable(error)}")
    return status


def _check_unique_names(report: _Report, where: str, index, names) -> None:
    """Two tensors under one name in one pass are mixed data (the capture layer names every call
    and element uniquely): the reader would have to rename one, and nobody could tell which is which."""
    if not len(index):
        return
    keys = np.stack([index["pass"].astype(np.int64), index["name"].astype(np.int64)], axis=1)
    unique, counts = np.unique(keys, axis=0, return_counts=True)
    repeated, times = unique[counts > 1], counts[counts > 1]
    for (pass_id, slot), count in zip(repeated[:5].tolist(), times[:5].tolist()):
        name = names[slot] if isinstance(names, list) and 0 <= slot < len(names) else slot
        report.problem(where, f"pass {pass_id}: {count} tensors named {name!r} (mixed: which is which is lost)")
    if len(repeated) > 5:
        report.problem(where, f"... and {len(repeated) - 5} more names repeated within a pass")


def _check_counts(report: _Report, path: str, info: dict, pass_ids: set, tensors: int) -> None:
    """The Dumper's own counts (rank.json ``stats``, sent at close) against what is on disk: a
    pass or tensor it handed over that is not on disk is lost. Drops under policy "drop" are
    reported, not failed: that policy drops by design and counts them. Under "block" (the default,
    which loses nothing while the writer keeps up) a drop means the writer fell behind for longer
    than block_timeout_s, or CUDA-graph replays outran the drain: the dump is not whole, and fails."""
    stats = info.get("stats") if isinstance(info.get("stats"), dict) else {}

    def count(obj: dict, key: str, where: str = "") -> int:
        """A count rank.json holds: what is missing is 0, anything but an integer >= 0 a problem
        (a damaged count must not pass for none: 4.0 passes sent, or -5 dropped)."""
        value = obj.get(key, 0)
        if not _is_count(value):
            report.problem(path, f"{fmt.RANK_FILE} {where}{key} is {_printable(json.dumps(value))[:40]}, "
                                 "not a count (an integer >= 0)")
            return 0
        return value

    passes_sent, tensors_sent = count(stats, "passes", "stats."), count(stats, "tensors", "stats.")
    if len(pass_ids) < passes_sent:
        report.problem(path, f"the Dumper dumped {passes_sent} passes; {len(pass_ids)} are on disk")
    skipped = count(info, "skipped")
    reasons = info.get("skipped_reasons") if isinstance(info.get("skipped_reasons"), dict) else {}
    torn = count(reasons, fmt.TORN_TENSOR_REASON, "skipped_reasons.")  # (rank.json before lost_tensors)
    lost = max(count(info, "lost_tensors"), torn)
    if lost:  # staged, then lost: a skip that explains the missing tensor would hide the loss
        report.problem(path, f"{lost} staged tensor(s) were lost after they were accepted: torn (part of their "
                             "copies failed, a CUDA drain error) or not stored by the writer (each pass's "
                             "skipped list says which and why); they are not on disk")
    lost = count(stats, "lost_at_close", "stats.")
    if lost:
        report.problem(path, f"{lost} staged tensor(s) were lost at close: a CUDA-graph capture still "
                             "running on another stream held their batch")
        tensors += lost  # explained above; the count below looks for any other loss
    if tensors + skipped < tensors_sent:
        report.problem(path, f"the Dumper staged {tensors_sent} tensors; {tensors} are on disk "
                             f"({skipped} recorded as skipped)")
    graphs = count(stats, "graphs_not_dumped", "stats.")
    if graphs:
        report.problem(path, f"{graphs} CUDA graph(s) captured while dumping cannot be dumped: their replays ran "
                             "unseen (see the capture pass's incomplete reason)")
    compiled = count(stats, "compiled_not_dumped", "stats.")
    if compiled:
        report.problem(path, f"{compiled} dumped module(s) were compiled into graphs that may not break "
                             "(torch.compile fullgraph=True): that compiled code ran undumped")
    _check_not_followed(report, path, stats.get("modules_not_followed", []))
    config = info.get("config") if isinstance(info.get("config"), dict) else {}
    dropped, dropped_passes = count(info, "dropped"), count(info, "dropped_passes")
    if dropped or dropped_passes:
        counts = f"{dropped} tensor(s) and {dropped_passes} whole pass(es) were dropped (counted, not dumped)"
        if config.get("policy") == "drop":
            report.warning(path, f"policy 'drop': {counts}")
        else:
            report.problem(path, f"policy {config.get('policy', 'block')!r}: {counts}: the writer fell behind "
                                 "for longer than block_timeout_s, or CUDA-graph replays outran the drain")
    # A pass end the ring refused and that never reached the writer in time (its passes are stored
    # complete = 0): their drop counts, metadata and skips are nowhere on disk. Like a drop, it is
    # the `drop` policy's to accept; under `block` the dump is not whole.
    ends = count(stats, "lost_pass_ends", "stats.") + count(info, "late_pass_ends_left_out")
    if ends:
        text = (f"{ends} pass end(s) never reached the writer in time (ring full): those passes are stored "
                "incomplete, without their drop counts, metadata and skips")
        if config.get("policy") == "drop":
            report.warning(path, f"policy 'drop': {text}")
        else:
            report.problem(path, text)


def _check_not_followed(report: _Report, path: str, edits) -> None:
    """Module edits after attach the Dumper could not follow (rank.json ``stats.modules_not_followed``,
    its check at close: a direct write to a module's ``_modules``): a selected module no wrapper
    dumped, or one dumped under a name the model no longer had for it."""
    if not isinstance(edits, list) or not all(isinstance(edit, str) for edit in edits):
        report.problem(path, f"{fmt.RANK_FILE} stats.modules_not_followed is "
                             f"{_printable(json.dumps(edits))[:40]}, not a list of texts")
    elif edits:
        shown = "; ".join(_printable(edit) for edit in edits[:5]) + (f"; ... and {len(edits) - 5} more" if len(edits) > 5 else "")
        report.problem(path, f"{len(edits)} module edit(s) after attach fastdump could not follow: their outputs are "
                             f"missing, or dumped under a name that no longer leads to them: {shown}")


def _check_producer_error(report: _Report, path: str, status: str) -> str:
    """producer_error.json exists only when the serving process stopped dumping and could not tell
    the writer: always a problem. Returns the rank's status with it taken into account."""
    perr_file = os.path.join(path, fmt.PRODUCER_ERROR_FILE)
    try:
        record = fsutil.load_json(perr_file)
    except FileNotFoundError:
        return status
    except (OSError, ValueError) as exc:
        report.problem(perr_file, str(exc))
        return "error"
    error = record.get("error") if isinstance(record, dict) else record
    report.problem(path, f"the serving process stopped dumping ({fmt.PRODUCER_ERROR_FILE}): {_printable(error)}")
    # a writer that was stopped or killed may leave temporary files: what a kill leaves
    return status if status in _UNFINISHED_STATUSES else "error"


def check_rank_dir(report: _Report, path: str, read_data: bool = False) -> dict | None:
    """Checks one rank directory into ``report``. Returns its rank.json's checked rank numbers (None
    when it has none that check)."""
    rank_file = os.path.join(path, fmt.RANK_FILE)
    try:
        info = fsutil.load_json(rank_file)
    except FileNotFoundError:
        report.problem(path, f"{fmt.RANK_FILE} missing")
        info = {}
    except (OSError, ValueError) as exc:
        report.problem(rank_file, str(exc))
        info = {}
    if not isinstance(info, dict):
        report.problem(rank_file, f"not a JSON object ({type(info).__name__})")
        info = {}
    status = _check_status(report, path, info)
    status = _check_producer_error(report, path, status)
    numbers = None
    if "rank" in info:
        try:
            numbers = fmt.check_rank_numbers(info["rank"])
        except ValueError as exc:
            report.problem(rank_file, str(exc))
        else:
            mismatch = fmt.rank_dir_mismatch(os.path.basename(path), numbers)
            if mismatch:  # mixed: read by number, diffed or exported, it is the wrong rank
                report.problem(path, mismatch)

    entries = os.listdir(path)
    for entry in sorted(entries):
        if fsutil.is_temp_name(entry):
            text = f"leftover temporary file {entry}"
            if status in _UNFINISHED_STATUSES:
                report.warning(path, text + f" (status {status}: what an interrupted writer leaves)")
            else:
                report.problem(path, text)

    on_disk = sorted((fmt.segment_number(e), e) for e in entries if fmt.segment_number(e) is not None)
    summaries = {}
    for _, name in on_disk:
        summary = check_segment(report, os.path.join(path, name), read_data)
        if summary is not None:
            summaries[name] = summary

    expected = fmt.expected_session(os.path.basename(path), info)
    for name, summary in summaries.items():
        foreign = fmt.foreign_session(summary["session"], expected, fmt.session_required(info, summary["version"]))
        if foreign:  # mixed: its passes would read as this session's
            report.problem(os.path.join(path, name), foreign)

    _check_segment_list(report, path, info, status, on_disk, summaries)
    version = info.get("format_version")
    if _is_count(version) and version >= fmt.PASS_SENT_VERSION:
        for name, summary in summaries.items():
            if summary["version"] < fmt.PASS_SENT_VERSION:  # (no CRC covers the version attribute)
                report.problem(os.path.join(path, name), f"a format-{summary['version']} segment in a rank directory "
                                                         f"whose {fmt.RANK_FILE} says format {version}, whose writer "
                                                         "writes no other: its passes' counts of the tensors sent "
                                                         "taken out, the version set back")

    pass_ids = set()
    unexplained = set()  # passes whose last part on disk is not complete, with no reason given
    for _, name in on_disk:
        summary = summaries.get(name)
        if summary is not None:
            unexplained = (unexplained - set(summary["pass_ids"])) | summary["unexplained"]
            pass_ids.update(summary["pass_ids"])
    _check_counts(report, path, info, pass_ids, sum(summary["tensors"] for summary in summaries.values()))
    _check_sent_counts(report, path, on_disk, summaries)
    if unexplained and status not in _UNFINISHED_STATUSES:
        first = sorted(unexplained)
        report.warning(path, f"{len(first)} pass(es) stored incomplete without a reason (their end never reached "
                             f"the writer: dropped from a full ring, or cut off by Ctrl-C), e.g. pass {first[0]}")

    _check_pass_order(report, path, on_disk, summaries)
    return numbers


def _check_segment_list(report: _Report, path: str, info: dict, status: str, on_disk: list,
                        summaries: dict) -> None:
    """The segment list (segments.jsonl, or rank.json's before format 5) against the segment files
    ``on_disk`` ((number, name), sorted) and their ``summaries``, and rank.json's totals against it."""
    on_disk_names = {name for _, name in on_disk}
    listed = {}
    segments, why, tail = segment_list.read(path, info)
    listing = fmt.SEGMENT_LIST_FILE if segment_list.appended(info) else fmt.RANK_FILE  # where the list is
    if why:
        report.problem(path, why)
    if tail:  # a writer killed between appending a segment's line and rank.json; never a closed one
        text = f"{fmt.SEGMENT_LIST_FILE} holds {tail} bytes after the lines {fmt.RANK_FILE} commits"
        if status in _UNFINISHED_STATUSES or status == "error":  # (an append that failed leaves one too)
            report.warning(path, text + f" (status {status}: what an interrupted writer leaves; not read)")
        else:
            report.problem(path, text)
    highest = -1  # the highest segment number listed so far
    for item in segments:
        if not isinstance(item, dict):
            report.problem(path, f"{listing} segments entry is not an object: {item!r:.80}")
            continue
        if not isinstance(item.get("file"), str):
            report.problem(path, f"{listing} segments entry without a file name: {item!r:.80}")
            continue
        if item["file"] in listed:  # (a list the writer got wrong: its totals would count the file twice)
            report.problem(path, f"{item['file']} is listed twice in {listing}")
            continue
        number = fmt.segment_number(item["file"])
        if number is not None and number < highest:
            report.problem(path, f"{listing} lists {item['file']} after a later segment (it lists them in "
                                 "write order)")
        highest = max(highest, -1 if number is None else number)
        listed[item["file"]] = item
        if item["file"] not in on_disk_names:
            report.problem(path, f"{item['file']} is listed in {listing} but missing")
            continue
        found = summaries.get(item["file"])
        if found is None:
            continue
        for key in ("first_pass", "last_pass", "passes", "tensors", "bytes"):
            if key in item and item[key] != found[key]:
                report.problem(path, f"{item['file']}: {listing} says {key}={item[key]}, file has {found[key]}")
    for _, name in on_disk:
        if name not in listed:
            text = f"{name} is not listed in {listing}"
            if status in _UNFINISHED_STATUSES:
                report.warning(path, text + f" (status {status})")
            else:
                report.problem(path, text)
    if listed and status not in _UNFINISHED_STATUSES:
        for key in ("passes", "tensors", "bytes"):
            total = sum(_count(item.get(key, 0)) for item in listed.values())
            if key in info and info[key] != total:
                report.problem(path, f"{fmt.RANK_FILE} total {key}={info[key]} but its segments add up to {total}")


def _check_pass_order(report: _Report, path: str, on_disk: list, summaries: dict) -> None:
    """Segments cover disjoint, increasing pass ranges, eager passes and CUDA-graph replays each on
    their own: replays are numbered from GRAPH_PASS_BASE and arrive between eager passes, so one
    segment may hold eager passes 0..5 and replays B..B+3, the next 6..9 and B+4..B+7. The one
    allowed overlap: a pass the writer had to flush before it ended (marked incomplete) continues
    in the next segment. A continued pass must not repeat a name across its parts either (mixed
    data, as within one segment: _check_unique_names)."""
    for replays in (False, True):
        previous, carried = None, []  # carried: the names of the continued pass so far
        for _, name in on_disk:
            summary = summaries.get(name)
            ids = [p for p in summary["pass_ids"] if (p >= protocol.GRAPH_PASS_BASE) == replays] if summary else []
            if not ids:
                continue
            first, last = min(ids), max(ids)
            continued = False
            if previous is not None:
                prev_name, prev_first, prev_last, prev_incomplete = previous
                continued = first == prev_last and prev_last in prev_incomplete
                if first <= prev_last and not continued:
                    report.problem(path, f"{name} passes {first}..{last} overlap {prev_name} passes "
                                         f"{prev_first}..{prev_last}")
            first_names = summary["names_of"](first)
            if continued:
                again = sorted(set(carried) & set(first_names), key=str)
                if again:
                    report.problem(path, f"pass {first}: tensors named {again[0]!r} in both {name} and an "
                                         f"earlier segment ({len(again)} name(s); mixed: which is which is lost)")
                carried = carried + first_names
            else:
                carried = first_names
            if last != first:
                carried = summary["names_of"](last)
            previous = (name, first, last, summary["incomplete"])


def verify_dump(root: str, read_data: bool = False) -> _Report:
    report = _Report()
    root = os.path.abspath(root)
    why = fsutil.why_not_a_directory(root)  # ("no such directory" was said of /dev/null and a FIFO too)
    if why:
        report.problem(root, why)
        return report
    rank_dirs = []

    def listed(path: str):
        """A directory's entries; one that cannot be listed is a problem (its ranks go unchecked): None."""
        try:
            return sorted(os.listdir(path))
        except OSError as exc:
            report.problem(path, f"cannot list: {exc.strerror or exc}")
            return None

    from ..reader import lost_records, recorded_roles

    roles = _role_names(root) - set(recorded_roles(root))  # (those recorded: lost_records below)
    for role in listed(root) or ():
        role_path = os.path.join(root, role)
        if os.path.islink(role_path):
            report.problem(role_path, "symbolic link: not followed (it may point out of the dump)")
            continue
        if role in fmt.ROOT_NAMES:  # (fastdump.json, the records of the roles and sessions: lost_records)
            continue
        if not os.path.isdir(role_path):
            # A root may hold other files (notes, a launcher's log), but not one named as a role:
            # that role's directory was replaced, and whatever it held is not here.
            if role in roles:
                report.problem(role_path, "named as a role but not a directory: that role's dump is not here")
            continue
        for rank in listed(role_path) or ():
            rank_path = os.path.join(role_path, rank)
            if os.path.islink(rank_path):
                report.problem(rank_path, "symbolic link: not followed (it may point out of the dump)")
                continue
            entries = listed(rank_path) if os.path.isdir(rank_path) else None
            if entries is None:
                if fmt.parse_rank_dir(rank) and not os.path.isdir(rank_path):
                    # A session's name on a file, a FIFO...: its directory was replaced or never
                    # made by fastdump; whatever that session wrote is not here.
                    report.problem(rank_path, "named as a session's directory but not a directory: that "
                                              "session's dump is not here")
                continue
            if any(e in (fmt.RANK_FILE, fmt.PRODUCER_ERROR_FILE) or fmt.segment_number(e) is not None
                   or fsutil.is_temp_name(e) for e in entries):
                rank_dirs.append(rank_path)
            elif fmt.parse_rank_dir(rank):
                # A session's directory is made at attach; its writer then writes rank.json. Without
                # any file the session recorded nothing at all (a full disk at its start, say).
                report.problem(rank_path, "a session directory with no rank.json, producer_error.json or "
                                          "segment: this session recorded nothing (not even why)")
    for path, text in lost_records(root):  # a role or session attached here, then replaced, emptied or deleted
        report.problem(path, text)
    if not rank_dirs:
        from ..reader import wrong_root_hint

        hint = wrong_root_hint(root)
        report.problem(root, "no rank directories (expected <root>/<role>/<rank>/rank.json)"
                       + (f"; {hint}" if hint else ""))
    numbers = {rank_path: check_rank_dir(report, rank_path, read_data) for rank_path in rank_dirs}
    _check_sessions_attached_here(report, root, rank_dirs)
    _warn_of_absent_ranks(report, root, numbers)
    _check_manifest(report, root)
    return report


def _check_sessions_attached_here(report: _Report, root: str, rank_dirs: list) -> None:
    """Each rank directory is a session attached to this root, once. Every session's Dumper records
    itself (``fastdump.sessions/<role>/<rank directory>``) before its writer starts, so in a role
    whose sessions are recorded, a directory of a session not recorded was copied in from another
    dump (its segments carry its own session, so every other check passed); and two directories of
    one session (by name, else by rank.json, as segments are matched) are one session copied under
    another name: its passes would be read, diffed and exported twice."""
    seen: dict = {}  # (role, session) -> the first rank directory holding it
    records: dict = {}  # role -> (recorded rank directory names, their sessions), or None: no record
    for rank_path in rank_dirs:
        role_path, name = os.path.split(rank_path)
        role = os.path.basename(role_path)
        try:
            info = fsutil.load_json(os.path.join(rank_path, fmt.RANK_FILE))
        except (OSError, ValueError):
            info = None  # (check_rank_dir said why)
        session = fmt.expected_session(name, info if isinstance(info, dict) else {})
        if session is not None:
            if (role, session) in seen:
                report.problem(rank_path, f"session {_printable(session)} again: {seen[role, session]} holds it "
                                          "too (one session's directory copied under another name: its passes "
                                          "would be read twice)")
            seen.setdefault((role, session), rank_path)
        if role not in records:
            record = os.path.join(root, fmt.SESSIONS_DIR, role)
            try:  # (a root, or a role, from before the record: nothing to check against)
                recorded = {entry for entry in os.listdir(record) if not fsutil.is_temp_name(entry)} \
                    if fsutil.is_real_dir(record) else None
            except OSError:
                recorded = None  # (lost_sessions says what cannot be listed)
            records[role] = recorded and (recorded, {(fmt.parse_rank_dir(e) or (None,) * 5)[4] for e in recorded})
        if not records[role]:
            continue
        recorded, recorded_sessions = records[role]
        if name not in recorded and (session is None or session not in recorded_sessions):
            report.problem(rank_path, f"a session {os.path.join(fmt.SESSIONS_DIR, role)} does not record as "
                                      "attached to this root (every Dumper records its session before writing): "
                                      "copied in from another dump")


def _role_names(root: str) -> set:
    """Names a role directory of this root has: the standard roles and fastdump.json's role."""
    try:  # (a damaged one is _check_manifest's problem)
        manifest = fsutil.load_json(os.path.join(root, fmt.MANIFEST_FILE))
    except (OSError, ValueError):
        manifest = {}
    config = manifest.get("config") if isinstance(manifest, dict) else None
    role = config.get("role") if isinstance(config, dict) else None
    return set(fmt.STANDARD_ROLES) | ({role} if isinstance(role, str) and role else set())


def _check_manifest(report: _Report, root: str) -> None:
    """fastdump.json, the run's record (config, command, versions): it may be absent (a root whose
    first Dumper wrote none), but one that is there and damaged, a directory or a FIFO was passed
    as OK while ls warned about it."""
    path = os.path.join(root, fmt.MANIFEST_FILE)
    if not os.path.lexists(path):
        return
    try:
        manifest = fsutil.load_json(path)
    except (OSError, ValueError) as exc:
        report.problem(path, str(exc))
        return
    if not isinstance(manifest, dict):
        report.problem(path, f"not a JSON object ({type(manifest).__name__})")
        return
    _check_manifest_session(report, root, path, manifest)


def _check_manifest_session(report: _Report, root: str, path: str, manifest: dict) -> None:
    """fastdump.json's ``config`` is the config of the session it names (``session``: the Dumper
    that made it), which that session's rank.json holds too: a record replaced by another process's
    (two attaching at once rewrote it), copied from another root or edited names one config while
    its session ran with another. A root from before the record names no session: nothing to check."""
    if fmt.MANIFEST_SESSION not in manifest:
        return
    session = manifest[fmt.MANIFEST_SESSION]
    role = session.get("role") if isinstance(session, dict) else None
    name = session.get("rank_dir") if isinstance(session, dict) else None
    if not (isinstance(role, str) and isinstance(name, str) and fmt.parse_rank_dir(name)
            and role not in fmt.ROOT_NAMES and "/" not in role and role not in ("", ".", "..")):
        report.problem(path, f"its session is {_printable(json.dumps(session))[:120]}, not a role and rank "
                             "directory name")
        return
    rank_path = os.path.join(root, role, name)
    if not fsutil.is_real_dir(rank_path):  # (renamed during its run: found by its session, as lost_sessions does)
        session_id = fmt.parse_rank_dir(name)[4]
        try:
            renamed = [entry for entry in sorted(os.listdir(os.path.join(root, role))) if session_id
                       and (fmt.parse_rank_dir(entry) or (None,) * 5)[4] == session_id]
        except OSError:
            renamed = []
        rank_path = os.path.join(root, role, renamed[0]) if renamed else rank_path
    if not fsutil.is_real_dir(rank_path):
        # (removed, or moved during its run: the lost-session record says which, where it is kept)
        report.warning(path, f"its session {_printable(role)}/{_printable(name)} is not here: its config cannot be "
                             f"held against that session's {fmt.RANK_FILE}")
        return
    try:
        info = fsutil.load_json(os.path.join(rank_path, fmt.RANK_FILE))
    except (OSError, ValueError):
        return  # (check_rank_dir said what is wrong with it)
    ran = info.get("config") if isinstance(info, dict) else None
    if not isinstance(ran, dict):
        return
    ran = {key: value for key, value in ran.items() if key != "not_wrapped"}  # (added to the channel's copy)
    said = manifest.get("config")
    if said != ran:
        keys = sorted(set(ran) | set(said), key=str) if isinstance(said, dict) else []
        differ = [key for key in keys if said.get(key, "(none)") != ran.get(key, "(none)")]
        shown = "; ".join(f"{key}: {json.dumps(said.get(key))} here, {json.dumps(ran.get(key))} there"
                          for key in differ[:4]) if differ else f"{json.dumps(said)[:80]} here"
        report.problem(path, f"its config is not the config its session {role}/{name} ran with ({fmt.RANK_FILE}): "
                             f"{_printable(shown)}" + (f"; ... and {len(differ) - 4} more" if len(differ) > 4 else ""))


def _warn_of_absent_ranks(report: _Report, root: str, rank_numbers: dict) -> None:
    """A warning where the ranks' rank.json files name TP/PP ranks no directory here holds: a rank
    that never attached (it lost nothing fastdump had accepted, so this is no problem), or another
    node's root (read several with ``fastdump.open([...])`` and ``diff``). ``rank_numbers``: {rank
    directory: its checked rank numbers, None where check_rank_dir found none}."""
    held: dict = {}  # (role, dp_rank, tp_size, pp_size) -> {(tp_rank, pp_rank)}
    for rank_path, numbers in rank_numbers.items():
        if not numbers:
            continue  # (check_rank_dir said what is wrong with it, if anything)
        role = os.path.basename(os.path.dirname(rank_path))
        key = (role, numbers.get("dp_rank", 0), numbers.get("tp_size", 1), numbers.get("pp_size", 1))
        held.setdefault(key, set()).add((numbers.get("tp_rank", 0), numbers.get("pp_rank", 0)))
    for (role, dp_rank, tp_size, pp_size), ranks in sorted(held.items()):
        absent = [(tp, pp) for pp in range(pp_size) for tp in range(tp_size) if (tp, pp) not in ranks]
        if absent:
            shown = ", ".join(f"TP{tp}_PP{pp}" for tp, pp in absent[:8]) + (" ..." if len(absent) > 8 else "")
            dp = f" (dp rank {dp_rank})" if dp_rank else ""
            report.warning(os.path.join(root, role), f"its ranks{dp} say tp_size {tp_size} and pp_size {pp_size}, "
                           f"but {shown} ha{'s' if len(absent) == 1 else 've'} no directory here: a rank that "
                           "never attached, or another node's root (fastdump.open and diff take several roots)")


def cmd_verify(args) -> int:
    report = verify_dump(args.root, read_data=getattr(args, "data", False))
    ok = not report.problems
    if getattr(args, "json", False):
        print(json.dumps({"ok": ok, "problems": report.problems, "warnings": report.warnings}, indent=2))
    else:
        for text in report.warnings:
            print(f"warning: {_printable(text)}")
        for text in report.problems:
            print(f"PROBLEM: {_printable(text)}")
        print("OK" if ok else f"FAILED: {len(report.problems)} problem(s)")
    return 0 if ok else 1


# ------------------------------------------------------------------------------------------- show


def tensor_stats(tensor):
    """See ``fastdump.stats.tensor_stats``: one statistics module serves show and diff (imported
    here, late, so that ls and verify never import torch)."""
    from ..stats import tensor_stats as summarize

    return summarize(tensor)


def _number(value) -> str:
    return "-" if value is None else f"{value:.6g}"


# A pass up to this size is read with one load (per-tensor lookups would cost more on decode
# steps); a larger one tensor by tensor, so that show holds one tensor, never a whole prefill pass.
SHOW_LOAD_BYTES = 64 << 20


def _pass_tensors(ds, role, rank, pass_id, select, session, meta):
    """(name, tensor) of one pass in dump order, one at a time past SHOW_LOAD_BYTES."""
    if not isinstance(meta.get("bytes"), int) or meta["bytes"] <= SHOW_LOAD_BYTES:
        yield from ds.load(role, rank, pass_id, select=select, session=session).items()
        return
    names = [name for name in ds.pass_names(role, rank, pass_id, session=session) if select is None or select(name)]
    repeated = {name for name, n in collections.Counter(names).items() if n > 1}
    for name in dict.fromkeys(names):
        if name in repeated:  # load names every copy (name, name#dup1, ...): none is lost
            yield from ds.load(role, rank, pass_id, select=name.__eq__, session=session).items()
        else:
            yield name, ds.tensor(role, rank, name, pass_id, session=session)


def cmd_show(args) -> int:
    from .. import reader

    try:
        pattern = re.compile(args.name) if args.name else None
    except re.error as exc:
        print(f"fastdump show: --name {_printable(args.name)!r} is not a regular expression ({exc})", file=sys.stderr)
        return 1
    rows = []
    try:
        with warnings.catch_warnings(record=True) as caught, reader.open(args.root) as ds:
            warnings.simplefilter("always")
            rank, session = _rank_arg(args.rank), getattr(args, "session", None)
            meta = ds.meta(args.role, rank, args.pass_id, session=session)  # (no pass N: the reader says why)
            for name, tensor in _pass_tensors(ds, args.role, rank, args.pass_id, pattern.search if pattern else None,
                                              session, meta):
                stats = tensor_stats(tensor) if tensor.numel() else None
                dtype = dtypes.torch_name(tensor.dtype)
                shape = "[" + ", ".join(str(d) for d in tensor.shape) + "]"
                del tensor  # (one tensor held at a time)
                if stats is None:
                    rows.append([_printable(name), dtype, shape, "-", "-", "-", "-", "-", "-"])
                else:
                    numbers = [_number(stats[key]) for key in ("min", "max", "mean", "std")]
                    rows.append([_printable(name), dtype, shape, *numbers, stats["nan"], stats["inf"]])
            problems = list(ds.problems)
    except (KeyError, ValueError, OSError) as exc:  # DumpError is a ValueError
        _print_warnings([], caught)
        print(f"fastdump show: {_printable(exc.args[0] if isinstance(exc, KeyError) and exc.args else exc)}",
              file=sys.stderr)
        return 1
    _print_warnings(problems, caught)
    print(f"pass {args.pass_id}: " + json.dumps(meta, default=str))
    print(_table(["NAME", "DTYPE", "SHAPE", "MIN", "MAX", "MEAN", "STD", "NAN", "INF"], rows))
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fastdump.cli.dump")
    add_arguments(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
