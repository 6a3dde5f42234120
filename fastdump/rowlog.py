"""The rows of a ``fastdump diff``, held in bounded memory.

A diff makes one row (~1.2 KB as a dict) per compared tensor: 40k passes of 95 tensors held 663 MB.
``RowLog`` keeps the first ``MEMORY_ROWS`` in a list and, past them, every row in a temporary file
of JSON lines, read back as often as a report needs them. What the verdict needs (counts, the first
failing row) is kept as the rows go by. The file has no name (``tempfile.TemporaryFile``): a diff
killed with SIGKILL leaves nothing behind in TMPDIR.
"""

from __future__ import annotations

import json
import os
import tempfile

MEMORY_ROWS = 20000  # ~24 MB of rows; a diff of more spills them to a temporary file


class RowLog:
    """Rows appended in execution order; iterable (as often as wanted), ``len``, counts."""

    def __init__(self, memory_rows=None):
        self.memory_rows = MEMORY_ROWS if memory_rows is None else memory_rows
        self._rows: list = []
        self._file = None
        self._count = 0
        self.compared = 0  # rows with numbers (not a shape or read error)
        self.failed = 0  # status fail or error
        self.errors = 0  # status error (unreadable data)
        self.first_divergence = None  # the first row with status fail (an error row is damage, not the model's)

    def append(self, row: dict) -> None:
        self._count += 1
        self.compared += row.get("max_abs") is not None or bool(row.get("bitwise"))
        if row["status"] != "ok":
            self.failed += 1
            self.errors += row["status"] == "error"
            # A tensor that could not be read is no divergence of the model: named as the first, it
            # put a damaged block ahead of the model's real divergence.
            if self.first_divergence is None and row["status"] == "fail":
                self.first_divergence = row
        if self._file is None and len(self._rows) < self.memory_rows:
            self._rows.append(row)
            return
        if self._file is None:
            self._file = tempfile.TemporaryFile(prefix="fastdump-diff-rows-", suffix=".jsonl")
            for kept in self._rows:
                self._write(kept)
            self._rows = []
        self._write(row)

    def _write(self, row: dict) -> None:
        # Rows hold plain Python values; json keeps inf and NaN (read back as floats) and every
        # string (a lone surrogate as \\ud800).
        self._file.write(json.dumps(row, ensure_ascii=True).encode("ascii") + b"\n")

    @property
    def spilled(self) -> bool:
        return self._file is not None

    def __len__(self) -> int:
        return self._count

    def __iter__(self):
        if self._file is None:
            return iter(self._rows)
        self._file.flush()
        return self._read()

    def _read(self):
        # pread at its own offset: the writes' file position is left alone, and several readings
        # may interleave (the report walks the rows more than once).
        fd, offset, tail = self._file.fileno(), 0, b""
        while True:
            chunk = os.pread(fd, 1 << 16, offset)  # (what the rows in hand may hold at once)
            if not chunk:
                return
            offset += len(chunk)
            *lines, tail = (tail + chunk).split(b"\n")
            for line in lines:
                yield json.loads(line)

    def __getitem__(self, index):
        if self._file is None:
            return self._rows[index]
        if isinstance(index, slice):
            return list(self)[index]
        if index < 0:
            index += self._count
        if not 0 <= index < self._count:
            raise IndexError(index)
        for k, row in enumerate(self):
            if k == index:
                return row
        raise IndexError(index)

    def as_list(self) -> list:
        return self._rows if self._file is None else list(self)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
            self._rows, self._count = [], 0
