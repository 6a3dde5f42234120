"""Crash-safe small file writes.

A reader (or a human with ``cat``) must never see a half-written ``rank.json`` or ``fastdump.json``:
we write a temporary file in the same directory, fsync it, rename it over the target (atomic on
POSIX) and fsync the directory so the rename itself survives a crash.
"""

from __future__ import annotations

import itertools
import json
import os
import threading

# Temporary names start with '.' and end with '.tmp': readers skip them, `fastdump verify` reports
# leftovers. pid + counter keep concurrent writers of one target (several ranks writing the run
# manifest, two threads) from clobbering each other's temporary file.
TMP_SUFFIX = ".tmp"
_counter = itertools.count()
_counter_lock = threading.Lock()


def temp_path(path: str, unique: bool = True) -> str:
    """Temporary sibling of ``path``: ``.<name>.<pid>-<n>.tmp`` (or ``.<name>.tmp`` if not unique)."""
    directory, name = os.path.split(os.fspath(path))
    if unique:
        with _counter_lock:
            n = next(_counter)
        name = f".{name}.{os.getpid()}-{n}{TMP_SUFFIX}"
    else:
        name = f".{name}{TMP_SUFFIX}"
    return os.path.join(directory, name)


def is_temp_name(name: str) -> bool:
    return name.startswith(".") and name.endswith(TMP_SUFFIX)


def fsync_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(directory: str) -> None:
    """Make renames/creations inside ``directory`` durable (no-op where directories can't be opened)."""
    try:
        fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems refuse fsync on directories; the rename is still atomic
    finally:
        os.close(fd)


def publish(tmp: str, path: str, durable: bool = True) -> None:
    """Rename a finished temporary file over ``path`` (fsyncing file and directory if ``durable``)."""
    if durable:
        fsync_file(tmp)
    os.replace(tmp, path)
    if durable:
        fsync_dir(os.path.dirname(os.path.abspath(path)))


def remove_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def atomic_write_bytes(path: str, data: bytes, durable: bool = True) -> None:
    """Replace ``path`` with ``data`` so that readers see the old or the new content, never a mix."""
    tmp = temp_path(path)
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        remove_quietly(tmp)
        raise
    if durable:
        fsync_dir(os.path.dirname(os.path.abspath(path)))


def atomic_write_json(path: str, obj, durable: bool = True) -> None:
    """``atomic_write_bytes`` of pretty JSON; values JSON can't hold are written as ``str()``."""
    text = json.dumps(obj, indent=2, sort_keys=False, default=str, ensure_ascii=False)
    atomic_write_bytes(path, (text + "\n").encode("utf-8"), durable=durable)


def read_json(path: str, default=None):
    """Parsed JSON at ``path``; ``default`` when missing or unparsable."""
    try:
        with open(path, "rb") as f:
            return json.loads(f.read().decode("utf-8"))
    except (OSError, ValueError):
        return default
