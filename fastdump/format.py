"""On-disk names and table layouts shared by the segment writer, the reader and ``fastdump verify``.

docs/FORMAT.md is the prose version of this module; change both together (and bump FORMAT_VERSION
when an old reader could misread the new layout).
"""

from __future__ import annotations

import json
import os
import re
import time

import numpy as np

FORMAT_NAME = "fastdump-segment"
# Version of segment files and rank.json. 2: index rows carry a CRC32C; rank directories carry a
# session id. 3: a segment's tables carry a CRC32C too (ATTR_TABLES_CRC). 4: each block carries a
# CRC32C of what its attributes and row shape say (ATTR_BLOCK_CRC). 5: rank.json no longer lists
# the segments; each closed segment's entry is appended to SEGMENT_LIST_FILE, and rank.json says how
# much of that file is committed (segment files are as in 4). 6: each pass that ended carries its
# producer's count of the tensors it sent (PASS_SENT), which verify holds its rows to. Readers read 1 to 6.
FORMAT_VERSION = 6
READABLE_VERSIONS = (1, 2, 3, 4, 5, 6)
APPENDED_LIST_VERSION = 5  # the first format whose segment list is SEGMENT_LIST_FILE, not rank.json's
# Version of the run manifest (fastdump.json), independent of the segment format.
MANIFEST_VERSION = 1

MANIFEST_FILE = "fastdump.json"
# fastdump.json's record of the session that made it: {"role", "rank_dir"}. Its "config" is that
# session's, which its rank.json holds too (verify compares them). Roots made before it have none.
MANIFEST_SESSION = "session"
# The roles fastdump's integrations write (EAGLE's target and draft models). A root entry named so
# (or named as fastdump.json's role) that is not a directory is a role whose dump is not there.
STANDARD_ROLES = ("target", "draft")
# One marker file per role ever attached on the root: ROLES_DIR/<role>, made (atomically, never
# rewritten) by the first Dumper of that role once its rank directory exists. A role of another
# name (attach(role="reward") on a root whose fastdump.json names "target") left no trace: its
# directory replaced by a file, emptied or deleted, verify said OK. A recorded role whose entry is
# not a directory holding a rank directory is lost. Roots written before it have none: nothing to check.
ROLES_DIR = "fastdump.roles"
# One marker file per session ever attached on the root: SESSIONS_DIR/<role>/<rank directory name>,
# made atomically by the session's Dumper once its rank directory exists. The role record alone
# missed one session's directory removed beside another of its role (a server restarted, or a
# second Dumper of one process): verify said OK with half the run. A recorded session whose rank
# directory is not in its role's directory, by name or (renamed) by the session its rank.json
# names, is lost. Roots written before it have none: nothing to check.
SESSIONS_DIR = "fastdump.sessions"
# Names fastdump uses at the root itself: no role may be named so (its directory could not be made).
ROOT_NAMES = (MANIFEST_FILE, ROLES_DIR, SESSIONS_DIR)
RANK_FILE = "rank.json"  # written by the writer process alone
# Space the writer holds back in a rank directory for rank.json (deleted so that a full disk can still
# be recorded, removed at close). No reader reads it, and it is not part of the dump: readers, verify
# and export pass over it (they read only the names above and segments).
RESERVE_FILE = ".rank.json.reserve"
# Format 5: one JSON line per closed segment, appended (never rewritten) by the writer process; rank.json
# says how many lines (and bytes, and their CRC32C) are committed. Rewritten whole after every
# segment, rank.json's list cost a long run O(N^2) bytes written (4000 one-pass segments: 20 s).
SEGMENT_LIST_FILE = "segments.jsonl"
# rank.json's record of the committed part of SEGMENT_LIST_FILE: lines, bytes, CRC32C of those bytes.
LIST_COUNT, LIST_BYTES, LIST_CRC = "segments_listed", "segments_bytes", "segments_crc32c"
# Written by the serving process alone, only when it stopped dumping and the writer could not be
# told (dead, stopped, or already past its close): {"status": "error", "error": ..., "time": ...}.
# Readers merge it into rank.json's facts; ``verify`` fails while it exists. One file, one writer.
PRODUCER_ERROR_FILE = "producer_error.json"
# Why a rank.json status other than "closed" (and other than "error", which carries its own) means
# the rank may lack data: verify's problem, diff's refusal and export's, in the same words.
UNFINISHED_STATUS_WHY = {
    "running": "the writer never finished: the dump is still being written, or its writer died or the disk "
               "filled before it could say so; passes may be missing",
    "incomplete": "the dumping process exited without close(): what it had not yet handed to the writer is "
                  "missing, and its last pass may be cut short",
}
NAMES_FILE = "sglang_names.json"  # module names the SGLang drop-in records per rank (read by export)
# The skip reason the writer gives a chunked tensor whose other chunks never came (a failed CUDA
# drain turned them into padding after the tensor was staged): rank.json skipped_reasons counts it,
# and ``verify`` fails on it, since that tensor was accepted and then lost.
TORN_TENSOR_REASON = "incomplete tensor (staging failed mid-copy)"
# The start of the skip reason of a tensor the writer received and could not store (an exception
# of its own, e.g. no memory to put a chunked tensor together). Accepted and then lost, too.
WRITER_LOST_REASON = "writer could not store it"


# The starts of the other skip reasons the writer gives a tensor it received and did not store (not
# a loss: a record that describes no tensor, or one numpy cannot represent).
BAD_RECORD_REASON = "bad record"
TOO_WIDE_REASON = "empty tensor of shape"


def not_stored_by_writer(reason: str) -> bool:
    """A skip the writer recorded for a tensor that reached it (whole or in part) and that it did
    not store: one a pass's PASS_SENT count may hold beyond its stored rows. The producer's own
    skips (dtypes, layouts, names) were never sent and are not in that count."""
    return is_loss(reason) or reason.startswith((BAD_RECORD_REASON, TOO_WIDE_REASON))


def is_loss(reason: str) -> bool:
    """A skip reason that records a loss (a tensor accepted, then not stored): rank.json's
    ``lost_tensors`` counts these, and ``verify`` fails on them. Other skips are values fastdump
    says it cannot store."""
    return reason == TORN_TENSOR_REASON or reason.startswith(WRITER_LOST_REASON)

SEGMENT_RE = re.compile(r"^seg-(\d+)\.h5$")

# Rank directories: SGLang's ``TP{tp}_PP{pp}_Rank{rank}`` prefix, the writing process's pid, and
# (format 2) a session id, so that two Dumpers of one process (same root and role), or two runs
# that reuse a pid (attach/close in a loop; containers where every run is pid 1), never share a
# directory. A session id sorts by start time (UTC, microseconds) and ends in random bits:
# ``TP0_PP0_Rank0_pid1234_20261201T013200.123456Z-9f3ac2e1``. Format 1 names have no session.
RANK_DIR_RE = re.compile(r"^TP(\d+)_PP(\d+)_Rank(\d+)_pid(\d+)(?:_(\d{8}T\d{6}\.\d{6}Z-[0-9a-f]{8}))?$")


# rank.json's "rank" object (capture/ranks.py writes every key, as integers).
RANK_KEYS = ("rank", "tp_rank", "tp_size", "pp_rank", "pp_size", "dp_rank", "dp_size", "ep_rank", "ep_size")
MAX_PARALLEL_SIZE = 65536  # a larger size is damage (diff sizes its tables by tp_size and pp_size)


def check_rank_numbers(numbers) -> dict:
    """rank.json's "rank" object, checked as fastdump writes it: each rank present an integer >= 0,
    each size an integer 1..MAX_PARALLEL_SIZE, each rank below its size, the world rank below
    tp_size * pp_size (SGLang's numbering). Returns it. ValueError names the field: attach refuses
    such ranks, and diff and export refuse a damaged or crafted file with that message, never a
    traceback nor a size they would allocate by."""
    if not isinstance(numbers, dict):
        raise ValueError(f'"rank" is {_json_text(numbers)}, not an object of rank numbers')
    for key in RANK_KEYS:
        if key not in numbers:
            continue
        value, size = numbers[key], key.endswith("_size")
        if (isinstance(value, bool) or not isinstance(value, int) or value < (1 if size else 0)
                or (size and value > MAX_PARALLEL_SIZE)):
            bound = f"1..{MAX_PARALLEL_SIZE}" if size else ">= 0"
            raise ValueError(f"rank.{key} is {_json_text(value)}, expected an integer {bound}")
    for kind in ("tp", "pp", "dp", "ep"):
        rank, size = numbers.get(f"{kind}_rank"), numbers.get(f"{kind}_size")
        if rank is not None and size is not None and rank >= size:
            raise ValueError(f"rank.{kind}_rank {rank} is not below rank.{kind}_size {size}")
    world = numbers.get("tp_size", 1) * numbers.get("pp_size", 1)
    if numbers.get("rank", 0) >= world:
        raise ValueError(f"rank.rank {numbers['rank']} is not below tp_size * pp_size = {world}")
    return numbers


def _json_text(value) -> str:
    """``value`` as the JSON file spells it, cut to 60 characters (for messages)."""
    text = json.dumps(value, default=str)
    return text if len(text) <= 60 else text[:57] + "..."


def merge_producer_error(info: dict, producer_error) -> dict:
    """rank.json's facts with the serving process's ``producer_error.json`` merged in: status
    "error" and its error, unless the writer recorded an error of its own (kept, the earlier cause).
    The producer's record is kept whole under ``producer_error``."""
    if not isinstance(producer_error, dict):
        return info
    merged = dict(info, producer_error=producer_error)
    if merged.get("status") != "error" or not merged.get("error"):
        merged.update(status="error", error=str(producer_error.get("error") or "the serving process stopped dumping"))
    return merged


def new_session_id() -> str:
    """A fresh session id: start time (sorts) + 32 random bits (two sessions in one microsecond)."""
    now = time.time()
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime(now))
    return f"{stamp}.{int(now * 1e6) % 1000000:06d}Z-{os.urandom(4).hex()}"


def rank_dir_name(ranks: dict, pid: int, session: str = None) -> str:
    """``TP{tp}_PP{pp}_Rank{rank}_pid{pid}_{session}`` (no session: the format-1 name)."""
    name = f"TP{ranks['tp_rank']}_PP{ranks['pp_rank']}_Rank{ranks['rank']}_pid{pid}"
    return f"{name}_{session}" if session else name


def parse_rank_dir(name: str):
    """(tp, pp, rank, pid, session or None) of a rank directory name, or None for other names."""
    match = RANK_DIR_RE.match(name)
    if match is None:
        return None
    tp, pp, rank, pid, session = match.groups()
    return int(tp), int(pp), int(rank), int(pid), session


def rank_dir_mismatch(name: str, numbers) -> str | None:
    """Why rank directory ``name`` is not the rank its rank.json's "rank" object (``numbers``) says,
    or None (a name without rank numbers, or numbers that agree). The writer names its directory
    from those very numbers: a directory renamed to another rank (two ranks' names swapped), or a
    rank.json copied or edited, would read by number, diff and export as the wrong rank."""
    parsed = parse_rank_dir(name)
    if parsed is None or not isinstance(numbers, dict):
        return None
    said = [(key, value, numbers.get(key)) for key, value in zip(("tp_rank", "pp_rank", "rank"), parsed[:3])]
    wrong = [f"{key} {value}" for key, value, stored in said if isinstance(stored, int) and stored != value]
    if not wrong:
        return None
    return (f"the directory's name says {', '.join(wrong)} but its {RANK_FILE} says "
            + ", ".join(f"{key} {stored}" for key, value, stored in said if isinstance(stored, int) and stored != value)
            + ": renamed to another rank, or its rank.json is another rank's")


def segment_name(number: int) -> str:
    return f"seg-{number:06d}.h5"


def segment_temp_name(number: int) -> str:
    """Where a segment is built; starts with '.' so no ``seg-*.h5`` glob ever matches it."""
    return f".{segment_name(number)}.tmp"


def segment_number(file_name: str):
    """Number of a visible segment file name, or None for anything else."""
    match = SEGMENT_RE.match(file_name)
    return int(match.group(1)) if match else None


# Tensor names: a module's k-th call in a pass (k >= 1) is stored as ``name#k`` (``name#k.0`` ...).
# A name of the user's that holds such a part would read as another call's, so capture refuses it.
CALL_SUFFIX_RE = re.compile(r"#(\d+)(?=\.|$)")


def call_name(name: str, k: int) -> str:
    """The name of a module's k-th call in a pass: ``name``, then ``name#1``, ``name#2``..."""
    return name if k == 0 else f"{name}#{k}"


def reads_as_call(name: str) -> bool:
    """``name`` holds a ``#k`` part (``a#1``, ``a#1.b``), which only call numbering may add."""
    return CALL_SUFFIX_RE.search(name) is not None


# Objects inside a segment file.
NAMES = "names"  # scalar string: JSON array of tensor names (JSON keeps any character, NUL included)
INDEX = "index"  # one row per stored tensor, in the order tensors arrived
PASSES = "passes"  # one row per pass
PASS_META = "pass_meta"  # per pass (same order as PASSES): JSON {"meta": {...}, "skipped": [...]}
# A pass_meta entry's key beside "meta" and "skipped", only where the pass has one (a reader that
# does not know it reads everything else as before: no format version): {call name: {"kinds":
# {part path: kind}, "after": n}} for outputs whose stored names do not tell their container
# structure (docs/FORMAT.md, "Output structure").
PASS_STRUCTURE = "structure"
# A pass_meta entry's key (format 6), on every pass whose end reached the writer: the tensors its
# producer put into the ring for it whole (staged; not its drops nor its skips), as its end record
# counts them (a CUDA-graph replay's: the graph's tensors). `verify` fails a pass whose rows are
# more, or fewer than that less the tensors the writer recorded as not stored
# (not_stored_by_writer): crafted or leaked tensors written in afterwards with valid rows and CRCs
# passed every other check, rank.json's counts being whole-rank totals.
PASS_SENT = "sent"
PASS_SENT_VERSION = 6  # the first format that stores it (older segments are checked as before)
STRUCTURE_LOST = "(fastdump)"  # its only key when the record was cut (the pass end exceeded the ring's limit)
BLOCKS = "blocks"  # group of datasets "0", "1", ...: rows of one name with one dtype and row shape

# Dataset attributes.
ATTR_DTYPE = "dtype"  # torch dtype name, e.g. "bfloat16"
ATTR_ENCODING = "encoding"  # "native" or "raw-bits" (see fastdump/dtypes.py)
ATTR_SCALAR = "scalar"  # 1 on blocks whose rows are 0-d tensors (each index entry then has rows == 1)

_INDEX_FIELDS_V1 = [
    ("pass", "<i8"),  # pass id
    ("name", "<i4"),  # position in NAMES
    ("block", "<i4"),  # dataset BLOCKS/<block>
    ("first_row", "<i8"),  # first row of this tensor in the block
    ("rows", "<i8"),  # rows it spans: shape[0], or 1 for a 0-d tensor
]
INDEX_DTYPE_V1 = np.dtype(_INDEX_FIELDS_V1)
# Format 2: CRC32C (Castagnoli) of the tensor's bytes as stored (its rows, C order, little-endian).
INDEX_DTYPE = np.dtype(_INDEX_FIELDS_V1 + [("crc32c", "<u4")])
INDEX_DTYPES = {1: INDEX_DTYPE_V1, 2: INDEX_DTYPE, 3: INDEX_DTYPE, 4: INDEX_DTYPE, 5: INDEX_DTYPE, 6: INDEX_DTYPE}

# Format 3: root attribute, CRC32C of the segment's tables as stored. A row's own crc32c covers its
# data only, so an index row whose pass, name or block changed (or two rows that traded pass ids)
# still checks; this covers what says which data is whose.
ATTR_TABLES_CRC = "tables_crc32c"


def tables_crc32c(names_text, index: np.ndarray, passes: np.ndarray, pass_meta) -> int:
    """CRC32C of: the NAMES text, "\n", the INDEX rows, the PASSES rows (both packed,
    little-endian, as INDEX_DTYPE/PASS_DTYPE lay them out), then each PASS_META entry followed by
    "\n" (entries are ASCII JSON, which never holds a raw newline). Text may be str or bytes."""
    from . import _C

    def text(value) -> bytes:
        if isinstance(value, str):
            return value.encode("utf-8")
        if isinstance(value, bytes):
            return value
        raise ValueError(f"a table holds {type(value).__name__} where text belongs")

    value = _C.crc32c(text(names_text) + b"\n")
    value = _C.crc32c(np.ascontiguousarray(index).view(np.uint8), value)
    value = _C.crc32c(np.ascontiguousarray(passes).view(np.uint8), value)
    return _C.crc32c(b"".join(text(entry) + b"\n" for entry in pass_meta), value)

# Format 4: attribute of each block, CRC32C of block_text(): how its stored bytes are read back
# (dtype, encoding, 0-d rows, row shape). Neither the rows' CRC (the bytes as stored) nor the
# tables' covers these, and a bfloat16 block relabelled uint16, or (N, 4, 8) rows relabelled
# (N, 8, 4), would read back as other values with every other check passing.
ATTR_BLOCK_CRC = "block_crc32c"

# Root attribute (any format, since 2026-12): the session id of the rank directory the segment was
# written for. The tables' CRCs say nothing of whose a segment is, so a segment copied in from
# another session's directory (another run's seg-000001.h5 over this one's) read back as this
# session's passes. Readers and verify refuse a segment whose session is not its directory's.
ATTR_SESSION = "session"


# Root attribute: the number in the segment's file name. A pass the writer flushed unfinished
# continues in the next segment and is read back in file-number order, so a renamed file (two
# parts swapped by hand) would hand back that pass's tensors out of order; no CRC covers the name.
ATTR_SEGMENT = "segment"


def renamed_segment(stored, number: int) -> str | None:
    """Why a segment whose ATTR_SEGMENT is ``stored`` is not the file numbered ``number``, or None
    (None also when the attribute is absent)."""
    if stored is None or (isinstance(stored, int) and not isinstance(stored, bool) and stored == number):
        return None
    return f"written as segment {str(stored)[:40]}: renamed"


def expected_session(rank_dir_name: str, info: dict) -> str | None:
    """The session a rank directory's segments must carry: its name's, else rank.json's."""
    parsed = parse_rank_dir(rank_dir_name)
    if parsed and parsed[4]:
        return parsed[4]
    session = info.get("session") if isinstance(info, dict) else None
    return session if isinstance(session, str) else None


# The first format whose segments all carry ATTR_SESSION when their writer had a session (rank.json's
# "session"): the attribute came a few hours before format 5. No CRC covers a root attribute, so a
# segment copied in from another run with the attribute deleted read back as this session's passes.
SESSION_ATTR_VERSION = 5


def session_required(info: dict, segment_version) -> bool:
    """Whether a segment of format ``segment_version`` in the rank directory whose rank.json is
    ``info`` must carry ATTR_SESSION: its writer wrote one into every segment of a session it knew."""
    version = info.get("format_version") if isinstance(info, dict) else None
    return (isinstance(info, dict) and isinstance(info.get("session"), str)
            and isinstance(version, int) and not isinstance(version, bool) and version >= SESSION_ATTR_VERSION
            and isinstance(segment_version, int) and segment_version >= SESSION_ATTR_VERSION)


def foreign_session(session, expected, required: bool = False) -> str | None:
    """Why a segment whose ATTR_SESSION is ``session`` is not its directory's, or None. A segment
    written before the attribute existed carries none and is taken as its directory's, unless
    ``required`` (``session_required``: its writer would have written one)."""
    if isinstance(session, bytes):
        session = session.decode("utf-8", "replace")
    if session is None and required and expected is not None:
        return (f"carries no session attribute, though a format-{SESSION_ATTR_VERSION} writer puts its session "
                f"{expected!r} in every segment: copied in from another run, its attribute removed")
    if session is None or expected is None or session == expected:
        return None
    return (f"written by session {str(session)[:80]!r}, not this directory's {expected!r}: copied in from "
            "another run")


def block_crc32c(number: int, dtype_name: str, encoding: str, scalar: bool, row_shape) -> int:
    """CRC32C of ``"<number> <dtype> <encoding> <0|1> <d1,d2,...>"`` (ASCII): a block's number
    (attributes moved to another block fail) and what its attributes and dataset shape say."""
    from . import _C

    dims = ",".join(str(int(d)) for d in row_shape)
    return _C.crc32c(f"{int(number)} {dtype_name} {encoding} {int(bool(scalar))} {dims}".encode("ascii"))


# The keys DumpSet.meta adds to every pass's metadata itself; the capture side refuses them as user keys.
READER_META_KEYS = ("complete", "dropped", "skipped", "tensors", "bytes")
INCOMPLETE_META_KEYS = ("incomplete", "mixed")  # added where the capture side marked the pass incomplete
# Added by the capture side where passes of two Dumpers nested on one thread (an EAGLE draft inside the
# target's forward): the inner pass's `nested_in`, the outer's `suspended_for` (and the count of its
# entries left out past 256).
NESTING_META_KEYS = ("nested_in", "suspended_for", "suspended_for_left_out")
RESERVED_META_KEYS = READER_META_KEYS + INCOMPLETE_META_KEYS + NESTING_META_KEYS


PASS_DTYPE = np.dtype(
    [
        ("pass", "<i8"),
        ("complete", "u1"),  # 0: the pass never ended before the writer closed (what arrived is kept)
        ("dropped", "<i8"),  # tensors of this pass dropped by the ring (policy "drop")
        ("tensors", "<i8"),  # index rows of this pass in this segment
        ("bytes", "<i8"),  # payload bytes of those tensors
    ]
)


def printable(text) -> str:
    """Text from a dump (a name, a status, an error, a directory name) as a terminal may show it: it
    can hold any character, so those a terminal would swallow or obey (ANSI escapes in a crafted
    name) are written as Python escapes. Used by everything that prints such text: ls, show, verify,
    diff (text and HTML), export."""
    text = str(text)
    if text.isprintable():  # (the common case, checked in C: a wide pass prints 100k names)
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)
