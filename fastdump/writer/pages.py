"""Page-aligned, pre-faulted, reusable buffers for rows waiting for their segment file.

A segment stores all rows of one name as one dataset (docs/FORMAT.md), so rows of small tensors
wait in the writer until their segment is written. They are copied out of the ring exactly once,
into these pages. Because pages are aligned to ``ALIGN`` and sized in multiples of it, the segment
write can hand them to the kernel with O_DIRECT: the disk's DMA reads them and no CPU copies them
into the page cache, nor writes the page cache back later (segment_file.OpenSegment). And because
pages are reused from one segment to the next, the writer takes no page faults and makes no
munmap calls once its first segment is written. Profiles of the writer before this (a fresh
``bytes`` per record, then a buffered write) showed ~45% of its CPU in the kernel's page-cache
copy and ~20% in page faults and munmap (benchmarks/RESULTS.md).
"""

from __future__ import annotations

import mmap

from .. import _C

# O_DIRECT alignment that every Linux block device accepts (memory, offset, length); the ring
# starts large payloads on the same boundary (csrc/ring.h, kPageBytes).
ALIGN = _C.PAGE_BYTES
_copy_into = _C.copy_into  # page[offset:offset + n] = data, bypassing the shared last-level cache
MIN_PAGE = 16 << 10
MAX_PAGE = 1 << 20
SLAB_BYTES = 8 << 20  # pages are cut from slabs this large (one mmap, pre-faulted)

_SIZES = tuple(MIN_PAGE << i for i in range((MAX_PAGE // MIN_PAGE).bit_length()))


def page_size_for(nbytes: int, previous: int = 0) -> int:
    """The page to take next: enough for ``nbytes`` and at least twice the previous page, within
    [MIN_PAGE, MAX_PAGE], so a block needs few pages and a tiny block wastes little."""
    want = max(nbytes, 2 * previous, MIN_PAGE)
    for size in _SIZES:
        if size >= want:
            return size
    return MAX_PAGE


class PagePool:
    """Free lists of pages by size. One per writer: the writer loop is single-threaded.

    Memory grows to the most rows ever buffered at once (one segment: ``segment_mb``) and is kept
    for reuse; a writer process gives it back when it exits.
    """

    def __init__(self):
        self._free: dict = {size: [] for size in _SIZES}
        self._slabs: list = []
        self.allocated = 0  # bytes mapped

    def take(self, size: int) -> memoryview:
        free = self._free[size]
        if not free:
            self._grow(size)
        return free.pop()

    def give_back(self, pages: list) -> None:
        free = self._free
        for page in pages:
            free[page.nbytes].append(page)

    def _grow(self, size: int) -> None:
        count = max(1, SLAB_BYTES // size)
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)
        slab = mmap.mmap(-1, count * size, flags=flags)  # page-aligned by construction
        self._slabs.append(slab)
        view = memoryview(slab)
        self._free[size].extend(view[i * size:(i + 1) * size] for i in range(count))
        self.allocated += count * size


POOL = PagePool()


def byte_view(data) -> memoryview:
    """``data`` (any C-contiguous buffer) as a flat memoryview of bytes."""
    view = memoryview(data)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


class PageBuffer:
    """A byte stream (one block's rows, in order) stored in pool pages.

    Every page but the last is full; ``fill`` bytes of the last page are used.
    """

    __slots__ = ("pages", "fill", "nbytes")

    def __init__(self):
        self.pages: list = []
        self.fill = 0
        self.nbytes = 0

    def append(self, data, pool: PagePool = POOL) -> None:
        """Copy ``data`` (1-D bytes: ``bytes``, a uint8 array, a view into the ring) in."""
        pages = self.pages
        if pages:  # the common case, kept short: it fits in the current page
            fill = self.fill
            end = fill + len(data)
            page = pages[-1]
            if end <= page.nbytes:
                _copy_into(page, fill, data)  # streaming stores: the model's cache stays its own
                self.fill = end
                self.nbytes += end - fill
                return
        src = byte_view(data)
        n = src.nbytes
        pos = 0
        while pos < n:
            if not pages or self.fill == pages[-1].nbytes:
                pages.append(pool.take(page_size_for(n - pos, pages[-1].nbytes if pages else 0)))
                self.fill = 0
            page = pages[-1]
            k = min(page.nbytes - self.fill, n - pos)
            _copy_into(page, self.fill, src[pos:pos + k])
            self.fill += k
            pos += k
        self.nbytes += n

    def views(self) -> list:
        """Buffers covering the stream, in order (the last one cut to ``fill``)."""
        if not self.pages:
            return []
        return self.pages[:-1] + [self.pages[-1][:self.fill]]

    def split_aligned(self) -> tuple:
        """(body, tail): ``body`` are whole ``ALIGN`` multiples at aligned addresses (O_DIRECT can
        take them), ``tail`` is the rest, shorter than ``ALIGN``, to be written through the cache."""
        if not self.pages:
            return [], None
        cut = self.fill - self.fill % ALIGN
        last = self.pages[-1]
        body = self.pages[:-1] + ([last[:cut]] if cut else [])
        return body, (last[cut:self.fill] if cut < self.fill else None)

    def free(self, pool: PagePool = POOL) -> None:
        pool.give_back(self.pages)
        self.pages = []
        self.fill = 0
        self.nbytes = 0
