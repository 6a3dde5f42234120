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

from .. import _C

# O_DIRECT alignment that every Linux block device accepts (memory, offset, length); the ring
# starts large payloads on the same boundary (csrc/ring.h, kPageBytes).
ALIGN = _C.PAGE_BYTES
MIN_PAGE = _C.MIN_PAGE
MAX_PAGE = _C.MAX_PAGE
page_size_for = _C.page_size_for  # enough for nbytes and at least twice the previous page

# PagePool(): free lists of pre-faulted pages by size (PageBuffer() without a pool: the process's).
# PageBuffer(pool=None): append(data), views(), split_aligned() -> (body, tail), free(), nbytes,
# rows; views are read-only and valid until free() gives the pages back for reuse.
PagePool = _C.PagePool
PageBuffer = _C.PageBuffer


def byte_view(data) -> memoryview:
    """``data`` (any C-contiguous buffer) as a flat memoryview of bytes."""
    view = memoryview(data)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")
