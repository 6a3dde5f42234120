#include "ring.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <stdexcept>
#include <thread>

#include "strided_copy.h"

namespace fastdump {

namespace {

std::runtime_error sys_error(const std::string& what) {
  return std::runtime_error(what + ": " + std::strerror(errno));
}

// Sleep that backs off: spin a little (cheap when the other side is about to act), then yield,
// then sleep up to `max_us`.
// An idle writer naps this long before looking again: it then drains ~1 ms of records in one
// batch instead of waking every few tens of microseconds for one or two, each wake-up a context
// switch on the core beside the model's and a cold start of its Python loop.
constexpr int kWriterNapUs = 1000;

class Backoff {
 public:
  explicit Backoff(int max_us, int spins = 64, int yields = 64, int first_us = 20)
      : us_(first_us), max_us_(max_us), spins_(spins), yields_(yields) {}
  void wait() {
    if (n_ < spins_) {
      ++n_;
      return;
    }
    if (n_ < spins_ + yields_) {
      ++n_;
      std::this_thread::yield();
      return;
    }
    sleeping_ = true;
    std::this_thread::sleep_for(std::chrono::microseconds(us_));
    if (us_ < max_us_) us_ = us_ * 2 > max_us_ ? max_us_ : us_ * 2;
  }
  bool sleeping() const { return sleeping_; }

 private:
  int n_ = 0;
  int us_;
  int max_us_;
  int spins_, yields_;
  bool sleeping_ = false;
};

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// True while the other end of the pipe is open (fd < 0 means "no pipe: assume alive").
bool peer_alive(int fd) {
  if (fd < 0) return true;
  struct pollfd p = {fd, POLLIN, 0};
  int r = ::poll(&p, 1, 0);
  if (r <= 0) return true;
  if (p.revents & (POLLHUP | POLLERR | POLLNVAL)) return false;
  if (p.revents & POLLIN) {
    // Readable with no data means EOF. The peer never writes, so any readable state is EOF.
    char c;
    ssize_t n = ::read(fd, &c, 1);
    return n > 0;
  }
  return true;
}

// Producer::set_thread_wait_cancel: the calling thread's flag that ends its waits for space.
thread_local const std::atomic<bool>* t_wait_cancel = nullptr;

}  // namespace

// ---------------------------------------------------------------------------------------------
// ShmRegion

ShmRegion::~ShmRegion() {
  if (base_) ::munmap(base_, size_);
  if (owner_ && !unlinked_) ::shm_unlink(name_.c_str());
}

void ShmRegion::create(const std::string& name, uint64_t capacity) {
  capacity = align_up(capacity);
  name_ = name;
  size_ = kHeaderBytes + capacity;
  int fd = ::shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  if (fd < 0) throw sys_error("shm_open(" + name + ")");
  owner_ = true;
  // A file size limit (ulimit -f) below the region refuses the reservation, and the kernel then
  // sends SIGXFSZ (Linux: shmem_fallocate through inode_newsize_ok), whose default action kills the
  // serving process: refused here first, as EFBIG.
  struct rlimit fsize {};
  const bool over_limit = ::getrlimit(RLIMIT_FSIZE, &fsize) == 0 && fsize.rlim_cur != RLIM_INFINITY &&
                          static_cast<uint64_t>(fsize.rlim_cur) < size_;
  // posix_fallocate makes a too-small /dev/shm fail here, with ENOSPC, instead of SIGBUS later.
  int rc = over_limit ? EFBIG : ::posix_fallocate(fd, 0, static_cast<off_t>(size_));
  if (rc != 0) {
    ::close(fd);
    ::shm_unlink(name.c_str());
    unlinked_ = true;
    errno = rc;
    // The advice follows the cause: a full /dev/shm is the common one, but a file size limit on the
    // process (ulimit -f) refuses the reservation too, and /dev/shm's size is then not the fix.
    const char* fix = rc == EFBIG   ? "(over this process's file size limit, ulimit -f: raise it or lower ring_mb)"
                      : rc == ENOSPC ? "(docker's default is 64 MiB: raise --shm-size or lower ring_mb)"
                                     : "(lower ring_mb)";
    throw sys_error("cannot reserve " + std::to_string(size_ >> 20) + " MiB of shared memory in /dev/shm " + fix);
  }
  void* p = ::mmap(nullptr, size_, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0);
  ::close(fd);
  if (p == MAP_FAILED) throw sys_error("mmap");
  base_ = static_cast<uint8_t*>(p);
  RingHeader* h = new (base_) RingHeader();
  h->magic = kMagic;
  h->version = kVersion;
  h->capacity = capacity;
  h->producer_pid = ::getpid();
  h->writer_pid = 0;
  h->head.store(0);
  h->tail.store(0);
  h->acked_seq.store(0);
  h->writer_state.store(kWriterStarting);
  h->writer_attached.store(0);
  h->error[0] = 0;
}

void ShmRegion::open(const std::string& name) {
  name_ = name;
  int fd = ::shm_open(name.c_str(), O_RDWR, 0600);
  if (fd < 0) throw sys_error("shm_open(" + name + ")");
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    ::close(fd);
    throw sys_error("fstat");
  }
  size_ = static_cast<size_t>(st.st_size);
  // Populate: the writer touches every page on its first lap; faulting them in one by one is slow.
  void* p = ::mmap(nullptr, size_, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0);
  ::close(fd);
  if (p == MAP_FAILED) throw sys_error("mmap");
  base_ = static_cast<uint8_t*>(p);
  if (header()->magic != kMagic || header()->version != kVersion)
    throw std::runtime_error("not a fastdump ring: " + name);
  header()->writer_pid = ::getpid();
  header()->writer_attached.store(1, std::memory_order_release);
}

void ShmRegion::unlink() {
  if (!unlinked_ && !name_.empty()) {
    ::shm_unlink(name_.c_str());
    unlinked_ = true;
  }
}

// ---------------------------------------------------------------------------------------------
// Producer

Producer::Producer(const std::string& name, uint64_t capacity, uint64_t chunk_bytes) {
  seg_.create(name, capacity);
  // A chunk must leave room for its header and for the ring to hold two of them.
  uint64_t max_chunk = seg_.capacity() / 4;
  chunk_bytes_ = chunk_bytes == 0 || chunk_bytes > max_chunk ? max_chunk : chunk_bytes;
  chunk_bytes_ &= ~(kAlign - 1);
  if (chunk_bytes_ < kAlign) throw std::runtime_error("ring too small");
  control_reserve_ = seg_.capacity() / 16 < (1u << 20) ? seg_.capacity() / 16 : (1u << 20);
  control_reserve_ &= ~(kAlign - 1);
}

Producer::~Producer() = default;

bool Producer::writer_alive() {
  if (disabled()) return false;
  RingHeader* h = seg_.header();
  uint64_t st = h->writer_state.load(std::memory_order_acquire);
  if (st == kWriterFailed || st == kWriterExited || !peer_alive(writer_fd_)) {
    disable();
    return false;
  }
  alive_at_s_.store(now_s(), std::memory_order_relaxed);
  return true;
}

bool Producer::writer_seen_alive(double max_age_s) {
  if (disabled()) return false;
  const uint64_t st = seg_.header()->writer_state.load(std::memory_order_acquire);
  if (st != kWriterFailed && st != kWriterExited && now_s() - alive_at_s_.load(std::memory_order_relaxed) < max_age_s)
    return true;
  return writer_alive();
}

void Producer::set_thread_wait_cancel(const std::atomic<bool>* flag) { t_wait_cancel = flag; }

bool Producer::wait_for_space(uint64_t need, bool block, double timeout_s) {
  RingHeader* h = seg_.header();
  const uint64_t cap = seg_.capacity();
  uint64_t head = h->head.load(std::memory_order_relaxed);
  if (cap - (head - h->tail.load(std::memory_order_acquire)) >= need) return true;
  if (!block || timeout_s == 0) return false;
  Backoff backoff(200);
  double t0 = now_s();
  double last_check = t0;
  bool ok = true;
  stats_.block_waits++;
  while (cap - (head - h->tail.load(std::memory_order_acquire)) < need) {
    double t = now_s();
    if (t - last_check > 0.05) {
      last_check = t;
      if (!writer_alive()) return false;
    }
    if (timeout_s > 0 && t - t0 >= timeout_s) {  // a stopped writer must not hold the model hostage
      ok = false;
      break;
    }
    if (t_wait_cancel && t_wait_cancel->load(std::memory_order_acquire)) {  // ended early, as a timeout
      ok = false;
      break;
    }
    backoff.wait();
  }
  stats_.block_seconds += now_s() - t0;
  return ok;
}

Producer::Placement Producer::place(uint64_t head, uint32_t kind, uint64_t poff, uint64_t payload_len) const {
  const uint64_t cap = seg_.capacity();
  Placement p;
  p.len = align_up(poff + payload_len);
  uint64_t off = head % cap;
  p.pad = (off + p.len > cap) ? cap - off : 0;  // no room before the end: wrap to 0
  // A large payload starts on a page boundary, so the writer can hand it to the disk with
  // O_DIRECT straight from the ring. The gap before it is a padding record (a multiple of kAlign,
  // so at least one header long).
  if (kind == kTensor && payload_len >= kPageAlignedBytes) {
    auto gap_at = [&](uint64_t start) {
      auto a = reinterpret_cast<uintptr_t>(seg_.data() + start + poff);
      return (kPageBytes - a % kPageBytes) % kPageBytes;
    };
    p.gap = gap_at(p.pad ? 0 : off);
    if (!p.pad && off + p.gap + p.len > cap) {
      p.pad = cap - off;
      p.gap = gap_at(0);
    }
    if (p.gap + p.len > cap / 2) p.gap = 0;  // a tiny ring: give up the alignment, not the record
  }
  return p;
}

void Producer::write_record(uint64_t& head, const Placement& p, uint32_t kind, uint32_t channel,
                            uint32_t name_id, int64_t pass_id, uint16_t dtype,
                            const std::vector<int64_t>& shape, uint64_t payload_len, ChunkInfo chunk,
                            Reservation* out) {
  const uint64_t cap = seg_.capacity();
  uint64_t off = head % cap;
  auto put_pad = [&](uint64_t at, uint64_t n) {
    auto* r = reinterpret_cast<RecordHeader*>(seg_.data() + at);
    r->kind = kPad;
    r->total_len = n;
    r->seq = 0;
    r->state.store(kReady, std::memory_order_relaxed);
  };
  if (p.pad) {
    put_pad(off, p.pad);
    head += p.pad;
    off = 0;
  }
  if (p.gap) {
    put_pad(off, p.gap);
    head += p.gap;
    off += p.gap;
  }
  auto* rec = reinterpret_cast<RecordHeader*>(seg_.data() + off);
  rec->state.store(kAllocated, std::memory_order_relaxed);
  rec->kind = kind;
  rec->total_len = p.len;
  rec->seq = next_seq_++;
  rec->channel = channel;
  rec->name_id = name_id;
  rec->pass_id = pass_id;
  rec->dtype = dtype;
  rec->ndim = static_cast<uint16_t>(shape.size());
  rec->flags = 0;
  rec->payload_len = payload_len;
  uint8_t* base = reinterpret_cast<uint8_t*>(rec);
  std::memcpy(base + sizeof(RecordHeader), &chunk, sizeof(ChunkInfo));
  if (!shape.empty())
    std::memcpy(base + sizeof(RecordHeader) + sizeof(ChunkInfo), shape.data(), 8 * shape.size());
  head += p.len;
  stats_.records++;
  stats_.bytes += payload_len;
  out->rec = rec;
  out->payload = base + payload_offset(rec->ndim);
  out->payload_len = payload_len;
}

bool Producer::reserve(uint32_t kind, uint32_t channel, uint32_t name_id, int64_t pass_id,
                       uint16_t dtype, const std::vector<int64_t>& shape, uint64_t payload_len,
                       ChunkInfo chunk, bool block, Reservation* out, double timeout_s, bool whole_tensor) {
  if (!reservable(shape.size(), payload_len)) return false;
  std::lock_guard<std::mutex> g(mu_);
  if (!reserve_locked(kind, channel, name_id, pass_id, dtype, shape, payload_len, chunk, block, out, timeout_s))
    return false;
  // A tensor in one record is staged once reserved (its copy cannot fail): counted under this
  // lock rather than by taking it a second time after the copy.
  if (whole_tensor) stats_.tensors++;
  return true;
}

bool Producer::try_reserve(uint32_t kind, uint32_t channel, uint32_t name_id, int64_t pass_id, uint16_t dtype,
                           const std::vector<int64_t>& shape, uint64_t payload_len, ChunkInfo chunk,
                           Reservation* out) {
  if (!reservable(shape.size(), payload_len)) return false;
  std::unique_lock<std::mutex> g(mu_, std::try_to_lock);
  if (!g.owns_lock()) return false;  // another thread allocates, or waits for the writer holding mu_
  return reserve_locked(kind, channel, name_id, pass_id, dtype, shape, payload_len, chunk, false, out, 0.0);
}

bool Producer::reservable(size_t ndim, uint64_t payload_len) const {
  if (disabled()) return false;
  if (ndim > kMaxDims) return false;
  const uint64_t poff = payload_offset(static_cast<uint32_t>(ndim));
  return align_up(poff + payload_len) <= seg_.capacity() / 2;
}

bool Producer::reserve_locked(uint32_t kind, uint32_t channel, uint32_t name_id, int64_t pass_id, uint16_t dtype,
                              const std::vector<int64_t>& shape, uint64_t payload_len, ChunkInfo chunk, bool block,
                              Reservation* out, double timeout_s) {
  const uint64_t poff = payload_offset(static_cast<uint32_t>(shape.size()));
  RingHeader* h = seg_.header();
  uint64_t head = h->head.load(std::memory_order_relaxed);
  Placement p = place(head, kind, poff, payload_len);
  // Tensors never take the control reserve, blocking or not: when a wait for space runs out
  // (block_timeout_s) the pass's end record must still fit, or its drop count would be lost.
  const uint64_t keep_free = kind == kTensor ? control_reserve_ : 0;
  if (!wait_for_space(p.bytes() + keep_free, block, timeout_s)) return false;
  write_record(head, p, kind, channel, name_id, pass_id, dtype, shape, payload_len, chunk, out);
  // Header complete before the writer can see it (it reads head with acquire).
  h->head.store(head, std::memory_order_release);
  return true;
}

bool Producer::fits_whole(size_t ndim, const std::vector<uint64_t>& plan) const {
  const uint64_t poff = payload_offset(static_cast<uint32_t>(ndim));
  uint64_t bytes = control_reserve_;
  for (uint64_t n : plan) bytes += align_up(poff + n);
  return bytes <= seg_.capacity();
}

uint64_t Producer::span(uint64_t head, uint64_t poff, const std::vector<uint64_t>& plan) const {
  uint64_t start = head;
  for (uint64_t n : plan) head += place(head, kTensor, poff, n).bytes();
  return head - start;
}

int Producer::reserve_all(uint32_t channel, uint32_t name_id, int64_t pass_id, uint16_t dtype,
                          const std::vector<int64_t>& shape, const std::vector<uint64_t>& plan,
                          uint64_t total, bool block, double timeout_s, std::vector<Reservation>* out) {
  if (disabled()) return 0;
  const uint64_t poff = payload_offset(static_cast<uint32_t>(shape.size()));
  std::lock_guard<std::mutex> g(mu_);
  RingHeader* h = seg_.header();
  uint64_t head = h->head.load(std::memory_order_relaxed);
  const uint64_t keep_free = control_reserve_;  // (as reserve_locked: the pass end's room)
  const uint64_t need = span(head, poff, plan) + keep_free;
  if (need > seg_.capacity()) return -1;  // no wait can make room for all of it from here
  if (!wait_for_space(need, block, timeout_s)) return 0;
  out->resize(plan.size());
  uint64_t offset = 0;
  for (size_t i = 0; i < plan.size(); ++i) {
    Placement p = place(head, kTensor, poff, plan[i]);
    write_record(head, p, kTensor, channel, name_id, pass_id, dtype, shape, plan[i], ChunkInfo{offset, total},
                 &(*out)[i]);
    offset += plan[i];
  }
  h->head.store(head, std::memory_order_release);  // every chunk's header is complete
  return 1;
}

void Producer::publish(const Reservation& r) {
  r.rec->state.store(kReady, std::memory_order_release);
}

StageStatus Producer::stage_host(uint32_t channel, uint32_t name_id, int64_t pass_id, uint16_t dtype,
                                 const HostSource& src, bool block, double timeout_s) {
  if (disabled()) return kDisabled;
  if (src.shape.size() > kMaxDims) return kTooLarge;
  // A broadcast view (stride 0) may claim more bytes than any process holds: its size must not
  // wrap (2**61 float64s would read as 0 bytes), and no plan is made of it (below).
  // (A dimension of 0 makes any other size fine: nothing to copy.)
  uint64_t numel = 1, total = 0;
  bool zero = false, over = false;
  for (int64_t d : src.shape) {
    if (d < 0) return kTooLarge;
    if (d == 0) zero = true;
    else if (__builtin_mul_overflow(numel, static_cast<uint64_t>(d), &numel)) over = true;
  }
  if (zero) numel = 0;
  else if (over || __builtin_mul_overflow(numel, static_cast<uint64_t>(src.elem_size), &total) ||
           total > (uint64_t{1} << 63))
    return kTooLarge;
  // Split into element-aligned chunks; a tensor of one element is never split.
  uint64_t per_chunk = chunk_bytes_ / src.elem_size;
  if (per_chunk == 0) return kTooLarge;
  const double wait_s = block ? timeout_s : 0;
  auto no_space = [&] {
    if (disabled() || !writer_alive()) return kDisabled;
    return block ? kTimedOut : kNoSpace;
  };
  auto finish = [&] {
    std::lock_guard<std::mutex> g(mu_);
    stats_.tensors++;
    return kStaged;
  };
  if (numel <= per_chunk) {  // one record (the common case): no planning, no allocation
    Reservation r;
    if (!reserve(kTensor, channel, name_id, pass_id, dtype, src.shape, total, ChunkInfo{0, total}, block, &r, wait_s,
                 /*whole_tensor=*/true))
      return no_space();
    copy_strided(r.payload, src.ptr, src.elem_size, src.shape, src.strides, 0, numel);
    publish(r);
    return kStaged;
  }
  auto chunk_elems = [&](uint64_t first) { return numel - first < per_chunk ? numel - first : per_chunk; };
  // Larger than the whole ring (its payload alone): no plan of its chunks is made, since a
  // terabyte-sized broadcast view would take minutes and gigabytes to plan on the model's thread.
  const bool over_ring = total > seg_.capacity();
  std::vector<uint64_t> plan;
  int got = -1;
  std::vector<Reservation> rs;
  if (!over_ring) {
    for (uint64_t first = 0; first < numel; first += per_chunk) plan.push_back(chunk_elems(first) * src.elem_size);
    // Staged whole or not at all: every chunk's record is reserved before the first byte is copied.
    got = reserve_all(channel, name_id, pass_id, dtype, src.shape, plan, total, block, wait_s, &rs);
  }
  if (got == 0) return no_space();
  if (got > 0) {
    uint64_t first = 0;
    for (size_t i = 0; i < rs.size(); ++i) {
      uint64_t count = plan[i] / src.elem_size;
      copy_strided(rs[i].payload, src.ptr, src.elem_size, src.shape, src.strides, first, first + count);
      publish(rs[i]);
      first += count;
    }
    return finish();
  }
  // Larger than the ring can hold at once: it can only go in as the writer frees space, chunk by
  // chunk. `drop` never waits for the writer, so it never stages such a tensor.
  if (!block) return !over_ring && fits_whole(src.shape.size(), plan) ? kNoSpace : kRingTooSmall;  // kNoSpace: the wrap was in the way
  // Each chunk's wait is bounded on its own: block_timeout_s is how long the writer may free no
  // space, not how long a tensor may take (a 2 GiB tensor through a 256 MiB ring took longer than
  // 5 s on a busy machine with the writer consuming all along, and was torn).
  uint64_t first = 0;
  while (first < numel) {
    const uint64_t count = chunk_elems(first);
    Reservation r;
    if (!reserve(kTensor, channel, name_id, pass_id, dtype, src.shape, count * src.elem_size,
                 ChunkInfo{first * src.elem_size, total}, true, &r, timeout_s)) {
      StageStatus st = no_space();
      // Chunks already published can never be completed: the writer records the tensor as
      // incomplete when its pass ends.
      return (st == kTimedOut && first > 0) ? kTorn : st;
    }
    copy_strided(r.payload, src.ptr, src.elem_size, src.shape, src.strides, first, first + count);
    publish(r);
    first += count;
  }
  return finish();
}

uint64_t Producer::put_control(uint32_t channel, const char* bytes, uint64_t len, bool block,
                               double timeout_s) {
  Reservation r;
  static const std::vector<int64_t> no_shape;
  if (!reserve(kControl, channel, 0, -1, 0, no_shape, len, ChunkInfo{0, len}, block, &r, timeout_s)) return 0;
  std::memcpy(r.payload, bytes, len);
  uint64_t seq = r.rec->seq;
  publish(r);
  return seq;
}

bool Producer::wait_acked(uint64_t seq, double timeout_s) {
  RingHeader* h = seg_.header();
  Backoff backoff(2000);
  double deadline = now_s() + timeout_s;
  while (h->acked_seq.load(std::memory_order_acquire) < seq) {
    if (!writer_alive() || now_s() > deadline) return false;
    backoff.wait();
  }
  return true;
}

ProducerStats Producer::stats() {
  std::lock_guard<std::mutex> g(mu_);
  return stats_;
}

// ---------------------------------------------------------------------------------------------
// Consumer

Consumer::Consumer(const std::string& name) {
  seg_.open(name);
  cursor_ = released_ = seg_.header()->tail.load(std::memory_order_acquire);
}

bool Consumer::producer_alive() { return peer_alive(producer_fd_); }

void Consumer::set_state(uint64_t state, const std::string& error) {
  RingHeader* h = seg_.header();
  if (!error.empty()) {
    size_t n = error.size() < sizeof(h->error) - 1 ? error.size() : sizeof(h->error) - 1;
    std::memcpy(h->error, error.data(), n);
    h->error[n] = 0;
  }
  h->writer_state.store(state, std::memory_order_release);
}

bool Consumer::next(double timeout_s, RecordView* out) {
  RingHeader* h = seg_.header();
  const uint64_t cap = seg_.capacity();
  // The writer is never in a hurry: a short spin, no yields (each one a syscall, on a CPU the
  // model may want), then sleeps. Liveness (a poll() syscall) is checked once sleeping.
  Backoff backoff(1000, 16, 0, kWriterNapUs);
  double deadline = now_s() + timeout_s;
  bool producer_gone = false;
  for (;;) {
    uint64_t head = h->head.load(std::memory_order_acquire);
    if (cursor_ < head) {
      auto* rec = reinterpret_cast<RecordHeader*>(seg_.data() + cursor_ % cap);
      uint32_t st = rec->state.load(std::memory_order_acquire);
      if (st == kReady && rec->kind == kPad) {
        skip(rec->total_len);
        continue;
      }
      if (st == kReady) {
        const uint8_t* base = reinterpret_cast<const uint8_t*>(rec);
        out->kind = rec->kind;
        out->channel = rec->channel;
        out->name_id = rec->name_id;
        out->pass_id = rec->pass_id;
        out->dtype = rec->dtype;
        out->seq = rec->seq;
        std::memcpy(&out->chunk, base + sizeof(RecordHeader), sizeof(ChunkInfo));
        out->shape.resize(rec->ndim);
        if (rec->ndim)
          std::memcpy(out->shape.data(), base + sizeof(RecordHeader) + sizeof(ChunkInfo), 8ull * rec->ndim);
        out->payload = base + payload_offset(rec->ndim);
        out->payload_len = rec->payload_len;
        cursor_ += rec->total_len;  // handed out: its space stays ours until release()
        return true;
      }
      if (producer_gone) {
        // The producer died while filling this record: it will never be published.
        abandoned_++;
        skip(rec->total_len);
        continue;
      }
    } else if (producer_gone) {
      drained_ = true;
      return false;
    }
    if (!producer_gone && (backoff.sleeping() || timeout_s <= 0) && !producer_alive()) {
      producer_gone = true;
      continue;  // drain what is published, skip what is not
    }
    if (now_s() > deadline) return false;
    backoff.wait();
  }
}

void Consumer::skip(uint64_t len) {
  const bool was_holding = holding();
  cursor_ += len;
  if (!was_holding) release();  // nothing handed out is waiting: give the space back at once
}

void Consumer::release() {
  if (released_ == cursor_) return;
  released_ = cursor_;
  seg_.header()->tail.store(released_, std::memory_order_release);
}

}  // namespace fastdump
