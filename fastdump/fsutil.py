"""Crash-safe small file writes, and the guarded opens and reads of a dump's small files.

A reader (or a human with ``cat``) must never see a half-written ``rank.json`` or ``fastdump.json``:
we write a temporary file in the same directory, fsync it, rename it over the target (atomic on
POSIX) and fsync the directory so the rename itself survives a crash.

A dump may come from someone else: ``open_regular`` and ``load_json`` open only regular files
(never following a link, never blocking on a FIFO) and read JSON of bounded size, each key once.
``pid_alive`` says whether the process that wrote a file or region still exists (``process_identity``
tells it from a later process given the same pid).
"""

from __future__ import annotations

import errno
import itertools
import json
import os
import stat
import sys
import threading
import weakref

# Temporary names start with '.' and end with '.tmp': readers skip them, `fastdump verify` reports
# leftovers. pid + counter + random bits keep concurrent writers of one target (several ranks writing
# the run manifest, two threads; two containers whose processes are both pid 1 on one shared root,
# whose counters both start at 0) from clobbering each other's temporary file.
TMP_SUFFIX = ".tmp"
_counter = itertools.count()
_counter_lock = threading.Lock()


def renew_locks_at_fork(owner, *names: str) -> None:
    """Give each plain lock ``owner.<name>`` (a module's or a class's) a fresh one in every child
    that ``os.fork()`` makes. A lock another thread of the parent held at the fork (an attach
    starting the writer process, a temporary file being named) is held for good in the child, whose
    first attach then waited forever (a data loader or a worker pool forking beside a serving thread)."""
    if hasattr(os, "register_at_fork"):
        os.register_at_fork(after_in_child=lambda: [setattr(owner, name, threading.Lock()) for name in names])


renew_locks_at_fork(sys.modules[__name__], "_counter_lock")


_NAME_MAX = 255  # bytes of one file name (Linux file systems)


def temp_path(path: str, unique: bool = True) -> str:
    """Temporary sibling of ``path``: ``.<name>.<pid>-<n>.tmp`` (or ``.<name>.tmp`` if not unique).
    A long ``name`` is cut (on a character boundary) so that the whole fits in a file name: a role
    of 255 bytes is allowed, and its marker's temporary name failed with ENAMETOOLONG at attach."""
    directory, name = os.path.split(os.fspath(path))
    if unique:
        with _counter_lock:
            n = next(_counter)
        tail = f".{os.getpid()}-{n}-{os.urandom(4).hex()}{TMP_SUFFIX}"
    else:
        tail = TMP_SUFFIX
    room = _NAME_MAX - 1 - len(tail.encode())
    encoded = os.fsencode(name)
    if len(encoded) > room:
        name = encoded[:room].decode("utf-8", "ignore")
    return os.path.join(directory, f".{name}{tail}")


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


class DirAnchor:
    """A directory held open, and the path that reaches it through that descriptor.

    A writer that names its files by the directory's path writes wherever that path leads NOW: a
    rank directory renamed and replaced by a symbolic link during a run sent the next segment,
    rank.json and producer_error.json out of the dump (issue: "writer uses paths, not directory
    handles"). Held open (``O_DIRECTORY | O_NOFOLLOW``), the directory is the one that was created,
    wherever it is moved; files are never created in one deleted under it (ENOENT), nor through a
    link put in its place. ``path`` is ``/proc/self/fd/<fd>``, which the kernel resolves through the
    descriptor, so HDF5 (which opens by name) and every path-based call here stay inside it; where
    /proc is missing (not Linux, a chroot) it is the plain path, whose identity each ``join`` checks
    (a directory moved or replaced stops the writing there). ``shown`` is what messages say.
    """

    _PROC_FD = "/proc/self/fd"

    def __init__(self, directory: str):
        self.shown = os.path.abspath(os.fspath(directory))
        flags = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_NOFOLLOW", 0)
        self.fd = os.open(self.shown, flags)  # raises OSError: missing, not a directory, a link
        info = os.fstat(self.fd)
        self._identity = (info.st_dev, info.st_ino)
        anchored = f"{self._PROC_FD}/{self.fd}"
        self.path = anchored if os.path.isdir(anchored) else self.shown
        # Closed with its owner (a Dumper dropped without close()): one descriptor per attach otherwise.
        self._finalizer = weakref.finalize(self, _close_if_held, self.fd, self._identity)

    def join(self, name: str) -> str:
        """The path of ``name`` in the held directory. Raises OSError once closed, or once the
        descriptor is no longer the directory's: a program's ``os.closerange`` (daemonizing, or
        before running a child) closes it under us, and the number may then name another open file
        or directory, whose /proc path must never be written to."""
        if self.fd is None:
            raise OSError(f"{self.shown}: closed for writing")
        if self.path != self.shown and not _holds(self.fd, self._identity):
            self.fd = None
            self._finalizer.detach()  # (the number is someone else's now: never closed by us)
            raise OSError(f"{self.shown}: its held descriptor was closed by someone else (os.closerange?); "
                          "nothing more is written there")
        if self.path == self.shown and not _is_at(self.shown, self._identity):
            # No /proc (a chroot, a container without it): the plain path, which a rename, deletion
            # or link put in the directory's place leads elsewhere. Checked, so such a change stops
            # the writing loudly instead of sending the next files out of the dump.
            raise OSError(f"{self.shown}: no longer the directory created there (renamed, deleted or "
                          "replaced), and without /proc/self/fd it cannot be reached otherwise; "
                          "nothing more is written there")
        return os.path.join(self.path, name)

    def readable(self, text: str) -> str:
        """``text`` (an error message) with the descriptor's path replaced by the directory's."""
        return text.replace(self.path, self.shown) if self.path != self.shown else text

    def close(self) -> None:
        """Close the descriptor, when it is still the directory's (twice: nothing)."""
        self.fd = None
        self._finalizer()


def _holds(fd: int, identity: tuple) -> bool:
    """Whether descriptor ``fd`` is still open on the directory of ``identity`` (st_dev, st_ino)."""
    try:
        info = os.fstat(fd)
    except OSError:
        return False
    return (info.st_dev, info.st_ino) == identity


def _is_at(path: str, identity: tuple) -> bool:
    """Whether ``path`` itself (not a link's target) is the directory of ``identity``."""
    try:
        info = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISDIR(info.st_mode) and (info.st_dev, info.st_ino) == identity


def _close_if_held(fd: int, identity: tuple) -> None:
    if _holds(fd, identity):
        os.close(fd)


def remove_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def atomic_write_bytes(path: str, data: bytes, durable: bool = True) -> None:
    """Replace ``path`` with ``data`` so that readers see the old or the new content, never a mix.
    An OSError names ``path``, never the temporary file the caller did not ask for (`fastdump diff
    --html /proc/x` said "No such file or directory: '/proc/.x.123-0-....tmp'")."""
    tmp = temp_path(path)
    try:
        f = open(tmp, "xb")  # exclusive: never another writer's file (nor removed below), whatever the name
    except OSError as exc:
        raise OSError(exc.errno, exc.strerror, path) from None
    try:
        with f:
            f.write(data)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        remove_quietly(tmp)
        raise OSError(exc.errno, exc.strerror, path) from None
    except BaseException:
        remove_quietly(tmp)
        raise
    if durable:
        fsync_dir(os.path.dirname(os.path.abspath(path)))


def atomic_write_json(path: str, obj, durable: bool = True) -> None:
    """``atomic_write_bytes`` of pretty JSON; values JSON can't hold are written as ``str()``."""
    text = json.dumps(obj, indent=2, sort_keys=False, default=str, ensure_ascii=False)
    atomic_write_bytes(path, (text + "\n").encode("utf-8"), durable=durable)


def create_json_once(path: str, obj) -> bool:
    """Create ``path`` holding ``obj`` as pretty JSON, whole, unless something is there already:
    True when this call made it, False when it was there (then nothing is changed). The text goes to
    a temporary file first, which is then hard-linked to ``path`` (``link`` fails where ``path``
    exists, atomically, where a rename replaces): "if absent, write" as a check then a rename let two
    processes attaching to one root at once both find fastdump.json absent, and the later rename
    replaced the record the first had written and read back. On a file system without hard links the
    file is created with O_EXCL and written in place (a reader may then see it half written)."""
    text = json.dumps(obj, indent=2, sort_keys=False, default=str, ensure_ascii=False)
    data = (text + "\n").encode("utf-8")
    tmp = temp_path(path)
    try:
        with open(tmp, "xb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, path)
        except FileExistsError:
            return False
        except OSError as exc:
            if exc.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EMLINK, errno.ENOSYS):
                raise
            try:  # (no hard links here: exclusive creation still makes one record, never a second)
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o644)
            except FileExistsError:
                return False
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
    except OSError as exc:
        raise OSError(exc.errno, exc.strerror, path) from None
    finally:
        remove_quietly(tmp)
    fsync_dir(os.path.dirname(os.path.abspath(path)))
    return True


# rank.json and fastdump.json are small; a larger file is damage (or /dev/zero behind a link).
MAX_JSON_BYTES = 64 << 20


_FILE_KINDS = ((stat.S_ISREG, "a regular file"), (stat.S_ISCHR, "a character device"),
               (stat.S_ISBLK, "a block device"), (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISSOCK, "a socket"))


def why_not_a_directory(path) -> str:
    """Why ``path`` is no directory that can be listed, in plain words; "" when it is one. Readers
    said "no such directory" for /dev/null, a regular file, a FIFO, a symbolic link loop and a
    directory under one they may not search alike, and a raw "[Errno 13] ..." for one they may
    not list. (Opening the directory is the test: nothing in it is read.)"""
    path = os.fspath(path)
    try:
        mode = os.stat(path).st_mode
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return "a symbolic link loop (too many levels of symbolic links)"
        if exc.errno == errno.ENOENT and os.path.islink(path):
            return "a symbolic link to nothing"
        if exc.errno == errno.ENOENT:
            return "no such file or directory"
        if exc.errno == errno.ENOTDIR:
            return "cannot be reached: a part of its path is not a directory"
        if exc.errno == errno.EACCES:
            return "cannot be reached: permission denied on a directory above it"
        return f"cannot be reached: {exc.strerror or exc}"
    if not stat.S_ISDIR(mode):
        kind = next((name for test, name in _FILE_KINDS if test(mode)), "not a directory")
        return f"not a directory: {kind}" if kind != "not a directory" else kind
    try:
        with os.scandir(path):
            pass
    except OSError as exc:
        return f"cannot be listed: {exc.strerror or exc}"
    return ""


def is_regular_file(path: str) -> bool:
    """True for a regular file that is not a symbolic link (a FIFO would hang a reader)."""
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False


def is_real_dir(path: str) -> bool:
    """True for a directory that is not a symbolic link (readers never follow links out of a dump)."""
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        return False


def open_regular(path: str):
    """(descriptor open for reading, its fstat) of a regular file at ``path``: never follows a link
    nor blocks on a FIFO or device. Raises FileNotFoundError when missing, ValueError saying why
    otherwise. The caller closes the descriptor."""
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise ValueError(f"cannot open ({exc.strerror or exc}; symbolic links are not followed)") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ValueError("not a regular file")
    except BaseException:
        os.close(fd)
        raise
    return fd, info


def load_json(path: str, max_bytes: int = MAX_JSON_BYTES):
    """Parsed JSON at ``path``, read only if it is a regular file (no link, FIFO or device) of at
    most ``max_bytes``. Raises FileNotFoundError when missing, ValueError saying why otherwise."""
    fd, info = open_regular(path)
    try:
        if info.st_size > max_bytes:
            raise ValueError(f"{info.st_size} bytes, more than the {max_bytes} a JSON file here may have")
        chunks, total = [], 0
        while total <= max_bytes:
            chunk = os.read(fd, min(1 << 20, max_bytes + 1 - total))
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
        if total > max_bytes:
            raise ValueError(f"more than {max_bytes} bytes")
    finally:
        os.close(fd)
    try:
        return json.loads(b"".join(chunks).decode("utf-8"), object_pairs_hook=unique_keys)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:  # RecursionError: nesting too deep
        raise ValueError(f"not valid JSON ({exc})") from None


def unique_keys(pairs: list) -> dict:
    """A JSON object whose keys are all different: json keeps the last of two, which would let a
    damaged or crafted file say one thing to one reader and another to the next."""
    obj = dict(pairs)
    if len(obj) != len(pairs):
        seen = set()
        again = next(key for key, _ in pairs if key in seen or seen.add(key))
        raise ValueError(f"key {again!r} appears twice in one object")
    return obj


def pid_alive(pid: int, identity=None) -> bool:
    """Whether process ``pid`` (> 0) exists on this host: the writer of a rank directory or of a
    shared-memory region. A process we may not signal exists; a pid too large for the kernel
    (a crafted name or rank.json) does not, where ``os.kill`` raised OverflowError. ``identity``:
    what ``process_identity`` said of that process then (rank.json's ``pid_identity``); a process
    of that pid with another identity is another process (the pid reused after the writer's died,
    or after a reboot), and the one meant is gone. Unknown (no /proc): the pid alone decides."""
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):
        return False
    except OSError:  # EPERM: someone else's process
        pass
    if isinstance(identity, str) and identity:
        now = process_identity(pid)
        return now is None or now == identity
    return True


def proc_stat_fields(pid: int):
    """The fields of Linux ``/proc/PID/stat`` after the command name (``fields[0]`` is field 3 of
    proc(5), the state), or None where it cannot be read. The command name (field 2) is in
    parentheses and may hold spaces and ')': split after the last one."""
    try:
        with open(f"/proc/{int(pid)}/stat", "rb") as f:
            stat_line = f.read()
        return stat_line[stat_line.rindex(b")") + 2:].split()
    except (OSError, ValueError, OverflowError):
        return None


def process_identity(pid: int):
    """``"<boot id>/<start time in clock ticks since boot>"`` of process ``pid`` (Linux /proc), or
    None where it cannot be read. A pid is reused; this pair is not: the start time is counted
    from boot, so neither a wall-clock step nor a pid reused after a reboot (a restarted
    container's pid 1) makes another process look like the one that wrote a directory."""
    fields = proc_stat_fields(pid)
    if fields is None:
        return None
    try:
        with open("/proc/sys/kernel/random/boot_id", "rb") as f:
            boot = f.read().strip().decode("ascii")
        return f"{boot}/{int(fields[19])}"  # field 22 of proc(5): starttime
    except (OSError, ValueError, IndexError, UnicodeDecodeError):
        return None
