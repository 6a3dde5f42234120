// The shared-memory host ring: one producer process (the model being served), one consumer
// process or thread (the writer). Layout and protocol: docs/INTERNALS.md.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <string>
#include <vector>

namespace fastdump {

constexpr uint64_t kMagic = 0x31474e4952504446ull;  // "FDPRING1"
// 2: no `published` counter; 3: failed_channels, channel_errors; 4: 64 channel_errors, each taken
// by its Dumper as it reads it (the place goes to the next channel that fails)
constexpr uint64_t kVersion = 4;
constexpr uint64_t kAlign = 64;
constexpr uint64_t kHeaderBytes = 32768;  // RingHeader, mostly channel_errors (a multiple of the page size)
constexpr uint32_t kMaxDims = 32;  // HDF5 datasets hold at most 32 dimensions (H5S_MAX_RANK)
// Channels whose failure the writer can report one by one (RingHeader::failed_channels); a channel
// of a higher id that fails stops the whole writer, as every failure once did.
constexpr uint32_t kFailedChannelBits = 4096;

enum RecordState : uint32_t { kAllocated = 0, kReady = 1, kAbandoned = 2 };
enum RecordKind : uint32_t { kTensor = 1, kControl = 2, kPad = 3 };
enum WriterState : uint64_t { kWriterStarting = 0, kWriterRunning = 1, kWriterFailed = 2, kWriterExited = 3 };

// Result of staging one tensor.
// kNoSpace: a non-blocking attempt found the ring full (the caller decides: drop or block).
// (5 is the CUDA stager's "graph capture in progress".)
// kTimedOut: a blocking attempt waited its whole timeout for space; nothing of the tensor is in
//   the ring (dropped whole).
// kTorn: a tensor larger than the ring, staged chunk by chunk, timed out after some of its chunks
//   were published; the writer records it as an incomplete tensor at its pass's end.
// kRingTooSmall: a non-blocking attempt for a tensor that cannot fit in the ring at once (it could
//   only be staged by waiting for the writer mid-tensor, which `drop` never does).
// kCapturing (CUDA stager): the producer stream is being captured into a CUDA graph; nothing was
//   enqueued (a capture would bake the ring addresses into the graph and the side stream cannot
//   wait on a captured event); the caller counts the tensor as skipped.
// kRingUnavailable (Python staging glue): the tensor's GPU has no device ring; nothing was staged.
// The one definition of every staging status: module.cpp exports each to Python under its name.
enum StageStatus : int {
  kStaged = 0, kDropped = 1, kDisabled = 2, kTooLarge = 3, kNoSpace = 4, kCapturing = 5,
  kTimedOut = 6, kTorn = 7, kRingTooSmall = 8, kRingUnavailable = 9
};

// A wait for ring space: none (`drop`), bounded, or unbounded (timeout_s < 0).
constexpr double kWaitForever = -1.0;

inline uint64_t align_up(uint64_t n) { return (n + kAlign - 1) & ~(kAlign - 1); }

// Tensor payloads of this size or more start on a kPageBytes boundary in the ring (the writer's
// O_DIRECT path; fastdump/writer/channel_writer.py DIRECT_BYTES is the same number).
constexpr uint64_t kPageBytes = 4096;
constexpr uint64_t kPageAlignedBytes = 1ull << 20;

// A failed channel's error text (RingHeader::channel_errors). The writer claims a free place (0 ->
// kChannelErrorBusy), writes the text and stores `channel` (id + 1) last with release, so a producer
// that sees its id reads a whole text; the producer takes it (id + 1 -> kChannelErrorBusy), copies
// it and frees the place (0) for the next channel that fails. With 4 places kept for good, the
// fifth of five Dumpers on five full disks got no error but "its log says why".
constexpr uint32_t kChannelErrorSlots = 64;
constexpr uint32_t kChannelErrorBusy = 0xFFFFFFFFu;  // being written or being taken
struct ChannelError {
  std::atomic<uint32_t> channel;  // id + 1 while it holds a text; 0 while free; kChannelErrorBusy
  char text[444];
};

struct alignas(64) RingHeader {
  uint64_t magic;
  uint64_t version;
  uint64_t capacity;      // bytes in the data area (multiple of kAlign)
  int64_t producer_pid;
  int64_t writer_pid;
  alignas(64) std::atomic<uint64_t> head;        // producer: next byte to allocate (monotonic)
  alignas(64) std::atomic<uint64_t> tail;        // writer: bytes released so far (monotonic)
  alignas(64) std::atomic<uint64_t> acked_seq;   // highest control seq the writer has handled
  std::atomic<uint64_t> writer_state;
  std::atomic<uint64_t> writer_attached;         // writer has mapped the region (producer may unlink)
  char error[1024];                              // writer failure text
  // One bit per channel id the writer stopped writing (its root's disk full or unwritable): that
  // Dumper stops, the others go on. The channel's own error is in its rank.json when that can be
  // written, and also here until its Dumper takes it (a deleted rank directory or a read-only file
  // system leaves no rank.json to read it from).
  alignas(64) std::atomic<uint64_t> failed_channels[kFailedChannelBits / 64];
  ChannelError channel_errors[kChannelErrorSlots];
};
static_assert(sizeof(RingHeader) <= kHeaderBytes, "ring header too large");

struct alignas(64) RecordHeader {
  std::atomic<uint32_t> state;
  uint32_t kind;
  uint64_t total_len;     // header + shape + payload, aligned
  uint64_t seq;           // per-ring record sequence number
  uint32_t channel;
  uint32_t name_id;
  int64_t pass_id;
  uint16_t dtype;
  uint16_t ndim;
  uint32_t flags;
  uint64_t payload_len;   // bytes of payload in this record
  // For a tensor split over several records, where this part starts and the whole size are in
  // the ChunkInfo that follows the header (not in it: it stays 64 bytes).
};
static_assert(sizeof(RecordHeader) == 64, "record header must be 64 bytes");

struct ChunkInfo {
  uint64_t offset;
  uint64_t total;
};

// Layout of one record after its RecordHeader: ChunkInfo, shape[ndim], padding, payload.
inline uint64_t payload_offset(uint32_t ndim) {
  return align_up(sizeof(RecordHeader) + sizeof(ChunkInfo) + 8ull * ndim);
}

// The mapped shared-memory region holding the ring (either side). "Segment" means an HDF5 file.
class ShmRegion {
 public:
  ShmRegion() = default;
  ~ShmRegion();
  ShmRegion(const ShmRegion&) = delete;
  ShmRegion& operator=(const ShmRegion&) = delete;

  void create(const std::string& name, uint64_t capacity);  // producer
  void open(const std::string& name);                        // writer
  void unlink();                                             // remove the name (mapping stays)

  RingHeader* header() const { return reinterpret_cast<RingHeader*>(base_); }
  uint8_t* data() const { return base_ + kHeaderBytes; }
  uint64_t capacity() const { return header()->capacity; }
  size_t mapped_bytes() const { return size_; }
  const std::string& name() const { return name_; }

 private:
  uint8_t* base_ = nullptr;
  size_t size_ = 0;
  std::string name_;
  bool owner_ = false;
  bool unlinked_ = false;
};

// Where a staged tensor's bytes come from: host pointer with strides in elements.
struct HostSource {
  const uint8_t* ptr;
  uint64_t elem_size;
  std::vector<int64_t> shape;
  std::vector<int64_t> strides;
};

struct ProducerStats {
  uint64_t records = 0;
  uint64_t tensors = 0;
  uint64_t bytes = 0;
  uint64_t dropped = 0;
  uint64_t block_waits = 0;
  double block_seconds = 0;
};

// A record reserved in the ring, not yet published.
struct Reservation {
  RecordHeader* rec = nullptr;
  uint8_t* payload = nullptr;
  uint64_t payload_len = 0;
};

class Producer {
 public:
  Producer(const std::string& name, uint64_t capacity, uint64_t chunk_bytes);
  ~Producer();

  ShmRegion& region() { return seg_; }

  // Whether the writer stopped writing `channel` alone (RingHeader::failed_channels).
  bool channel_failed(uint32_t channel) { return failed_bit_set(failed_word(channel), channel); }
  // `channel`'s bit in its word of failed_channels (failed_word; nullptr: never set). The one
  // place of this bit math: ChannelStager keeps its channel's word and asks here.
  static bool failed_bit_set(const std::atomic<uint64_t>* word, uint32_t channel) {
    return word != nullptr && ((word->load(std::memory_order_acquire) >> (channel % 64)) & 1);
  }
  // The writer's error for a failed `channel`, taken out of the header: its place is free for the
  // next failed channel's (the caller keeps it). "" when the writer had no free place to say it
  // in, or it was taken already.
  std::string take_channel_error(uint32_t channel) {
    for (ChannelError& e : seg_.header()->channel_errors) {
      uint32_t mine = channel + 1;
      if (!e.channel.compare_exchange_strong(mine, kChannelErrorBusy, std::memory_order_acquire)) continue;
      std::string text(e.text, strnlen(e.text, sizeof(e.text)));
      e.channel.store(0, std::memory_order_release);
      return text;
    }
    return "";
  }
  // Where stage_tensor reads whether `channel` failed: its word of failed_channels (nullptr for an id
  // above them, whose failure stops the whole writer).
  const std::atomic<uint64_t>* failed_word(uint32_t channel) {
    return channel < kFailedChannelBits ? &seg_.header()->failed_channels[channel / 64] : nullptr;
  }

  // Writer liveness: fd whose EOF/HUP means the writer is gone (-1: in-process thread writer).
  void set_writer_fd(int fd) { writer_fd_ = fd; }
  bool writer_alive();
  // writer_alive() for a check made at every pass: the writer's state in the ring header is read
  // each time, its pipe polled (a syscall, ~5 us between the model's kernels on a VM) only when
  // the last poll that found it alive is older than `max_age_s`.
  bool writer_seen_alive(double max_age_s);
  bool disabled() const { return disabled_.load(std::memory_order_relaxed); }
  void disable() { disabled_.store(true); }

  // Copy a host tensor into the ring (split into chunks if large). Thread-safe.
  // A tensor that fits in the ring has all its chunk records reserved at once, so it is staged
  // whole or not at all. `block` waits up to `timeout_s` (kWaitForever: no limit) for the space.
  StageStatus stage_host(uint32_t channel, uint32_t name_id, int64_t pass_id, uint16_t dtype,
                         const HostSource& src, bool block, double timeout_s = kWaitForever);
  // Control record (JSON bytes): returns its seq; 0 if disabled, or if no space (non-blocking, or
  // still none after timeout_s).
  uint64_t put_control(uint32_t channel, const char* bytes, uint64_t len, bool block = true,
                       double timeout_s = kWaitForever);
  uint64_t acked_seq() const { return seg_.header()->acked_seq.load(std::memory_order_acquire); }
  // Wait until the writer has handled control record `seq`. False on timeout or dead writer.
  bool wait_acked(uint64_t seq, double timeout_s);

  // Low level, for the CUDA path: reserve a record (blocking or not); publish later.
  // Returns false when no space (non-blocking) or disabled.
  // A tensor leaves `control_reserve()` bytes free, so that the pass's control records (names,
  // pass end) still fit while tensors are dropped (`drop`, or `block` once a wait ran out).
  bool reserve(uint32_t kind, uint32_t channel, uint32_t name_id, int64_t pass_id, uint16_t dtype,
               const std::vector<int64_t>& shape, uint64_t payload_len, ChunkInfo chunk, bool block,
               Reservation* out, double timeout_s = kWaitForever, bool whole_tensor = false);
  // reserve(block = false) that also never waits for the allocation lock: false when another
  // thread holds it (which may be waiting for the writer). For callers that hold a lock of their own
  // whose records the writer may be waiting for (the CUDA lean path).
  bool try_reserve(uint32_t kind, uint32_t channel, uint32_t name_id, int64_t pass_id, uint16_t dtype,
                   const std::vector<int64_t>& shape, uint64_t payload_len, ChunkInfo chunk, Reservation* out);
  uint64_t control_reserve() const { return control_reserve_; }
  // Whether chunk records of these payload sizes fit in the ring together (its control reserve
  // kept free), wherever the ring's end falls.
  bool fits_whole(size_t ndim, const std::vector<uint64_t>& plan) const;
  // All chunk records of one tensor at once (mu_ taken here): 1 reserved; 0 no space (after
  // waiting, with `block`) or disabled; -1 they can never fit in the ring together from the current
  // head. `plan` lists each chunk's payload bytes.
  int reserve_all(uint32_t channel, uint32_t name_id, int64_t pass_id, uint16_t dtype,
                   const std::vector<int64_t>& shape, const std::vector<uint64_t>& plan, uint64_t total,
                   bool block, double timeout_s, std::vector<Reservation>* out);
  void publish(const Reservation& r);

  // Ends the calling thread's waits for ring space (as a timeout does) once `*flag` is true, for
  // a thread that must be stoppable mid-wait (the CUDA-graph recorder's drain, at close). Per
  // thread; nullptr (the default) for none. `*flag` must outlive the thread's waits.
  static void set_thread_wait_cancel(const std::atomic<bool>* flag);

  uint64_t chunk_bytes() const { return chunk_bytes_; }
  ProducerStats stats();
  void count_dropped(uint64_t n) {
    std::lock_guard<std::mutex> g(mu_);
    stats_.dropped += n;
  }

 private:
  // Where a record of `len` bytes starting at ring position `head` goes: `pad` bytes to the ring's
  // end (wrap), then `gap` bytes to page-align a large payload.
  struct Placement {
    uint64_t pad = 0, gap = 0, len = 0;
    uint64_t bytes() const { return pad + gap + len; }
  };
  Placement place(uint64_t head, uint32_t kind, uint64_t poff, uint64_t payload_len) const;
  // Whether a record of this rank and payload can be reserved at all (not disabled, fits half the ring).
  bool reservable(size_t ndim, uint64_t payload_len) const;
  // reserve() with mu_ held.
  bool reserve_locked(uint32_t kind, uint32_t channel, uint32_t name_id, int64_t pass_id, uint16_t dtype,
                      const std::vector<int64_t>& shape, uint64_t payload_len, ChunkInfo chunk, bool block,
                      Reservation* out, double timeout_s);
  // Writes the padding and the record header at `head` (mu_ held), advancing `head`.
  void write_record(uint64_t& head, const Placement& p, uint32_t kind, uint32_t channel, uint32_t name_id,
                    int64_t pass_id, uint16_t dtype, const std::vector<int64_t>& shape, uint64_t payload_len,
                    ChunkInfo chunk, Reservation* out);
  // Bytes all chunk records of a tensor take when placed from `head` (padding included).
  uint64_t span(uint64_t head, uint64_t poff, const std::vector<uint64_t>& plan) const;
  bool wait_for_space(uint64_t need, bool block, double timeout_s);

  ShmRegion seg_;
  uint64_t chunk_bytes_;
  uint64_t control_reserve_;
  int writer_fd_ = -1;
  std::atomic<bool> disabled_{false};
  std::atomic<double> alive_at_s_{-1e300};  // when writer_alive() last found the writer alive (now_s())
  std::mutex mu_;               // serializes allocation (head) among producer threads
  uint64_t next_seq_ = 1;
  ProducerStats stats_;
};

// Decoded view of the record at the ring's tail (writer side).
struct RecordView {
  uint32_t kind;
  uint32_t channel;
  uint32_t name_id;
  int64_t pass_id;
  uint16_t dtype;
  uint64_t seq;
  std::vector<int64_t> shape;
  ChunkInfo chunk;
  const uint8_t* payload;
  uint64_t payload_len;
};

class Consumer {
 public:
  explicit Consumer(const std::string& name);

  ShmRegion& region() { return seg_; }
  void set_producer_fd(int fd) { producer_fd_ = fd; }
  bool producer_alive();

  // Next ready record, waiting up to timeout_s. Returns false on timeout or when the producer is
  // gone and nothing is left (then `drained()` is true). Records handed out stay valid (their
  // ring space is not reused) until release(), which gives back every record handed out so far:
  // the writer can hold a batch of views, consume them, and free the batch at once.
  bool next(double timeout_s, RecordView* out);
  void release();
  bool holding() const { return released_ != cursor_; }
  bool drained() const { return drained_; }

  void ack(uint64_t seq) { seg_.header()->acked_seq.store(seq, std::memory_order_release); }
  void set_state(uint64_t state, const std::string& error);
  uint64_t abandoned() const { return abandoned_; }

 private:
  ShmRegion seg_;
  int producer_fd_ = -1;
  uint64_t cursor_ = 0;    // ring position of the next record to hand out
  uint64_t released_ = 0;  // ring position up to which space is given back (the tail we publish)
  void skip(uint64_t len);  // step over a record nobody will see (padding, abandoned)
  bool drained_ = false;
  uint64_t abandoned_ = 0;
};

}  // namespace fastdump
