// CUDA-graph record mode: see cuda_graph_record.h and docs/CUDA.md ("CUDA graphs").
//
// While a graph is captured (capturing thread):
//   record():    D2D copy (or the gather kernel) of each module output into a static slot; the
//                slots of one graph are contiguous ("the graph's span").
//   end_graph(): three small kernels on the capturing stream —
//     claim   (1 thread): under a device spin lock, advance the per-graph replay counter and take
//             room for the span in the device replay ring and a position in the replay log, both
//             addressed by device-side counters; when either is full (the host has not consumed
//             enough, read from mapped memory) the replay is dropped and counted instead;
//     copy    (grid):     span → ring entry, unless dropped;
//     publish (1 thread): write the entry's ReplayHeader (device memory) and the log entry (mapped
//             host memory), fence, then its stamp.
// Every replay runs them, so the host does nothing per replay on the serving thread.
// Drain thread (one per recorder): poll the log in order; each stamped entry is one
// CudaStager::stage() of the whole entry (header + span) as ONE tensor record on the drain's own
// stream: O(1) host work per replay, whatever the graph's tensor count. The writer splits the
// record into the pass's tensors (the layout came once, in the "graph" control message). Give the
// ring room and the log position back once the stager has completed the record; when the count of
// dropped replays changed, send the drop note (a template from fastdump/protocol.py).
#include "cuda_graph_record.h"

#include <cuda_runtime.h>  // tests/cuda_mock/cuda_runtime.h in the mock test build

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <sys/prctl.h>
#include <vector>

#include "ring.h"

#ifdef FASTDUMP_CUDA_MOCK
#define FD_GR_HD
#else
#define FD_GR_HD __host__ __device__
#endif

namespace fastdump {

namespace {

constexpr uint64_t kSlotAlign = 256;
constexpr uint64_t kSkip = ~uint64_t(0);   // decision: this replay is not committed
constexpr uint32_t kMaxGraphs = kMaxGraphsPerRecorder;  // graphs per recorder (decision words)
constexpr int kCopyThreads = 256;
// The drain's longest wait for host-ring space per record: a stalled (alive) writer must not hold
// it forever (close() joins it); what times out is counted, never written partially. Once close()
// has begun, no wait outlasts its deadline.
constexpr double kDrainWaitS = 10.0;

using Clock = std::chrono::steady_clock;

Clock::time_point after_s(double seconds) {
  return Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
}

// Device memory, written only by the graph kernels.
struct GraphCtl {
  uint32_t lock;
  uint32_t pad;
  uint64_t head;      // ring bytes claimed (monotonic; position p lives at p % ring_bytes)
  uint64_t log_head;  // log positions claimed (monotonic)
};
struct GraphDecision {  // one per graph: what its current replay does
  uint64_t offset;      // ring position of the entry (monotonic), or kSkip
  uint64_t log_pos;
  uint64_t replays;     // replays of this graph so far (dropped ones included)
  uint64_t replay;      // this replay's index
};

// Mapped pinned host memory, shared by the kernels and the drain thread.
struct alignas(64) HostCtl {
  uint64_t consumed_bytes;  // host → device: ring bytes given back (monotonic)
  uint64_t log_consumed;    // host → device: log positions given back
  uint64_t closed;          // host → device: nonzero after close(): replays do nothing
  uint64_t pad0[5];
  uint64_t dropped;         // device → host: replays dropped (no room, or claimed after close())
  // device → host, for close(): every replay that may take a log position is either seen by it or
  // sees `closed` (a claim counts itself in claims_begun BEFORE it reads `closed`; close() sets
  // `closed` BEFORE it reads claims_begun, then waits for claims_done to catch up and reads
  // log_claimed: no position is taken after that).
  uint64_t claims_begun;
  uint64_t claims_done;
  uint64_t log_claimed;     // log positions taken (the device's log_head)
  uint64_t pad1[4];
};
static_assert(sizeof(HostCtl) == 128, "host control block layout");
struct LogEntry {
  uint64_t stamp;   // log position + 1 once the entry is complete
  uint64_t offset;  // ring position of the replay's entry
  uint64_t replay;  // the graph's replay index
  uint32_t graph;
  uint32_t pad;
};
static_assert(sizeof(LogEntry) == 32, "log entry layout");

// 64-bit words shared between the graph kernels and the host through mapped memory: volatile on the
// device (every access reaches memory), acquire/release atomics on the host (and in the mock).
FD_GR_HD inline uint64_t ld_shared(const uint64_t* p) {
#ifdef __CUDA_ARCH__
  return *reinterpret_cast<const volatile uint64_t*>(p);
#else
  return __atomic_load_n(p, __ATOMIC_ACQUIRE);
#endif
}
FD_GR_HD inline void st_shared(uint64_t* p, uint64_t v) {
#ifdef __CUDA_ARCH__
  *reinterpret_cast<volatile uint64_t*>(p) = v;
#else
  __atomic_store_n(p, v, __ATOMIC_RELEASE);
#endif
}

// The close() handshake (see HostCtl): a store, then a load of another word, that must not be
// reordered (a store-load fence on the device; sequentially consistent accesses on the host).
FD_GR_HD inline void st_shared_sc(uint64_t* p, uint64_t v) {
#ifdef __CUDA_ARCH__
  *reinterpret_cast<volatile uint64_t*>(p) = v;
  __threadfence_system();
#else
  __atomic_store_n(p, v, __ATOMIC_SEQ_CST);
#endif
}
FD_GR_HD inline uint64_t ld_shared_sc(const uint64_t* p) {
#ifdef __CUDA_ARCH__
  return *reinterpret_cast<const volatile uint64_t*>(p);
#else
  return __atomic_load_n(p, __ATOMIC_SEQ_CST);
#endif
}

// The claim, run by one thread with the lock held. `ctl` and `dec` are device memory, `host` mapped.
template <typename C, typename D>
FD_GR_HD inline void claim_locked(C* ctl, D* dec, HostCtl* host, uint64_t need, uint64_t ring_bytes,
                                  uint64_t log_cap) {
  const uint64_t replay = dec->replays;
  dec->replays = replay + 1;
  dec->replay = replay;
  // (host words below are only ever written under the lock)
  // Counted before `closed` is read (close() writes `closed`, then reads this).
  st_shared_sc(&host->claims_begun, ld_shared(&host->claims_begun) + 1);
  const uint64_t tail = ld_shared(&host->consumed_bytes), log_tail = ld_shared(&host->log_consumed);
  uint64_t start = ctl->head;
  if (start % ring_bytes + need > ring_bytes) start += ring_bytes - start % ring_bytes;  // entries never wrap
  if (ld_shared_sc(&host->closed) || start + need - tail > ring_bytes || ctl->log_head - log_tail >= log_cap) {
    // No room, or a replay launched while (or after) the Dumper closed: a whole pass dropped, counted.
    st_shared(&host->dropped, ld_shared(&host->dropped) + 1);
    dec->offset = kSkip;
  } else {
    dec->offset = start;
    dec->log_pos = ctl->log_head;
    ctl->log_head = ctl->log_head + 1;
    ctl->head = start + need;
    st_shared(&host->log_claimed, ctl->log_head);
  }
#ifdef __CUDA_ARCH__
  __threadfence_system();  // the decision's words before claims_done (st_shared releases on the host)
#endif
  st_shared(&host->claims_done, ld_shared(&host->claims_done) + 1);
}

#ifndef FASTDUMP_CUDA_MOCK
__global__ void graph_claim_kernel(GraphCtl* ctl, GraphDecision* dec, HostCtl* host, uint64_t need,
                                   uint64_t ring_bytes, uint64_t log_cap) {
  if (threadIdx.x != 0 || blockIdx.x != 0) return;
  while (atomicCAS(&ctl->lock, 0u, 1u) != 0u) {
  }
  __threadfence();
  claim_locked(reinterpret_cast<volatile GraphCtl*>(ctl), reinterpret_cast<volatile GraphDecision*>(dec), host,
               need, ring_bytes, log_cap);
  __threadfence();
  atomicExch(&ctl->lock, 0u);
}

__global__ void __launch_bounds__(kCopyThreads)
    graph_copy_kernel(const GraphDecision* dec, const uint4* __restrict__ span, uint8_t* ring, uint64_t ring_bytes,
                      uint64_t units) {
  const uint64_t off = *reinterpret_cast<const volatile uint64_t*>(&dec->offset);
  if (off == kSkip) return;
  uint4* dst = reinterpret_cast<uint4*>(ring + off % ring_bytes);
  const uint64_t step = static_cast<uint64_t>(gridDim.x) * blockDim.x;
  for (uint64_t i = static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < units; i += step)
    dst[i] = span[i];
}

__global__ void graph_publish_kernel(const GraphDecision* dec, LogEntry* log, uint64_t log_cap, uint32_t graph,
                                     uint8_t* ring, uint64_t ring_bytes, uint64_t span_name_id, uint64_t span_bytes,
                                     uint64_t number) {
  if (threadIdx.x != 0 || blockIdx.x != 0) return;
  const volatile GraphDecision* d = dec;
  const uint64_t off = d->offset;
  if (off == kSkip) return;
  const uint64_t pos = d->log_pos;
  // The entry's header: after the copy kernel (stream order), which copied the span's unused header room.
  volatile ReplayHeader* h = reinterpret_cast<volatile ReplayHeader*>(ring + off % ring_bytes);
  h->magic = kReplayMagic;
  h->pass_id = static_cast<uint64_t>(kGraphPassBase) + pos;
  h->replay = d->replay;
  h->span_name_id = span_name_id;
  h->span_bytes = span_bytes;
  h->graph = number;
  volatile LogEntry* e = log + pos % log_cap;
  e->offset = off;
  e->replay = d->replay;
  e->graph = graph;
  __threadfence_system();  // the entry (and the copy kernel's ring writes before it) before the stamp
  st_shared(const_cast<uint64_t*>(&e->stamp), pos + 1);
}
#endif

std::string cuda_text(cudaError_t e, const char* what) {
  return std::string("fastdump CUDA graph record: ") + what + ": " + cudaGetErrorName(e) + " (" +
         cudaGetErrorString(e) + ")";
}

// A failed call leaves its error as the thread's "last error" (cudaGetLastError); cleared here, or
// torch would blame its next kernel launch for it.
#define FD_GR_CUDA(call)                                   \
  do {                                                     \
    cudaError_t fd_e_ = (call);                            \
    if (fd_e_ != cudaSuccess) {                            \
      (void)cudaGetLastError();                            \
      throw std::runtime_error(cuda_text(fd_e_, #call));   \
    }                                                      \
  } while (0)

uint64_t align_slot(uint64_t n) { return (n + kSlotAlign - 1) / kSlotAlign * kSlotAlign; }

// Setup and teardown must not invalidate a global-mode capture on another thread.
class Relaxed {
 public:
  Relaxed() { (void)cudaThreadExchangeStreamCaptureMode(&mode_); }
  ~Relaxed() { (void)cudaThreadExchangeStreamCaptureMode(&mode_); }

 private:
  cudaStreamCaptureMode mode_ = cudaStreamCaptureModeRelaxed;
};

// The thread's device for a scope; restored without ever creating a stray context.
class OnDevice {
 public:
  explicit OnDevice(int device) {
    FD_GR_CUDA(cudaGetDevice(&prev_));
    if (prev_ != device) {
      FD_GR_CUDA(cudaSetDevice(device));
      changed_ = true;
    }
  }
  ~OnDevice() {
    if (changed_) cuda_restore_device(prev_);
  }

 private:
  int prev_ = 0;
  bool changed_ = false;
};

struct GraphInfo {
  uint32_t id = 0;           // its decision word and span name; reused once reclaim() freed it
  uint64_t number = 0;       // committed graphs, numbered from 0 by the recorder: never reused
  uint64_t serial = 0;       // the capture's number (begin_graph): what reclaim() names
  uint64_t span_offset = 0;  // in the slot area
  uint64_t slot_limit = 0;   // end of the free slot extent the span grows in
  uint64_t span_bytes = 0;   // multiple of kSlotAlign
  std::vector<GraphTensorLayout> tensors;
  uint64_t tensor_bytes = 0;  // sum of the tensors' nbytes
  cudaStream_t stream = nullptr;
  unsigned long long capture_id = 0;  // the capture it was begun in (cudaStreamGetCaptureInfo)
  // Its own done event, recorded by capture_ending() when the capture ends before the pass does
  // (the graph is then given up): what reclaim() waits on before its slots go to another graph.
  cudaEvent_t own_done = nullptr;
  bool overflow = false;
};

struct PendingRelease {
  uint64_t stager_mark;  // CudaStager::submitted() after the pass's tensors
  uint64_t ring_end;     // ring position up to which bytes can be given back
  uint64_t log_next;     // log positions consumed
};

}  // namespace

struct GraphRecorder::Impl {
  CudaStager* stager;
  Producer* producer;
  uint32_t channel;
  int device;
  uint64_t slot_cap, ring_cap;
  uint32_t log_cap;
  int sm_count = 0;

  uint8_t* dmem = nullptr;  // GraphCtl | GraphDecision[kMaxGraphs] | slots | ring
  GraphCtl* ctl = nullptr;
  GraphDecision* dec = nullptr;
  uint8_t* slots = nullptr;
  uint8_t* ring = nullptr;
  HostCtl* host = nullptr;     // host address of the mapped block
  HostCtl* host_dev = nullptr; // its device address
  LogEntry* log = nullptr;
  LogEntry* log_dev = nullptr;
  cudaStream_t stream = nullptr;  // the drain's own stream (non-blocking)

  mutable std::mutex mu;          // graphs, open capture, slots, counters
  // Committed graphs by id: the last graph of each id (see retired_ids). Shared with the drain,
  // which holds its own reference while it stages a replay.
  std::vector<std::shared_ptr<const GraphInfo>> graphs;
  // Ids reclaim() freed -> the log position the drain must have released (published to the host
  // ring) before the id names another graph: every replay of the old graph is then ahead of the
  // new graph's layout in the ring, and no log entry still to be drained names the old one.
  std::map<uint32_t, uint64_t> retired_ids;
  std::map<uint64_t, uint32_t> serial_ids;  // capture serial -> id, of committed graphs
  // Per graph id, the event every launch of its graph records after the commit kernels (an event
  // record node); made once per id, kept while the device memory is. Capture serial -> that event,
  // for the committed graphs whose capture recorded it: what reclaim() waits on.
  std::vector<cudaEvent_t> done_events;
  std::map<uint64_t, cudaEvent_t> serial_done;
  // Capture serial -> the event capture_ending() made for that graph (GraphInfo::own_done), owned
  // here: destroyed when its slots are given back (the graph no longer exists) or the memory freed.
  std::map<uint64_t, cudaEvent_t> own_done;
  uint64_t next_number = 0;
  uint64_t live_graphs = 0;
  std::unique_ptr<GraphInfo> open;
  // The slot area: free extents (offset -> bytes, coalesced) and the spans graphs hold (capture
  // serial -> offset, bytes). A span is held from its capture until reclaim() proves that no
  // replay of its graph can run any more.
  std::map<uint64_t, uint64_t> free_slots;
  std::map<uint64_t, std::pair<uint64_t, uint64_t>> held_slots;
  uint64_t next_serial = 1;
  uint64_t slot_used = 0;          // bytes held
  uint64_t reclaimed_graphs = 0, reclaimed_bytes = 0;
  uint64_t captured_tensors = 0;
  uint64_t replays = 0, tensors = 0, bytes = 0, span_records = 0;
  uint64_t unwritten_replays = 0;  // drained replays whose span record could not be staged
  std::string note_head, note_tail;  // the drop note around the count (empty head: no note)
  uint64_t noted_drops = 0;          // drain thread only: the count the last note that went out said
  std::string last_error;
  bool broken = false;
  bool closed = false;
  uint64_t dropped_at_free = 0;  // the device's count when the mapped block was freed
  // The count close() reported: replays after close() returned are neither dumped nor counted (the
  // Dumper's totals are final by then).
  bool drops_final = false;
  uint64_t final_drops = 0;
  // close(): the log positions claimed when no replay could claim one any more; the drain stages
  // up to it (or counts what it could not).
  std::atomic<uint64_t> final_pos{~uint64_t(0)};
  uint64_t undecided_claims = 0;  // claims close() saw begun but not decided by its deadline

  std::atomic<bool> paused{false};
  std::atomic<bool> stop{false};
  // close()'s deadline (set when it begins): the drain's waits end by then, and replays still
  // unstaged at it are counted as unwritten, never staged.
  std::atomic<Clock::rep> close_deadline{Clock::time_point::max().time_since_epoch().count()};
  std::atomic<bool> end_waits{false};  // set at close()'s deadline: ends a staging wait under way
  std::atomic<uint64_t> busy{0};  // the drain is inside a pass (flush waits for it)
  uint64_t next_pos = 0;          // drain thread only
  std::deque<PendingRelease> pending;  // drain thread only (size mirrored in n_pending)
  std::atomic<uint64_t> n_pending{0};
  std::thread drain;

  Impl(CudaStager* s, uint32_t ch, int dev, uint64_t slot_bytes, uint64_t ring_bytes, uint32_t log_entries,
       const std::string& drop_note, const std::string& drop_mark)
      : stager(s), producer(s->producer()), channel(ch), device(dev), slot_cap(align_slot(slot_bytes)),
        ring_cap(align_slot(ring_bytes)), log_cap(log_entries) {
    if (slot_cap == 0 || ring_cap == 0 || log_cap == 0) throw std::invalid_argument("graph recorder sizes must be > 0");
    free_slots[0] = slot_cap;
    if (dev < 0 || static_cast<uint64_t>(dev) >= (~kGraphSpanNameBase) / kMaxGraphs)
      throw std::invalid_argument("graph recorder: device index out of range");
    if (!drop_note.empty()) {
      const size_t at = drop_mark.empty() ? std::string::npos : drop_note.find(drop_mark);
      if (at == std::string::npos || drop_note.find(drop_mark, at + 1) != std::string::npos)
        throw std::invalid_argument("drop_note must hold drop_mark exactly once");
      note_head = drop_note.substr(0, at);
      note_tail = drop_note.substr(at + drop_mark.size());
    }
    Relaxed relaxed;
    OnDevice on(device);
    FD_GR_CUDA(cudaDeviceGetAttribute(&sm_count, cudaDevAttrMultiProcessorCount, device));
    const uint64_t head_bytes = align_slot(sizeof(GraphCtl) + sizeof(GraphDecision) * kMaxGraphs);
    void* p = nullptr;
    FD_GR_CUDA(cudaMalloc(&p, head_bytes + slot_cap + ring_cap));
    dmem = static_cast<uint8_t*>(p);
    ctl = reinterpret_cast<GraphCtl*>(dmem);
    dec = reinterpret_cast<GraphDecision*>(dmem + sizeof(GraphCtl));
    slots = dmem + head_bytes;
    ring = slots + slot_cap;
    const size_t host_bytes = sizeof(HostCtl) + sizeof(LogEntry) * log_cap;
    try {
      FD_GR_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
      std::vector<uint8_t> zeros(head_bytes, 0);
      FD_GR_CUDA(cudaMemcpyAsync(dmem, zeros.data(), head_bytes, cudaMemcpyHostToDevice, stream));
      FD_GR_CUDA(cudaStreamSynchronize(stream));
      void* h = nullptr;
      FD_GR_CUDA(cudaHostAlloc(&h, host_bytes, cudaHostAllocMapped | cudaHostAllocPortable));
      std::memset(h, 0, host_bytes);
      host = static_cast<HostCtl*>(h);
      log = reinterpret_cast<LogEntry*>(host + 1);
      void* hd = nullptr;
      FD_GR_CUDA(cudaHostGetDevicePointer(&hd, h, 0));
      host_dev = static_cast<HostCtl*>(hd);
      log_dev = reinterpret_cast<LogEntry*>(host_dev + 1);
    } catch (...) {
      if (host) (void)cudaFreeHost(host);
      if (stream) (void)cudaStreamDestroy(stream);
      (void)cudaFree(dmem);
      throw;
    }
    drain = std::thread([this] { drain_loop(); });
  }

  // ------------------------------------------------------------------ capture side
  int begin_graph(uintptr_t s) {
    cudaStream_t cs = reinterpret_cast<cudaStream_t>(s);
    cudaStreamCaptureStatus st = cudaStreamCaptureStatusNone;
    unsigned long long capture_id = 0;
    const cudaError_t ge = cudaStreamGetCaptureInfo(cs, &st, &capture_id);
    // No graph comes of these three (ValueError in Python: nothing to dump, the tensor is skipped);
    // any other refusal below leaves a graph that replays undumped (counted as not dumped).
    if (ge == cudaErrorStreamCaptureImplicit) {
      // The legacy default stream while a blocking stream of its device captures (another thread's
      // raw capture, CuPy's): the legacy stream itself never captures, so no graph of ours exists,
      // and any work on it now would invalidate that capture. The tensor is skipped, not a graph lost.
      (void)cudaGetLastError();
      throw std::invalid_argument(
          "the legacy default stream cannot be used while a blocking stream of GPU " + std::to_string(device) +
          " is being captured (by other code): nothing is copied until that capture ends");
    }
    if (ge != cudaSuccess) {
      (void)cudaGetLastError();
      throw std::runtime_error(cuda_text(ge, "cudaStreamGetCaptureInfo"));
    }
    if (st == cudaStreamCaptureStatusInvalidated)
      throw std::invalid_argument("the CUDA graph capture was invalidated: it makes no graph");
    if (st != cudaStreamCaptureStatusActive) throw std::invalid_argument("the stream is not capturing a CUDA graph");
    std::lock_guard<std::mutex> g(mu);
    if (closed || broken) throw std::runtime_error("graph recorder closed" + (last_error.empty() ? "" : ": " + last_error));
    if (open) throw std::runtime_error("another CUDA graph capture of this Dumper is open (one at a time)");
    const int64_t id = free_id_locked();
    if (id < 0)
      throw std::overflow_error("more than " + std::to_string(kMaxGraphs) + " CUDA graphs of one Dumper exist on GPU " +
                                std::to_string(device) + " (reset or delete graphs no longer replayed)");
    open.reset(new GraphInfo());
    open->id = static_cast<uint32_t>(id);
    open->serial = next_serial++;
    // The graph's span grows in the largest free extent (its size is known only at its end).
    open->span_offset = open->slot_limit = slot_cap;
    for (const auto& f : free_slots)
      if (open->slot_limit - open->span_offset < f.second) {
        open->span_offset = f.first;
        open->slot_limit = f.first + f.second;
      }
    open->span_bytes = kReplayHeaderBytes;  // each ring entry opens with its ReplayHeader
    open->stream = cs;
    open->capture_id = capture_id;
    return static_cast<int>(open->id);
  }

  // The id for the next graph: the lowest freed one the drain is past (see retired_ids), else a
  // new one; -1 when kMaxGraphs graphs hold one. mu held.
  int64_t free_id_locked() {
    const uint64_t released = host ? ld_shared(&host->log_consumed) : 0;
    for (const auto& r : retired_ids)
      if (released >= r.second) return r.first;
    return graphs.size() < kMaxGraphs ? static_cast<int64_t>(graphs.size()) : -1;
  }

  // Whether the open graph's capture is over (ended, or another capture on its stream since): its
  // commit kernels would run once, at once, publishing slots no replay wrote, and the graph's
  // replays would have none. mu held.
  bool capture_ended_locked() {
    if (!open) return false;
    cudaStreamCaptureStatus st = cudaStreamCaptureStatusNone;
    unsigned long long id = 0;
    if (cudaStreamGetCaptureInfo(open->stream, &st, &id) != cudaSuccess) {
      (void)cudaGetLastError();
      return true;
    }
    return st != cudaStreamCaptureStatusActive || id != open->capture_id;
  }

  // The open graph's capture is still open but invalidated (an unsafe call, an error on a captured
  // stream): cudaStreamEndCapture will return no graph, so nothing recorded into it can ever run.
  // Unlike a capture that ended, no graph's replays go unseen. mu held.
  bool capture_invalidated_locked() {
    if (!open) return false;
    cudaStreamCaptureStatus st = cudaStreamCaptureStatusNone;
    unsigned long long id = 0;
    if (cudaStreamGetCaptureInfo(open->stream, &st, &id) != cudaSuccess) {
      (void)cudaGetLastError();
      return false;
    }
    return st == cudaStreamCaptureStatusInvalidated && id == open->capture_id;
  }

  bool capture_ended() {
    std::lock_guard<std::mutex> g(mu);
    return capture_ended_locked();
  }

  bool capture_invalidated() {
    std::lock_guard<std::mutex> g(mu);
    return capture_invalidated_locked();
  }

  int record(uint32_t name_id, uint16_t dtype, const CudaSource& src) {
    std::lock_guard<std::mutex> g(mu);
    if (!open) throw std::runtime_error("no CUDA graph capture is open");
    if (src.shape.size() > kMaxDims) return kTooLarge;
    if (reinterpret_cast<cudaStream_t>(src.stream) != open->stream)
      throw std::runtime_error("the tensor's stream is not the stream being captured");
    uint64_t nbytes = src.elem_size;
    for (int64_t d : src.shape) nbytes *= static_cast<uint64_t>(d);
    const uint64_t off = open->span_bytes, end = off + align_slot(nbytes);
    if (open->span_offset + end > open->slot_limit || end > ring_cap) {
      open->overflow = true;
      return kNoSpace;
    }
    OnDevice on(device);
    snapshot_whole(slots + open->span_offset + off, src, sm_count);  // recorded into the graph
    std::vector<int64_t> shape(src.shape);
    open->tensors.push_back(GraphTensorLayout{name_id, dtype, std::move(shape), off, nbytes});
    open->tensor_bytes += nbytes;
    open->span_bytes = end;
    return kStaged;
  }

  int end_graph() {
    std::lock_guard<std::mutex> g(mu);
    if (open) open->number = next_number;  // (taken below, once committed)
    if (!open) throw std::runtime_error("no CUDA graph capture is open");
    if (capture_ended_locked()) {
      hold_given_up_locked();  // (the graph may be replayed)
      open.reset();
      throw std::runtime_error("the capture ended before the pass did: the graph holds no commit, its replays "
                               "cannot be dumped (end the pass inside the capture)");
    }
    std::unique_ptr<GraphInfo> gi(std::move(open));
    if (gi->own_done) own_done[gi->serial] = gi->own_done;  // (in its graph: kept while the graph may be)
    if (gi->tensors.empty()) return -1;
    OnDevice on(device);
    enqueue_commit(*gi);
    if (cudaEvent_t ev = record_done_event_locked(gi->id, gi->stream)) serial_done[gi->serial] = ev;
    ++next_number;
    hold_slots_locked(*gi);  // the graph's until reclaim()
    captured_tensors += gi->tensors.size();
    const uint32_t id = gi->id;
    retired_ids.erase(id);
    serial_ids[gi->serial] = id;
    ++live_graphs;
    if (id == graphs.size()) graphs.emplace_back();
    graphs[id] = std::shared_ptr<const GraphInfo>(std::move(gi));
    return static_cast<int>(id);
  }

  void enqueue_commit(const GraphInfo& gi) {
    GraphDecision* d = dec + gi.id;
    const uint8_t* span = slots + gi.span_offset;
    const uint64_t need = gi.span_bytes, rb = ring_cap, lc = log_cap;
    const uint32_t id = gi.id;
    const uint64_t name_id = span_name(gi.id), number = gi.number;
#ifdef FASTDUMP_CUDA_MOCK
    GraphCtl* c = ctl;
    HostCtl* h = host_dev;
    LogEntry* lg = log_dev;
    uint8_t* r = ring;
    FD_GR_CUDA(fdmock::enqueue(gi.stream, [=] {  // claim
      GraphCtl* cs = fdmock::dev_bytes(c);
      GraphDecision* ds = fdmock::dev_bytes(d);
      while (__atomic_exchange_n(&cs->lock, 1u, __ATOMIC_ACQUIRE)) std::this_thread::yield();
      claim_locked(cs, ds, h, need, rb, lc);
      __atomic_store_n(&cs->lock, 0u, __ATOMIC_RELEASE);
    }));
    FD_GR_CUDA(fdmock::enqueue(gi.stream, [=] {  // copy
      const GraphDecision* ds = fdmock::dev_bytes(d);
      if (ds->offset == kSkip) return;
      std::memcpy(fdmock::dev_bytes(r + ds->offset % rb), fdmock::dev_bytes(span), need);
    }));
    FD_GR_CUDA(fdmock::enqueue(gi.stream, [=] {  // publish
      const GraphDecision* ds = fdmock::dev_bytes(d);
      if (ds->offset == kSkip) return;
      const ReplayHeader h{kReplayMagic, static_cast<uint64_t>(kGraphPassBase) + ds->log_pos, ds->replay, name_id,
                           need, number};
      std::memcpy(fdmock::dev_bytes(r + ds->offset % rb), &h, sizeof h);
      LogEntry* e = lg + ds->log_pos % lc;
      e->offset = ds->offset;
      e->replay = ds->replay;
      e->graph = id;
      st_shared(&e->stamp, ds->log_pos + 1);
    }));
#else
    graph_claim_kernel<<<1, 1, 0, gi.stream>>>(ctl, d, host_dev, need, rb, lc);
    FD_GR_CUDA(cudaGetLastError());
    const uint64_t units = need / 16;
    uint64_t blocks = (units + kCopyThreads - 1) / kCopyThreads;
    const uint64_t max_blocks = static_cast<uint64_t>(sm_count > 0 ? sm_count : 16) * 4;
    if (blocks > max_blocks) blocks = max_blocks;
    if (blocks == 0) blocks = 1;
    graph_copy_kernel<<<static_cast<unsigned>(blocks), kCopyThreads, 0, gi.stream>>>(
        d, reinterpret_cast<const uint4*>(span), ring, rb, units);
    FD_GR_CUDA(cudaGetLastError());
    graph_publish_kernel<<<1, 1, 0, gi.stream>>>(d, log_dev, lc, id, ring, rb, name_id, need, number);
    FD_GR_CUDA(cudaGetLastError());
#endif
  }

  // Records graph `id`'s done event on its capturing stream as an event record node
  // (cudaEventRecordExternal), after the commit kernels and so after every snapshot into its slots:
  // each launch records it, and cudaEventSynchronize on it waits for the latest launch, on
  // whatever stream. nullptr when it cannot be had (that graph's slots are then never given back).
  // mu held; on the graph's device, inside its capture.
  cudaEvent_t record_done_event_locked(uint32_t id, cudaStream_t cs) {
    if (done_events.size() <= id) done_events.resize(id + 1, nullptr);
    cudaEvent_t& ev = done_events[id];
    if (!ev) {
      Relaxed relaxed;  // (this thread captures; an event is no allocation a graph could miss)
      if (cudaEventCreateWithFlags(&ev, cudaEventDisableTiming) != cudaSuccess) {
        (void)cudaGetLastError();
        ev = nullptr;
        return nullptr;
      }
    }
    if (cudaEventRecordWithFlags(ev, cs, cudaEventRecordExternal) != cudaSuccess) {
      (void)cudaGetLastError();
      return nullptr;
    }
    return ev;
  }

  void abort_graph() {
    std::lock_guard<std::mutex> g(mu);
    // The copies may be in a graph, whose replays write the slots: kept, unless its capture was
    // invalidated (no graph comes of it: the next graph may have them).
    if (open && !capture_invalidated_locked()) {
      hold_given_up_locked();
    } else if (open && open->own_done) {
      (void)cudaEventDestroy(open->own_done);
    }
    open.reset();
  }

  // The open graph's capture is about to end while its pass is still open (torch's capture_end,
  // staging/graphs.py): its commit can no longer be recorded, so the graph will be given up, but a
  // done event still can be. Recorded now, as an event record node after every snapshot into its
  // slots (an event of its own: its id goes to the next graph, whose commit records done_events[id]),
  // so that reclaim() can give the slots back once the graph can never run again. Without it a
  // given-up graph kept its slots for good, and repeated failing captures used them all up.
  void capture_ending() {
    std::lock_guard<std::mutex> g(mu);
    if (!open || open->tensors.empty() || open->own_done || capture_ended_locked()) return;
    OnDevice on(device);
    cudaEvent_t ev = nullptr;
    {
      Relaxed relaxed;  // (this thread captures; an event is no allocation a graph could miss)
      if (cudaEventCreateWithFlags(&ev, cudaEventDisableTiming) != cudaSuccess) {
        (void)cudaGetLastError();
        return;
      }
    }
    if (cudaEventRecordWithFlags(ev, open->stream, cudaEventRecordExternal) != cudaSuccess) {
      (void)cudaGetLastError();
      (void)cudaEventDestroy(ev);
      return;
    }
    open->own_done = ev;
  }

  // The open graph is given up without a commit: its slots stay held (it may be replayed), and
  // can be reclaimed when capture_ending() gave it a done event. mu held.
  void hold_given_up_locked() {
    hold_slots_locked(*open);
    if (!open->own_done) return;
    own_done[open->serial] = open->own_done;
    if (held_slots.count(open->serial)) serial_done[open->serial] = open->own_done;
    open->own_done = nullptr;
  }

  // The span of `gi` (opened at the start of a free extent) is taken out of the free slots, held
  // under its capture's serial. Nothing when no snapshot was recorded into it. mu held.
  void hold_slots_locked(const GraphInfo& gi) {
    if (gi.tensors.empty()) return;
    auto f = free_slots.find(gi.span_offset);
    if (f == free_slots.end() || f->second < gi.span_bytes) return;  // (cannot happen: record() checked)
    const uint64_t rest = f->second - gi.span_bytes;
    free_slots.erase(f);
    if (rest) free_slots[gi.span_offset + gi.span_bytes] = rest;
    held_slots[gi.serial] = {gi.span_offset, gi.span_bytes};
    slot_used += gi.span_bytes;
  }

  // Give back the slots of the captures `serials`, whose graphs the caller knows can never be
  // launched again (torch reset() or collected them). A replay launched before may still be in
  // flight, writing those slots (its snapshots) and reading them (its copy kernel): each graph's
  // done event is waited for first (its latest launch has run past every node that touches the
  // slots), and nothing is given back when it cannot be (an error). Never cudaDeviceSynchronize:
  // while any stream of the device captures (another thread's raw cudaStreamBeginCapture, in any
  // mode) a device-wide synchronization is illegal and invalidates that capture. A graph without a
  // done event (given up before its capture ended, outside torch; the record failed) keeps its
  // slots, and so does one whose event cannot be waited for (the others are given back all the
  // same). A replay's pass needs only its ring entry, never the slots, so one still waiting for the
  // drain is unaffected. Returns the serials given back.
  std::vector<uint64_t> reclaim(const std::vector<uint64_t>& wanted) {
    std::vector<uint64_t> asked;
    std::vector<cudaEvent_t> events;
    {
      std::lock_guard<std::mutex> g(mu);
      if (dmem == nullptr) return {};
      for (uint64_t s : wanted) {
        auto d = serial_done.find(s);
        if (!held_slots.count(s) || d == serial_done.end()) continue;
        asked.push_back(s);
        events.push_back(d->second);
      }
      if (asked.empty()) return {};
    }
    std::vector<uint64_t> serials;  // those whose latest launch is over
    {
      Relaxed relaxed;  // (never invalidates another thread's capture)
      OnDevice on(device);
      for (size_t i = 0; i < asked.size(); ++i)
        if (launches_over(events[i])) serials.push_back(asked[i]);
      if (serials.empty()) return {};
    }
    // The freed graphs' decision words start over (replay index 0) for the next graph of their id.
    // Nothing replays them now (synchronized, and they can never run again).
    std::vector<uint32_t> ids;
    {
      std::lock_guard<std::mutex> g(mu);
      for (uint64_t s : serials) {
        auto i = serial_ids.find(s);
        if (i != serial_ids.end()) ids.push_back(i->second);
      }
    }
    if (!ids.empty()) {
      Relaxed relaxed;
      OnDevice on(device);
      static const GraphDecision zero{};
      cudaError_t e = cudaSuccess;
      for (uint32_t id : ids)
        if (e == cudaSuccess) e = cudaMemcpyAsync(dec + id, &zero, sizeof zero, cudaMemcpyHostToDevice, stream);
      if (e == cudaSuccess) e = cudaStreamSynchronize(stream);
      if (e != cudaSuccess) {  // the ids stay taken (the slots are given back below all the same)
        (void)cudaGetLastError();
        ids.clear();
      }
    }
    std::vector<uint64_t> done;
    std::lock_guard<std::mutex> g(mu);
    // Reusable once the drain released every replay claimed so far (until then graphs[id] still
    // names the old graph, for the drain).
    for (uint32_t id : ids) {
      retired_ids[id] = host ? ld_shared(&host->log_claimed) : 0;
      --live_graphs;
    }
    for (uint64_t s : serials) {
      auto h = held_slots.find(s);
      if (h == held_slots.end()) continue;
      serial_ids.erase(s);
      serial_done.erase(s);
      auto own = own_done.find(s);
      if (own != own_done.end()) {  // (its graph no longer exists: no node records it any more)
        (void)cudaEventDestroy(own->second);
        own_done.erase(own);
      }
      free_extent_locked(h->second.first, h->second.second);
      slot_used -= h->second.second;
      reclaimed_bytes += h->second.second;
      ++reclaimed_graphs;
      held_slots.erase(h);
      done.push_back(s);
    }
    return done;
  }

  // Waits until the latest launch of every committed graph has run past its commit kernels (its
  // done event): close() then finds every replay launched before it. Events, never the device
  // (see reclaim). False when one could not be waited for.
  bool wait_launched() {
    std::vector<cudaEvent_t> events;
    {
      std::lock_guard<std::mutex> g(mu);
      if (dmem == nullptr) return true;
      for (const auto& d : serial_done) events.push_back(d.second);
    }
    if (events.empty()) return true;
    Relaxed relaxed;
    OnDevice on(device);
    bool ok = true;
    for (cudaEvent_t ev : events) ok = launches_over(ev) && ok;
    return ok;
  }

  // Waits for the latest launch of the graph whose done event is `ev` (relaxed mode, on the
  // device). True once it is over. cudaErrorCapturedEvent ("last recorded in a capturing stream")
  // means no launch recorded it since the capture did, so no launch is in flight: over too. The CUDA
  // docs do not say whether an event record node made with cudaEventRecordExternal leaves the event
  // "captured" (the mock says no: such a record changes nothing until a launch); either answer
  // works here.
  static bool launches_over(cudaEvent_t ev) {
    const cudaError_t e = cudaEventSynchronize(ev);
    if (e == cudaSuccess) return true;
    (void)cudaGetLastError();
    return e == cudaErrorCapturedEvent;
  }

  void free_extent_locked(uint64_t off, uint64_t bytes) {
    auto next = free_slots.lower_bound(off);
    if (next != free_slots.end() && off + bytes == next->first) {  // merge with the extent after
      bytes += next->second;
      next = free_slots.erase(next);
    }
    if (next != free_slots.begin()) {
      auto prev = std::prev(next);
      if (prev->first + prev->second == off) {  // ... and the one before
        prev->second += bytes;
        return;
      }
    }
    free_slots[off] = bytes;
  }

  // ------------------------------------------------------------------ drain side
  void fail(const std::string& why) {
    std::lock_guard<std::mutex> g(mu);
    if (!broken) last_error = why;
    broken = true;
  }

  uint32_t span_name(uint32_t graph) const {
    return kGraphSpanNameBase + static_cast<uint32_t>(device) * kMaxGraphs + graph;
  }

  // One replay → one tensor record: the whole ring entry (header + span), staged like any tensor
  // (D2D into the staging ring on the drain's stream, batched D2H, published in ring order). The
  // writer turns it into the pass. Anything but STAGED: the replay is dropped whole and counted
  // (a chunked record that timed out part-way never completes at the writer: nothing is written).
  void stage_replay(const GraphInfo& gi, uint64_t pos, uint64_t offset, double wait_s) {
    const int64_t pass_id = kGraphPassBase + static_cast<int64_t>(pos);
    CudaSource src{reinterpret_cast<uintptr_t>(ring + offset % ring_cap), 1, {static_cast<int64_t>(gi.span_bytes)},
                   {1}, device, reinterpret_cast<uintptr_t>(stream), 0};
    int st = kDisabled;
    std::string error;
    // The writer stopped writing this channel (its root's disk full): the replay goes no further
    // (the writer would throw it away) and takes the kDisabled path below, as one the stager
    // refused: counted as unwritten, the recorder broken with the reason (the Dumper reads the
    // writer's error). No record was tried, so span_records stays.
    const bool channel_failed = producer->channel_failed(channel);
    if (!channel_failed) {
      try {
        st = stager->stage(channel, span_name(gi.id), pass_id, kReplaySpanDtype, src, true, nullptr, wait_s);
      } catch (const std::exception& e) {
        st = -1;
        error = e.what();
      }
    }
    {
      std::lock_guard<std::mutex> g(mu);
      if (!channel_failed) ++span_records;
      if (st == kStaged) {
        ++replays;
        tensors += gi.tensors.size();
        bytes += gi.tensor_bytes;
      } else {
        ++unwritten_replays;
        if (!error.empty() && last_error.empty()) last_error = error;
      }
    }
    if (st == kDisabled)
      fail(channel_failed               ? "the writer stopped writing this Dumper's channel"
           : producer->writer_alive() ? "CUDA staging stopped"
                                      : "the writer stopped");
  }

  uint64_t dropped_now() {  // with mu held
    if (drops_final) return final_drops;
    return (host ? ld_shared(&host->dropped) : dropped_at_free) + unwritten_replays;
  }

  // The drop note, when the count changed since the last one that went out. Non-blocking: a full
  // ring just means the next cycle tries again (and close() sends the Dumper's total anyway).
  void note_drops() {
    if (note_head.empty()) return;
    uint64_t n;
    {
      std::lock_guard<std::mutex> g(mu);
      n = dropped_now();
    }
    if (n == noted_drops) return;
    const std::string msg = note_head + std::to_string(n) + note_tail;
    if (producer->put_control(channel, msg.data(), msg.size(), false, 0)) noted_drops = n;
  }

  void release_finished() {
    const uint64_t done = stager->completed(device);
    while (!pending.empty() && pending.front().stager_mark <= done) {
      st_shared(&host->consumed_bytes, pending.front().ring_end);
      st_shared(&host->log_consumed, pending.front().log_next);
      pending.pop_front();
    }
    n_pending.store(pending.size(), std::memory_order_release);
  }

  Clock::time_point close_by() const { return Clock::time_point(Clock::duration(close_deadline.load())); }

  // How long the drain may wait for host-ring space for one replay: kDrainWaitS, and never past
  // close()'s deadline.
  double wait_for_space_s() const {
    const double left = std::chrono::duration<double>(close_by() - Clock::now()).count();
    return std::max(0.0, std::min(kDrainWaitS, left));
  }

  // The drain stops: replays that claimed a log position but were not staged (published or not
  // yet) are counted as unwritten (dropped passes), never silently lost; and so are the claims
  // close() could not see decided (each may have taken a position after it looked).
  void count_unstaged_replays() {
    const uint64_t last = final_pos.load(std::memory_order_acquire);
    uint64_t n = last > next_pos && last != ~uint64_t(0) ? last - next_pos : 0;
    std::lock_guard<std::mutex> g(mu);
    unwritten_replays += n + undecided_claims;
  }

  void drain_loop() {
    (void)prctl(PR_SET_TIMERSLACK, 1UL, 0, 0, 0);
    // Relaxed, like the stager's drain: its staging calls must neither fail nor invalidate a
    // global-mode capture another thread runs meanwhile (the next batch size's graph).
    cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
    (void)cudaThreadExchangeStreamCaptureMode(&mode);
    Producer::set_thread_wait_cancel(&end_waits);  // close() can end a wait that began before it
    int idle_us = 10;
    while (true) {
      bool did = false;
      if (!pending.empty()) release_finished();
      const bool stopping = stop.load(std::memory_order_acquire);
      if (stopping && Clock::now() >= close_by()) break;  // close()'s time is up
      if (!paused.load(std::memory_order_acquire) && !broken_now()) {
        LogEntry* e = log + next_pos % log_cap;
        if (ld_shared(&e->stamp) == next_pos + 1) {
          busy.store(1, std::memory_order_release);
          const uint64_t offset = e->offset;
          const uint32_t graph = e->graph;
          std::shared_ptr<const GraphInfo> gi;
          {
            std::lock_guard<std::mutex> g(mu);
            if (graph < graphs.size()) gi = graphs[graph];
          }
          if (gi == nullptr) {
            fail("replay log names an unknown graph " + std::to_string(graph));
          } else {
            stage_replay(*gi, next_pos, offset, wait_for_space_s());
            pending.push_back(PendingRelease{stager->submitted(device), offset + gi->span_bytes, next_pos + 1});
            n_pending.store(pending.size(), std::memory_order_release);
          }
          ++next_pos;
          busy.store(0, std::memory_order_release);
          did = true;
        }
      }
      note_drops();
      if (did) {
        idle_us = 10;
        continue;
      }
      // close() waits for every replay that claimed a position before it closed (the last ones may
      // still be copying on the GPU); paused or broken, they are counted instead.
      if (stopping && pending.empty() &&
          (next_pos >= final_pos.load(std::memory_order_acquire) || paused.load() || broken_now()))
        break;
      std::this_thread::sleep_for(std::chrono::microseconds(idle_us));
      idle_us = std::min(idle_us * 2, 1000);
    }
    count_unstaged_replays();
    note_drops();
    Producer::set_thread_wait_cancel(nullptr);
  }

  bool broken_now() {
    std::lock_guard<std::mutex> g(mu);
    return broken;
  }

  bool idle_now() {
    if (dmem == nullptr) return true;  // memory freed (close(free_memory)): nothing left to drain
    if (busy.load(std::memory_order_acquire) || n_pending.load(std::memory_order_acquire)) return false;
    if (paused.load(std::memory_order_acquire) || broken_now()) return true;  // nothing more will be drained
    // next_pos belongs to the drain thread: read the log position it consumed instead.
    const uint64_t consumed = ld_shared(&host->log_consumed);
    return ld_shared(&log[consumed % log_cap].stamp) != consumed + 1;
  }

  bool flush(double timeout_s) { return flush_until(after_s(timeout_s)); }

  bool flush_until(Clock::time_point deadline) {
    int calm = 0;  // consecutive idle looks: the drain may be between two steps
    while (Clock::now() < deadline) {
      calm = idle_now() ? calm + 1 : 0;
      if (calm >= 3) return true;
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
    return false;
  }

  GraphRecorderStats stats() {
    GraphRecorderStats s;
    std::lock_guard<std::mutex> g(mu);
    s.graphs = next_number;
    s.live_graphs = live_graphs;
    s.captured_tensors = captured_tensors;
    s.replays = replays;
    s.dropped_replays = dropped_now();
    s.unwritten_replays = unwritten_replays;
    s.tensors = tensors;
    s.bytes = bytes;
    s.span_records = span_records;
    s.slot_bytes = slot_cap;
    s.slot_used = slot_used;
    s.reclaimed_graphs = reclaimed_graphs;
    s.reclaimed_bytes = reclaimed_bytes;
    s.claimed_replays = host ? ld_shared(&host->log_claimed) : 0;
    s.ring_bytes = ring_cap;
    s.last_error = last_error;
    s.broken = broken;
    return s;
  }

  void close(double timeout_s, bool free_memory) {
    {
      std::lock_guard<std::mutex> g(mu);
      if (closed && !free_memory) return;
      closed = true;
      // No graph can ever write into it: none open, and none holding slots (committed or given
      // up after recording; reclaim() gives a graph's slots back once it can never run again).
      if (!open && held_slots.empty()) free_memory = true;
    }
    if (drain.joinable()) {
      // One deadline for the flush and the drain's last steps: close() takes about timeout_s at
      // most, whatever the writer does.
      const Clock::time_point deadline = after_s(timeout_s);
      close_deadline.store(deadline.time_since_epoch().count());
      paused.store(false, std::memory_order_release);
      const bool flushed = flush_until(deadline);
      // From here on a replay claims nothing (counted as dropped); one that claimed before is
      // waited for and staged by the drain (or counted): a replay launched while close() runs is
      // written whole or counted, never lost unseen. See HostCtl.
      st_shared_sc(&host->closed, 1);
      const uint64_t begun = ld_shared_sc(&host->claims_begun);
      while (ld_shared(&host->claims_done) < begun && Clock::now() < deadline)
        std::this_thread::sleep_for(std::chrono::microseconds(50));
      const uint64_t decided = ld_shared(&host->claims_done);
      {
        std::lock_guard<std::mutex> g(mu);
        undecided_claims = decided < begun ? begun - decided : 0;
      }
      final_pos.store(ld_shared(&host->log_claimed), std::memory_order_release);
      if (!flushed) end_waits.store(true, std::memory_order_release);  // a wait begun before close()
      stop.store(true, std::memory_order_release);
      drain.join();
    }
    {
      std::lock_guard<std::mutex> g(mu);
      if (!drops_final) {
        final_drops = dropped_now();  // what the Dumper reports; later replays are not its passes
        drops_final = true;
      }
    }
    if (free_memory && dmem) {
      Relaxed relaxed;
      OnDevice on(device);
      (void)cudaStreamSynchronize(stream);
      (void)cudaStreamDestroy(stream);
      std::lock_guard<std::mutex> g(mu);  // stats() reads `host`
      // (no graph can launch any more: the memory is freed only then, see close's callers)
      for (cudaEvent_t& ev : done_events)
        if (ev) (void)cudaEventDestroy(ev);
      for (const auto& own : own_done) (void)cudaEventDestroy(own.second);
      done_events.clear();
      serial_done.clear();
      own_done.clear();
      dropped_at_free = ld_shared(&host->dropped);
      (void)cudaFreeHost(host);
      (void)cudaFree(dmem);
      dmem = nullptr;
      host = nullptr;
      stream = nullptr;
    }
  }

  ~Impl() {
    try {
      close(60.0, false);  // graphs may still replay into the device memory: it is kept (see close)
    } catch (...) {
    }
  }
};

GraphRecorder::GraphRecorder(CudaStager* stager, uint32_t channel, int device, uint64_t slot_bytes,
                             uint64_t ring_bytes, uint32_t log_entries, const std::string& drop_note,
                             const std::string& drop_mark)
    : impl_(new Impl(stager, channel, device, slot_bytes, ring_bytes, log_entries, drop_note, drop_mark)) {}
GraphRecorder::~GraphRecorder() = default;
int GraphRecorder::begin_graph(uintptr_t stream) { return impl_->begin_graph(stream); }
int GraphRecorder::record(uint32_t name_id, uint16_t dtype, const CudaSource& src) {
  return impl_->record(name_id, dtype, src);
}
int GraphRecorder::end_graph() {
  return impl_->end_graph();
}
void GraphRecorder::abort_graph() { impl_->abort_graph(); }
void GraphRecorder::capture_ending() { impl_->capture_ending(); }
uint64_t GraphRecorder::open_serial() const {
  std::lock_guard<std::mutex> g(impl_->mu);
  return impl_->open ? impl_->open->serial : 0;
}
bool GraphRecorder::wait_launched() { return impl_->wait_launched(); }
std::vector<uint64_t> GraphRecorder::reclaim(const std::vector<uint64_t>& serials) {
  return impl_->reclaim(serials);
}
bool GraphRecorder::capture_ended() { return impl_->capture_ended(); }
bool GraphRecorder::capture_invalidated() { return impl_->capture_invalidated(); }
bool GraphRecorder::capturing() const {
  std::lock_guard<std::mutex> g(impl_->mu);
  return impl_->open != nullptr;
}
const GraphInfo& committed(const std::vector<std::shared_ptr<const GraphInfo>>& graphs, int graph) {
  if (graph < 0 || static_cast<size_t>(graph) >= graphs.size() || !graphs[static_cast<size_t>(graph)])
    throw std::out_of_range("no such CUDA graph");
  return *graphs[static_cast<size_t>(graph)];
}
uint32_t GraphRecorder::span_name_id(int graph) const {
  std::lock_guard<std::mutex> g(impl_->mu);
  return impl_->span_name(committed(impl_->graphs, graph).id);
}
uint64_t GraphRecorder::graph_number(int graph) const {
  std::lock_guard<std::mutex> g(impl_->mu);
  return committed(impl_->graphs, graph).number;
}
uint64_t GraphRecorder::span_bytes(int graph) const {
  std::lock_guard<std::mutex> g(impl_->mu);
  return committed(impl_->graphs, graph).span_bytes;
}
std::vector<GraphTensorLayout> GraphRecorder::layout(int graph) const {
  std::lock_guard<std::mutex> g(impl_->mu);
  return committed(impl_->graphs, graph).tensors;
}
uint64_t GraphRecorder::dropped_replays() {
  std::lock_guard<std::mutex> g(impl_->mu);
  return impl_->dropped_now();
}
void GraphRecorder::set_paused(bool paused) { impl_->paused.store(paused, std::memory_order_release); }
bool GraphRecorder::flush(double timeout_s) { return impl_->flush(timeout_s); }
GraphRecorderStats GraphRecorder::stats() { return impl_->stats(); }
void GraphRecorder::close(double timeout_s, bool free_memory) { impl_->close(timeout_s, free_memory); }

}  // namespace fastdump
