"""A rank directory's segment list: ``segments.jsonl`` (format 5), or rank.json's ``segments`` (1 to 4).

Format 5: the writer appends one JSON line per closed segment to ``segments.jsonl`` and makes it
durable, then rewrites rank.json, which records the committed part: ``segments_listed`` lines,
``segments_bytes`` bytes, ``segments_crc32c`` (CRC32C of those bytes). rank.json stays small, so
each segment costs O(1) bytes written instead of the whole list again (O(N^2) over a run: 8000
one-pass segments took minutes), and the full-disk reserve covers it however long the run.

Anything after the committed bytes is what a writer killed between the append and rank.json
leaves (a whole line, or a torn one): it is never read as part of the list; the segment file such
a line names is on disk unlisted, as it was before format 5 when the writer was killed between a
segment's rename and rank.json. ``read`` says how many such bytes there are.

Writer side: ``Appender``. Readers (reader, verify, the Dumper's close): ``read``.
"""

from __future__ import annotations

import json
import os

from . import _C, fsutil
from . import format as fmt


class Appender:
    """Appends entries to a new (emptied) ``segments.jsonl`` in ``directory``; ``committed()`` is
    what rank.json records. Opened per append: a channel holds no descriptor between segments."""

    def __init__(self, directory):
        """``directory``: a path, or a fsutil.DirAnchor (the writer's: the list's path is asked of it
        at each append, which fails once the anchor is closed)."""
        # (isinstance, not hasattr(directory, "join"): a str has a join method too)
        self._join = directory.join if isinstance(directory, fsutil.DirAnchor) \
            else lambda name: os.path.join(directory, name)
        self.count = 0
        self.nbytes = 0
        self.crc = 0
        # Emptied: a writer reopening a directory starts its list anew (rank.json, rewritten next,
        # commits none of the old lines). Its directory entry is made durable by that rank.json.
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0), 0o644)
        os.close(fd)

    @property
    def path(self) -> str:
        return self._join(fmt.SEGMENT_LIST_FILE)

    def append(self, entry: dict) -> None:
        """Write ``entry`` as the next line at the committed end (over any torn tail) and make it
        durable. Raises OSError (a full disk) with nothing committed: the caller stops writing."""
        line = (json.dumps(entry, ensure_ascii=True, default=str) + "\n").encode("ascii")  # one line: no raw newline
        fd = os.open(self.path, os.O_WRONLY | getattr(os, "O_NOFOLLOW", 0))
        try:
            done = 0
            while done < len(line):
                done += os.pwrite(fd, line[done:], self.nbytes + done)
            (os.fdatasync if hasattr(os, "fdatasync") else os.fsync)(fd)  # (its size too: the reader needs it)
        finally:
            os.close(fd)
        self.count += 1
        self.nbytes += len(line)
        self.crc = _C.crc32c(line, self.crc)

    def committed(self) -> dict:
        """rank.json's record of the list: lines, bytes and their CRC32C."""
        return {fmt.LIST_COUNT: self.count, fmt.LIST_BYTES: self.nbytes, fmt.LIST_CRC: self.crc}


def appended(info: dict) -> bool:
    """Whether rank.json ``info`` keeps its segment list in ``segments.jsonl`` (format 5 on)."""
    version = info.get("format_version")
    return isinstance(version, int) and not isinstance(version, bool) and version >= fmt.APPENDED_LIST_VERSION


def read(directory: str, info: dict):
    """``(entries, problem, tail)``: the segment list of the rank directory whose rank.json is
    ``info``; ``problem`` a sentence when the list cannot be trusted (entries then []), else None;
    ``tail`` the bytes of ``segments.jsonl`` after its committed lines (0 for formats 1 to 4).
    Entries are returned as stored (JSON values): callers check each."""
    if not appended(info):
        segments = info.get("segments")
        return (segments if isinstance(segments, list) else []), None, 0
    name = fmt.SEGMENT_LIST_FILE
    count, nbytes, crc = (info.get(key) for key in (fmt.LIST_COUNT, fmt.LIST_BYTES, fmt.LIST_CRC))
    for key, value in ((fmt.LIST_COUNT, count), (fmt.LIST_BYTES, nbytes), (fmt.LIST_CRC, crc)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            return [], (f"{fmt.RANK_FILE} {key} is {str(value)[:40]!r}, not an integer >= 0: its segment list is "
                        "unknown"), 0
    try:
        data, size = _read_prefix(os.path.join(directory, name), nbytes)
    except FileNotFoundError:
        if count == 0 and nbytes == 0:
            return [], None, 0
        return [], f"{name} missing: {fmt.RANK_FILE} commits {count} segment(s) to it", 0
    except OSError as exc:
        return [], f"{name}: cannot read ({exc.strerror or exc})", 0
    except ValueError as exc:
        return [], f"{name}: {exc}", 0
    if len(data) < nbytes:
        return [], (f"{name} holds {len(data)} bytes, {fmt.RANK_FILE} commits {count} segment(s) in {nbytes}: "
                    "truncated"), 0
    found = _C.crc32c(data)
    if found != crc:
        return [], (f"{name}: its {nbytes} committed bytes have CRC32C {found:08x}, {fmt.RANK_FILE} says "
                    f"{crc & 0xFFFFFFFF:08x}: the list changed after it was written"), size - nbytes
    lines = data.split(b"\n")
    if lines[-1] != b"" or len(lines) - 1 != count:
        return [], f"{name}: {fmt.RANK_FILE} commits {count} line(s) in {nbytes} bytes, they hold {len(lines) - 1}", \
            size - nbytes
    entries = []
    for number, line in enumerate(lines[:-1], 1):
        try:
            entries.append(json.loads(line.decode("ascii"), object_pairs_hook=fsutil.unique_keys))
        except (UnicodeDecodeError, ValueError, RecursionError) as exc:
            return [], f"{name} line {number}: not valid JSON ({exc})", size - nbytes
    return entries, None, size - nbytes


def _read_prefix(path: str, nbytes: int):
    """The first ``nbytes`` bytes of a regular file (fewer when it is shorter), and its size. Never
    follows a link nor opens a FIFO or device; reads no more than the file holds."""
    fd, info = fsutil.open_regular(path)
    try:
        want, chunks = min(nbytes, info.st_size), []
        while want > 0:
            chunk = os.read(fd, min(want, 1 << 24))
            if not chunk:
                break
            chunks.append(chunk)
            want -= len(chunk)
        return b"".join(chunks), info.st_size
    finally:
        os.close(fd)
