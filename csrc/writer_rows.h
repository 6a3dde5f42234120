// The writer's per-tensor work in C++: rows buffered in page-aligned pages, and one channel's
// pending index (fastdump/writer/channel_writer.py owns everything else: names, passes, segment
// files, rank.json).
//
// Issue 11: the writer spent ~6.5 us of CPU per small tensor, most of it Python per record (a
// tuple per record, dict lookups, a bound call to copy and one to CRC); beside a small model on a
// 2-core machine that CPU is taken from the model (benchmarks/RESULTS.md, section 0e). Now a
// record whose pass and layout the channel writer already knows is taken here, inside
// Consumer.next_batch: copied once into its block's pages (streaming stores), CRC32C'd, and
// indexed, with no Python object made for it. Every other record (a new pass, name or layout, a
// chunk, a large tensor, a bad record, a CUDA-graph span) still goes to Python, which decides and
// registers what the fast path may take next time.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

namespace fastdump {

struct RecordView;

// Page sizes: kMinPage << k up to kMaxPage, cut from pre-faulted slabs that are never unmapped
// (reused from one segment to the next: no page faults, no munmap once warm). Pages are aligned
// to kPageBytes and sized in its multiples, so a segment write can hand them to O_DIRECT.
constexpr size_t kMinPage = 16 << 10;
constexpr size_t kMaxPage = 1 << 20;
constexpr size_t kSlabBytes = 8 << 20;
constexpr int kPageSizes = 7;  // 16 KiB ... 1 MiB

size_t page_size_for(size_t nbytes, size_t previous);

class PagePool {
 public:
  ~PagePool();
  uint8_t* take(size_t size);
  void give_back(uint8_t* page, size_t size);
  uint64_t allocated() const { return allocated_; }
  // fork(): held across it by the forking thread (see default_page_pool), so a child never starts
  // with the lock taken by a parent thread that does not exist there.
  void lock_for_fork() { mu_.lock(); }
  void unlock_after_fork() { mu_.unlock(); }

 private:
  std::mutex mu_;  // one writer loop takes pages; tests run several
  std::vector<uint8_t*> free_[kPageSizes];
  std::vector<std::pair<void*, size_t>> slabs_;
  uint64_t allocated_ = 0;
};

PagePool& default_page_pool();

// A byte stream (one block's rows, in order) in pool pages: every page but the last is full.
class PageBuffer {
 public:
  struct Page {
    uint8_t* ptr;
    size_t size;
  };
  explicit PageBuffer(std::shared_ptr<PagePool> pool) : pool_(std::move(pool)) {}
  ~PageBuffer() { free(); }
  PageBuffer(const PageBuffer&) = delete;
  PageBuffer& operator=(const PageBuffer&) = delete;

  void append(const uint8_t* src, size_t n);
  void free();  // pages back to the pool; the buffer is empty (rows too)
  const std::vector<Page>& pages() const { return pages_; }
  size_t fill() const { return fill_; }
  uint64_t nbytes() const { return nbytes_; }
  PagePool& pool() { return pool_ ? *pool_ : default_page_pool(); }

  int64_t rows = 0;  // rows appended (the block's row count)

 private:
  std::shared_ptr<PagePool> pool_;  // null: the process's pool
  std::vector<Page> pages_;
  size_t fill_ = 0;
  uint64_t nbytes_ = 0;
};

// One row of format.INDEX_DTYPE (packed, little-endian like every platform fastdump builds on).
#pragma pack(push, 1)
struct IndexRow {
  int64_t pass;
  int32_t name;
  int32_t block;
  int64_t first_row;
  int64_t rows;
  uint32_t crc32c;
};
#pragma pack(pop)
static_assert(sizeof(IndexRow) == 36, "format.INDEX_DTYPE is 36 bytes");

// One channel's pending segment as far as tensors go: its layouts (name id, dtype, row shape) ->
// block, its index rows in arrival order, the bytes it holds. Single-threaded (the writer loop).
class RowSink {
 public:
  // Layout key: scalar rows (0-d tensors) are a layout of their own (`row_shape` ignored).
  void add_layout(uint32_t name_id, uint16_t dtype, bool scalar, const std::vector<int64_t>& row_shape,
                  int32_t block, int32_t name_slot, uint64_t row_bytes, std::shared_ptr<PageBuffer> buf);
  // A tensor's bytes appended to `block`'s rows (registered by add_layout); its index row.
  void append(int32_t block, int64_t pass_id, const uint8_t* data, size_t n, int64_t rows);
  // An index row for bytes stored elsewhere (a large tensor written straight to the file).
  void add_index(const IndexRow& row, uint64_t nbytes);
  // The fast path: true when the record was taken (copied, CRC'd, indexed); false: Python's.
  bool take(const RecordView& v);

  void set_pass(int64_t pass_id) { pass_ = pass_id, has_pass_ = true; }
  void clear_pass() { has_pass_ = false; }
  void reset();  // a new segment: no layouts, no rows (the blocks' buffers belong to their Blocks)

  const std::vector<IndexRow>& index() const { return index_; }
  uint64_t nbytes() const { return nbytes_; }
  uint64_t taken() const { return taken_; }  // records the fast path took (tests, stats)
  bool accepting = true;  // false once the channel failed or closed: every record goes to Python

 private:
  struct Layout {
    std::shared_ptr<PageBuffer> buf;
    int32_t block;
    int32_t name_slot;
    uint64_t row_bytes;
    bool scalar;
  };
  static void key_of(std::string* key, uint32_t name_id, uint16_t dtype, bool scalar, const int64_t* dims,
                     size_t ndim);
  std::unordered_map<std::string, Layout> layouts_;
  std::vector<Layout*> by_block_;  // block number -> its layout (null: not buffered here)
  std::vector<IndexRow> index_;
  std::string scratch_;  // the key being looked up: no allocation once warm
  int64_t pass_ = 0;
  bool has_pass_ = false;
  uint64_t nbytes_ = 0;
  uint64_t taken_ = 0;
};

}  // namespace fastdump
