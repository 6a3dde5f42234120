// A CPU stand-in for the parts of the CUDA runtime that csrc/cuda_staging.cu uses, for tests on
// machines without a GPU (tests/test_cuda.py builds fastdump._C against it as a separate module).
// What it models and what it cannot: docs/CUDA.md, "The mock runtime". In short:
//   * streams: each stream runs its queue on its own thread (random, seedable delays); events and
//     cudaStreamWaitEvent are the only order between streams, plus the legacy default stream's
//     implicit synchronization with blocking streams (per device); cudaStreamNonBlocking streams
//     do not synchronize with it; handle 2 (cudaStreamPerThread) is a blocking stream per thread;
//   * device memory: cudaMalloc hands out addresses in a PROT_NONE range reserved per device (a
//     host dereference faults); the mock's copy engine and kernels reach the bytes through a shadow
//     mapping. Copies check `kind` against the pointers; pinned vs pageable host memory is tracked
//     and an async copy to/from pageable memory returns only once it is done, as in real CUDA;
//   * devices and contexts: current device per thread; a primary context per device, created by
//     the first call that needs one (cudaSetDevice included, as since CUDA 12) and counted;
//   * graph capture: per-stream capture sequences with their mode, joined streams, invalidation by
//     unsafe calls (cudaErrorStreamCaptureUnsupported / Implicit / Isolation / CapturedEvent),
//     EndCapture errors (Invalidated / Unmatched / Unjoined / WrongThread), instantiate and replay;
//   * errors: injected per API name (non-sticky), and sticky errors raised by a faulting stream
//     operation, reported by every later call on that device (first by the next synchronizing one).
#pragma once

#include <sys/mman.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <iterator>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#define CUDART_VERSION 13000

enum cudaError_t {
  cudaSuccess = 0,
  cudaErrorInvalidValue = 1,
  cudaErrorMemoryAllocation = 2,
  cudaErrorInsufficientDriver = 35,
  cudaErrorNoDevice = 100,
  cudaErrorInvalidDevice = 101,
  cudaErrorInvalidResourceHandle = 400,
  cudaErrorIllegalState = 401,
  cudaErrorNotReady = 600,
  cudaErrorIllegalAddress = 700,
  cudaErrorHostMemoryAlreadyRegistered = 712,
  cudaErrorHostMemoryNotRegistered = 713,
  cudaErrorNotSupported = 801,
  cudaErrorStreamCaptureUnsupported = 900,
  cudaErrorStreamCaptureInvalidated = 901,
  cudaErrorStreamCaptureMerge = 902,
  cudaErrorStreamCaptureUnmatched = 903,
  cudaErrorStreamCaptureUnjoined = 904,
  cudaErrorStreamCaptureIsolation = 905,
  cudaErrorStreamCaptureImplicit = 906,
  cudaErrorCapturedEvent = 907,
  cudaErrorStreamCaptureWrongThread = 908,
  cudaErrorUnknown = 999,
};

struct CUstream_mock;
struct CUevent_mock;
struct CUgraph_mock;
struct CUgraphExec_mock;
typedef CUstream_mock* cudaStream_t;
typedef CUevent_mock* cudaEvent_t;
typedef CUgraph_mock* cudaGraph_t;
typedef CUgraphExec_mock* cudaGraphExec_t;

enum cudaMemcpyKind {
  cudaMemcpyHostToHost = 0,
  cudaMemcpyHostToDevice = 1,
  cudaMemcpyDeviceToHost = 2,
  cudaMemcpyDeviceToDevice = 3,
  cudaMemcpyDefault = 4
};
enum cudaStreamCaptureStatus { cudaStreamCaptureStatusNone = 0, cudaStreamCaptureStatusActive = 1,
                               cudaStreamCaptureStatusInvalidated = 2 };
enum cudaStreamCaptureMode { cudaStreamCaptureModeGlobal = 0, cudaStreamCaptureModeThreadLocal = 1,
                             cudaStreamCaptureModeRelaxed = 2 };
enum cudaDeviceAttr { cudaDevAttrMultiProcessorCount = 16 };
enum cudaMemoryType { cudaMemoryTypeUnregistered = 0, cudaMemoryTypeHost = 1, cudaMemoryTypeDevice = 2,
                      cudaMemoryTypeManaged = 3 };
enum cudaMemLocationType { cudaMemLocationTypeInvalid = 0, cudaMemLocationTypeDevice = 1,
                           cudaMemLocationTypeHost = 2 };
enum cudaMemcpySrcAccessOrder { cudaMemcpySrcAccessOrderInvalid = 0, cudaMemcpySrcAccessOrderStream = 1 };
enum cudaMemcpyFlags { cudaMemcpyFlagDefault = 0, cudaMemcpyFlagPreferOverlapWithCompute = 1 };
enum cudaDriverEntryPointQueryResult { cudaDriverEntryPointSuccess = 0, cudaDriverEntryPointSymbolNotFound = 1,
                                       cudaDriverEntryPointVersionNotSufficent = 2 };

#define cudaEventDisableTiming 0x02
#define cudaEventRecordDefault 0x00
#define cudaEventRecordExternal 0x01
#define cudaStreamDefault 0x00
#define cudaStreamNonBlocking 0x01
#define cudaHostRegisterPortable 0x01
#define cudaHostAllocPortable 0x01
#define cudaHostAllocMapped 0x02
#define cudaEnableDefault 0x0ull
#define cudaStreamLegacy (reinterpret_cast<cudaStream_t>(0x1))
#define cudaStreamPerThread (reinterpret_cast<cudaStream_t>(0x2))

struct cudaMemLocation {
  cudaMemLocationType type;
  int id;
};
struct cudaMemcpyAttributes {
  cudaMemcpySrcAccessOrder srcAccessOrder;
  cudaMemLocation srcLocHint;
  cudaMemLocation dstLocHint;
  unsigned int flags;
};
struct cudaUUID_t {
  char bytes[16];
};
struct cudaDeviceProp {
  char name[256];
  cudaUUID_t uuid;
  size_t totalGlobalMem;
  int major;
  int minor;
  int multiProcessorCount;
};
struct cudaPointerAttributes {
  cudaMemoryType type;
  int device;
  void* devicePointer;
  void* hostPointer;
};
struct uint4 {
  unsigned int x, y, z, w;
};

namespace fdmock {

constexpr int kMaxDevices = 8;
constexpr uint64_t kArenaBytes = 16ull << 30;  // address space reserved per device

// ------------------------------------------------------------------------------------------------
// State shared by every translation unit (inline functions' statics are one object each).

inline uint64_t env_seed() {
  const char* v = std::getenv("FASTDUMP_MOCK_SEED");
  return v ? std::strtoull(v, nullptr, 10) : 0;
}

struct Config {
  std::atomic<int> device_count{2};
  std::atomic<int> max_delay_us{0};           // each stream op sleeps a random 0..max first
  std::atomic<int> graph_node_us{0};          // each node of a launched graph runs this long (a kernel's time)
  // 1: an event record node made in a capture (cudaEventRecordExternal) leaves the event "last
  // recorded in a capturing stream" until a launch records it (cudaErrorCapturedEvent to a query),
  // an answer CUDA's docs leave open; 0: such a record changes nothing until a launch.
  std::atomic<int> external_record_captures{0};
  std::atomic<uint64_t> seed{env_seed()};     // of those delays (FASTDUMP_MOCK_SEED; 0: random)
  std::atomic<int> capturing{0};              // legacy knob: every stream reports an active capture
  std::atomic<uint64_t> device_free{1ull << 34};  // bytes cudaMalloc can still hand out per device
  std::atomic<uint64_t> batch_calls{0};
  std::atomic<uint64_t> memcpy_calls{0};
  std::atomic<uint64_t> kernel_calls{0};
  std::atomic<uint64_t> memcpy2d_calls{0};
  std::atomic<uint64_t> crossing_copies{0};   // D2H copies whose destination spans registrations
  std::atomic<uint64_t> unpinned_copies{0};   // D2H copies into pageable memory (synchronous)
  std::atomic<uint64_t> syncs{0};             // stream/device synchronizations (never on the hot path)
  std::atomic<uint64_t> live_allocs{0};
  std::atomic<uint64_t> live_streams{0};
  std::atomic<uint64_t> live_events{0};
  std::atomic<uint64_t> live_graphs{0};
  std::atomic<uint64_t> registered_ranges{0};
  std::atomic<uint64_t> captures_invalidated{0};
  std::atomic<int> contexts[kMaxDevices] = {};  // primary contexts created, per device
};

inline Config& config() {
  static Config c;
  return c;
}

inline std::mutex& big_lock() {  // captures, stream registry, injected failures, sticky errors
  static std::mutex m;
  return m;
}

inline int& current_device() {
  static thread_local int d = 0;
  return d;
}

inline cudaStreamCaptureMode& thread_capture_mode() {
  static thread_local cudaStreamCaptureMode m = cudaStreamCaptureModeGlobal;
  return m;
}

inline cudaError_t& last_error() {
  static thread_local cudaError_t e = cudaSuccess;
  return e;
}

// ------------------------------------------------------------------------------------------------
// Errors: sticky per device (a faulted context), and failures injected per API name.

inline cudaError_t* sticky() {
  static cudaError_t s[kMaxDevices] = {};
  return s;
}

struct Injected {
  int skip = 0;   // calls that still succeed before the failures begin
  int count = 0;  // calls that fail then
  cudaError_t error = cudaErrorUnknown;
};

inline std::map<std::string, Injected>& injected() {
  static std::map<std::string, Injected> m;
  return m;
}

inline void inject(const std::string& api, int count, cudaError_t e, int skip = 0) {
  std::lock_guard<std::mutex> g(big_lock());
  if (count <= 0) injected().erase(api);
  else injected()[api] = Injected{skip, count, e};
}

// Calls of an API made to wait before they take effect (what they read of the device's state,
// a stream's capture included, is read after the wait): a caller that checked something and then
// acts on it, with another thread acting meanwhile. `delayed_calls` counts the waits begun.
struct Delayed {
  int count = 0;
  double seconds = 0;
};
inline std::map<std::string, Delayed>& delays() {
  static std::map<std::string, Delayed> m;
  return m;
}
inline std::atomic<int>& delayed_calls() {
  static std::atomic<int> n{0};
  return n;
}
inline void delay(const std::string& api, int count, double seconds) {
  std::lock_guard<std::mutex> g(big_lock());
  if (count <= 0) delays().erase(api);
  else delays()[api] = Delayed{count, seconds};
}
inline void maybe_delay(const char* api) {
  double seconds = 0;
  {
    std::lock_guard<std::mutex> g(big_lock());
    auto it = delays().find(api);
    if (it == delays().end()) return;
    seconds = it->second.seconds;
    if (--it->second.count <= 0) delays().erase(it);
  }
  delayed_calls()++;
  std::this_thread::sleep_for(std::chrono::duration<double>(seconds));
}

inline cudaError_t ret(cudaError_t e) {
  if (e != cudaSuccess) last_error() = e;
  return e;
}

inline void ensure_context(int dev) {
  if (dev < 0 || dev >= kMaxDevices) return;
  int zero = 0;
  config().contexts[dev].compare_exchange_strong(zero, 1);
}

// Entry of every API call that works on a device: a sticky error of that device wins, then a
// failure injected for `api`; `ctx` says whether the call creates the primary context.
inline cudaError_t enter(const char* api, int dev, bool ctx = true) {
  maybe_delay(api);
  if (ctx) ensure_context(dev);
  std::lock_guard<std::mutex> g(big_lock());
  if (dev >= 0 && dev < kMaxDevices && sticky()[dev] != cudaSuccess) return sticky()[dev];
  auto it = injected().find(api);
  if (it == injected().end()) return cudaSuccess;
  if (it->second.skip > 0) {
    --it->second.skip;
    return cudaSuccess;
  }
  cudaError_t e = it->second.error;
  if (--it->second.count <= 0) injected().erase(it);
  return e;
}

// Per-thread counts of what the code under test does on the calling thread (the forward thread,
// in tests/test_cuda.py's lean-path tests): runtime API calls per function, and, counted by the
// test module (tests/cuda_mock: cuda_bindings.cpp's mock part), heap allocations and mutex
// acquisitions made outside the mock's own calls (the mock's internals are not the code's cost).
struct ThreadCounts {
  std::map<const char*, uint64_t> calls;  // keyed by __func__ (one static string per function)
  uint64_t allocs = 0;
  uint64_t locks = 0;
  int in_mock = 0;  // depth of mock API calls on this thread
};
inline ThreadCounts& thread_counts() {
  static thread_local ThreadCounts c;
  return c;
}
struct CallScope {
  explicit CallScope(const char* fn) {
    ThreadCounts& c = thread_counts();
    ++c.in_mock;  // first: the map insertion below is the mock's, not the caller's
    ++c.calls[fn];
  }
  ~CallScope() { --thread_counts().in_mock; }
};
#define FDMOCK_CALL() fdmock::CallScope fdmock_call_scope_(__func__)

#define FDMOCK_ENTER(api, dev)                                   \
  do {                                                           \
    cudaError_t fdm_e_ = fdmock::enter(api, dev);                \
    if (fdm_e_ != cudaSuccess) return fdmock::ret(fdm_e_);       \
  } while (0)

// ------------------------------------------------------------------------------------------------
// Streams

struct Progress {  // how far a stream has run; shared with events recorded on it
  std::mutex mu;
  std::condition_variable cv;
  uint64_t done = 0;
  uint64_t get() {
    std::lock_guard<std::mutex> g(mu);
    return done;
  }
  void wait_for(uint64_t ticket) {
    std::unique_lock<std::mutex> lk(mu);
    cv.wait(lk, [&] { return done >= ticket; });
  }
};

struct Capture;

class Stream {
 public:
  Stream(int device, unsigned flags, bool legacy)
      : device_(device), nonblocking_(flags & cudaStreamNonBlocking), legacy_(legacy),
        progress_(std::make_shared<Progress>()) {
    static std::atomic<uint64_t> serial{0};
    const uint64_t seed = config().seed.load();
    rng_.seed(seed ? seed * 1000003u + serial++ : std::random_device{}());
    config().live_streams++;
    thread_ = std::thread([this] { run(); });
    std::lock_guard<std::mutex> g(registry_mu());
    registry().insert(this);
  }
  // Every stream, for cudaDeviceSynchronize (its own lock: streams are made without big_lock()).
  static std::mutex& registry_mu() {
    static std::mutex mu;
    return mu;
  }
  static std::set<Stream*>& registry() {
    static std::set<Stream*> s;
    return s;
  }
  ~Stream() {
    {
      std::lock_guard<std::mutex> g(registry_mu());
      registry().erase(this);
    }
    {
      std::lock_guard<std::mutex> g(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();  // runs what is queued first
    config().live_streams--;
  }
  uint64_t push(std::function<void()> fn) {
    std::lock_guard<std::mutex> g(mu_);
    q_.push_back(std::move(fn));
    ++enq_;
    cv_.notify_all();
    return enq_;
  }
  uint64_t enqueued() {
    std::lock_guard<std::mutex> g(mu_);
    return enq_;
  }
  const std::shared_ptr<Progress>& progress() const { return progress_; }
  void sync() { progress_->wait_for(enqueued()); }
  int device() const { return device_; }
  bool legacy() const { return legacy_; }
  bool blocking() const { return !nonblocking_ && !legacy_; }
  std::shared_ptr<Capture> capture;  // under big_lock()
  bool capture_pending = false;      // joined stream with captured work its origin has not waited for

 private:
  void run() {
    for (;;) {
      std::function<void()> fn;
      {
        std::unique_lock<std::mutex> lk(mu_);
        cv_.wait(lk, [&] { return !q_.empty() || stop_; });
        if (q_.empty()) return;
        fn = std::move(q_.front());
        q_.pop_front();
      }
      const int max = config().max_delay_us.load();
      if (max > 0) {
        std::uniform_int_distribution<int> dist(0, max);
        std::this_thread::sleep_for(std::chrono::microseconds(dist(rng_)));
      }
      fn();
      {
        std::lock_guard<std::mutex> g(progress_->mu);
        ++progress_->done;
      }
      progress_->cv.notify_all();
    }
  }
  int device_;
  bool nonblocking_;
  bool legacy_;
  std::shared_ptr<Progress> progress_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> q_;
  uint64_t enq_ = 0;
  bool stop_ = false;
  std::mt19937_64 rng_;
  std::thread thread_;
};

inline std::set<Stream*>& blocking_streams() {  // under big_lock(): for the legacy stream's syncs
  static std::set<Stream*> s;
  return s;
}

inline Stream* legacy(int dev) {
  static Stream* s[kMaxDevices] = {};
  static std::mutex mu;
  std::lock_guard<std::mutex> g(mu);
  if (!s[dev]) s[dev] = new Stream(dev, 0, true);  // never destroyed: lives until exit
  return s[dev];
}

// cudaStreamPerThread: a blocking stream per thread and device, gone with the thread.
struct PerThreadStreams {
  std::map<int, Stream*> by_device;
  ~PerThreadStreams() {
    for (auto& p : by_device) {
      {
        std::lock_guard<std::mutex> g(big_lock());
        blocking_streams().erase(p.second);
      }
      delete p.second;
    }
  }
};

inline Stream* per_thread(int dev) {
  static thread_local PerThreadStreams pts;
  Stream*& s = pts.by_device[dev];
  if (!s) {
    s = new Stream(dev, 0, false);
    std::lock_guard<std::mutex> g(big_lock());
    blocking_streams().insert(s);
  }
  return s;
}

inline Stream* stream_of(cudaStream_t h) {
  uintptr_t v = reinterpret_cast<uintptr_t>(h);
  if (v == 0 || v == 1) return legacy(current_device());
  if (v == 2) return per_thread(current_device());
  return reinterpret_cast<Stream*>(h);
}

// ------------------------------------------------------------------------------------------------
// Graph capture

// CUDA orders each launch of an executable graph after its previous launches, whatever the stream
// ("cudaGraphLaunch": a graph exec never runs concurrently with itself): launches take tickets.
struct LaunchOrder {
  std::mutex mu;
  std::condition_variable cv;
  uint64_t launched = 0, done = 0;
  std::set<uint64_t> abandoned;  // tickets whose launch failed: skipped
  void finish_locked() {
    ++done;
    while (abandoned.erase(done)) ++done;
    cv.notify_all();
  }
};

struct Event;
struct Graph {
  std::vector<std::function<void()>> ops;  // in issue order: a valid topological order
  std::shared_ptr<LaunchOrder> order;      // executable graphs only
  // Event record nodes (cudaEventRecordWithFlags(..., cudaEventRecordExternal) during capture):
  // each launch records them, as of the launch's end (after every node: a later mark than the
  // node's own, never an earlier one).
  std::vector<Event*> external_events;
};

struct Capture {
  cudaStreamCaptureMode mode;
  std::thread::id thread;
  Stream* origin;
  int device;
  uint64_t id;
  Graph* graph = new Graph();
  cudaError_t invalid = cudaSuccess;  // why it was invalidated
  std::vector<Stream*> members;
};

inline std::vector<std::shared_ptr<Capture>>& captures() {  // active, under big_lock()
  static std::vector<std::shared_ptr<Capture>> c;
  return c;
}

inline void invalidate_locked(Capture& c, cudaError_t why) {
  if (c.invalid == cudaSuccess) {
    c.invalid = why;
    config().captures_invalidated++;
  }
}

// A "potentially unsafe" call (allocation, synchronization, event query, pinning...) from this
// thread, under big_lock(). Returns cudaErrorStreamCaptureUnsupported (and invalidates the
// captures concerned) when the thread's capture mode forbids it, as cudaThreadExchangeStreamCaptureMode
// documents: global forbids it during this thread's non-relaxed captures and any other thread's
// global-mode captures; thread-local only during this thread's non-relaxed captures; relaxed never.
inline cudaError_t unsafe_call_locked() {
  const cudaStreamCaptureMode mode = thread_capture_mode();
  if (mode == cudaStreamCaptureModeRelaxed) return cudaSuccess;
  cudaError_t e = cudaSuccess;
  for (auto& c : captures()) {
    const bool mine = c->thread == std::this_thread::get_id();
    const bool forbids = mine ? c->mode != cudaStreamCaptureModeRelaxed
                              : (mode == cudaStreamCaptureModeGlobal && c->mode == cudaStreamCaptureModeGlobal);
    if (forbids) {
      invalidate_locked(*c, cudaErrorStreamCaptureUnsupported);
      e = cudaErrorStreamCaptureUnsupported;
    }
  }
  return e;
}

inline cudaError_t unsafe_call() {
  std::lock_guard<std::mutex> g(big_lock());
  return unsafe_call_locked();
}

// Work for stream `h`: recorded into its capture, or queued (with the legacy stream's implicit
// synchronization). Returns the stream's ticket after the work (0 when captured).
inline cudaError_t submit(cudaStream_t h, std::function<void()> fn, uint64_t* ticket = nullptr) {
  Stream* s = stream_of(h);
  std::unique_lock<std::mutex> g(big_lock());
  if (s->capture) {
    Capture& c = *s->capture;
    if (c.invalid != cudaSuccess) return cudaErrorStreamCaptureInvalidated;
    c.graph->ops.push_back(std::move(fn));
    if (s != c.origin) s->capture_pending = true;
    if (ticket) *ticket = 0;
    return cudaSuccess;
  }
  if (s->legacy()) {
    // Implicit dependency on every blocking stream of the device: not allowed while one captures.
    for (auto& c : captures())
      for (Stream* mbr : c->members)
        if (mbr->device() == s->device() && mbr->blocking()) {
          invalidate_locked(*c, cudaErrorStreamCaptureImplicit);
          return cudaErrorStreamCaptureImplicit;
        }
    for (Stream* b : blocking_streams()) {
      if (b->device() != s->device()) continue;
      const uint64_t t = b->enqueued();
      auto pr = b->progress();
      if (pr->get() < t) s->push([pr, t] { pr->wait_for(t); });
    }
  } else if (s->blocking()) {
    Stream* l = legacy(s->device());
    const uint64_t t = l->enqueued();
    auto pr = l->progress();
    if (pr->get() < t) s->push([pr, t] { pr->wait_for(t); });
  }
  uint64_t t = s->push(std::move(fn));
  if (ticket) *ticket = t;
  return cudaSuccess;
}

// A kernel launch (the gather kernel of the mock build).
inline cudaError_t enqueue(cudaStream_t h, std::function<void()> fn) {
  FDMOCK_ENTER("kernel", current_device());
  config().kernel_calls++;
  return ret(submit(h, std::move(fn)));
}

struct Event {
  int device = 0;  // current when it was created: it is recorded only on that device's streams
  std::mutex mu;
  std::shared_ptr<Progress> progress;  // of the stream it was last recorded on
  uint64_t ticket = 0;
  Stream* stream = nullptr;
  std::shared_ptr<Capture> captured;   // last recorded in this capture
};

// ------------------------------------------------------------------------------------------------
// Memory: device arenas (PROT_NONE for the host, bytes in a shadow mapping), pinned host ranges.

struct Arena {
  uint8_t* base = nullptr;    // what cudaMalloc hands out: PROT_NONE
  uint8_t* shadow = nullptr;  // the same bytes, as the mock's copy engine sees them
  std::map<uint64_t, uint64_t> blocks;  // offset -> size, live allocations
};

struct Memory {
  std::mutex mu;
  Arena arenas[kMaxDevices];
  std::map<uintptr_t, size_t> pinned;  // cudaHostRegister'd / cudaHostAlloc'd ranges
  std::set<uintptr_t> host_allocs;     // of which cudaHostAlloc'd
};

inline Memory& memory() {
  static Memory m;
  return m;
}

inline Arena& arena_locked(int dev) {
  Arena& a = memory().arenas[dev];
  if (!a.base) {
    void* b = ::mmap(nullptr, kArenaBytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    void* s = ::mmap(nullptr, kArenaBytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (b == MAP_FAILED || s == MAP_FAILED) {
      std::fprintf(stderr, "fdmock: cannot reserve the device arena\n");
      std::abort();
    }
    a.base = static_cast<uint8_t*>(b);
    a.shadow = static_cast<uint8_t*>(s);
  }
  return a;
}

// Device owning [p, p+n) as one live allocation; -1 when p is not device memory at all, -2 when
// it is device memory but the range is not inside one allocation.
inline int device_of_locked(const void* p, size_t n, uint8_t** shadow) {
  const uint8_t* v = static_cast<const uint8_t*>(p);
  for (int d = 0; d < kMaxDevices; ++d) {
    Arena& a = memory().arenas[d];
    if (!a.base || v < a.base || v >= a.base + kArenaBytes) continue;
    const uint64_t off = static_cast<uint64_t>(v - a.base);
    auto it = a.blocks.upper_bound(off);
    if (it == a.blocks.begin()) return -2;
    --it;
    if (off + n > it->first + it->second) return -2;
    if (shadow) *shadow = a.shadow + off;
    return d;
  }
  return -1;
}

inline int device_of(const void* p, size_t n = 1, uint8_t** shadow = nullptr) {
  std::lock_guard<std::mutex> g(memory().mu);
  return device_of_locked(p, n, shadow);
}

// The bytes behind a device pointer, for the mock's "kernels". A host pointer here is a bug a
// GPU would fault on (or silently read through HMM): abort loudly.
template <typename T>
inline T* dev_bytes(T* p) {
  uint8_t* sh = nullptr;
  if (device_of(p, 1, &sh) < 0) {
    std::fprintf(stderr, "fdmock: device code touched %p, which is not device memory\n", static_cast<const void*>(p));
    std::abort();
  }
  return reinterpret_cast<T*>(sh);
}

// 1: [p, p+n) inside one pinned range; 0: pageable; -1: straddles pinned and pageable memory.
inline int pinned_state(const void* p, size_t n) {
  Memory& m = memory();
  std::lock_guard<std::mutex> g(m.mu);
  uintptr_t a = reinterpret_cast<uintptr_t>(p);
  auto it = m.pinned.upper_bound(a);
  if (it == m.pinned.begin()) return 0;
  --it;
  if (a >= it->first + it->second) return 0;
  return a + n <= it->first + it->second ? 1 : -1;
}

// One side of a copy: where its bytes are, and what it is.
struct Side {
  uint8_t* bytes = nullptr;
  bool device = false;
  int dev = -1;
};

inline cudaError_t resolve(const void* p, size_t n, Side* s) {
  uint8_t* sh = nullptr;
  const int d = device_of(p, n, &sh);
  if (d == -2) return cudaErrorInvalidValue;  // out of bounds of a device allocation
  s->device = d >= 0;
  s->dev = d;
  s->bytes = d >= 0 ? sh : static_cast<uint8_t*>(const_cast<void*>(p));
  return cudaSuccess;
}

// Checks `kind` against the pointers (cudaMemcpyDefault infers it); fills both sides.
inline cudaError_t check_copy(void* dst, const void* src, size_t n, cudaMemcpyKind kind, Side* d, Side* s) {
  if (resolve(dst, n, d) != cudaSuccess || resolve(src, n, s) != cudaSuccess) return cudaErrorInvalidValue;
  if (kind == cudaMemcpyDefault) return cudaSuccess;
  const bool want_src_dev = kind == cudaMemcpyDeviceToHost || kind == cudaMemcpyDeviceToDevice;
  const bool want_dst_dev = kind == cudaMemcpyHostToDevice || kind == cudaMemcpyDeviceToDevice;
  if (kind > cudaMemcpyDefault || want_src_dev != s->device || want_dst_dev != d->device) return cudaErrorInvalidValue;
  return cudaSuccess;
}

inline void count_d2h_dst(const void* dst, size_t n) {
  const int p = pinned_state(dst, n);
  if (p < 0) config().crossing_copies++;
  else if (p == 0) config().unpinned_copies++;
}

// Submit a copy; one from or to pageable memory returns only once it is done (real CUDA stages it
// through a pinned bounce buffer: "async" copies from pageable memory are synchronous).
inline cudaError_t submit_copy(cudaStream_t h, std::function<void()> fn, bool pageable) {
  if (pageable) {
    std::lock_guard<std::mutex> g(big_lock());
    if (stream_of(h)->capture) return cudaErrorStreamCaptureUnsupported;
  }
  uint64_t t = 0;
  cudaError_t e = submit(h, std::move(fn), &t);
  if (e == cudaSuccess && pageable && t) stream_of(h)->progress()->wait_for(t);
  return e;
}

// A stream operation that faults when it runs: the device's context gets a sticky error.
inline void fault(int dev, cudaError_t e) {
  std::lock_guard<std::mutex> g(big_lock());
  if (sticky()[dev] == cudaSuccess) sticky()[dev] = e;
}

inline void reset_device_state() {  // tests: forget sticky errors and injected failures
  std::lock_guard<std::mutex> g(big_lock());
  for (int d = 0; d < kMaxDevices; ++d) sticky()[d] = cudaSuccess;
  injected().clear();
  delays().clear();
  delayed_calls() = 0;
}

// cuDevicePrimaryCtxGetState, as cudaGetDriverEntryPointByVersion hands it out.
inline int primary_ctx_get_state(int dev, unsigned int* flags, int* active) {
  if (dev < 0 || dev >= config().device_count.load()) return 101;  // CUDA_ERROR_INVALID_DEVICE
  if (flags) *flags = 0;
  *active = dev < kMaxDevices ? config().contexts[dev].load() : 0;
  return 0;
}

}  // namespace fdmock

// --------------------------------------------------------------------------------------------------
// The runtime API subset.

inline const char* cudaGetErrorName(cudaError_t e) {
  FDMOCK_CALL();
  switch (e) {
    case cudaSuccess: return "cudaSuccess";
    case cudaErrorInvalidValue: return "cudaErrorInvalidValue";
    case cudaErrorMemoryAllocation: return "cudaErrorMemoryAllocation";
    case cudaErrorInsufficientDriver: return "cudaErrorInsufficientDriver";
    case cudaErrorNoDevice: return "cudaErrorNoDevice";
    case cudaErrorInvalidDevice: return "cudaErrorInvalidDevice";
    case cudaErrorInvalidResourceHandle: return "cudaErrorInvalidResourceHandle";
    case cudaErrorIllegalState: return "cudaErrorIllegalState";
    case cudaErrorNotReady: return "cudaErrorNotReady";
    case cudaErrorIllegalAddress: return "cudaErrorIllegalAddress";
    case cudaErrorHostMemoryAlreadyRegistered: return "cudaErrorHostMemoryAlreadyRegistered";
    case cudaErrorHostMemoryNotRegistered: return "cudaErrorHostMemoryNotRegistered";
    case cudaErrorNotSupported: return "cudaErrorNotSupported";
    case cudaErrorStreamCaptureUnsupported: return "cudaErrorStreamCaptureUnsupported";
    case cudaErrorStreamCaptureInvalidated: return "cudaErrorStreamCaptureInvalidated";
    case cudaErrorStreamCaptureMerge: return "cudaErrorStreamCaptureMerge";
    case cudaErrorStreamCaptureUnmatched: return "cudaErrorStreamCaptureUnmatched";
    case cudaErrorStreamCaptureUnjoined: return "cudaErrorStreamCaptureUnjoined";
    case cudaErrorStreamCaptureIsolation: return "cudaErrorStreamCaptureIsolation";
    case cudaErrorStreamCaptureImplicit: return "cudaErrorStreamCaptureImplicit";
    case cudaErrorCapturedEvent: return "cudaErrorCapturedEvent";
    case cudaErrorStreamCaptureWrongThread: return "cudaErrorStreamCaptureWrongThread";
    default: return "cudaErrorUnknown";
  }
}
inline const char* cudaGetErrorString(cudaError_t e) { return cudaGetErrorName(e); }
inline cudaError_t cudaGetLastError() {
  FDMOCK_CALL();
  cudaError_t e = fdmock::last_error();
  const int d = fdmock::current_device();
  {
    std::lock_guard<std::mutex> g(fdmock::big_lock());
    if (fdmock::sticky()[d] != cudaSuccess) return fdmock::sticky()[d];  // sticky: never cleared
  }
  fdmock::last_error() = cudaSuccess;
  return e;
}
inline cudaError_t cudaRuntimeGetVersion(int* v) {
  FDMOCK_CALL();
  *v = 13000;
  return cudaSuccess;
}
inline cudaError_t cudaDriverGetVersion(int* v) {
  FDMOCK_CALL();
  *v = fdmock::config().device_count.load() > 0 ? 13000 : 0;
  return cudaSuccess;
}
inline cudaError_t cudaGetDeviceCount(int* n) {
  FDMOCK_CALL();
  *n = std::min(fdmock::config().device_count.load(), fdmock::kMaxDevices);
  if (*n <= 0) {
    *n = 0;
    return fdmock::ret(cudaErrorNoDevice);
  }
  return cudaSuccess;
}
inline cudaError_t cudaGetDevice(int* d) {  // 0 on a thread that never set one; creates nothing
  FDMOCK_CALL();
  *d = fdmock::current_device();
  return cudaSuccess;
}
inline cudaError_t cudaSetDevice(int d) {
  FDMOCK_CALL();
  if (d < 0 || d >= std::min(fdmock::config().device_count.load(), fdmock::kMaxDevices))
    return fdmock::ret(cudaErrorInvalidDevice);
  FDMOCK_ENTER("cudaSetDevice", d);  // since CUDA 12 it initializes the device's primary context
  fdmock::current_device() = d;
  return cudaSuccess;
}
inline cudaError_t cudaGetDriverEntryPointByVersion(const char* symbol, void** fn, unsigned int, unsigned long long,
                                                    cudaDriverEntryPointQueryResult* status = nullptr) {
  FDMOCK_CALL();
  *fn = nullptr;
  if (std::strcmp(symbol, "cuDevicePrimaryCtxGetState") == 0)
    *fn = reinterpret_cast<void*>(&fdmock::primary_ctx_get_state);
  if (status) *status = *fn ? cudaDriverEntryPointSuccess : cudaDriverEntryPointSymbolNotFound;
  return cudaSuccess;
}
inline cudaError_t cudaGetDeviceProperties(cudaDeviceProp* p, int d) {
  FDMOCK_CALL();
  std::memset(p, 0, sizeof(*p));
  std::snprintf(p->name, sizeof(p->name), "Mock GPU %d", d);
  for (int i = 0; i < 16; ++i) p->uuid.bytes[i] = static_cast<char>(i * 17 + d);
  p->totalGlobalMem = 1ull << 34;
  p->major = 9;
  p->minor = 0;
  p->multiProcessorCount = 4;
  return cudaSuccess;
}
inline cudaError_t cudaDeviceGetPCIBusId(char* buf, int len, int d) {
  FDMOCK_CALL();
  std::snprintf(buf, static_cast<size_t>(len), "0000:%02X:00.0", 0x10 + d);
  return cudaSuccess;
}
inline cudaError_t cudaDeviceGetAttribute(int* v, cudaDeviceAttr, int) {
  FDMOCK_CALL();
  *v = 4;
  return cudaSuccess;
}
inline cudaError_t cudaDeviceGetStreamPriorityRange(int* least, int* greatest) {
  FDMOCK_CALL();
  FDMOCK_ENTER("cudaDeviceGetStreamPriorityRange", fdmock::current_device());
  *least = 0;
  *greatest = -5;
  return cudaSuccess;
}
inline cudaError_t cudaPointerGetAttributes(cudaPointerAttributes* a, const void* p) {
  FDMOCK_CALL();
  FDMOCK_ENTER("cudaPointerGetAttributes", fdmock::current_device());
  std::memset(a, 0, sizeof(*a));
  a->device = -2;
  const int d = fdmock::device_of(p);
  if (d >= 0) {
    a->type = cudaMemoryTypeDevice;
    a->device = d;
    a->devicePointer = const_cast<void*>(p);
  } else if (fdmock::pinned_state(p, 1) != 0) {
    a->type = cudaMemoryTypeHost;
    a->hostPointer = const_cast<void*>(p);
    a->devicePointer = const_cast<void*>(p);
  } else {
    a->type = cudaMemoryTypeUnregistered;
  }
  return cudaSuccess;
}
inline cudaError_t cudaMalloc(void** p, size_t n) {
  FDMOCK_CALL();
  const int dev = fdmock::current_device();
  *p = nullptr;
  FDMOCK_ENTER("cudaMalloc", dev);
  if (cudaError_t e = fdmock::unsafe_call()) return fdmock::ret(e);
  const uint64_t len = (std::max<size_t>(n, 1) + 255) / 256 * 256;
  std::lock_guard<std::mutex> g(fdmock::memory().mu);
  uint64_t used = 0;
  fdmock::Arena& a = fdmock::arena_locked(dev);
  for (auto& b : a.blocks) used += b.second;
  if (used + len > fdmock::config().device_free.load()) return fdmock::ret(cudaErrorMemoryAllocation);
  uint64_t off = 0;  // first fit: freed blocks are reused at once, like a caching allocator's
  for (auto& b : a.blocks) {
    if (b.first >= off + len) break;
    off = (b.first + b.second + 255) / 256 * 256;
  }
  if (off + len > fdmock::kArenaBytes) return fdmock::ret(cudaErrorMemoryAllocation);
  a.blocks[off] = len;
  std::memset(a.shadow + off, 0xA5, len);  // poison: unwritten bytes show up in comparisons
  *p = a.base + off;
  fdmock::config().live_allocs++;
  return cudaSuccess;
}
inline cudaError_t cudaFree(void* p) {
  FDMOCK_CALL();
  if (!p) return cudaSuccess;
  FDMOCK_ENTER("cudaFree", fdmock::current_device());
  if (cudaError_t e = fdmock::unsafe_call()) return fdmock::ret(e);
  std::lock_guard<std::mutex> g(fdmock::memory().mu);
  uint8_t* sh = nullptr;
  const int d = fdmock::device_of_locked(p, 1, &sh);
  if (d < 0) return fdmock::ret(cudaErrorInvalidValue);
  fdmock::Arena& a = fdmock::memory().arenas[d];
  auto it = a.blocks.find(static_cast<uint64_t>(static_cast<uint8_t*>(p) - a.base));
  if (it == a.blocks.end()) return fdmock::ret(cudaErrorInvalidValue);
  // Give back the whole pages inside the block only: blocks are 256-byte aligned, neighbours share pages.
  const uint64_t page = 4096, lo = (it->first + page - 1) / page * page, hi = (it->first + it->second) / page * page;
  if (hi > lo) ::madvise(a.shadow + lo, hi - lo, MADV_DONTNEED);
  a.blocks.erase(it);
  fdmock::config().live_allocs--;
  return cudaSuccess;
}
inline cudaError_t cudaHostAlloc(void** p, size_t n, unsigned int) {
  FDMOCK_CALL();
  FDMOCK_ENTER("cudaHostAlloc", fdmock::current_device());
  if (cudaError_t e = fdmock::unsafe_call()) return fdmock::ret(e);
  *p = std::aligned_alloc(4096, (n + 4095) / 4096 * 4096);
  std::lock_guard<std::mutex> g(fdmock::memory().mu);
  fdmock::memory().pinned[reinterpret_cast<uintptr_t>(*p)] = n;
  fdmock::memory().host_allocs.insert(reinterpret_cast<uintptr_t>(*p));
  return cudaSuccess;
}
// Mapped pinned memory: with unified addressing (every 64-bit platform) the device pointer is the
// host pointer; mock "kernels" (host lambdas) reach it directly, as GPU kernels do over PCIe.
inline cudaError_t cudaHostGetDevicePointer(void** dev, void* host, unsigned int flags) {
  FDMOCK_CALL();
  FDMOCK_ENTER("cudaHostGetDevicePointer", fdmock::current_device());
  if (flags != 0) return fdmock::ret(cudaErrorInvalidValue);
  std::lock_guard<std::mutex> g(fdmock::memory().mu);
  auto& pinned = fdmock::memory().pinned;
  auto it = pinned.upper_bound(reinterpret_cast<uintptr_t>(host));
  if (it == pinned.begin()) return fdmock::ret(cudaErrorInvalidValue);
  --it;
  if (reinterpret_cast<uintptr_t>(host) >= it->first + it->second) return fdmock::ret(cudaErrorInvalidValue);
  *dev = host;
  return cudaSuccess;
}
inline cudaError_t cudaFreeHost(void* p) {
  FDMOCK_CALL();
  {
    std::lock_guard<std::mutex> g(fdmock::memory().mu);
    if (!fdmock::memory().host_allocs.erase(reinterpret_cast<uintptr_t>(p))) return fdmock::ret(cudaErrorInvalidValue);
    fdmock::memory().pinned.erase(reinterpret_cast<uintptr_t>(p));
  }
  std::free(p);
  return cudaSuccess;
}
inline cudaError_t cudaStreamCreateWithPriority(cudaStream_t* s, unsigned int flags, int) {
  FDMOCK_CALL();
  const int dev = fdmock::current_device();
  FDMOCK_ENTER("cudaStreamCreateWithPriority", dev);
  auto* st = new fdmock::Stream(dev, flags, false);
  if (st->blocking()) {
    std::lock_guard<std::mutex> g(fdmock::big_lock());
    fdmock::blocking_streams().insert(st);
  }
  *s = reinterpret_cast<cudaStream_t>(st);
  return cudaSuccess;
}
inline cudaError_t cudaStreamCreateWithFlags(cudaStream_t* s, unsigned int flags) {
  FDMOCK_CALL();
  return cudaStreamCreateWithPriority(s, flags, 0);
}
inline cudaError_t cudaStreamDestroy(cudaStream_t s) {
  FDMOCK_CALL();
  if (reinterpret_cast<uintptr_t>(s) <= 2) return fdmock::ret(cudaErrorInvalidResourceHandle);
  auto* st = reinterpret_cast<fdmock::Stream*>(s);
  {
    std::lock_guard<std::mutex> g(fdmock::big_lock());
    fdmock::blocking_streams().erase(st);
  }
  delete st;
  return cudaSuccess;
}
inline cudaError_t cudaStreamSynchronize(cudaStream_t s) {
  FDMOCK_CALL();
  fdmock::Stream* st = fdmock::stream_of(s);
  FDMOCK_ENTER("cudaStreamSynchronize", st->device());
  {
    std::lock_guard<std::mutex> g(fdmock::big_lock());
    if (st->capture) {  // synchronizing a capturing stream is never allowed
      fdmock::invalidate_locked(*st->capture, cudaErrorStreamCaptureUnsupported);
      return fdmock::ret(cudaErrorStreamCaptureUnsupported);
    }
    if (cudaError_t e = fdmock::unsafe_call_locked()) return fdmock::ret(e);
  }
  fdmock::config().syncs++;
  st->sync();
  FDMOCK_ENTER("", st->device());  // a fault while we waited is reported here
  return cudaSuccess;
}
// Waits for the work of every stream of the current device enqueued before the call. While a
// stream of the device captures, in any capture mode and from any thread, it is illegal
// (Programming Guide, stream capture: synchronizing "a broader handle which encompasses an active
// stream capture, such as a device or context handle") and invalidates those captures.
inline cudaError_t cudaDeviceSynchronize() {
  FDMOCK_CALL();
  const int dev = fdmock::current_device();
  FDMOCK_ENTER("cudaDeviceSynchronize", dev);
  {
    std::lock_guard<std::mutex> g(fdmock::big_lock());
    bool refused = false;
    for (auto& c : fdmock::captures())
      if (c->device == dev) {
        fdmock::invalidate_locked(*c, cudaErrorStreamCaptureUnsupported);
        refused = true;
      }
    if (refused) return fdmock::ret(cudaErrorStreamCaptureUnsupported);
    if (cudaError_t e = fdmock::unsafe_call_locked()) return fdmock::ret(e);
  }
  std::vector<std::pair<std::shared_ptr<fdmock::Progress>, uint64_t>> waits;
  {
    std::lock_guard<std::mutex> g(fdmock::Stream::registry_mu());
    for (fdmock::Stream* st : fdmock::Stream::registry())
      if (st->device() == dev) waits.emplace_back(st->progress(), st->enqueued());
  }
  fdmock::config().syncs++;
  for (auto& w : waits) w.first->wait_for(w.second);
  FDMOCK_ENTER("", dev);  // a fault while we waited is reported here
  return cudaSuccess;
}
inline cudaError_t cudaStreamBeginCapture(cudaStream_t s, cudaStreamCaptureMode mode) {
  FDMOCK_CALL();
  fdmock::Stream* st = fdmock::stream_of(s);
  FDMOCK_ENTER("cudaStreamBeginCapture", st->device());
  if (st->legacy()) return fdmock::ret(cudaErrorStreamCaptureUnsupported);
  std::lock_guard<std::mutex> g(fdmock::big_lock());
  if (st->capture) return fdmock::ret(cudaErrorIllegalState);
  static uint64_t next_id = 1;
  auto c = std::make_shared<fdmock::Capture>();
  c->mode = mode;
  c->thread = std::this_thread::get_id();
  c->origin = st;
  c->device = st->device();
  c->id = next_id++;
  c->members.push_back(st);
  st->capture = c;
  fdmock::captures().push_back(c);
  fdmock::config().live_graphs++;
  return cudaSuccess;
}
inline cudaError_t cudaStreamEndCapture(cudaStream_t s, cudaGraph_t* graph) {
  FDMOCK_CALL();
  fdmock::Stream* st = fdmock::stream_of(s);
  *graph = nullptr;
  std::lock_guard<std::mutex> g(fdmock::big_lock());
  std::shared_ptr<fdmock::Capture> c = st->capture;
  if (!c) return fdmock::ret(cudaErrorIllegalState);
  if (c->origin != st) {
    fdmock::invalidate_locked(*c, cudaErrorStreamCaptureUnmatched);
    return fdmock::ret(cudaErrorStreamCaptureUnmatched);
  }
  if (c->mode != cudaStreamCaptureModeRelaxed && c->thread != std::this_thread::get_id())
    return fdmock::ret(cudaErrorStreamCaptureWrongThread);
  cudaError_t e = c->invalid != cudaSuccess ? cudaErrorStreamCaptureInvalidated : cudaSuccess;
  for (fdmock::Stream* m : c->members) {
    if (m->capture_pending && e == cudaSuccess) e = cudaErrorStreamCaptureUnjoined;
    m->capture_pending = false;
    m->capture.reset();
  }
  auto& all = fdmock::captures();
  for (size_t i = 0; i < all.size(); ++i)
    if (all[i] == c) all.erase(all.begin() + static_cast<std::ptrdiff_t>(i));
  if (e != cudaSuccess) {
    delete c->graph;
    fdmock::config().live_graphs--;
    return fdmock::ret(e);
  }
  *graph = reinterpret_cast<cudaGraph_t>(c->graph);
  return cudaSuccess;
}
inline cudaError_t cudaStreamIsCapturing(cudaStream_t s, cudaStreamCaptureStatus* out) {
  FDMOCK_CALL();
  fdmock::Stream* st = fdmock::stream_of(s);
  FDMOCK_ENTER("cudaStreamIsCapturing", st->device());
  *out = cudaStreamCaptureStatusNone;
  if (fdmock::config().capturing.load()) {
    *out = cudaStreamCaptureStatusActive;
    return cudaSuccess;
  }
  std::lock_guard<std::mutex> g(fdmock::big_lock());
  if (st->legacy()) {  // asking about the legacy stream while a blocking stream captures
    for (auto& c : fdmock::captures())
      for (fdmock::Stream* m : c->members)
        if (m->device() == st->device() && m->blocking()) return fdmock::ret(cudaErrorStreamCaptureImplicit);
    return cudaSuccess;
  }
  if (st->capture)
    *out = st->capture->invalid != cudaSuccess ? cudaStreamCaptureStatusInvalidated : cudaStreamCaptureStatusActive;
  return cudaSuccess;
}
inline cudaError_t cudaStreamGetCaptureInfo(cudaStream_t s, cudaStreamCaptureStatus* out,
                                            unsigned long long* id = nullptr, cudaGraph_t* graph = nullptr,
                                            const void** deps = nullptr, const void** edges = nullptr,
                                            size_t* ndeps = nullptr) {
  FDMOCK_CALL();
  cudaError_t e = cudaStreamIsCapturing(s, out);
  if (e != cudaSuccess) return e;
  std::lock_guard<std::mutex> g(fdmock::big_lock());
  auto& c = fdmock::stream_of(s)->capture;
  if (id) *id = c ? c->id : 0;
  if (graph) *graph = c ? reinterpret_cast<cudaGraph_t>(c->graph) : nullptr;
  if (deps) *deps = nullptr;
  if (edges) *edges = nullptr;
  if (ndeps) *ndeps = 0;
  return cudaSuccess;
}
inline cudaError_t cudaThreadExchangeStreamCaptureMode(cudaStreamCaptureMode* mode) {
  FDMOCK_CALL();
  std::swap(fdmock::thread_capture_mode(), *mode);
  return cudaSuccess;
}
inline cudaError_t cudaGraphInstantiate(cudaGraphExec_t* exec, cudaGraph_t graph, unsigned long long = 0) {
  FDMOCK_CALL();
  FDMOCK_ENTER("cudaGraphInstantiate", fdmock::current_device());
  if (!graph) return fdmock::ret(cudaErrorInvalidValue);
  auto* x = new fdmock::Graph(*reinterpret_cast<fdmock::Graph*>(graph));
  x->order = std::make_shared<fdmock::LaunchOrder>();
  *exec = reinterpret_cast<cudaGraphExec_t>(x);
  fdmock::config().live_graphs++;
  return cudaSuccess;
}
inline cudaError_t cudaGraphLaunch(cudaGraphExec_t exec, cudaStream_t s) {
  FDMOCK_CALL();
  FDMOCK_ENTER("cudaGraphLaunch", fdmock::current_device());
  auto* g = reinterpret_cast<fdmock::Graph*>(exec);
  bool capturing;
  {
    std::lock_guard<std::mutex> l(fdmock::big_lock());
    capturing = fdmock::stream_of(s)->capture != nullptr;
  }
  if (capturing)  // (launched inside a capture: a child graph, ordered only when its graph runs)
    return fdmock::ret(fdmock::submit(s, [g] {
      for (auto& op : g->ops) op();
    }));
  std::shared_ptr<fdmock::LaunchOrder> order = g->order;
  uint64_t ticket;
  {
    std::lock_guard<std::mutex> l(order->mu);
    ticket = order->launched++;
  }
  // The launch keeps its own copy of the nodes: an executable graph destroyed while a launch of
  // it is in flight is freed on completion (cudaGraphExecDestroy), never under the running launch.
  auto ops = std::make_shared<std::vector<std::function<void()>>>(g->ops);
  uint64_t done_ticket = 0;
  const cudaError_t e = fdmock::submit(s, [ops, order, ticket] {
    {
      std::unique_lock<std::mutex> l(order->mu);
      order->cv.wait(l, [&] { return order->done == ticket; });
    }
    for (auto& op : *ops) {
      if (const int us = fdmock::config().graph_node_us.load())
        std::this_thread::sleep_for(std::chrono::microseconds(us));
      op();
    }
    std::lock_guard<std::mutex> l(order->mu);
    order->finish_locked();
  }, &done_ticket);
  if (e == cudaSuccess) {
    fdmock::Stream* st = fdmock::stream_of(s);
    for (fdmock::Event* ev : g->external_events) {  // recorded at this launch
      std::lock_guard<std::mutex> l(ev->mu);
      ev->captured.reset();
      ev->stream = st;
      ev->progress = st->progress();
      ev->ticket = done_ticket;
    }
  }
  if (e != cudaSuccess) {
    std::lock_guard<std::mutex> l(order->mu);
    if (order->done == ticket)
      order->finish_locked();
    else
      order->abandoned.insert(ticket);
  }
  return fdmock::ret(e);
}
inline cudaError_t cudaGraphDestroy(cudaGraph_t graph) {
  FDMOCK_CALL();
  delete reinterpret_cast<fdmock::Graph*>(graph);
  fdmock::config().live_graphs--;
  return cudaSuccess;
}
inline cudaError_t cudaGraphExecDestroy(cudaGraphExec_t exec) {
  FDMOCK_CALL();
  delete reinterpret_cast<fdmock::Graph*>(exec);
  fdmock::config().live_graphs--;
  return cudaSuccess;
}
inline cudaError_t cudaEventCreateWithFlags(cudaEvent_t* e, unsigned int) {
  FDMOCK_CALL();
  FDMOCK_ENTER("cudaEventCreateWithFlags", fdmock::current_device());
  auto* ev = new fdmock::Event();
  ev->device = fdmock::current_device();
  *e = reinterpret_cast<cudaEvent_t>(ev);
  fdmock::config().live_events++;
  return cudaSuccess;
}
inline cudaError_t cudaEventDestroy(cudaEvent_t e) {
  FDMOCK_CALL();
  delete reinterpret_cast<fdmock::Event*>(e);
  fdmock::config().live_events--;
  return cudaSuccess;
}
inline cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t s) {
  FDMOCK_CALL();
  auto* ev = reinterpret_cast<fdmock::Event*>(e);
  fdmock::Stream* st = fdmock::stream_of(s);
  FDMOCK_ENTER("cudaEventRecord", st->device());
  // CUDA Programming Guide, "Stream and Event Behavior": cudaEventRecord() fails if the event and
  // the stream belong to different devices (stream 0 is the current device's legacy stream).
  if (ev->device != st->device()) return fdmock::ret(cudaErrorInvalidResourceHandle);
  std::shared_ptr<fdmock::Capture> cap;
  {
    std::lock_guard<std::mutex> g(fdmock::big_lock());
    cap = st->capture;
  }
  std::lock_guard<std::mutex> g(ev->mu);
  ev->stream = st;
  if (cap) {  // an event node in the graph: joins the streams that wait on it to the capture
    ev->captured = cap;
    ev->progress.reset();
    return cudaSuccess;
  }
  uint64_t t = 0;
  cudaError_t err = fdmock::submit(s, [] {}, &t);
  if (err != cudaSuccess) return fdmock::ret(err);
  ev->captured.reset();
  ev->progress = st->progress();
  ev->ticket = t;
  return cudaSuccess;
}
// cudaEventRecordExternal during a capture: an event record node of the graph (each launch records
// the event); otherwise an ordinary record.
inline cudaError_t cudaEventRecordWithFlags(cudaEvent_t e, cudaStream_t s, unsigned int flags = 0) {
  FDMOCK_CALL();
  auto* ev = reinterpret_cast<fdmock::Event*>(e);
  fdmock::Stream* st = fdmock::stream_of(s);
  if (flags & cudaEventRecordExternal) {
    FDMOCK_ENTER("cudaEventRecordWithFlags", st->device());
    if (ev->device != st->device()) return fdmock::ret(cudaErrorInvalidResourceHandle);
    std::shared_ptr<fdmock::Capture> cap;
    {
      std::lock_guard<std::mutex> g(fdmock::big_lock());
      if (st->capture) {
        if (st->capture->invalid != cudaSuccess) return fdmock::ret(cudaErrorStreamCaptureInvalidated);
        st->capture->graph->external_events.push_back(ev);
        cap = st->capture;
      }
    }
    if (cap) {
      if (fdmock::config().external_record_captures) {  // (ev->mu is never taken under big_lock)
        std::lock_guard<std::mutex> l(ev->mu);
        ev->captured = cap;
        ev->progress.reset();
      }
      return cudaSuccess;
    }
  }
  return cudaEventRecord(e, s);
}
namespace fdmock {
// The progress and ticket of an event's last record, read under its lock; an event recorded in a
// capture has none (cudaErrorCapturedEvent), as CUDA answers for one.
inline cudaError_t last_record(Event* ev, std::shared_ptr<Progress>& pr, uint64_t& t) {
  std::lock_guard<std::mutex> g(ev->mu);
  if (ev->captured) return cudaErrorCapturedEvent;
  pr = ev->progress;
  t = ev->ticket;
  return cudaSuccess;
}
}  // namespace fdmock
// Waits for the event's last record; potentially unsafe as cudaEventQuery is.
inline cudaError_t cudaEventSynchronize(cudaEvent_t e) {
  FDMOCK_CALL();
  auto* ev = reinterpret_cast<fdmock::Event*>(e);
  FDMOCK_ENTER("cudaEventSynchronize", fdmock::current_device());
  std::shared_ptr<fdmock::Progress> pr;
  uint64_t t;
  if (cudaError_t c = fdmock::last_record(ev, pr, t)) return fdmock::ret(c);
  if (cudaError_t u = fdmock::unsafe_call()) return fdmock::ret(u);
  fdmock::config().syncs++;
  if (pr) pr->wait_for(t);
  FDMOCK_ENTER("", fdmock::current_device());  // a fault while we waited is reported here
  return cudaSuccess;
}
inline cudaError_t cudaEventQuery(cudaEvent_t e) {
  FDMOCK_CALL();
  auto* ev = reinterpret_cast<fdmock::Event*>(e);
  FDMOCK_ENTER("cudaEventQuery", fdmock::current_device());
  std::shared_ptr<fdmock::Progress> pr;
  uint64_t t;
  if (cudaError_t c = fdmock::last_record(ev, pr, t)) return fdmock::ret(c);
  if (cudaError_t u = fdmock::unsafe_call()) return fdmock::ret(u);
  if (!pr) return cudaSuccess;
  return pr->get() >= t ? cudaSuccess : cudaErrorNotReady;
}
inline cudaError_t cudaStreamWaitEvent(cudaStream_t s, cudaEvent_t e, unsigned int) {
  FDMOCK_CALL();
  auto* ev = reinterpret_cast<fdmock::Event*>(e);
  fdmock::Stream* st = fdmock::stream_of(s);
  FDMOCK_ENTER("cudaStreamWaitEvent", st->device());
  std::shared_ptr<fdmock::Progress> pr;
  std::shared_ptr<fdmock::Capture> cap;
  fdmock::Stream* from;
  uint64_t t;
  {
    std::lock_guard<std::mutex> g(ev->mu);
    pr = ev->progress;
    t = ev->ticket;
    cap = ev->captured;
    from = ev->stream;
  }
  std::unique_lock<std::mutex> g(fdmock::big_lock());
  if (cap) {
    if (st->capture && st->capture != cap) {
      fdmock::invalidate_locked(*cap, cudaErrorStreamCaptureMerge);
      return fdmock::ret(cudaErrorStreamCaptureMerge);
    }
    if (cap->invalid == cudaSuccess && cap->origin == st && from) from->capture_pending = false;  // joined back
    if (!st->capture) {  // fork: st joins the capture
      st->capture = cap;
      cap->members.push_back(st);
    }
    return cudaSuccess;
  }
  if (st->capture) {  // a captured stream may not wait on work outside its capture
    fdmock::invalidate_locked(*st->capture, cudaErrorStreamCaptureIsolation);
    return fdmock::ret(cudaErrorStreamCaptureIsolation);
  }
  g.unlock();
  if (!pr) return cudaSuccess;
  return fdmock::ret(fdmock::submit(s, [pr, t] { pr->wait_for(t); }));
}
inline cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t n, cudaMemcpyKind kind, cudaStream_t s) {
  FDMOCK_CALL();
  fdmock::Stream* st = fdmock::stream_of(s);
  FDMOCK_ENTER("cudaMemcpyAsync", st->device());
  fdmock::Side d, sr;
  if (fdmock::check_copy(dst, src, n, kind, &d, &sr) != cudaSuccess) return fdmock::ret(cudaErrorInvalidValue);
  fdmock::config().memcpy_calls++;
  if (sr.device && !d.device) fdmock::count_d2h_dst(dst, n);
  const bool pageable = (!d.device && fdmock::pinned_state(dst, n) != 1) || (!sr.device && fdmock::pinned_state(src, n) != 1);
  uint8_t* db = d.bytes;
  const uint8_t* sb = sr.bytes;
  return fdmock::ret(fdmock::submit_copy(s, [=] { std::memcpy(db, sb, n); }, pageable && (d.device || sr.device)));
}
inline cudaError_t cudaMemcpy2DAsync(void* dst, size_t dpitch, const void* src, size_t spitch, size_t width,
                                     size_t height, cudaMemcpyKind kind, cudaStream_t s) {
  FDMOCK_CALL();
  FDMOCK_ENTER("cudaMemcpy2DAsync", fdmock::stream_of(s)->device());
  if (dpitch < width || spitch < width || height == 0) return fdmock::ret(cudaErrorInvalidValue);
  const size_t dspan = dpitch * (height - 1) + width, sspan = spitch * (height - 1) + width;
  fdmock::Side d, sr;
  if (fdmock::resolve(dst, dspan, &d) != cudaSuccess || fdmock::resolve(src, sspan, &sr) != cudaSuccess)
    return fdmock::ret(cudaErrorInvalidValue);
  if (kind != cudaMemcpyDefault && (((kind == cudaMemcpyDeviceToHost || kind == cudaMemcpyDeviceToDevice) != sr.device) ||
                                    ((kind == cudaMemcpyHostToDevice || kind == cudaMemcpyDeviceToDevice) != d.device)))
    return fdmock::ret(cudaErrorInvalidValue);
  fdmock::config().memcpy2d_calls++;
  uint8_t* db = d.bytes;
  const uint8_t* sb = sr.bytes;
  return fdmock::ret(fdmock::submit(s, [=] {
    for (size_t r = 0; r < height; ++r) std::memcpy(db + r * dpitch, sb + r * spitch, width);
  }));
}
inline cudaError_t cudaMemcpyBatchAsync(void* const* dsts, const void* const* srcs, const size_t* sizes,
                                        size_t count, cudaMemcpyAttributes* attrs, size_t* idxs, size_t nattrs,
                                        cudaStream_t s) {
  FDMOCK_CALL();
  FDMOCK_ENTER("cudaMemcpyBatchAsync", fdmock::stream_of(s)->device());
  if (reinterpret_cast<uintptr_t>(s) <= 1 || nattrs != 1 || idxs[0] != 0 ||
      attrs[0].srcAccessOrder != cudaMemcpySrcAccessOrderStream)
    return fdmock::ret(cudaErrorInvalidValue);
  {
    std::lock_guard<std::mutex> g(fdmock::big_lock());
    if (fdmock::stream_of(s)->capture) return fdmock::ret(cudaErrorStreamCaptureUnsupported);  // not capturable
  }
  std::vector<uint8_t*> d(count);
  std::vector<const uint8_t*> sr(count);
  std::vector<size_t> n(sizes, sizes + count);
  for (size_t i = 0; i < count; ++i) {
    fdmock::Side ds, ss;
    if (fdmock::check_copy(dsts[i], srcs[i], n[i], cudaMemcpyDefault, &ds, &ss) != cudaSuccess)
      return fdmock::ret(cudaErrorInvalidValue);
    if (ss.device && !ds.device) fdmock::count_d2h_dst(dsts[i], n[i]);
    d[i] = ds.bytes;
    sr[i] = ss.bytes;
  }
  fdmock::config().batch_calls++;
  return fdmock::ret(fdmock::submit(s, [d, sr, n] {
    for (size_t i = 0; i < d.size(); ++i) std::memcpy(d[i], sr[i], n[i]);
  }));
}
inline cudaError_t cudaHostRegister(void* p, size_t n, unsigned int) {
  FDMOCK_CALL();
  FDMOCK_ENTER("cudaHostRegister", fdmock::current_device());
  if (cudaError_t e = fdmock::unsafe_call()) return fdmock::ret(e);
  std::lock_guard<std::mutex> g(fdmock::memory().mu);
  auto& r = fdmock::memory().pinned;
  uintptr_t a = reinterpret_cast<uintptr_t>(p);
  auto it = r.upper_bound(a);
  if (it != r.begin()) {
    auto prev = std::prev(it);
    if (a < prev->first + prev->second) return fdmock::ret(cudaErrorHostMemoryAlreadyRegistered);
  }
  if (it != r.end() && it->first < a + n) return fdmock::ret(cudaErrorHostMemoryAlreadyRegistered);
  r[a] = n;
  fdmock::config().registered_ranges++;
  return cudaSuccess;
}
inline cudaError_t cudaHostUnregister(void* p) {
  FDMOCK_CALL();
  FDMOCK_ENTER("cudaHostUnregister", fdmock::current_device());
  std::lock_guard<std::mutex> g(fdmock::memory().mu);
  if (!fdmock::memory().pinned.erase(reinterpret_cast<uintptr_t>(p))) return fdmock::ret(cudaErrorHostMemoryNotRegistered);
  fdmock::config().registered_ranges--;
  return cudaSuccess;
}
