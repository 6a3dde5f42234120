"""Write one complete segment file (layout in docs/FORMAT.md) and publish it atomically.

The file is built as ``.seg-NNNNNN.h5.tmp``, closed, fsynced, renamed to ``seg-NNNNNN.h5`` and the
directory fsynced: a visible segment is always complete. On any error the temporary file is removed
and the error propagates; nothing half-written ever carries a ``seg-*.h5`` name.

Speed notes (docs/DESIGN.md, "Facts the design rests on"): every HDF5 object costs tens of microseconds, so the caller hands over whole
blocks (all rows of one name and layout in the segment); datasets are created with the low-level API
(~16 us instead of ~55 us through ``create_dataset``), contiguous, no compression, and each block is
written in as few write calls as possible.
"""

from __future__ import annotations

import errno
import json
import logging
import math
import os
import resource
import signal
import sys
import threading
from concurrent.futures import Future, ThreadPoolExecutor

import h5py
import numpy as np
from h5py import h5a, h5d, h5p, h5s, h5t

from .. import dtypes, fsutil
from .. import format as fmt
from .pages import ALIGN, PageBuffer, byte_view

log = logging.getLogger("fastdump.writer")

# A block's rows go to the file in one gathered write (pwritev) of at most this many buffers.
_IOV_MAX = min(os.sysconf("SC_IOV_MAX"), 1024) if hasattr(os, "sysconf") else 1024


class Block:
    """Rows of one tensor name with one dtype and one row shape, waiting to become ``blocks/<n>``.

    ``data`` (a pages.PageBuffer) holds the rows' bytes in row order and counts them (``rows``);
    the writer's C++ fast path appends to it too. A block written straight to the file
    (OpenSegment.write_direct) has its rows set once."""

    __slots__ = ("number", "name_slot", "code", "row_shape", "scalar", "data", "written")

    def __init__(self, number: int, name_slot: int, code: int, row_shape: tuple, scalar: bool):
        self.number = number
        self.name_slot = name_slot
        self.code = code
        self.row_shape = row_shape
        self.scalar = scalar  # rows are 0-d tensors
        self.data = PageBuffer()
        self.written = False  # already in the file (OpenSegment.write_direct)

    @property
    def rows(self) -> int:
        return self.data.rows

    @rows.setter
    def rows(self, value: int) -> None:
        self.data.rows = value

    @property
    def row_bytes(self) -> int:
        return dtypes.ITEMSIZE[self.code] * math.prod(self.row_shape)


_VLEN_STR = h5t.py_create(h5py.string_dtype(), logical=True)
_INT64 = h5t.py_create(np.dtype("<i8"))
_FLOAT64 = h5t.py_create(np.dtype("<f8"))
_FILE_TYPES: dict = {}


def _file_type(storage: np.dtype):
    tid = _FILE_TYPES.get(storage)
    if tid is None:
        tid = _FILE_TYPES[storage] = h5t.py_create(storage, logical=True)
    return tid


_SCALAR = h5s.create(h5s.SCALAR)  # one dataspace for every scalar attribute (read-only to HDF5)
_STR_VALUES: dict = {}  # str -> its attribute value: the dtype and encoding names repeat per block


def _str_attr(obj_id, name: bytes, value: str) -> None:
    encoded = _STR_VALUES.get(value)
    if encoded is None:
        encoded = np.array(value.encode("utf-8"), dtype=object)
        if len(_STR_VALUES) < 256:
            _STR_VALUES[value] = encoded
    h5a.create(obj_id, name, _VLEN_STR, _SCALAR).write(encoded)


def _int_attr(obj_id, name: bytes, value: int) -> None:
    attr = h5a.create(obj_id, name, _INT64, _SCALAR)
    attr.write(np.array(value, dtype="<i8"))


def _float_attr(obj_id, name: bytes, value: float) -> None:
    attr = h5a.create(obj_id, name, _FLOAT64, _SCALAR)
    attr.write(np.array(value, dtype="<f8"))


def _pwritev_all(fd: int, buffers: list, offset: int) -> None:
    """Write ``buffers`` back to back at ``offset``: gathered, so small rows need no joining copy."""
    views = [v for v in map(byte_view, buffers) if v.nbytes]
    while views:
        batch = views[:_IOV_MAX]
        written = os.pwritev(fd, batch, offset)
        offset += written
        # pwritev may write less than asked: drop what is done, keep the rest of a cut buffer.
        while views and written >= views[0].nbytes:
            written -= views[0].nbytes
            views.pop(0)
        if written:
            views[0] = views[0][written:]


def _create_dataset(group_id, block: Block, dcpl=None, name: bytes = None):
    """``block``'s dataset, named by its number (or ``name`` until it has one: OpenSegment.number_block)."""
    storage = dtypes.STORAGE[block.code]
    shape = (block.rows,) + block.row_shape
    dset = h5d.create(group_id, name or str(block.number).encode(), _file_type(storage), h5s.create_simple(shape),
                      dcpl=dcpl)
    _str_attr(dset, fmt.ATTR_DTYPE.encode(), dtypes.NAMES[block.code])
    _str_attr(dset, fmt.ATTR_ENCODING.encode(), dtypes.ENCODING[block.code])
    if block.scalar:
        _int_attr(dset, fmt.ATTR_SCALAR.encode(), 1)
    if name is None:
        _block_crc_attr(dset, block)
    return dset


def _block_crc_attr(dset, block: Block) -> None:
    _int_attr(dset, fmt.ATTR_BLOCK_CRC.encode(), fmt.block_crc32c(block.number, dtypes.NAMES[block.code],
                                                                  dtypes.ENCODING[block.code], block.scalar,
                                                                  block.row_shape))


def no_direct_io() -> bool:
    """FASTDUMP_NO_DIRECT_IO set to anything but 0/false/no/off/empty (=0 turned O_DIRECT off)."""
    return os.environ.get("FASTDUMP_NO_DIRECT_IO", "").strip().lower() not in ("", "0", "false", "no", "off")


def _open_direct(path: str):
    """A second descriptor with O_DIRECT, or None where the file system refuses it (tmpfs before
    Linux 6.6, some network and FUSE file systems) or the platform lacks it."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag or no_direct_io():
        return None
    try:
        return os.open(path, os.O_WRONLY | flag)
    except OSError:
        return None


def refuse_file_size_signal() -> None:
    """Block SIGXFSZ in the calling thread (a writer loop's, an I/O thread's): a write past the file
    size limit (``ulimit -f``) then fails with EFBIG in that thread, and the channel fails loudly.
    Unblocked, the kernel sends SIGXFSZ, whose default action killed a serving process whose writer
    was a thread (a process that set SIG_DFL for it; the Python interpreter starts with it ignored).
    The signal is sent to the writing thread alone, so blocking it there is enough; it stays
    pending on that thread, never delivered."""
    if hasattr(signal, "pthread_sigmask") and hasattr(signal, "SIGXFSZ"):
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGXFSZ})


def error_text(exc: BaseException) -> str:
    """``exc`` as a channel's error; a write over the file size limit names the limit (h5py
    reports it as a RuntimeError whose text carries HDF5's ``errno = 27``)."""
    text = f"{type(exc).__name__}: {exc}"
    over_limit = getattr(exc, "errno", None) == errno.EFBIG or f"errno = {errno.EFBIG}," in str(exc)
    if over_limit:
        limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
        if limit != resource.RLIM_INFINITY:
            text += (f" (a segment file reached this process's file size limit, ulimit -f, of {limit} bytes: "
                     "raise it or lower segment_mb / segment_passes)")
    return text


IO_THREADS = 4
_IO_POOL = None


def _io_thread_start() -> None:
    """An I/O thread's start: it writes block data, so it refuses SIGXFSZ as its writer loop does
    (threads inherit their creator's mask; this does not depend on who created the pool)."""
    refuse_file_size_signal()


def start_io_threads() -> None:
    """Make every I/O thread now, from the calling thread, whose priority they take. A writer
    process calls it before it lowers itself to SCHED_IDLE (writer/__main__.py, settle): the I/O
    threads use almost no CPU (they wait on the disk), and an idle-priority one woken by its disk
    could wait seconds for a CPU. Made later by the idle loop, they could not raise themselves back
    without CAP_SYS_NICE (an ordinary user's SCHED_IDLE thread gets EPERM). Never raises: a pool
    not made here is made at the first segment, as in a writer thread."""
    try:
        pool = _io_threads()
        # Each task holds its thread until all are running, so the pool starts a thread per task
        # (it reuses an idle thread when it has one).
        started = threading.Barrier(IO_THREADS + 1)
        for _ in range(IO_THREADS):
            pool.submit(started.wait, 10)
        started.wait(10)
    except Exception as exc:  # (a broken barrier, no threads left to make)
        log.warning("fastdump writer: I/O threads not started early: %s", exc)


def _io_threads() -> ThreadPoolExecutor:
    """Threads that run block writes; they wait on the disk with the GIL released."""
    global _IO_POOL
    with _IO_LOCK:
        if _IO_POOL is None:
            _IO_POOL = ThreadPoolExecutor(max_workers=IO_THREADS, thread_name_prefix="fastdump-io",
                                          initializer=_io_thread_start)
        return _IO_POOL


_IO_LOCK = threading.Lock()
fsutil.renew_locks_at_fork(sys.modules[__name__], "_IO_LOCK")
_IO_HOLDERS = 0  # writer loops running in this process (loop.run_consumer)


def _forget_the_parents_io_threads() -> None:
    """In a child made by os.fork(): the parent's pool came along, its threads did not (only the
    forking thread is copied), nor do the parent's writer loops run here. A block write handed to
    that pool waited for good: a writer thread the child started never wrote a segment, its close
    timed out and every pass was lost."""
    global _IO_POOL, _IO_HOLDERS
    _IO_POOL, _IO_HOLDERS = None, 0


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_the_parents_io_threads)


def hold_io_threads() -> None:
    """A writer loop starts: the I/O threads (made at its first segment) stay until it ends."""
    global _IO_HOLDERS
    with _IO_LOCK:
        _IO_HOLDERS += 1


def release_io_threads() -> None:
    """A writer loop ended: with the process's last one, its I/O threads end too. A writer THREAD
    in the serving process leaves none behind after close() (they idled there for good)."""
    global _IO_HOLDERS, _IO_POOL
    with _IO_LOCK:
        _IO_HOLDERS = max(0, _IO_HOLDERS - 1)
        if _IO_HOLDERS or _IO_POOL is None:
            return
        pool, _IO_POOL = _IO_POOL, None
        # Its threads are idle: every segment write waits for its block writes (finish_writes).
        pool.shutdown(wait=True)


def _run_inline(fn, *args) -> Future:
    """``fn(*args)`` run here, as a finished Future."""
    future = Future()
    try:
        future.set_result(fn(*args))
    except BaseException as exc:
        future.set_exception(exc)
    return future


class OpenSegment:
    """A segment's temporary file, opened before the segment is complete.

    Every dataset is allocated at creation, without fill, so its offset in the file is known, and
    its bytes are written there by ``pwritev`` rather than through HDF5: HDF5 needs one contiguous
    buffer per write, which for rows gathered over many passes would cost a joining copy per block.

    Buffered rows sit in page-aligned pages (pages.PageBuffer) and HDF5 aligns every allocation of
    ``ALIGN`` bytes or more, so all of a block but its last partial ``ALIGN`` bytes goes to the
    disk with O_DIRECT: no CPU copy into the page cache and no write-back later, which on a busy
    CPU is time taken from the model. The tail goes through the page cache (O_DIRECT needs whole
    blocks). Without O_DIRECT (file system, or FASTDUMP_NO_DIRECT_IO=1) every write is buffered.

    Large tensors go straight from the ring's memory into the file as they arrive
    (``write_direct``), with O_DIRECT too (the ring starts them on a page). The rest of the
    segment is written by ``write_segment(..., open_segment=self)``.
    """

    def __init__(self, directory: str, number: int):
        self.temp_path = os.path.join(directory, fmt.segment_temp_name(number))
        self.final_path = os.path.join(directory, fmt.segment_name(number))
        self.number = number
        self._fd = self._direct_fd = None
        self._direct_ok = False
        self._queued: list = []  # (body, tail, offset, whole) of blocks created, not yet written
        self._inflight: list = []  # groups of block writes running on the I/O threads
        self.direct_bytes = 0  # bytes written with O_DIRECT (tests, stats)
        try:
            self.file = h5py.File(self.temp_path, "w", libver="latest", locking=False,
                                  alignment_threshold=ALIGN, alignment_interval=ALIGN)
        except BaseException:
            fsutil.remove_quietly(self.temp_path)  # HDF5 may have created it before failing (disk full)
            raise
        try:
            self.blocks_group = self.file.create_group(fmt.BLOCKS).id
            self._fd = os.open(self.temp_path, os.O_WRONLY)
            self._direct_fd = _open_direct(self.temp_path)
        except BaseException:
            self.abort()
            raise
        self._dcpl = h5p.create(h5p.DATASET_CREATE)
        self._dcpl.set_alloc_time(h5d.ALLOC_TIME_EARLY)
        self._dcpl.set_fill_time(h5d.FILL_TIME_NEVER)
        self._direct_ok = self._direct_fd is not None

    def write_direct(self, block: Block, data) -> None:
        """Create ``block``'s dataset and write ``data`` (all its rows, C order) into it."""
        offset = self._create(block)
        if offset is not None:
            self.write_at(offset, data)

    def create_unnumbered(self, block: Block, name: str):
        """Create the dataset of ``block`` (its rows set, its number not yet) under the temporary
        ``name``, for writes that come later (``write_at``): its file offset, or None when it holds
        no bytes. ``number_block`` gives it its number once all its bytes are in; ``drop_unnumbered``
        takes it out if they never come. Numbers are given only to whole blocks, so a segment's
        blocks stay numbered 0..n-1 whatever is dropped."""
        dset = _create_dataset(self.blocks_group, block, self._dcpl, name=name.encode())
        if block.rows * math.prod(block.row_shape) == 0:
            return None
        offset = dset.get_offset()
        if offset is None:
            raise OSError(f"HDF5 allocated no contiguous storage for {name}")
        return offset

    def number_block(self, block: Block, name: str) -> None:
        """The dataset made as ``name`` becomes ``blocks/<block.number>``, with its block CRC."""
        self.blocks_group.move(name.encode(), str(block.number).encode())
        _block_crc_attr(h5d.open(self.blocks_group, str(block.number).encode()), block)
        block.written = True

    def drop_unnumbered(self, name: str) -> None:
        """Take out a dataset whose bytes will never all come (a torn tensor): unlinked, it is no
        block of the segment (its bytes stay unused in the file)."""
        self.blocks_group.unlink(name.encode())

    def write_at(self, offset: int, data) -> None:
        """Write ``data`` at ``offset`` in the file: with O_DIRECT where both are page-aligned."""
        view = byte_view(data)
        cut = view.nbytes - view.nbytes % ALIGN
        # The ring starts large payloads on a page (csrc/ring.cpp, kPageAlignedBytes).
        # Synchronous: ``data`` may be a view into the ring, given back once this returns.
        if cut and np.frombuffer(view, dtype=np.uint8).ctypes.data % ALIGN == 0:
            self.direct_bytes += self._write_aligned([view[:cut]], view[cut:] if cut < view.nbytes else None,
                                                     offset, [view])
        else:
            _pwritev_all(self._fd, [view], offset)

    def write_block(self, block: Block) -> None:
        """Create ``block``'s dataset and queue the write of its buffered rows (``block.data``).

        ``finish_writes()`` runs the queued writes on the I/O threads and waits for them:
        an O_DIRECT write returns only when the device has the data, so one block after another
        would wait out the disk's latency each time (8 KiB tensors/s fell by a third on this
        project's virtual disk). ``block.data`` must stay untouched until then.
        """
        offset = self._create(block)
        if offset is not None:
            body, tail = block.data.split_aligned()
            self._queued.append((body, tail, offset, block.data.views()))

    def _start_writes(self) -> None:
        """The queued block writes, in one job per I/O thread of about equal bytes: a segment of
        ~100 small blocks costs a handful of thread hand-offs, not one per block (issue 11: the
        writer's CPU per segment was dominated by per-block work)."""
        queued, self._queued = self._queued, []
        if not queued:
            return
        groups = [[] for _ in range(min(IO_THREADS, len(queued)))]
        sizes = [0] * len(groups)
        for nbytes, job in sorted(((sum(v.nbytes for v in job[3]), job) for job in queued), key=lambda e: -e[0]):
            k = sizes.index(min(sizes))  # the lightest group so far takes the next largest block
            groups[k].append(job)
            sizes[k] += nbytes
        pool = _io_threads()
        for group in groups:
            try:
                future = pool.submit(self._write_group, group)
            except RuntimeError:
                # "cannot schedule new futures after interpreter shutdown": concurrent.futures stops
                # every pool before the atexit hooks run, where a writer THREAD writes the final
                # segments of the Dumpers closed at exit (engine._shutdown_at_exit). Write here.
                future = _run_inline(self._write_group, group)
            self._inflight.append(future)

    def _write_group(self, jobs: list) -> int:
        return sum(self._write_aligned(*job) for job in jobs)

    def finish_writes(self) -> None:
        """Write the queued blocks and wait for every block write; raise the first error once all
        have ended."""
        self._start_writes()
        inflight, self._inflight = self._inflight, []
        error = None
        for future in inflight:
            try:
                self.direct_bytes += future.result()
            except BaseException as exc:
                error = error or exc
        if error is not None:
            raise error

    def _write_aligned(self, body: list, tail, offset: int, whole: list) -> int:
        """``body`` (aligned, whole ALIGN multiples) with O_DIRECT, then ``tail`` through the page
        cache; or ``whole`` (the same bytes) buffered where O_DIRECT cannot be used. Returns the
        bytes written with O_DIRECT. Runs on several threads at once for one segment."""
        if not self._direct_ok or offset % ALIGN:
            _pwritev_all(self._fd, whole, offset)
            return 0
        try:
            _pwritev_all(self._direct_fd, body, offset)
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
            # The device wants a larger alignment than ALIGN: buffered from now on (the descriptor
            # stays open until close_fd: other threads may be using it).
            self._direct_ok = False
            _pwritev_all(self._fd, whole, offset)
            return 0
        written = sum(v.nbytes for v in body)
        if tail is not None:
            _pwritev_all(self._fd, [tail], offset + written)
        return written

    def _create(self, block: Block):
        """Create the block's dataset; its file offset, or None when it holds no bytes."""
        dset = _create_dataset(self.blocks_group, block, self._dcpl)
        block.written = True
        if block.rows * math.prod(block.row_shape) == 0:
            return None  # no elements: HDF5 allocates no storage, there is nothing to write
        offset = dset.get_offset()
        if offset is None:
            raise OSError(f"HDF5 allocated no contiguous storage for block {block.number}")
        return offset

    def close_fd(self) -> None:
        try:
            self.finish_writes()  # never close a descriptor an I/O thread is still writing to
        finally:
            self._close_fds()

    def _close_fds(self) -> None:
        for name in ("_fd", "_direct_fd"):
            fd = getattr(self, name, None)
            if fd is not None:
                setattr(self, name, None)
                os.close(fd)

    def abort(self) -> None:
        """Drop the temporary file (an error, or a failed channel)."""
        self._queued = []  # never started: nothing to wait for
        try:
            self.close_fd()
        except Exception:
            pass
        try:
            self.file.close()
        except Exception:
            pass
        fsutil.remove_quietly(self.temp_path)


def _json_ascii(obj) -> str:
    # ensure_ascii: any character (NUL, lone surrogates) survives as a JSON escape.
    return json.dumps(obj, ensure_ascii=True, default=str)


def write_segment(
    directory: str,
    number: int,
    *,
    names: list,
    blocks: list,
    index: np.ndarray,
    passes: np.ndarray,
    pass_meta: list,
    attrs: dict,
    open_segment: OpenSegment = None,
) -> str:
    """Write and publish ``seg-<number>.h5``; return its path.

    ``blocks`` give their pages back to the pool once written (or on failure). ``index``/``passes`` use ``format.INDEX_DTYPE``/``PASS_DTYPE``; ``pass_meta`` is a
    list of JSON-able dicts aligned with ``passes``; ``attrs`` go on the file's root group.
    """
    segment = open_segment if open_segment is not None else OpenSegment(directory, number)
    try:
        for block in blocks:
            if not block.written:
                segment.write_block(block)
        segment.finish_writes()
        for block in blocks:
            block.data.free()
        segment.close_fd()  # the raw data is in; HDF5 writes the rest and its metadata
        with segment.file as f:
            root = f.id
            _str_attr(root, b"format", fmt.FORMAT_NAME)
            _int_attr(root, b"format_version", fmt.FORMAT_VERSION)
            _int_attr(root, b"segment", number)
            for key, value in attrs.items():
                if isinstance(value, (bool, np.bool_)):
                    _int_attr(root, key.encode(), int(value))
                elif isinstance(value, (int, np.integer)):
                    _int_attr(root, key.encode(), int(value))
                elif isinstance(value, (float, np.floating)):
                    _float_attr(root, key.encode(), float(value))
                else:
                    _str_attr(root, key.encode(), value if isinstance(value, str) else _json_ascii(value))

            names_text = _json_ascii(list(names))
            meta_texts = [_json_ascii(m) for m in pass_meta]
            _int_attr(root, fmt.ATTR_TABLES_CRC.encode(), fmt.tables_crc32c(names_text, index, passes, meta_texts))
            f.create_dataset(fmt.NAMES, data=names_text, dtype=h5py.string_dtype())
            f.create_dataset(fmt.INDEX, data=index)
            f.create_dataset(fmt.PASSES, data=passes)
            f.create_dataset(
                fmt.PASS_META,
                data=np.array(meta_texts, dtype=object),
                dtype=h5py.string_dtype(),
                shape=(len(pass_meta),),
            )
        fsutil.publish(segment.temp_path, segment.final_path)
    except BaseException:
        segment.abort()
        for block in blocks:
            block.data.free()  # back to the pool: the channel fails, nothing will write them
        raise
    return segment.final_path
