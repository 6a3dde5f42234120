// Rows buffered for a segment, and the writer's fast path (see writer_rows.h).
#include "writer_rows.h"

#include <pthread.h>
#include <sys/mman.h>

#include <cstring>
#include <new>

#include "crc32c.h"
#include "ring.h"
#include "strided_copy.h"

namespace fastdump {

size_t page_size_for(size_t nbytes, size_t previous) {
  // Enough for `nbytes` and at least twice the previous page: a block needs few pages, a tiny
  // block wastes little.
  size_t want = nbytes > 2 * previous ? nbytes : 2 * previous;
  for (size_t size = kMinPage; size < kMaxPage; size <<= 1)
    if (size >= want) return size;
  return kMaxPage;
}

static int size_class(size_t size) {
  int k = 0;
  for (size_t s = kMinPage; s < size; s <<= 1) ++k;
  return k;
}

PagePool::~PagePool() {
  for (auto& slab : slabs_) munmap(slab.first, slab.second);
}

uint8_t* PagePool::take(size_t size) {
  std::lock_guard<std::mutex> g(mu_);
  auto& free = free_[size_class(size)];
  if (free.empty()) {
    const size_t count = kSlabBytes / size > 0 ? kSlabBytes / size : 1;
    int flags = MAP_PRIVATE | MAP_ANONYMOUS;
#ifdef MAP_POPULATE
    flags |= MAP_POPULATE;  // faulted in now, once, not while rows are copied
#endif
    void* slab = mmap(nullptr, count * size, PROT_READ | PROT_WRITE, flags, -1, 0);
    if (slab == MAP_FAILED) throw std::bad_alloc();
    slabs_.emplace_back(slab, count * size);
    allocated_ += count * size;
    for (size_t i = count; i-- > 0;) free.push_back(static_cast<uint8_t*>(slab) + i * size);
  }
  uint8_t* page = free.back();
  free.pop_back();
  return page;
}

void PagePool::give_back(uint8_t* page, size_t size) {
  std::lock_guard<std::mutex> g(mu_);
  free_[size_class(size)].push_back(page);
}

static PagePool* g_default_pool = nullptr;  // set once, before any fork handler can run

PagePool& default_page_pool() {
  static PagePool* pool = [] {
    g_default_pool = new PagePool();  // never destroyed: buffers may outlive static teardown
    // A thread writer's loop takes pages with the GIL released, and maps new slabs (MAP_POPULATE,
    // milliseconds) under the pool's lock: an os.fork() on another thread then gave a child that
    // lock held for good, and the child's first row buffer (its own thread writer) hung for ever.
    // The forking thread holds it across fork() instead, so both sides start with it free.
    ::pthread_atfork([] { g_default_pool->lock_for_fork(); }, [] { g_default_pool->unlock_after_fork(); },
                     [] { g_default_pool->unlock_after_fork(); });
    return g_default_pool;
  }();
  return *pool;
}

void PageBuffer::append(const uint8_t* src, size_t n) {
  nbytes_ += n;
  while (n > 0) {
    if (pages_.empty() || fill_ == pages_.back().size) {
      const size_t size = page_size_for(n, pages_.empty() ? 0 : pages_.back().size);
      pages_.push_back(Page{pool().take(size), size});
      fill_ = 0;
    }
    Page& page = pages_.back();
    const size_t k = page.size - fill_ < n ? page.size - fill_ : n;
    // Streaming stores: these pages go to the disk by DMA and no CPU reads them again, so they
    // must not push the model's weights out of the shared last-level cache.
    copy_streaming(page.ptr + fill_, src, k);
    fill_ += k, src += k, n -= k;
  }
}

void PageBuffer::free() {
  for (const Page& page : pages_) pool().give_back(page.ptr, page.size);
  pages_.clear();
  fill_ = 0;
  nbytes_ = 0;
  rows = 0;
}

void RowSink::key_of(std::string* key, uint32_t name_id, uint16_t dtype, bool scalar, const int64_t* dims,
                     size_t ndim) {
  key->clear();
  key->append(reinterpret_cast<const char*>(&name_id), sizeof name_id);
  key->append(reinterpret_cast<const char*>(&dtype), sizeof dtype);
  key->push_back(scalar ? 1 : 0);
  if (!scalar) key->append(reinterpret_cast<const char*>(dims), ndim * sizeof(int64_t));
}

void RowSink::add_layout(uint32_t name_id, uint16_t dtype, bool scalar, const std::vector<int64_t>& row_shape,
                         int32_t block, int32_t name_slot, uint64_t row_bytes, std::shared_ptr<PageBuffer> buf) {
  if (block < 0) throw std::invalid_argument("block number < 0");
  std::string key;
  key_of(&key, name_id, dtype, scalar, row_shape.data(), row_shape.size());
  Layout& layout = layouts_[key];
  layout = Layout{std::move(buf), block, name_slot, row_bytes, scalar};
  if (by_block_.size() <= static_cast<size_t>(block)) by_block_.resize(block + 1, nullptr);
  by_block_[block] = &layout;
}

void RowSink::append(int32_t block, int64_t pass_id, const uint8_t* data, size_t n, int64_t rows) {
  if (block < 0 || static_cast<size_t>(block) >= by_block_.size() || by_block_[block] == nullptr)
    throw std::invalid_argument("append to a block without a layout");
  Layout& layout = *by_block_[block];
  layout.buf->append(data, n);  // first: a failure leaves no index row
  index_.push_back(IndexRow{pass_id, layout.name_slot, block, layout.buf->rows, rows, crc32c(data, n)});
  layout.buf->rows += rows;
  nbytes_ += n;
}

void RowSink::add_index(const IndexRow& row, uint64_t nbytes) {
  index_.push_back(row);
  nbytes_ += nbytes;
}

bool RowSink::take(const RecordView& v) {
  if (!accepting || !has_pass_ || v.pass_id != pass_ || v.kind != kTensor) return false;
  if (v.chunk.offset != 0 || v.chunk.total != v.payload_len || v.payload_len >= kPageAlignedBytes) return false;
  const size_t ndim = v.shape.size();
  const bool scalar = ndim == 0;
  key_of(&scratch_, v.name_id, v.dtype, scalar, scalar ? nullptr : v.shape.data() + 1, scalar ? 0 : ndim - 1);
  auto it = layouts_.find(scratch_);
  if (it == layouts_.end()) return false;
  const Layout& layout = it->second;
  const int64_t rows = scalar ? 1 : v.shape[0];
  // The layout fixes the bytes per row; a record that disagrees (only a bug could make one) is
  // Python's to record as a bad record.
  if (rows < 0 || static_cast<uint64_t>(rows) * layout.row_bytes != v.payload_len) return false;
  append(layout.block, v.pass_id, v.payload, v.payload_len, rows);
  ++taken_;
  return true;
}

void RowSink::reset() {
  layouts_.clear();
  by_block_.clear();
  index_.clear();
  has_pass_ = false;
  nbytes_ = 0;
}

}  // namespace fastdump
