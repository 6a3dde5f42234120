// A CPU stand-in for the parts of the CUDA runtime that csrc/cuda_staging.cu uses, for tests on
// machines without a GPU (tests/test_cuda.py builds fastdump._C against it as a separate module).
//
// Semantics kept: every stream is a worker thread running its operations in order; an event is a
// (stream, ticket) pair taken at record time, complete once that stream has run past the ticket;
// cudaStreamWaitEvent makes the waiting stream block on the ticket recorded at call time (so the
// event may be re-recorded right after). "Device memory" is host memory. Operations can be delayed
// at random to shake out ordering bugs, and calls can be made to fail on demand.
// Not modelled: real device/host address spaces, capture, multiple contexts.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <iterator>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
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
  cudaErrorNotReady = 600,
  cudaErrorHostMemoryAlreadyRegistered = 712,
  cudaErrorNotSupported = 801,
  cudaErrorStreamCaptureImplicit = 906,
  cudaErrorUnknown = 999,
};

struct CUstream_mock;
struct CUevent_mock;
typedef CUstream_mock* cudaStream_t;
typedef CUevent_mock* cudaEvent_t;

enum cudaMemcpyKind {
  cudaMemcpyHostToHost = 0,
  cudaMemcpyHostToDevice = 1,
  cudaMemcpyDeviceToHost = 2,
  cudaMemcpyDeviceToDevice = 3,
  cudaMemcpyDefault = 4
};
enum cudaStreamCaptureStatus { cudaStreamCaptureStatusNone = 0, cudaStreamCaptureStatusActive = 1 };
enum cudaStreamCaptureMode { cudaStreamCaptureModeGlobal = 0, cudaStreamCaptureModeThreadLocal = 1,
                             cudaStreamCaptureModeRelaxed = 2 };
enum cudaDeviceAttr { cudaDevAttrMultiProcessorCount = 16 };
enum cudaMemoryType { cudaMemoryTypeUnregistered = 0, cudaMemoryTypeHost = 1, cudaMemoryTypeDevice = 2,
                      cudaMemoryTypeManaged = 3 };
enum cudaMemLocationType { cudaMemLocationTypeInvalid = 0, cudaMemLocationTypeDevice = 1,
                           cudaMemLocationTypeHost = 2 };
enum cudaMemcpySrcAccessOrder { cudaMemcpySrcAccessOrderInvalid = 0, cudaMemcpySrcAccessOrderStream = 1 };
enum cudaMemcpyFlags { cudaMemcpyFlagDefault = 0, cudaMemcpyFlagPreferOverlapWithCompute = 1 };

#define cudaEventDisableTiming 0x02
#define cudaStreamNonBlocking 0x01
#define cudaHostRegisterPortable 0x01

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

// ------------------------------------------------------------------------------------------------
// State shared by every translation unit (inline functions' statics are one object each).

struct Config {
  std::atomic<int> device_count{2};
  std::atomic<int> max_delay_us{0};           // each stream op sleeps a random 0..max first
  std::atomic<int> fail_batch{0};             // cudaMemcpyBatchAsync returns NotSupported
  std::atomic<int> fail_event_query{0};       // next N cudaEventQuery calls on done events fail
  std::atomic<int> fail_malloc{0};            // cudaMalloc fails
  std::atomic<int> capturing{0};              // every stream reports an active capture
  std::atomic<uint64_t> batch_calls{0};
  std::atomic<uint64_t> memcpy_calls{0};
  std::atomic<uint64_t> kernel_calls{0};
  std::atomic<uint64_t> memcpy2d_calls{0};
  std::atomic<uint64_t> crossing_copies{0};   // D2H copies whose destination spans registrations
  std::atomic<uint64_t> unpinned_copies{0};   // D2H copies into unregistered memory
  std::atomic<uint64_t> syncs{0};             // stream/device synchronizations (never on the hot path)
  std::atomic<uint64_t> live_allocs{0};
  std::atomic<uint64_t> live_streams{0};
  std::atomic<uint64_t> live_events{0};
  std::atomic<uint64_t> registered_ranges{0};
};

inline Config& config() {
  static Config c;
  return c;
}

inline int& current_device() {
  static thread_local int d = 0;
  return d;
}

inline void random_delay() {
  int max = config().max_delay_us.load();
  if (max <= 0) return;
  static thread_local std::mt19937 rng(std::random_device{}());
  std::uniform_int_distribution<int> dist(0, max);
  std::this_thread::sleep_for(std::chrono::microseconds(dist(rng)));
}

// How far a stream has run. Shared by the stream, the events recorded on it and the waits on
// those events, so a stream may be destroyed while another stream still waits on its event (as
// CUDA allows).
struct Progress {
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

class Stream {
 public:
  explicit Stream(int device) : device_(device), progress_(std::make_shared<Progress>()) {
    config().live_streams++;
    thread_ = std::thread([this] { run(); });
  }
  ~Stream() {
    {
      std::lock_guard<std::mutex> g(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();  // runs what is queued first
    config().live_streams--;
  }
  uint64_t enqueue(std::function<void()> fn) {
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
      random_delay();
      fn();
      {
        std::lock_guard<std::mutex> g(progress_->mu);
        ++progress_->done;
      }
      progress_->cv.notify_all();
    }
  }
  int device_;
  std::shared_ptr<Progress> progress_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> q_;
  uint64_t enq_ = 0;
  bool stop_ = false;
  std::thread thread_;
};

struct Event {
  std::mutex mu;
  std::shared_ptr<Progress> progress;  // of the stream it was last recorded on
  uint64_t ticket = 0;
};

// The legacy default stream (handles 0, 1 = cudaStreamLegacy and 2 = per-thread, in this mock).
inline Stream* legacy() {
  static Stream* s = new Stream(0);  // never destroyed: lives until exit
  return s;
}

inline Stream* stream_of(cudaStream_t h) {
  uintptr_t v = reinterpret_cast<uintptr_t>(h);
  if (v <= 2) return legacy();
  return reinterpret_cast<Stream*>(h);
}

inline cudaError_t enqueue(cudaStream_t h, std::function<void()> fn) {
  config().kernel_calls++;
  stream_of(h)->enqueue(std::move(fn));
  return cudaSuccess;
}

struct Memory {
  std::mutex mu;
  std::map<uintptr_t, size_t> device;      // cudaMalloc'd blocks
  std::map<uintptr_t, size_t> registered;  // cudaHostRegister'd ranges
};

inline Memory& memory() {
  static Memory m;
  return m;
}

// Whether [p, p+n) lies inside one registered range; sets `any` when it touches one.
inline bool inside_one_registration(const void* p, size_t n, bool* any) {
  Memory& m = memory();
  std::lock_guard<std::mutex> g(m.mu);
  uintptr_t a = reinterpret_cast<uintptr_t>(p);
  auto it = m.registered.upper_bound(a);
  *any = false;
  if (it == m.registered.begin()) return false;
  --it;
  if (a >= it->first + it->second) return false;
  *any = true;
  return a + n <= it->first + it->second;
}

inline void check_d2h_dst(const void* dst, size_t n) {
  bool any = false;
  if (!inside_one_registration(dst, n, &any)) {
    if (any) config().crossing_copies++;
    else config().unpinned_copies++;
  }
}

inline cudaError_t& last_error() {
  static thread_local cudaError_t e = cudaSuccess;
  return e;
}

inline cudaError_t ret(cudaError_t e) {
  if (e != cudaSuccess) last_error() = e;
  return e;
}

}  // namespace fdmock

// --------------------------------------------------------------------------------------------------
// The runtime API subset.

inline const char* cudaGetErrorName(cudaError_t e) {
  switch (e) {
    case cudaSuccess: return "cudaSuccess";
    case cudaErrorInvalidValue: return "cudaErrorInvalidValue";
    case cudaErrorMemoryAllocation: return "cudaErrorMemoryAllocation";
    case cudaErrorInsufficientDriver: return "cudaErrorInsufficientDriver";
    case cudaErrorNoDevice: return "cudaErrorNoDevice";
    case cudaErrorNotReady: return "cudaErrorNotReady";
    case cudaErrorNotSupported: return "cudaErrorNotSupported";
    case cudaErrorStreamCaptureImplicit: return "cudaErrorStreamCaptureImplicit";
    default: return "cudaErrorUnknown(mock)";
  }
}
inline const char* cudaGetErrorString(cudaError_t e) { return cudaGetErrorName(e); }
inline cudaError_t cudaGetLastError() {
  cudaError_t e = fdmock::last_error();
  fdmock::last_error() = cudaSuccess;
  return e;
}
inline cudaError_t cudaRuntimeGetVersion(int* v) {
  *v = 13000;
  return cudaSuccess;
}
inline cudaError_t cudaDriverGetVersion(int* v) {
  *v = fdmock::config().device_count.load() > 0 ? 13000 : 0;
  return cudaSuccess;
}
inline cudaError_t cudaGetDeviceCount(int* n) {
  *n = fdmock::config().device_count.load();
  if (*n <= 0) {
    *n = 0;
    return fdmock::ret(cudaErrorNoDevice);
  }
  return cudaSuccess;
}
inline cudaError_t cudaGetDevice(int* d) {
  *d = fdmock::current_device();
  return cudaSuccess;
}
inline cudaError_t cudaSetDevice(int d) {
  if (d < 0 || d >= fdmock::config().device_count.load()) return fdmock::ret(cudaErrorInvalidDevice);
  fdmock::current_device() = d;
  return cudaSuccess;
}
inline cudaError_t cudaGetDeviceProperties(cudaDeviceProp* p, int d) {
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
  std::snprintf(buf, static_cast<size_t>(len), "0000:%02X:00.0", 0x10 + d);
  return cudaSuccess;
}
inline cudaError_t cudaDeviceGetAttribute(int* v, cudaDeviceAttr, int) {
  *v = 4;
  return cudaSuccess;
}
inline cudaError_t cudaDeviceGetStreamPriorityRange(int* least, int* greatest) {
  *least = 0;
  *greatest = -5;
  return cudaSuccess;
}
inline cudaError_t cudaPointerGetAttributes(cudaPointerAttributes* a, const void* p) {
  std::memset(a, 0, sizeof(*a));
  fdmock::Memory& m = fdmock::memory();
  std::lock_guard<std::mutex> g(m.mu);
  uintptr_t v = reinterpret_cast<uintptr_t>(p);
  auto it = m.device.upper_bound(v);
  if (it != m.device.begin()) {
    --it;
    if (v < it->first + it->second) {
      a->type = cudaMemoryTypeDevice;
      a->device = 0;
      return cudaSuccess;
    }
  }
  a->type = cudaMemoryTypeUnregistered;
  return cudaSuccess;
}
inline cudaError_t cudaMalloc(void** p, size_t n) {
  if (fdmock::config().fail_malloc.load()) return fdmock::ret(cudaErrorMemoryAllocation);
  *p = std::aligned_alloc(256, (n + 255) / 256 * 256);
  if (!*p) return fdmock::ret(cudaErrorMemoryAllocation);
  std::memset(*p, 0xA5, n);  // poison: unwritten bytes show up in comparisons
  std::lock_guard<std::mutex> g(fdmock::memory().mu);
  fdmock::memory().device[reinterpret_cast<uintptr_t>(*p)] = n;
  fdmock::config().live_allocs++;
  return cudaSuccess;
}
inline cudaError_t cudaFree(void* p) {
  if (!p) return cudaSuccess;
  {
    std::lock_guard<std::mutex> g(fdmock::memory().mu);
    fdmock::memory().device.erase(reinterpret_cast<uintptr_t>(p));
  }
  std::free(p);
  fdmock::config().live_allocs--;
  return cudaSuccess;
}
inline cudaError_t cudaStreamCreateWithPriority(cudaStream_t* s, unsigned int, int) {
  *s = reinterpret_cast<cudaStream_t>(new fdmock::Stream(fdmock::current_device()));
  return cudaSuccess;
}
inline cudaError_t cudaStreamDestroy(cudaStream_t s) {
  if (reinterpret_cast<uintptr_t>(s) <= 2) return fdmock::ret(cudaErrorInvalidResourceHandle);
  delete reinterpret_cast<fdmock::Stream*>(s);
  return cudaSuccess;
}
inline cudaError_t cudaStreamSynchronize(cudaStream_t s) {
  fdmock::config().syncs++;
  fdmock::stream_of(s)->sync();
  return cudaSuccess;
}
inline cudaError_t cudaStreamIsCapturing(cudaStream_t, cudaStreamCaptureStatus* st) {
  *st = fdmock::config().capturing.load() ? cudaStreamCaptureStatusActive : cudaStreamCaptureStatusNone;
  return cudaSuccess;
}
inline cudaError_t cudaThreadExchangeStreamCaptureMode(cudaStreamCaptureMode* mode) {
  static thread_local cudaStreamCaptureMode m = cudaStreamCaptureModeGlobal;
  std::swap(m, *mode);
  return cudaSuccess;
}
inline cudaError_t cudaEventCreateWithFlags(cudaEvent_t* e, unsigned int) {
  *e = reinterpret_cast<cudaEvent_t>(new fdmock::Event());
  fdmock::config().live_events++;
  return cudaSuccess;
}
inline cudaError_t cudaEventDestroy(cudaEvent_t e) {
  delete reinterpret_cast<fdmock::Event*>(e);
  fdmock::config().live_events--;
  return cudaSuccess;
}
inline cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t s) {
  auto* ev = reinterpret_cast<fdmock::Event*>(e);
  fdmock::Stream* st = fdmock::stream_of(s);
  uint64_t t = st->enqueue([] {});
  std::lock_guard<std::mutex> g(ev->mu);
  ev->progress = st->progress();
  ev->ticket = t;
  return cudaSuccess;
}
inline cudaError_t cudaEventQuery(cudaEvent_t e) {
  auto* ev = reinterpret_cast<fdmock::Event*>(e);
  int f = fdmock::config().fail_event_query.load();
  if (f > 0 && fdmock::config().fail_event_query.compare_exchange_strong(f, f - 1))
    return fdmock::ret(cudaErrorUnknown);
  std::shared_ptr<fdmock::Progress> pr;
  uint64_t t;
  {
    std::lock_guard<std::mutex> g(ev->mu);
    pr = ev->progress;
    t = ev->ticket;
  }
  if (!pr) return cudaSuccess;
  return pr->get() >= t ? cudaSuccess : cudaErrorNotReady;
}
inline cudaError_t cudaStreamWaitEvent(cudaStream_t s, cudaEvent_t e, unsigned int) {
  auto* ev = reinterpret_cast<fdmock::Event*>(e);
  std::shared_ptr<fdmock::Progress> pr;
  uint64_t t;
  {
    std::lock_guard<std::mutex> g(ev->mu);
    pr = ev->progress;
    t = ev->ticket;
  }
  if (!pr) return cudaSuccess;
  fdmock::stream_of(s)->enqueue([pr, t] { pr->wait_for(t); });
  return cudaSuccess;
}
inline cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t n, cudaMemcpyKind kind, cudaStream_t s) {
  fdmock::config().memcpy_calls++;
  if (kind == cudaMemcpyDeviceToHost) fdmock::check_d2h_dst(dst, n);
  fdmock::stream_of(s)->enqueue([=] { std::memcpy(dst, src, n); });
  return cudaSuccess;
}
inline cudaError_t cudaMemcpy2DAsync(void* dst, size_t dpitch, const void* src, size_t spitch, size_t width,
                                     size_t height, cudaMemcpyKind, cudaStream_t s) {
  if (dpitch < width || spitch < width) return fdmock::ret(cudaErrorInvalidValue);
  fdmock::config().memcpy2d_calls++;
  fdmock::stream_of(s)->enqueue([=] {
    for (size_t r = 0; r < height; ++r)
      std::memcpy(static_cast<char*>(dst) + r * dpitch, static_cast<const char*>(src) + r * spitch, width);
  });
  return cudaSuccess;
}
inline cudaError_t cudaMemcpyBatchAsync(void* const* dsts, const void* const* srcs, const size_t* sizes,
                                        size_t count, cudaMemcpyAttributes* attrs, size_t* idxs, size_t nattrs,
                                        cudaStream_t s) {
  if (fdmock::config().fail_batch.load()) return fdmock::ret(cudaErrorNotSupported);
  if (reinterpret_cast<uintptr_t>(s) <= 2 || nattrs != 1 || idxs[0] != 0 ||
      attrs[0].srcAccessOrder != cudaMemcpySrcAccessOrderStream)
    return fdmock::ret(cudaErrorInvalidValue);
  fdmock::config().batch_calls++;
  std::vector<void*> d(dsts, dsts + count);
  std::vector<const void*> sr(srcs, srcs + count);
  std::vector<size_t> n(sizes, sizes + count);
  for (size_t i = 0; i < count; ++i) fdmock::check_d2h_dst(d[i], n[i]);
  fdmock::stream_of(s)->enqueue([d, sr, n] {
    for (size_t i = 0; i < d.size(); ++i) std::memcpy(d[i], sr[i], n[i]);
  });
  return cudaSuccess;
}
inline cudaError_t cudaHostRegister(void* p, size_t n, unsigned int) {
  std::lock_guard<std::mutex> g(fdmock::memory().mu);
  auto& r = fdmock::memory().registered;
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
  std::lock_guard<std::mutex> g(fdmock::memory().mu);
  if (!fdmock::memory().registered.erase(reinterpret_cast<uintptr_t>(p))) return fdmock::ret(cudaErrorInvalidValue);
  fdmock::config().registered_ranges--;
  return cudaSuccess;
}
