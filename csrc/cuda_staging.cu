// CUDA staging: see cuda_staging.h and docs/CUDA.md.
//
// Per captured tensor (stage(), caller's thread):
//   1. take device-ring space (FIFO, contiguous);
//   2. reserve the tensor's first host record in the shared-memory ring (Producer::reserve): ring
//      order is fixed here, at stage time, so the writer sees records in the order they were staged;
//   3. enqueue the device-to-device snapshot ON THE PRODUCER STREAM (cudaMemcpyAsync when
//      contiguous, cudaMemcpy2DAsync for wide-row 2-D views, else a strided-gather kernel) and
//      record a pooled event after it; later kernels on that stream cannot change what is dumped;
//   4. hand the record(s) to the drain thread and return. No synchronization anywhere.
// Drain thread (one per stager, all devices): make the device's side stream wait on the snapshot
// event, move the device-ring regions into the host records' payloads with one batched call
// (cudaMemcpyBatchAsync), record a pooled completion event; when it has completed, publish the
// records (READY) and give the device-ring space back.
#include "cuda_staging.h"

#include <cuda_runtime.h>  // tests/cuda_mock/cuda_runtime.h in the mock test build

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <pthread.h>
#include <sys/prctl.h>
#include <unistd.h>
#include <utility>
#include <vector>

#ifdef FASTDUMP_CUDA_MOCK
#define FD_HOST_DEVICE
#else
#define FD_HOST_DEVICE __host__ __device__
#endif

namespace fastdump {

namespace {

constexpr uint64_t kDevAlign = 256;                 // device-ring region alignment
constexpr uint64_t kRegisterPieceMB = 256;          // cudaHostRegister granularity (default)
constexpr int kMaxDevices = 64;
constexpr size_t kMaxBatchCopies = 256;             // copies per cudaMemcpyBatchAsync call
constexpr int kPrecreatedEvents = 32;
constexpr size_t kQueueReserve = 1024;              // records queued to the drain before the queue grows
constexpr int kGatherThreads = 256;
constexpr uint64_t k2dMinRowBytes = 512;            // narrower rows: the gather kernel does better

std::string cuda_error_text(cudaError_t e, const char* what) {
  return std::string(what) + ": " + cudaGetErrorName(e) + " (" + cudaGetErrorString(e) + ")";
}

// A failed call also leaves its error as the calling thread's "last error" (cudaGetLastError):
// cleared here, or the next launch check on this thread (the gather kernel's, a later tensor's or
// one of the same stage() call) would take it for its own and fail that tensor, or stop staging
// when it came mid-tensor. (A sticky error stays: cudaGetLastError cannot clear it.)
[[noreturn]] void throw_cuda(cudaError_t e, const char* what) {
  (void)cudaGetLastError();
  throw std::runtime_error("fastdump CUDA: " + cuda_error_text(e, what));
}

#define FD_CUDA(call)                          \
  do {                                         \
    cudaError_t fd_err_ = (call);              \
    if (fd_err_ != cudaSuccess) throw_cuda(fd_err_, #call); \
  } while (0)

// Set in a child after fork(): a stager inherited from the parent must not be used there.
std::atomic<bool> g_forked{false};
void mark_forked() { g_forked.store(true); }
bool forked_child() { return g_forked.load(std::memory_order_relaxed); }
void watch_fork() {
  static std::once_flag once;
  std::call_once(once, [] { ::pthread_atfork(nullptr, nullptr, &mark_forked); });
}

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

uint64_t align_to(uint64_t n, uint64_t a) { return (n + a - 1) / a * a; }

// Whether `device`'s primary context exists (cuDevicePrimaryCtxGetState, reached through the
// runtime so the extension needs no -lcuda). cudaGetDevice answers 0 on a thread that never chose
// a device, and cudaSetDevice creates the primary context (CUDA 12+): switching "back" to such a
// device would create a stray context (~500 MiB) on a GPU the process never used.
bool primary_context_active(int device) {
  using GetState = int (*)(int, unsigned int*, int*);
  static GetState get_state = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult q = cudaDriverEntryPointSymbolNotFound;
    if (cudaGetDriverEntryPointByVersion("cuDevicePrimaryCtxGetState", &fn, 12000, cudaEnableDefault, &q) !=
            cudaSuccess ||
        q != cudaDriverEntryPointSuccess) {
      (void)cudaGetLastError();
      fn = nullptr;
    }
    return reinterpret_cast<GetState>(fn);
  }();
  if (!get_state) return true;  // cannot tell: behave as before (restore)
  unsigned int flags = 0;
  int active = 0;
  return get_state(device, &flags, &active) == 0 && active != 0;
}

// Restores the calling thread's previous device, unless that device has no context yet (then the
// thread stays on the device it used, as torch's MaybeSetDevice does).
void restore_device(int prev) {
  if (prev >= 0 && primary_context_active(prev)) (void)cudaSetDevice(prev);
}

// Sets the calling thread's current device for the scope and restores it (the producer's
// framework keeps its own idea of the current device; we must not change it behind its back).
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    FD_CUDA(cudaGetDevice(&prev_));
    if (prev_ != device) {
      FD_CUDA(cudaSetDevice(device));
      changed_ = true;
    }
  }
  ~DeviceGuard() {
    if (changed_) restore_device(prev_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int prev_ = 0;
  bool changed_ = false;
};

// While another thread captures a CUDA graph in global mode (torch.cuda.graph's default), "unsafe"
// calls such as cudaMalloc from any thread in global mode fail and invalidate that capture. The
// stager's setup and teardown calls run in relaxed mode for the scope.
class RelaxedCapture {
 public:
  RelaxedCapture() { (void)cudaThreadExchangeStreamCaptureMode(&mode_); }
  ~RelaxedCapture() { (void)cudaThreadExchangeStreamCaptureMode(&mode_); }
  RelaxedCapture(const RelaxedCapture&) = delete;
  RelaxedCapture& operator=(const RelaxedCapture&) = delete;

 private:
  cudaStreamCaptureMode mode_ = cudaStreamCaptureModeRelaxed;
};

// ---------------------------------------------------------------------------------------------
// Strided gather kernel. Works in units of W bytes (W = 1, 2, 4, 8 or 16, chosen on the host so
// that every address it touches is W-aligned); shapes/strides are in units, C order, coalesced.

template <int N>
struct GatherDims {
  int ndim;
  int64_t shape[N];
  int64_t stride[N];  // in units; may be zero or negative
};

// Offset (in units) of the element at C-order position `lin`.
template <typename I, int N>
FD_HOST_DEVICE inline I gather_offset(const GatherDims<N>& d, I lin) {
  I off = 0;
  for (int k = d.ndim - 1; k >= 0; --k) {
    const I s = static_cast<I>(d.shape[k]);
    const I q = lin / s;
    off += (lin - q * s) * static_cast<I>(d.stride[k]);
    lin = q;
  }
  return off;
}

#ifndef FASTDUMP_CUDA_MOCK
template <typename T, typename I, int N>
__global__ void __launch_bounds__(kGatherThreads)
    gather_kernel(T* __restrict__ dst, const T* __restrict__ src, const GatherDims<N> d, I begin, I count) {
  const I step = static_cast<I>(gridDim.x) * static_cast<I>(blockDim.x);
  for (I i = static_cast<I>(blockIdx.x) * static_cast<I>(blockDim.x) + static_cast<I>(threadIdx.x); i < count;
       i += step)
    dst[i] = src[gather_offset<I, N>(d, begin + i)];
}

template <typename T, typename I, int N>
cudaError_t launch_gather_t(uint8_t* dst, const uint8_t* src, const GatherDims<N>& d, uint64_t begin, uint64_t count,
                            int sm_count, cudaStream_t stream) {
  uint64_t blocks = (count + kGatherThreads - 1) / kGatherThreads;
  const uint64_t max_blocks = static_cast<uint64_t>(sm_count > 0 ? sm_count : 16) * 8;
  if (blocks > max_blocks) blocks = max_blocks;
  if (blocks == 0) blocks = 1;
  gather_kernel<T, I, N><<<static_cast<unsigned>(blocks), kGatherThreads, 0, stream>>>(
      reinterpret_cast<T*>(dst), reinterpret_cast<const T*>(src), d, static_cast<I>(begin), static_cast<I>(count));
  return cudaGetLastError();
}
#else
// Test build against tests/cuda_mock: the same index math, run by the mock stream's thread.
template <typename T, typename I, int N>
cudaError_t launch_gather_t(uint8_t* dst, const uint8_t* src, const GatherDims<N>& d, uint64_t begin, uint64_t count,
                            int, cudaStream_t stream) {
  fdmock::CallScope launch("<<<gather_kernel>>>");  // a kernel launch is a runtime call too
  // The same guide: a kernel launch fails if issued to a stream not of the current device (and
  // stream 0 is the current device's legacy stream).
  if (fdmock::stream_of(stream)->device() != fdmock::current_device()) return fdmock::ret(cudaErrorInvalidResourceHandle);
  return fdmock::enqueue(stream, [=] {
    T* out = fdmock::dev_bytes(reinterpret_cast<T*>(dst));  // faults on anything but device memory
    const T* in = fdmock::dev_bytes(reinterpret_cast<const T*>(src));
    for (I i = 0; i < static_cast<I>(count); ++i) out[i] = in[gather_offset<I, N>(d, static_cast<I>(begin) + i)];
  });
}
#endif

// A tensor's layout in bytes: size-1 dimensions removed, the element size as an innermost
// dimension of stride 1, adjacent dimensions merged where memory allows. One dimension of stride 1
// left means C-contiguous. Fixed-size arrays: computing it allocates nothing (the lean path).
struct ByteLayout {
  int nd = 0;
  int64_t shape[kMaxDims + 1];
  int64_t stride[kMaxDims + 1];
  bool contiguous() const { return nd <= 1 && (nd == 0 || stride[0] == 1); }
};

ByteLayout byte_layout(const CudaSource& src) {
  const int64_t e = static_cast<int64_t>(src.elem_size);
  int64_t sh[kMaxDims + 1], st[kMaxDims + 1];
  int n = 0;
  for (size_t i = 0; i < src.shape.size() && i < static_cast<size_t>(kMaxDims); ++i) {
    if (src.shape[i] == 1) continue;
    sh[n] = src.shape[i];
    st[n] = src.strides[i] * e;
    ++n;
  }
  if (e != 1) {
    sh[n] = e;
    st[n] = 1;
    ++n;
  }
  // Merge from the inside out: outer (i) and inner (i+1) merge when stride[i] == stride[i+1]*shape[i+1].
  // Built innermost first into l, then reversed.
  ByteLayout l;
  for (int i = n; i-- > 0;) {
    if (l.nd > 0 && st[i] == l.stride[l.nd - 1] * l.shape[l.nd - 1]) {
      l.shape[l.nd - 1] *= sh[i];  // the inner stride stays
      continue;
    }
    l.shape[l.nd] = sh[i];
    l.stride[l.nd] = st[i];
    ++l.nd;
  }
  std::reverse(l.shape, l.shape + l.nd);
  std::reverse(l.stride, l.stride + l.nd);
  if (l.nd == 0) {  // a single element
    l.shape[0] = e;
    l.stride[0] = 1;
    l.nd = 1;
  }
  return l;
}

template <typename T, int N>
cudaError_t launch_gather_n(uint8_t* dst, const uint8_t* src, const GatherDims<N>& d, uint64_t begin, uint64_t count,
                            bool small, int sm_count, cudaStream_t stream) {
  if (small) return launch_gather_t<T, int32_t, N>(dst, src, d, begin, count, sm_count, stream);
  return launch_gather_t<T, int64_t, N>(dst, src, d, begin, count, sm_count, stream);
}

template <int N>
cudaError_t launch_gather_w(uint8_t* dst, const uint8_t* src, const GatherDims<N>& d, uint64_t w, uint64_t begin,
                            uint64_t count, bool small, int sm_count, cudaStream_t stream) {
  switch (w) {
    case 16: return launch_gather_n<uint4, N>(dst, src, d, begin, count, small, sm_count, stream);
    case 8: return launch_gather_n<uint64_t, N>(dst, src, d, begin, count, small, sm_count, stream);
    case 4: return launch_gather_n<uint32_t, N>(dst, src, d, begin, count, small, sm_count, stream);
    case 2: return launch_gather_n<uint16_t, N>(dst, src, d, begin, count, small, sm_count, stream);
    default: return launch_gather_n<uint8_t, N>(dst, src, d, begin, count, small, sm_count, stream);
  }
}

constexpr int kSmallDims = 8;

// Gather bytes [b0, b1) of the C-order enumeration of `l` (based at src) into dst.
cudaError_t gather(uint8_t* dst, const uint8_t* src, const ByteLayout& l, uint64_t b0, uint64_t b1, int sm_count,
                   cudaStream_t stream) {
  const size_t nd = static_cast<size_t>(l.nd);
  const bool inner_run = l.stride[nd - 1] == 1;  // innermost dimension is a run of bytes
  // Widest unit W that keeps every access aligned: W divides the innermost run, every outer
  // stride, both addresses and both range ends. Without a byte run (1-byte elements with a
  // non-unit innermost stride) W is 1.
  uint64_t w = 16;
  for (; w > 1; w >>= 1) {
    if (!inner_run) continue;
    if (static_cast<uint64_t>(l.shape[nd - 1]) % w) continue;
    if (reinterpret_cast<uintptr_t>(src) % w || reinterpret_cast<uintptr_t>(dst) % w) continue;
    if (b0 % w || b1 % w) continue;
    bool ok = true;
    for (size_t i = 0; i + 1 < nd; ++i) {
      const uint64_t s = static_cast<uint64_t>(l.stride[i] < 0 ? -l.stride[i] : l.stride[i]);
      if (s % w) ok = false;
    }
    if (ok) break;
  }
  // Dimensions in units of W bytes.
  int64_t ushape[kMaxDims + 1], ustride[kMaxDims + 1];
  std::copy(l.shape, l.shape + nd, ushape);
  std::copy(l.stride, l.stride + nd, ustride);
  for (size_t i = 0; i < nd; ++i) {
    if (i == nd - 1 && inner_run) {
      ushape[i] = l.shape[i] / static_cast<int64_t>(w);
      ustride[i] = 1;
    } else {
      ustride[i] = l.stride[i] / static_cast<int64_t>(w);
    }
  }
  const uint64_t begin = b0 / w, count = (b1 - b0) / w;
  // 32-bit index arithmetic when every index and offset stays far below 2^31 (the grid-stride
  // loop adds at most a few hundred thousand past `count`).
  // Every dimension too: a broadcast one (stride 0) adds nothing to the span, but its index is
  // still computed, and a 2^32-long one would wrap.
  uint64_t span = 0;
  bool dims_small = true;
  for (size_t i = 0; i < nd; ++i) {
    const uint64_t s = static_cast<uint64_t>(ustride[i] < 0 ? -ustride[i] : ustride[i]);
    span += static_cast<uint64_t>(ushape[i] - 1) * s;
    dims_small = dims_small && static_cast<uint64_t>(ushape[i]) < (1ull << 30);
  }
  const bool small = begin + count < (1ull << 30) && span < (1ull << 30) && dims_small;
  if (nd <= static_cast<size_t>(kSmallDims)) {
    GatherDims<kSmallDims> d{};
    d.ndim = static_cast<int>(nd);
    for (size_t i = 0; i < nd; ++i) {
      d.shape[i] = ushape[i];
      d.stride[i] = ustride[i];
    }
    return launch_gather_w<kSmallDims>(dst, src, d, w, begin, count, small, sm_count, stream);
  }
  GatherDims<kMaxDims + 1> d{};
  d.ndim = static_cast<int>(nd);
  for (size_t i = 0; i < nd; ++i) {
    d.shape[i] = ushape[i];
    d.stride[i] = ustride[i];
  }
  return launch_gather_w<kMaxDims + 1>(dst, src, d, w, begin, count, small, sm_count, stream);
}

}  // namespace

// For the graph recorder (cuda_graph_record.cu): the same snapshot as stage() makes, whole tensor.
void snapshot_whole(uint8_t* dst, const CudaSource& src, int sm_count) {
  uint64_t nbytes = src.elem_size;
  for (int64_t d : src.shape) nbytes *= static_cast<uint64_t>(d);
  if (nbytes == 0) return;
  const ByteLayout l = byte_layout(src);
  const uint8_t* base = reinterpret_cast<const uint8_t*>(src.ptr);
  cudaStream_t stream = reinterpret_cast<cudaStream_t>(src.stream);
  if (l.contiguous()) {
    FD_CUDA(cudaMemcpyAsync(dst, base, nbytes, cudaMemcpyDeviceToDevice, stream));
  } else {
    FD_CUDA(gather(dst, base, l, 0, nbytes, sm_count, stream));
  }
}

void cuda_restore_device(int prev) { restore_device(prev); }

// ---------------------------------------------------------------------------------------------
// Queries

CudaInfo cuda_query_info() {
  CudaInfo info;
  info.built_with = std::to_string(CUDART_VERSION / 1000) + "." + std::to_string((CUDART_VERSION % 1000) / 10);
  (void)cudaRuntimeGetVersion(&info.runtime_version);
  (void)cudaDriverGetVersion(&info.driver_version);
  int n = 0;
  cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    info.reason = cuda_error_text(e, "cudaGetDeviceCount");
    if (info.driver_version == 0) info.reason += "; no NVIDIA driver found";
    else if (info.driver_version < info.runtime_version)
      info.reason += "; the driver supports CUDA " + std::to_string(info.driver_version / 1000) + "." +
                     std::to_string((info.driver_version % 1000) / 10) + " but fastdump was built with " +
                     info.built_with + " (rebuild with an older toolkit or update the driver)";
    return info;
  }
  if (n == 0) {
    info.reason = "no CUDA device visible";
    return info;
  }
  info.device_count = n;
  for (int i = 0; i < n; ++i) {
    CudaDeviceInfo d;
    d.index = i;
    cudaDeviceProp p;
    std::memset(&p, 0, sizeof(p));
    if (cudaGetDeviceProperties(&p, i) == cudaSuccess) {
      d.name = p.name;
      char u[64];
      const unsigned char* b = reinterpret_cast<const unsigned char*>(p.uuid.bytes);
      std::snprintf(u, sizeof(u), "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", b[0],
                    b[1], b[2], b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11], b[12], b[13], b[14], b[15]);
      d.uuid = u;
      d.total_memory = p.totalGlobalMem;
      d.major = p.major;
      d.minor = p.minor;
      d.multiprocessors = p.multiProcessorCount;
    } else {
      (void)cudaGetLastError();
    }
    char bus[64] = {0};
    if (cudaDeviceGetPCIBusId(bus, sizeof(bus), i) == cudaSuccess) {
      for (char* c = bus; *c; ++c)
        if (*c >= 'A' && *c <= 'Z') *c = static_cast<char>(*c - 'A' + 'a');
      d.pci_bus_id = bus;
    } else {
      (void)cudaGetLastError();
    }
    info.devices.push_back(std::move(d));
  }
  return info;
}

// Makes a device whose primary context exists current for a host-side call that needs one, when
// the calling thread's device has none (a thread that never chose a device is on 0): the runtime
// would create that device's context (~500 MiB) on a GPU the process may never use. Returns the
// device to give to restore_device() afterwards, or -1 when nothing was switched.
int switch_to_a_used_device() {
  int cur = -1, n = 0;
  if (cudaGetDevice(&cur) != cudaSuccess || cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();
    return -1;
  }
  if (primary_context_active(cur)) return -1;
  for (int i = 0; i < n; ++i)
    if (i != cur && primary_context_active(i)) return cudaSetDevice(i) == cudaSuccess ? cur : -1;
  return -1;  // no GPU in use yet: the call may create the current device's context, as before
}

int cuda_pointer_device(uintptr_t ptr) {
  cudaPointerAttributes a;
  std::memset(&a, 0, sizeof(a));
  const int switched_from = switch_to_a_used_device();
  cudaError_t e = cudaPointerGetAttributes(&a, reinterpret_cast<const void*>(ptr));
  if (switched_from >= 0) restore_device(switched_from);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    if (e == cudaErrorInvalidValue) return -1;
    throw_cuda(e, "cudaPointerGetAttributes");
  }
  if (a.type == cudaMemoryTypeDevice || a.type == cudaMemoryTypeManaged) return a.device;
  return -1;
}

// ---------------------------------------------------------------------------------------------
// The stager

namespace {

// A run of device-ring bytes handed out to one snapshot. Freed (in allocation order) once closed
// (the stager pushed every record that reads it) and every pushed record's D2H copy completed.
struct Region {
  uint64_t start = 0;   // monotonic ring position (includes wrap padding before the data)
  uint64_t end = 0;
  uint32_t pending = 0; // pushed records whose copy has not completed
  bool open = true;
};

// The open regions of a device ring, in allocation order, addressed by a sequence number that stays
// valid while the region lives. A power-of-two circular buffer that only grows: no allocation per
// region once warm (a std::deque allocates and frees a node every few dozen regions).
class RegionRing {
 public:
  RegionRing() : buf_(64) {}
  bool empty() const { return first_ == next_; }
  size_t size() const { return static_cast<size_t>(next_ - first_); }
  Region& at(uint64_t seq) { return buf_[seq & (buf_.size() - 1)]; }
  Region& front() { return at(first_); }
  void pop_front() { ++first_; }
  uint64_t push_back(const Region& r) {
    if (size() == buf_.size()) {  // full: double, every live region keeps its sequence number
      std::vector<Region> bigger(buf_.size() * 2);
      for (uint64_t s = first_; s != next_; ++s) bigger[s & (bigger.size() - 1)] = at(s);
      buf_.swap(bigger);
    }
    at(next_) = r;
    return next_++;
  }

 private:
  std::vector<Region> buf_;
  uint64_t first_ = 0, next_ = 0;
};

struct DeviceCtx;

struct Item {
  DeviceCtx* dev = nullptr;
  uint64_t region = 0;  // sequence number in dev->regions
  cudaEvent_t snap = nullptr;  // only the first record of a region carries the snapshot event
  const uint8_t* dsrc = nullptr;
  Reservation res;
  uint64_t len = 0;
};

struct InFlight {
  cudaEvent_t done = nullptr;
  std::vector<Item> items;
  uint64_t bytes = 0;
};

struct DeviceCtx {
  int index = 0;
  int sm_count = 0;
  uint8_t* ring = nullptr;
  uint64_t cap = 0;
  cudaStream_t side = nullptr;
  // A user's graph captured lean snapshots into `ring` (a capture begun mid-pass, seal_locked):
  // its replays write there for as long as it lives, so close() never frees it.
  std::atomic<bool> ring_in_foreign_graph{false};

  std::mutex mu;  // guards everything below
  uint64_t head = 0;  // monotonic allocation position
  uint64_t tail = 0;  // monotonic free position
  RegionRing regions;
  std::vector<cudaEvent_t> free_events;
  std::vector<cudaEvent_t> all_events;

  // drain thread only
  std::deque<InFlight> inflight;

  // Records of this device handed to the drain / finished (published or cancelled). They finish
  // in the order they were pushed, so finished >= n means the first n no longer read their source.
  std::atomic<uint64_t> pushed{0};
  std::atomic<uint64_t> finished{0};
};

}  // namespace

// Bumped before every CUDA graph capture torch begins (CudaStager::note_capture_begin).
std::atomic<uint64_t> g_capture_epoch{0};

// Held around torch's cudaStreamBeginCapture (CudaStager::capture_gate) and by every seal made from
// another thread than the lane's, across its capture check and its event record (see seal_all,
// seal_stale). Lock order: gate, lanes_mu, a lane's mu.
std::mutex g_capture_gate;
thread_local bool t_holds_capture_gate = false;

// See cuda_staging.h. Guarded by `mu`, which is never held while waiting for ring space.
class CudaLane {
 public:
  std::mutex mu;
  // The checks made for this pass and stream: the thread's current device is `device` and
  // `stream` was not capturing. Made again when the pass, the device or the stream changes.
  bool checked = false;
  int64_t pass_id = 0;
  int device = -1;
  uintptr_t stream = 0;
  uint64_t capture_epoch = 0;  // g_capture_epoch when checked: a capture begun since is checked for
  // Every snapshot of the open batch was enqueued before a capture that may now be running on its
  // stream (a capture-epoch change, or FASTDUMP_CUDA_CHECK_EACH_TENSOR): the batch stays open until
  // the capture has ended (its event cannot be recorded into the user's graph), then it is sealed.
  bool batch_precedes_capture = false;
  // The open batch: snapshots enqueued on `stream` of `dev`, no event recorded after them yet.
  DeviceCtx* dev = nullptr;
  std::vector<Item> batch;
  double opened_at = 0;                 // its first snapshot (the drain seals it after the hold time)
  std::atomic<bool> has_batch{false};   // read by the drain without `mu`
  uint64_t tensors = 0;                 // folded into the stager's counts when the batch is sealed
};

struct CudaStager::Impl {
  Producer* prod;
  uint64_t dcap;
  pid_t owner_pid = ::getpid();  // a forked child inherits this object but not the drain thread
  int device_count = 0;
  std::atomic<bool> use_batch{true};

  std::mutex init_mu;
  std::atomic<DeviceCtx*> devs[kMaxDevices];
  std::string dev_error[kMaxDevices];  // under init_mu

  std::atomic<bool> closed{false};
  std::atomic<bool> torn_down{false};  // close() finished: no snapshot reads any source any more
  std::atomic<bool> broken{false};
  std::atomic<int> active{0};

  // Lean path (stage_lean): every lane, the open batches, N and the hold time.
  std::mutex lanes_mu;
  std::vector<std::unique_ptr<CudaLane>> lanes;
  std::atomic<int> open_batches{0};
  std::atomic<uint32_t> events_every{64};
  double hold_s = 0.002;  // an open batch older than this is sealed by the drain (FASTDUMP_CUDA_HOLD_MS)
  // FASTDUMP_CUDA_CHECK_EACH_TENSOR=1: ask cudaStreamIsCapturing for every lean tensor (for code
  // that begins a capture mid-pass on the stream it was already running on; docs/CUDA.md).
  bool check_each_tensor = false;
  double last_stale_check = 0;  // drain thread only

  // Work queue to the drain thread.
  std::mutex q_mu;
  std::condition_variable q_cv;
  std::vector<Item> queue;
  bool stop = false;
  bool drain_running = false;
  std::thread drain;

  // Progress (device space freed, records published): waiters in stage() and flush().
  std::mutex prog_mu;
  std::condition_variable prog_cv;
  std::atomic<int> prog_waiters{0};
  std::atomic<uint64_t> submitted{0};
  std::atomic<uint64_t> completed{0};

  // Host registration.
  std::mutex reg_mu;
  std::vector<std::pair<void*, size_t>> registered;  // pieces we registered (and must unregister)
  uint8_t* reg_base = nullptr;
  uint64_t reg_len = 0;
  uint64_t reg_piece = kRegisterPieceMB << 20;
  std::atomic<bool> host_pinned{false};

  // Statistics.
  std::atomic<uint64_t> n_tensors{0}, n_records{0}, n_snapshots{0}, n_kernels{0}, n_2d{0}, snapshot_bytes{0};
  std::atomic<uint64_t> n_copies{0}, n_batches{0}, d2h_bytes{0}, n_published{0}, n_cancelled{0}, n_dropped{0};
  std::atomic<uint64_t> n_capturing{0}, dev_waits{0}, host_waits{0};
  std::atomic<uint64_t> n_lean{0}, n_checks{0}, n_snap_events{0}, n_wakeups{0}, n_timer_seals{0};
  std::mutex st_mu;
  double dev_wait_s = 0;
  double drain_s = 0;
  double register_s = 0;
  std::string last_error;
  std::string batch_fallback;  // stats().batch_api_fallback
  // drain-thread only
  uint64_t inflight_batches = 0;
  double busy_since = 0;
  std::atomic<long> drain_slack_ns{-1};  // the drain thread's timer slack, as it set it

  Impl(Producer* p, uint64_t ring_bytes) : prod(p) {
    for (auto& d : devs) d.store(nullptr);
    dcap = align_to(std::max<uint64_t>(ring_bytes, 1ull << 20), kDevAlign);
    const char* env = std::getenv("FASTDUMP_CUDA_BATCH");
    if (env && env[0] == '0') use_batch.store(false);
    const char* piece = std::getenv("FASTDUMP_CUDA_REGISTER_PIECE_MB");
    if (piece && std::atoll(piece) > 0) reg_piece = static_cast<uint64_t>(std::atoll(piece)) << 20;
    const char* hold = std::getenv("FASTDUMP_CUDA_HOLD_MS");
    if (hold && std::atof(hold) > 0) hold_s = std::atof(hold) / 1000.0;
    const char* each = std::getenv("FASTDUMP_CUDA_CHECK_EACH_TENSOR");
    check_each_tensor = each && each[0] == '1';
    const char* every = std::getenv("FASTDUMP_CUDA_EVENTS_EVERY");
    if (every && std::atoll(every) > 0) events_every.store(static_cast<uint32_t>(std::atoll(every)));
#if CUDART_VERSION < 12080
    use_batch.store(false);
#endif
    cudaError_t e = cudaGetDeviceCount(&device_count);
    if (e != cudaSuccess || device_count == 0) {
      (void)cudaGetLastError();
      CudaInfo info = cuda_query_info();
      throw std::runtime_error("fastdump CUDA staging unavailable: " +
                               (info.reason.empty() ? std::string("no CUDA device") : info.reason));
    }
    if (device_count > kMaxDevices) device_count = kMaxDevices;
    queue.reserve(kQueueReserve);  // the lean path's batches append here: no growth once warm
    watch_fork();
    drain_running = true;
    drain = std::thread([this] { drain_main(); });
  }

  ~Impl() {
    try {
      close(10.0);
    } catch (...) {
    }
    // A std::thread destroyed while joinable calls std::terminate ("terminate called without an
    // active exception"): whatever close() did, the drain thread is stopped and joined here.
    if (drain.joinable()) {
      {
        std::lock_guard<std::mutex> g(q_mu);
        stop = true;
      }
      q_cv.notify_all();
      drain.join();
    }
  }

  void set_error(const std::string& msg) {
    std::lock_guard<std::mutex> g(st_mu);
    last_error = msg;
  }

  void set_batch_fallback(const std::string& why) {
    std::lock_guard<std::mutex> g(st_mu);
    batch_fallback = why;
  }

  void notify_progress() {
    if (prog_waiters.load(std::memory_order_seq_cst) > 0) {
      std::lock_guard<std::mutex> g(prog_mu);
      prog_cv.notify_all();
    }
  }

  // -- devices ---------------------------------------------------------------------------------
  DeviceCtx* device(int index) {
    DeviceCtx* d = devs[index].load(std::memory_order_acquire);
    if (d) return d;
    std::lock_guard<std::mutex> g(init_mu);
    d = devs[index].load(std::memory_order_acquire);
    if (d) return d;
    if (!dev_error[index].empty()) throw std::runtime_error(dev_error[index]);
    std::unique_ptr<DeviceCtx> ctx(new DeviceCtx());
    ctx->index = index;
    ctx->cap = dcap;
    RelaxedCapture relaxed;
    try {
      // The caller's DeviceGuard made `index` current.
      FD_CUDA(cudaDeviceGetAttribute(&ctx->sm_count, cudaDevAttrMultiProcessorCount, index));
      cudaError_t e = cudaMalloc(reinterpret_cast<void**>(&ctx->ring), dcap);
      if (e != cudaSuccess) {
        (void)cudaGetLastError();
        throw std::runtime_error("fastdump CUDA: cannot allocate the " + std::to_string(dcap >> 20) +
                                 " MiB device staging ring on GPU " + std::to_string(index) + ": " +
                                 cuda_error_text(e, "cudaMalloc") + " (lower device_ring_mb)");
      }
      // Lowest priority (the default): the side stream only runs copies on the copy engines, where
      // stream priority has no effect, and it must never win SM time over the model's kernels.
      int least = 0, greatest = 0;
      FD_CUDA(cudaDeviceGetStreamPriorityRange(&least, &greatest));
      // Non-blocking: no implicit synchronization with the legacy default stream, which the
      // producer may be using.
      FD_CUDA(cudaStreamCreateWithPriority(&ctx->side, cudaStreamNonBlocking, least));
      for (int i = 0; i < kPrecreatedEvents; ++i) {
        cudaEvent_t ev;
        FD_CUDA(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
        ctx->all_events.push_back(ev);
        ctx->free_events.push_back(ev);
      }
    } catch (const std::exception& ex) {
      for (cudaEvent_t ev : ctx->all_events) (void)cudaEventDestroy(ev);
      if (ctx->side) (void)cudaStreamDestroy(ctx->side);
      if (ctx->ring) (void)cudaFree(ctx->ring);
      (void)cudaGetLastError();
      dev_error[index] = ex.what();
      throw;
    }
    d = ctx.release();
    devs[index].store(d, std::memory_order_release);
    return d;
  }

  // Current device must be dev->index (both callers make sure).
  cudaEvent_t take_event(DeviceCtx* dev) {
    {
      std::lock_guard<std::mutex> g(dev->mu);
      if (!dev->free_events.empty()) {
        cudaEvent_t ev = dev->free_events.back();
        dev->free_events.pop_back();
        return ev;
      }
    }
    cudaEvent_t ev;
    {
      RelaxedCapture relaxed;
      FD_CUDA(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
    }
    std::lock_guard<std::mutex> g(dev->mu);
    dev->all_events.push_back(ev);
    return ev;
  }

  void give_event(DeviceCtx* dev, cudaEvent_t ev) {
    std::lock_guard<std::mutex> g(dev->mu);
    dev->free_events.push_back(ev);
  }

  // Under dev->mu: free closed, fully copied regions at the front, in allocation order.
  static bool reclaim_locked(DeviceCtx* dev) {
    bool freed = false;
    while (!dev->regions.empty() && !dev->regions.front().open && dev->regions.front().pending == 0) {
      dev->tail = dev->regions.front().end;
      dev->regions.pop_front();
      freed = true;
    }
    return freed;
  }

  // `records`: when nonzero, the region is handed out already closed with that many pending records
  // (the lean path's single-record tensors: no close_region call, no second lock).
  bool try_alloc(DeviceCtx* dev, uint64_t bytes, uint64_t* reg, uint8_t** ptr, uint32_t records = 0) {
    const uint64_t len = align_to(bytes, kDevAlign);
    std::lock_guard<std::mutex> g(dev->mu);
    if (dev->head == dev->tail) {  // empty: restart at offset 0, no wrap padding needed
      dev->head = dev->tail = align_to(dev->head, dev->cap);
    }
    const uint64_t off = dev->head % dev->cap;
    const uint64_t pad = off + len > dev->cap ? dev->cap - off : 0;
    if (dev->cap - (dev->head - dev->tail) < pad + len) return false;
    Region r;
    r.start = dev->head;
    r.end = dev->head + pad + len;
    if (records) {
      r.open = false;
      r.pending = records;
    }
    *reg = dev->regions.push_back(r);
    *ptr = dev->ring + (pad ? 0 : off);
    dev->head = r.end;
    return true;
  }

  void close_region(DeviceCtx* dev, uint64_t reg) {
    bool freed;
    {
      std::lock_guard<std::mutex> g(dev->mu);
      dev->regions.at(reg).open = false;
      freed = reclaim_locked(dev);
    }
    if (freed) notify_progress();
  }

  // Blocking allocation: waits for the drain thread to free space. False when staging must stop.
  bool wait_alloc(DeviceCtx* dev, uint64_t bytes, uint64_t* reg, uint8_t** ptr) {
    dev_waits.fetch_add(1, std::memory_order_relaxed);
    const double t0 = now_s();
    double last_check = t0;
    bool ok = false;
    prog_waiters.fetch_add(1);
    {
      std::unique_lock<std::mutex> lk(prog_mu);
      for (;;) {
        if (try_alloc(dev, bytes, reg, ptr)) {
          ok = true;
          break;
        }
        if (closed.load() || broken.load() || prod->disabled()) break;
        const double t = now_s();
        if (t - last_check > 0.05) {
          last_check = t;
          if (!prod->writer_alive()) break;
        }
        prog_cv.wait_for(lk, std::chrono::milliseconds(2));
      }
    }
    prog_waiters.fetch_sub(1);
    std::lock_guard<std::mutex> g(st_mu);
    dev_wait_s += now_s() - t0;
    return ok;
  }

  // Turn a reserved record into padding (the writer skips it) and publish it.
  void cancel(const Reservation& r) {
    r.rec->kind = kPad;
    prod->publish(r);
    n_cancelled.fetch_add(1, std::memory_order_relaxed);
  }

  void push(Item&& it) {
    {
      std::lock_guard<std::mutex> g(it.dev->mu);
      it.dev->regions.at(it.region).pending++;
    }
    submitted.fetch_add(1, std::memory_order_relaxed);
    it.dev->pushed.fetch_add(1, std::memory_order_release);
    {
      std::lock_guard<std::mutex> g(q_mu);
      queue.push_back(std::move(it));
    }
    q_cv.notify_one();
  }

  // Enqueue the snapshot of elements [e0, e1) into dst, on the producer stream.
  void snapshot(DeviceCtx* dev, const ByteLayout& l, const CudaSource& src, uint64_t e0, uint64_t e1, uint8_t* dst,
                cudaStream_t stream) {
    const uint64_t b0 = e0 * src.elem_size, b1 = e1 * src.elem_size;
    const uint8_t* base = reinterpret_cast<const uint8_t*>(src.ptr);
    if (l.contiguous()) {
      FD_CUDA(cudaMemcpyAsync(dst, base + b0, b1 - b0, cudaMemcpyDeviceToDevice, stream));
    } else if (l.nd == 2 && l.stride[1] == 1 && l.stride[0] >= l.shape[1] &&
               static_cast<uint64_t>(l.shape[1]) >= k2dMinRowBytes && b0 % l.shape[1] == 0 && b1 % l.shape[1] == 0) {
      // Whole rows of a row-strided matrix: one 2-D copy.
      const uint64_t row = static_cast<uint64_t>(l.shape[1]);
      cudaError_t e = cudaMemcpy2DAsync(dst, row, base + (b0 / row) * static_cast<uint64_t>(l.stride[0]),
                                        static_cast<size_t>(l.stride[0]), row, (b1 - b0) / row,
                                        cudaMemcpyDeviceToDevice, stream);
      if (e == cudaSuccess) {
        n_2d.fetch_add(1, std::memory_order_relaxed);
      } else {
        (void)cudaGetLastError();  // e.g. a pitch over the device limit: use the kernel
        FD_CUDA(gather(dst, base, l, b0, b1, dev->sm_count, stream));
        n_kernels.fetch_add(1, std::memory_order_relaxed);
      }
    } else {
      FD_CUDA(gather(dst, base, l, b0, b1, dev->sm_count, stream));
      n_kernels.fetch_add(1, std::memory_order_relaxed);
    }
    n_snapshots.fetch_add(1, std::memory_order_relaxed);
    snapshot_bytes.fetch_add(b1 - b0, std::memory_order_relaxed);
  }

  int drop() {
    prod->count_dropped(1);
    n_dropped.fetch_add(1, std::memory_order_relaxed);
    return kDropped;
  }

  struct ActiveGuard {
    std::atomic<int>& a;
    explicit ActiveGuard(std::atomic<int>& x) : a(x) { a.fetch_add(1); }
    ~ActiveGuard() { a.fetch_sub(1); }
  };

  int stage(uint32_t channel, uint32_t name_id, int64_t pass_id, uint16_t dtype, const CudaSource& src, bool block,
            BlockHook* hook, double timeout_s) {
    ActiveGuard active_guard(active);
    if (closed.load() || broken.load() || prod->disabled() || forked_child()) return kDisabled;
    if (src.shape.size() != src.strides.size()) throw std::invalid_argument("shape and strides differ in length");
    if (src.shape.size() > kMaxDims) return kTooLarge;
    if (src.elem_size == 0) throw std::invalid_argument("elem_size must be positive");
    if (src.device < 0 || src.device >= device_count)
      throw std::invalid_argument("no CUDA device " + std::to_string(src.device));
    for (int64_t d : src.shape)
      if (d < 0) throw std::invalid_argument("negative dimension");
    uint64_t numel = 0, total = 0;
    if (!count_bytes(src, &numel, &total)) {
      // A broadcast (stride-0) view can say more bytes than 64 bits hold (torch allows 2^61 float64
      // elements). Wrapped, it was staged as a few bytes under that shape (a record the writer
      // refuses), or planned record by record until the plan exhausted memory. Nothing can store it.
      return kTooLarge;
    }
    bool hooked = false;
    auto before_block = [&] {
      if (!hooked) {
        seal_all(/*wait_for_lock=*/false);  // the space we wait for may be held by open lean batches
        if (hook) hook->before_block();
      }
      hooked = true;
    };
    // A blocking wait for host-ring space that ran out (block_timeout_s): dropped whole, counted.
    auto no_space = [&]() -> int {
      if (prod->disabled() || !prod->writer_alive()) return kDisabled;
      drop();
      return kTimedOut;
    };

    if (numel == 0) {  // nothing to copy: the record is complete at once
      Reservation r;
      if (!prod->reserve(kTensor, channel, name_id, pass_id, dtype, src.shape, 0, ChunkInfo{0, 0}, false, &r)) {
        if (prod->disabled() || !prod->writer_alive()) return kDisabled;
        if (!block) return drop();
        before_block();
        if (!prod->reserve(kTensor, channel, name_id, pass_id, dtype, src.shape, 0, ChunkInfo{0, 0}, true, &r,
                           timeout_s))
          return no_space();
      }
      prod->publish(r);
      n_records.fetch_add(1, std::memory_order_relaxed);
      n_published.fetch_add(1, std::memory_order_relaxed);
      n_tensors.fetch_add(1, std::memory_order_relaxed);
      return kStaged;
    }

    DeviceGuard guard(src.device);
    cudaStream_t stream = reinterpret_cast<cudaStream_t>(src.stream);
    cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
    cudaError_t ce = cudaStreamIsCapturing(stream, &cs);
    if (ce == cudaErrorStreamCaptureImplicit || (ce == cudaSuccess && cs != cudaStreamCaptureStatusNone)) {
      if (ce != cudaSuccess) (void)cudaGetLastError();
      n_capturing.fetch_add(1, std::memory_order_relaxed);
      return kCapturing;
    }
    if (ce != cudaSuccess) throw_cuda(ce, "cudaStreamIsCapturing(producer stream)");
    cudaStream_t producer = reinterpret_cast<cudaStream_t>(src.producer_stream);
    const bool other_producer = src.producer_stream != 0 && src.producer_stream != src.stream;
    if (other_producer) {
      // Waiting on an event recorded in a capture would join the snapshot stream to that capture.
      ce = cudaStreamIsCapturing(producer, &cs);
      if (ce == cudaErrorStreamCaptureImplicit || (ce == cudaSuccess && cs != cudaStreamCaptureStatusNone)) {
        if (ce != cudaSuccess) (void)cudaGetLastError();
        n_capturing.fetch_add(1, std::memory_order_relaxed);
        return kCapturing;
      }
      if (ce != cudaSuccess) throw_cuda(ce, "cudaStreamIsCapturing(producing stream)");
    }
    DeviceCtx* dev = device(src.device);
    if (other_producer) {
      // The tensor was produced on another stream: the snapshot stream waits for that work first
      // (a wait on work already issued; nothing later on the producing stream is affected).
      cudaEvent_t ev = take_event(dev);
      cudaError_t e = cudaEventRecord(ev, producer);
      if (e == cudaSuccess) e = cudaStreamWaitEvent(stream, ev, 0);
      give_event(dev, ev);  // the wait holds the state it needs
      if (e != cudaSuccess) {
        (void)cudaGetLastError();
        throw_cuda(e, "cudaStreamWaitEvent(snapshot stream on the producing stream)");
      }
    }
    const ByteLayout layout = byte_layout(src);

    // Record and span sizes, in elements. A record is at most a host chunk; a span (one
    // snapshot into one device region) is at most half the device ring, a whole number of records.
    const uint64_t dmax = (dev->cap / 2) / kDevAlign * kDevAlign;
    const uint64_t rec_cap = std::min<uint64_t>(prod->chunk_bytes(), dmax);
    const uint64_t rec_elems = rec_cap / src.elem_size;
    if (rec_elems == 0) return kTooLarge;
    uint64_t span_elems = rec_elems * std::max<uint64_t>(1, dmax / (rec_elems * src.elem_size));

    // A tensor of several records has all its host records reserved before anything is
    // snapshotted, when they fit in the ring together: it is then staged whole or not at all, and
    // later waits (device-ring space) depend on the GPU drain only, never on the writer.
    std::vector<Reservation> pre;
    size_t next_pre = 0;
    auto cancel_rest = [&] {
      for (; next_pre < pre.size(); ++next_pre) cancel(pre[next_pre]);
    };
    // Each host-ring wait is bounded on its own (as Producer::stage_host's): block_timeout_s is how
    // long the writer may free no space, not how long a tensor larger than the ring may take.
    if (numel > rec_elems) {
      // Larger than the whole host ring: it cannot be reserved at once, and its plan (one entry per
      // record) could be too large to build (a broadcast view of 2^60 elements).
      const bool fits = total <= prod->region().capacity();
      std::vector<uint64_t> plan;
      if (fits)
        for (uint64_t r0 = 0; r0 < numel; r0 += rec_elems)
          plan.push_back((std::min(numel, r0 + rec_elems) - r0) * src.elem_size);
      int got = fits ? prod->reserve_all(channel, name_id, pass_id, dtype, src.shape, plan, total, false, 0, &pre) : -1;
      if (got == 0) {
        if (prod->disabled() || !prod->writer_alive()) return kDisabled;
        if (!block) return drop();
        before_block();
        host_waits.fetch_add(1, std::memory_order_relaxed);
        got = prod->reserve_all(channel, name_id, pass_id, dtype, src.shape, plan, total, true, timeout_s, &pre);
        if (got == 0) return no_space();
      }
      if (got < 0) {
        pre.clear();  // too large for the ring at once: records are reserved one by one below
        if (!block) {  // `drop` never waits for the writer mid-tensor
          if (!fits || !prod->fits_whole(src.shape.size(), plan)) return kRingTooSmall;
          return drop();  // only the wrap at the ring's end was in the way
        }
        // One record per segment here. Each record's reservation may wait for the writer (or for the
        // ring's lock, held by a thread that waits for the writer), and no thread may hold device-ring
        // space while it does: device space is freed in allocation order, and a thread that holds host
        // records the writer waits for (its reserve_all'd records, or the record it got after its
        // fresh region went back) may be waiting for that space: a cycle (device region -> host ring
        // -> writer -> that thread's record -> device space). With several records per segment, the
        // segment's region (already holding its snapshot) stayed open across the waits of its second
        // and later records: the rare hang of tests/cuda_mock/stress.cpp, made deterministic in
        // tests/cuda_mock/ring_cycle.cpp. With one record per segment every wait is the segment's
        // first, whose empty region is given back before waiting (below). It costs a snapshot and an
        // event per record, only for tensors larger than the host ring, staged at the writer's pace.
        span_elems = rec_elems;
      }
    }

    bool started = false;  // part of this tensor is in the rings: finish it even under `drop`
    for (uint64_t s0 = 0; s0 < numel; s0 += span_elems) {
      const uint64_t s1 = std::min(numel, s0 + span_elems);
      uint64_t reg = 0;
      uint8_t* dptr = nullptr;
      if (!try_alloc(dev, (s1 - s0) * src.elem_size, &reg, &dptr)) {
        if (!block && !started && pre.empty()) return drop();
        before_block();
        if (!wait_alloc(dev, (s1 - s0) * src.elem_size, &reg, &dptr)) {
          cancel_rest();
          return kDisabled;
        }
      }
      for (uint64_t r0 = s0; r0 < s1; r0 += rec_elems) {
        const uint64_t r1 = std::min(s1, r0 + rec_elems);
        const uint64_t len = (r1 - r0) * src.elem_size;
        const ChunkInfo chunk{r0 * src.elem_size, total};
        Reservation res;
        if (next_pre < pre.size()) {
          res = pre[next_pre++];
        } else if (!prod->try_reserve(kTensor, channel, name_id, pass_id, dtype, src.shape, len, chunk, &res)) {
          // try_reserve never waits, not even for the ring's allocation lock: the thread holding it
          // may be waiting for the writer (a blocking reservation), and this thread holds device-ring
          // space now. Under both policies (`drop` used to take the lock with Producer::reserve while
          // holding the region: a hang of tests/cuda_mock/stress.cpp, see ring_cycle.cpp).
          if (prod->disabled() || !prod->writer_alive()) {
            close_region(dev, reg);
            return kDisabled;
          }
          // Hold no device-ring space while waiting for the host ring or its lock: device space is
          // freed in allocation order, and a thread waiting for it may hold the host records the
          // writer (and so the thread holding the ring lock) waits for. An empty region goes back.
          // A record reserved here is always its segment's first (`fresh`): records come from `pre`
          // or the segment is one record (see span_elems above); a later record's wait would hold
          // the segment's region, which already holds its snapshot and cannot go back.
          const bool fresh = r0 == s0;
          if (fresh) close_region(dev, reg);
          // Under `drop` (nothing of the tensor staged yet) only the lock is waited for, never space:
          // no room means the tensor is dropped. Under `block`, a ring lock held by another thread
          // (which may be waiting for the writer) is waited for like space: after before_block(),
          // which releases the GIL a thread writer needs.
          const bool may_wait = block || started;
          if (may_wait) {
            before_block();
            host_waits.fetch_add(1, std::memory_order_relaxed);
          }
          if (!prod->reserve(kTensor, channel, name_id, pass_id, dtype, src.shape, len, chunk, may_wait, &res,
                             may_wait ? timeout_s : 0.0)) {
            if (!fresh) close_region(dev, reg);
            if (prod->disabled() || !prod->writer_alive()) return kDisabled;
            if (!may_wait) return drop();
            if (!started) return no_space();
            // Records already queued can never be completed: the writer records the tensor as
            // incomplete when its pass ends.
            return kTorn;
          }
          if (fresh && !try_alloc(dev, (s1 - s0) * src.elem_size, &reg, &dptr)) {
            // Holding a host record the writer will wait for, this thread may wait for the device
            // ring (under `drop` too, as with `pre`): that space depends on the drain alone.
            before_block();
            if (!wait_alloc(dev, (s1 - s0) * src.elem_size, &reg, &dptr)) {
              cancel(res);
              cancel_rest();
              return kDisabled;
            }
          }
        }
        n_records.fetch_add(1, std::memory_order_relaxed);
        Item it;
        it.dev = dev;
        it.region = reg;
        it.dsrc = dptr + (r0 - s0) * src.elem_size;
        it.res = res;
        it.len = len;
        if (r0 == s0) {
          // The snapshot of the whole span, then its event, both on the producer stream.
          try {
            snapshot(dev, layout, src, s0, s1, dptr, stream);
          } catch (const std::exception& ex) {
            cancel(res);
            cancel_rest();
            close_region(dev, reg);  // nothing was enqueued into it
            if (!started) throw;
            broken.store(true);
            set_error(ex.what());
            return kDisabled;
          }
          cudaEvent_t ev = nullptr;
          cudaError_t e = cudaSuccess;
          try {
            ev = take_event(dev);
            e = cudaEventRecord(ev, stream);
          } catch (const std::exception& ex) {
            e = cudaErrorUnknown;
            set_error(ex.what());
          }
          if (e != cudaSuccess) {
            // The snapshot is queued but cannot be tracked: the region can never be proven free.
            // Leave it allocated, give up on CUDA staging (sticky errors end up here).
            (void)cudaGetLastError();
            cancel(res);
            cancel_rest();
            broken.store(true);
            set_error(cuda_error_text(e, "cudaEventRecord(producer stream)"));
            return kDisabled;
          }
          it.snap = ev;
        }
        push(std::move(it));
        started = true;
      }
      close_region(dev, reg);
    }
    n_tensors.fetch_add(1, std::memory_order_relaxed);
    return kStaged;
  }


  // Elements and bytes of `src`; false for a negative dimension or a size of more than 2^63 bytes
  // (a dimension of 0 makes any other size fine: nothing to copy).
  static bool count_bytes(const CudaSource& src, uint64_t* numel, uint64_t* bytes) {
    uint64_t n = 1;
    bool zero = false, over = false;
    for (int64_t d : src.shape) {
      if (d < 0) return false;
      if (d == 0) zero = true;
      else if (__builtin_mul_overflow(n, static_cast<uint64_t>(d), &n)) over = true;
    }
    if (zero) {
      *numel = *bytes = 0;
      return true;
    }
    uint64_t b = 0;
    if (over || __builtin_mul_overflow(n, src.elem_size, &b) || b > (1ull << 63)) return false;
    *numel = n;
    *bytes = b;
    return true;
  }

  // -- lean path (stage_lean) ---------------------------------------------------------------------
  static constexpr int kNotLean = -100;  // stage() handles it

  int stage_lean(CudaLane* lane, uint32_t channel, uint32_t name_id, int64_t pass_id, uint16_t dtype,
                 const CudaSource& src, bool block, BlockHook* hook, double timeout_s) {
    {
      std::lock_guard<std::mutex> g(lane->mu);
      // Checked under the lane's lock: close() seals every lane after setting `closed`.
      if (closed.load() || broken.load() || prod->disabled() || forked_child()) return kDisabled;
      const int st = try_lean(lane, channel, name_id, pass_id, dtype, src);
      if (st != kNotLean) return st;
      seal_locked(lane, false);  // what stage() does next may wait for the drain
    }
    return stage(channel, name_id, pass_id, dtype, src, block, hook, timeout_s);
  }

  // The lean stage of one tensor, or kNotLean (nothing done) when stage() must handle it.
  int try_lean(CudaLane* lane, uint32_t channel, uint32_t name_id, int64_t pass_id, uint16_t dtype,
               const CudaSource& src) {
    if (src.shape.size() != src.strides.size() || src.shape.size() > kMaxDims || src.elem_size == 0 ||
        src.device < 0 || src.device >= device_count)
      return kNotLean;  // stage() says what is wrong
    if (src.producer_stream != 0 && src.producer_stream != src.stream) return kNotLean;
    uint64_t numel = 0, total = 0;
    if (!count_bytes(src, &numel, &total) || numel == 0) return kNotLean;  // stage() says what is wrong
    cudaStream_t stream = reinterpret_cast<cudaStream_t>(src.stream);
    // The calling thread's current device, at every tensor (a thread-local read in the runtime,
    // unlike the capture check): the cached check below is the lane's, shared by every thread that
    // stages through it, and a thread may switch devices mid-pass (`with torch.cuda.device(1)`
    // around a GPU-0 tensor's hook). The snapshot and its event must be issued with the tensor's
    // device current: a kernel or event on another device's stream fails, and the legacy stream
    // (0) would be the other device's, unordered with the kernels that produced the tensor.
    int cur = -1;
    if (cudaGetDevice(&cur) != cudaSuccess) {
      (void)cudaGetLastError();
      return kNotLean;
    }
    if (cur != src.device) return kNotLean;  // stage() switches devices for it
    const uint64_t epoch = g_capture_epoch.load(std::memory_order_acquire);
    if (lane->checked && lane->capture_epoch != epoch && !lane->batch.empty())
      lane->batch_precedes_capture = true;  // all its snapshots were checked before that capture began
    if (!lane->checked || lane->pass_id != pass_id || lane->device != src.device || lane->stream != src.stream ||
        lane->capture_epoch != epoch) {
      // A new pass, device or stream: the open batch belongs to the old one; check again. A CUDA
      // graph capture always runs on a stream that is not the legacy one and begins between
      // passes or with a stream switch (torch.cuda.graph enters its capture stream), so it is seen.
      // (The thread's current device may have changed since the batch was opened.)
      seal_locked(lane, false);
      // A batch left open (its stream captures; FASTDUMP_CUDA_CHECK_EACH_TENSOR) stays on its stream.
      if (!lane->batch.empty() && (lane->device != src.device || lane->stream != src.stream)) return kNotLean;
      lane->checked = false;
      n_checks.fetch_add(1, std::memory_order_relaxed);
      cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
      const cudaError_t ce = cudaStreamIsCapturing(stream, &cs);
      if (ce == cudaErrorStreamCaptureImplicit || (ce == cudaSuccess && cs != cudaStreamCaptureStatusNone)) {
        if (ce != cudaSuccess) (void)cudaGetLastError();
        // Not cached (checked again at the next tensor) and not counted: the caller's general path
        // stages it again through stage(), which counts it (capturing_skipped) once.
        return kCapturing;
      }
      if (ce != cudaSuccess) {
        (void)cudaGetLastError();
        return kNotLean;  // stage() raises it
      }
      lane->checked = true;
      lane->pass_id = pass_id;
      lane->device = src.device;
      lane->stream = src.stream;
      lane->capture_epoch = epoch;
    } else if (check_each_tensor) {
      cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
      const cudaError_t ce = cudaStreamIsCapturing(stream, &cs);
      if (ce != cudaSuccess || cs != cudaStreamCaptureStatusNone) {
        if (ce != cudaSuccess) (void)cudaGetLastError();
        seal_locked(lane, true);  // what came before the capture began is not in it
        lane->checked = false;
        if (ce == cudaErrorStreamCaptureImplicit || ce == cudaSuccess) return kCapturing;  // as above
        return kNotLean;
      }
    }
    DeviceCtx* dev = devs[src.device].load(std::memory_order_acquire);
    if (!dev) return kNotLean;  // stage() allocates the device ring (or raises why it cannot)
    const uint64_t dmax = (dev->cap / 2) / kDevAlign * kDevAlign;
    if (total > std::min<uint64_t>(prod->chunk_bytes(), dmax)) return kNotLean;  // several records
    uint64_t reg = 0;
    uint8_t* dptr = nullptr;
    if (!try_alloc(dev, total, &reg, &dptr, /*records=*/1)) return kNotLean;  // stage() waits or drops
    Reservation res;
    // Never waits, not even for the ring's allocation lock: a thread that holds it may be waiting for
    // the writer, and the writer for a record of this lane's open batch (sealed under our lock).
    if (!prod->try_reserve(kTensor, channel, name_id, pass_id, dtype, src.shape, total, ChunkInfo{0, total}, &res)) {
      release_region(dev, reg);
      return kNotLean;  // stage() seals this lane's batch, then waits as its policy says
    }
    try {
      snapshot(dev, byte_layout(src), src, 0, numel, dptr, stream);
    } catch (...) {  // nothing of this tensor was enqueued
      cancel(res);
      release_region(dev, reg);
      throw;
    }
    n_records.fetch_add(1, std::memory_order_relaxed);
    Item it;
    it.dev = dev;
    it.region = reg;
    it.dsrc = dptr;
    it.res = res;
    it.len = total;
    if (lane->batch.empty()) {
      lane->dev = dev;
      lane->opened_at = now_s();
      lane->has_batch.store(true, std::memory_order_relaxed);
      open_batches.fetch_add(1, std::memory_order_relaxed);
    }
    lane->batch.push_back(it);  // capacity kept across batches: no allocation once warm
    lane->tensors++;
    if (lane->batch.size() >= events_every.load(std::memory_order_relaxed)) seal_locked(lane, true);
    return kStaged;
  }

  // A lean region whose record never got a snapshot: give it back.
  void release_region(DeviceCtx* dev, uint64_t reg) {
    bool freed;
    {
      std::lock_guard<std::mutex> g(dev->mu);
      dev->regions.at(reg).pending--;
      freed = reclaim_locked(dev);
    }
    if (freed) notify_progress();
  }

  // lane->mu held. Record one event after the open batch's snapshots on its stream and hand the
  // whole batch to the drain with one wake-up. `own_thread`: the caller just checked that its current
  // device is the batch's (the N-th lean snapshot); any other caller switches to it for the call.
  // The batch's stream must still exist: a stream must outlive the pass that staged on it.
  void seal_locked(CudaLane* lane, bool own_thread) {
    if (lane->batch.empty()) return;
    DeviceCtx* dev = lane->dev;
    std::vector<Item>& batch = lane->batch;
    int prev = -1;
    bool switched = false;
    if (!own_thread && cudaGetDevice(&prev) == cudaSuccess && prev != dev->index) {
      switched = cudaSetDevice(dev->index) == cudaSuccess;
    }
    // An event recorded while the stream captures would be a node of the user's graph, not a mark
    // of the work before it: one check per batch.
    cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
    const cudaError_t ce = cudaStreamIsCapturing(reinterpret_cast<cudaStream_t>(lane->stream), &cs);
    if (ce == cudaErrorStreamCaptureImplicit) {
      // The batch is on the legacy stream and a blocking stream of the device captures (another
      // thread's): the legacy stream itself never captures, so the snapshots are real copies, but an
      // event recorded on it now would join that capture. Sealed once the capture has ended.
      (void)cudaGetLastError();
      if (switched) restore_device(prev);
      return;
    }
    if (ce == cudaSuccess && cs != cudaStreamCaptureStatusNone) {
      if (switched) restore_device(prev);
      // A torch capture begun since the lane checked (the epoch moved): every snapshot of the batch
      // was enqueued by a tensor that still saw the old epoch, i.e. before that capture began.
      // Marked here too, not only by the lane's next tensor: the drain's hold timer may seal first
      // (the timer-seal race), and giving the batch up then stopped staging for the process.
      if (lane->checked && lane->capture_epoch != g_capture_epoch.load(std::memory_order_acquire))
        lane->batch_precedes_capture = true;
      if (check_each_tensor || lane->batch_precedes_capture) {
        // Every snapshot of the batch was checked before it was enqueued: all precede the capture.
        // Sealed once the capture has ended (by this lane's thread or the drain's timer).
        return;
      }
      // A capture began mid-pass on the stream this pass had already checked: snapshots enqueued
      // since are nodes of the user's graph, not copies made now. Which ones cannot be told, so
      // the batch is given up, loudly; the device ring may be written by replays: staging stops.
      for (const Item& it : batch) cancel(it.res);
      lane->tensors = 0;
      dev->ring_in_foreign_graph.store(true);  // (its regions are never given back either)
      broken.store(true);
      set_error("a CUDA graph capture not begun through torch's CUDAGraph began mid-pass on a stream this "
                "pass was already staging on; its tensors since the pass began were not dumped (set "
                "FASTDUMP_CUDA_CHECK_EACH_TENSOR=1 for code that captures on its current stream mid-pass)");
      std::fprintf(stderr, "fastdump: CUDA staging stopped: capture begun mid-pass on a checked stream\n");
      batch.clear();
      lane->has_batch.store(false, std::memory_order_relaxed);
      lane->batch_precedes_capture = false;
      open_batches.fetch_sub(1, std::memory_order_relaxed);
      return;
    }
    if (ce != cudaSuccess) (void)cudaGetLastError();
    cudaEvent_t ev = nullptr;
    cudaError_t e = cudaSuccess;
    std::string err;
    try {
      ev = take_event(dev);
      e = cudaEventRecord(ev, reinterpret_cast<cudaStream_t>(lane->stream));
    } catch (const std::exception& ex) {
      e = cudaErrorUnknown;
      err = ex.what();
    }
    if (switched) restore_device(prev);
    if (e != cudaSuccess) {
      // The snapshots are queued but cannot be tracked: their regions can never be proven free.
      // Leave them allocated and give up on CUDA staging (as stage() does); the writer must not
      // wait for the records.
      (void)cudaGetLastError();
      if (ev) give_event(dev, ev);
      for (const Item& it : batch) cancel(it.res);
      broken.store(true);
      set_error(err.empty() ? cuda_error_text(e, "cudaEventRecord(producer stream, lean batch)") : err);
    } else {
      n_tensors.fetch_add(lane->tensors, std::memory_order_relaxed);
      n_lean.fetch_add(lane->tensors, std::memory_order_relaxed);
      n_snap_events.fetch_add(1, std::memory_order_relaxed);
      batch.back().snap = ev;  // the drain makes the side stream wait on it before the batch's copies
      submitted.fetch_add(batch.size(), std::memory_order_relaxed);
      dev->pushed.fetch_add(batch.size(), std::memory_order_release);
      {
        std::lock_guard<std::mutex> g(q_mu);
        queue.insert(queue.end(), batch.begin(), batch.end());
      }
      q_cv.notify_one();
      n_wakeups.fetch_add(1, std::memory_order_relaxed);
    }
    lane->tensors = 0;
    batch.clear();
    lane->has_batch.store(false, std::memory_order_relaxed);
    lane->batch_precedes_capture = false;
    open_batches.fetch_sub(1, std::memory_order_relaxed);
  }

  void end_pass(CudaLane* lane) {
    std::lock_guard<std::mutex> g(lane->mu);
    seal_locked(lane, false);  // the current device may have changed since the last tensor
    lane->checked = false;  // the next pass checks again
  }

  // Seal every lane's open batch (flush, close, and before stage() waits for space that open
  // batches may hold). `wait_for_lock` false: lanes busy right now are left to their thread or to
  // the drain's hold timer.
  void seal_all(bool wait_for_lock) {
    if (open_batches.load() == 0) return;
    // Not the lanes' threads: a capture torch begins on a lane's stream meanwhile must not fall
    // between a seal's capture check and its event record (the gate; busy under `false`: skipped).
    std::unique_lock<std::mutex> gate(g_capture_gate, std::defer_lock);
    if (!t_holds_capture_gate) {
      if (wait_for_lock) gate.lock();
      else if (!gate.try_lock()) return;
    }
    std::lock_guard<std::mutex> g(lanes_mu);
    for (auto& lane : lanes) {
      if (!lane->has_batch.load(std::memory_order_relaxed)) continue;
      std::unique_lock<std::mutex> lk(lane->mu, std::defer_lock);
      if (wait_for_lock) lk.lock();
      else if (!lk.try_lock()) continue;
      seal_locked(lane.get(), false);
    }
  }

  // close(): a batch still held open because a capture is under way can never be sealed now; its
  // records become padding (counted as cancelled), so that the writer never waits for them.
  void cancel_open_batches() {
    if (open_batches.load() == 0) return;
    std::lock_guard<std::mutex> g(lanes_mu);
    for (auto& lane : lanes) {
      std::lock_guard<std::mutex> lk(lane->mu);
      if (lane->batch.empty()) continue;
      for (const Item& it : lane->batch) cancel(it.res);
      lane->batch.clear();
      lane->tensors = 0;
      lane->has_batch.store(false, std::memory_order_relaxed);
      lane->batch_precedes_capture = false;
      open_batches.fetch_sub(1, std::memory_order_relaxed);
    }
  }

  // Drain thread: seal open batches older than the hold time (a pass that runs long, or a thread
  // that stopped mid-pass), so completion latency stays bounded without a wake-up per tensor.
  void seal_stale() {
    if (open_batches.load(std::memory_order_relaxed) == 0) return;
    const double now = now_s();
    if (now - last_stale_check < hold_s / 2) return;
    // The drain is not the lanes' thread: its capture check and its event record must not straddle
    // the beginning of a capture torch makes on the lane's stream (a capture being begun: next round).
    std::unique_lock<std::mutex> gate(g_capture_gate, std::try_to_lock);
    if (!gate.owns_lock()) return;
    last_stale_check = now;
    std::lock_guard<std::mutex> g(lanes_mu);
    for (auto& lane : lanes) {
      if (!lane->has_batch.load(std::memory_order_relaxed)) continue;
      std::unique_lock<std::mutex> lk(lane->mu, std::try_to_lock);
      if (!lk || lane->batch.empty() || now - lane->opened_at < hold_s) continue;
      seal_locked(lane.get(), false);
      if (lane->batch.empty()) n_timer_seals.fetch_add(1, std::memory_order_relaxed);  // not held by a capture
    }
  }

  CudaLane* open_lane() {
    std::lock_guard<std::mutex> g(lanes_mu);
    lanes.emplace_back(new CudaLane());
    lanes.back()->batch.reserve(std::max<uint32_t>(events_every.load(), 1));
    return lanes.back().get();
  }

  // -- drain thread ----------------------------------------------------------------------------
  void drain_main() {
    // The drain polls completion events every few microseconds; with the default 50 us timer slack
    // each 5 us wait sleeps ~60-100 us. 1 ns slack makes the waits what they say.
    (void)::prctl(PR_SET_TIMERSLACK, 1UL, 0, 0, 0);
    drain_slack_ns.store(static_cast<long>(::prctl(PR_GET_TIMERSLACK, 0, 0, 0, 0)));
    // Relaxed capture mode for this thread: a CUDA-graph capture in global mode on any other
    // thread (torch.cuda.graph's default) would otherwise forbid, and be invalidated by, our
    // event queries and copies.
    cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
    (void)cudaThreadExchangeStreamCaptureMode(&mode);
    std::vector<Item> incoming;
    incoming.reserve(kQueueReserve);  // swapped with `queue`: both keep their capacity
    int idle_polls = 0;
    for (;;) {
      {
        std::unique_lock<std::mutex> lk(q_mu);
        if (queue.empty()) {
          if (inflight_batches == 0) {
            // Stop only once no stage() call can still push work (close() gives up waiting for
            // them after its timeout; their records must still be copied and published).
            if (stop && active.load() == 0) break;
            // Open lean batches: wake within the hold time to seal them (seal_stale below).
            const auto idle = open_batches.load(std::memory_order_relaxed) > 0
                                  ? std::chrono::microseconds(static_cast<int64_t>(hold_s * 5e5) + 1)
                                  : std::chrono::microseconds(stop ? 5000 : 100000);
            q_cv.wait_for(lk, idle, [&] { return !queue.empty() || stop; });
          } else {
            // Copies in flight: poll their events, backing off from 5 us to 100 us.
            const int us = idle_polls < 8 ? 5 : idle_polls < 32 ? 20 : 100;
            q_cv.wait_for(lk, std::chrono::microseconds(us), [&] { return !queue.empty(); });
          }
        }
        incoming.swap(queue);
      }
      if (incoming.empty()) {
        seal_stale();  // may push a batch: picked up by the next round
      }
      bool progress = false;
      if (!incoming.empty()) {
        issue(incoming);
        incoming.clear();
        progress = true;
      }
      if (poll()) progress = true;
      idle_polls = progress ? 0 : idle_polls + 1;
    }
    std::lock_guard<std::mutex> g(q_mu);
    drain_running = false;
  }

  void start_busy() {
    if (inflight_batches++ == 0) busy_since = now_s();
  }
  void end_busy() {
    if (--inflight_batches == 0) {
      std::lock_guard<std::mutex> g(st_mu);
      drain_s += now_s() - busy_since;
    }
  }

  // Append the copies of one item, split where the destination crosses from one
  // cudaHostRegister piece into the next (each copy then lies inside one registration).
  static void add_copies(const Item& it, const uint8_t* rbase, uint64_t rlen, uint64_t piece, std::vector<void*>& dsts,
                         std::vector<const void*>& srcs, std::vector<size_t>& sizes) {
    uint8_t* dst = it.res.payload;
    const uint8_t* src = it.dsrc;
    uint64_t left = it.len;
    while (left > 0) {
      uint64_t n = left;
      if (rbase && dst >= rbase && dst < rbase + rlen) {
        const uint64_t off = static_cast<uint64_t>(dst - rbase);
        const uint64_t piece_end = (off / piece + 1) * piece;
        n = std::min<uint64_t>(n, piece_end - off);
      }
      dsts.push_back(dst);
      srcs.push_back(src);
      sizes.push_back(n);
      dst += n;
      src += n;
      left -= n;
    }
  }

  cudaError_t copy_batch(DeviceCtx* dev, bool pinned, std::vector<void*>& dsts, std::vector<const void*>& srcs,
                         std::vector<size_t>& sizes) {
    if (dsts.empty()) return cudaSuccess;
#if CUDART_VERSION >= 12080
    // One call for the whole batch (CUDA 12.8+; not capturable, which is fine on this thread).
    // Only into pinned memory: pageable destinations go through the plain path below.
    if (pinned && use_batch.load(std::memory_order_relaxed)) {
      // Location hints stay zeroed: they apply only to managed or pageable system memory, never to
      // device memory copied into a pinned ring, and a driver need not accept what it ignores.
      cudaMemcpyAttributes attr;
      std::memset(&attr, 0, sizeof(attr));
      attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
      attr.flags = cudaMemcpyFlagPreferOverlapWithCompute;
      size_t attr_idx = 0;
#if CUDART_VERSION >= 13000
      cudaError_t e = cudaMemcpyBatchAsync(dsts.data(), srcs.data(), sizes.data(), dsts.size(), &attr, &attr_idx, 1,
                                           dev->side);
#else
      size_t fail_idx = 0;
      cudaError_t e = cudaMemcpyBatchAsync(dsts.data(), const_cast<void**>(srcs.data()), sizes.data(), dsts.size(),
                                           &attr, &attr_idx, 1, &fail_idx, dev->side);
#endif
      if (e == cudaSuccess) return e;
      (void)cudaGetLastError();
      // Unsupported here (old driver, unusual memory): per-copy from now on. Re-issuing copies the
      // failed batch may have queued is harmless: the same bytes to the same place, in stream order.
      // Not an error: staging goes on as well, only with more calls.
      use_batch.store(false);
      set_batch_fallback(cuda_error_text(e, "cudaMemcpyBatchAsync"));
    }
#endif
    for (size_t i = 0; i < dsts.size(); ++i) {
      cudaError_t e = cudaMemcpyAsync(dsts[i], srcs[i], sizes[i], cudaMemcpyDeviceToHost, dev->side);
      if (e != cudaSuccess) return e;
    }
    return cudaSuccess;
  }

  // Issue one device's items (in order). On failure returns the error text and leaves in `list`
  // exactly the items that are not in flight (the caller abandons them).
  std::string issue_device(DeviceCtx* dev, std::vector<Item>& list) {
    cudaError_t e = cudaSetDevice(dev->index);
    if (e != cudaSuccess) return cuda_error_text(e, "cudaSetDevice (drain)");
    // The side stream waits for every snapshot of this group. Once the wait is enqueued the event
    // may be recorded again (cudaStreamWaitEvent uses its state at the time of the call), so it
    // goes back to the pool at once.
    for (Item& it : list) {
      if (!it.snap) continue;
      e = cudaStreamWaitEvent(dev->side, it.snap, 0);
      if (e != cudaSuccess) return cuda_error_text(e, "cudaStreamWaitEvent(side stream)");
      give_event(dev, it.snap);
      it.snap = nullptr;
    }
    const bool pinned = host_pinned.load(std::memory_order_acquire);
    const uint8_t* rbase = pinned ? reg_base : nullptr;
    const uint64_t rlen = pinned ? reg_len : 0;
    // Batches bounded in bytes, so several are in flight and device space comes back steadily.
    const uint64_t max_bytes = std::max<uint64_t>(dev->cap / 8, 1);
    std::vector<void*> dsts;
    std::vector<const void*> srcs;
    std::vector<size_t> sizes;
    size_t i0 = 0;
    while (i0 < list.size()) {
      size_t i1 = i0;
      uint64_t bytes = 0;
      while (i1 < list.size() && (i1 == i0 || (i1 - i0 < kMaxBatchCopies && bytes + list[i1].len <= max_bytes))) {
        bytes += list[i1].len;
        ++i1;
      }
      dsts.clear();
      srcs.clear();
      sizes.clear();
      for (size_t k = i0; k < i1; ++k) add_copies(list[k], rbase, rlen, reg_piece, dsts, srcs, sizes);
      e = copy_batch(dev, pinned, dsts, srcs, sizes);
      cudaEvent_t done = nullptr;
      std::string err;
      if (e == cudaSuccess) {
        try {
          done = take_event(dev);
          e = cudaEventRecord(done, dev->side);
        } catch (const std::exception& ex) {
          err = ex.what();
        }
      }
      if (e != cudaSuccess || !err.empty()) {
        (void)cudaGetLastError();
        if (done) give_event(dev, done);
        list.erase(list.begin(), list.begin() + static_cast<std::ptrdiff_t>(i0));
        return err.empty() ? cuda_error_text(e, "D2H copy (drain)") : err;
      }
      InFlight b;
      b.done = done;
      b.bytes = bytes;
      b.items.assign(list.begin() + static_cast<std::ptrdiff_t>(i0), list.begin() + static_cast<std::ptrdiff_t>(i1));
      n_copies.fetch_add(dsts.size(), std::memory_order_relaxed);
      n_batches.fetch_add(1, std::memory_order_relaxed);
      start_busy();
      dev->inflight.push_back(std::move(b));
      i0 = i1;
    }
    list.clear();
    return std::string();
  }

  void issue(std::vector<Item>& items) {
    // Group per device, keeping each device's order.
    std::vector<std::pair<DeviceCtx*, std::vector<Item>>> groups;
    for (Item& it : items) {
      auto g = std::find_if(groups.begin(), groups.end(), [&](const auto& p) { return p.first == it.dev; });
      if (g == groups.end()) {
        groups.emplace_back(it.dev, std::vector<Item>());
        g = groups.end() - 1;
      }
      g->second.push_back(it);
    }
    for (size_t g = 0; g < groups.size(); ++g) {
      std::string err = issue_device(groups[g].first, groups[g].second);
      if (err.empty()) continue;
      std::vector<Item> rest = std::move(groups[g].second);
      for (size_t h = g + 1; h < groups.size(); ++h)
        rest.insert(rest.end(), groups[h].second.begin(), groups[h].second.end());
      fail_all(err, &rest);
      return;
    }
  }

  // Publish completed batches, in order per device. Returns whether anything completed.
  bool poll() {
    bool any = false;
    for (int i = 0; i < device_count; ++i) {
      DeviceCtx* dev = devs[i].load(std::memory_order_acquire);
      if (!dev) continue;
      while (!dev->inflight.empty()) {
        InFlight& b = dev->inflight.front();
        cudaError_t e = cudaEventQuery(b.done);
        if (e == cudaErrorNotReady) break;
        if (e != cudaSuccess) {
          (void)cudaGetLastError();
          fail_all(cuda_error_text(e, "cudaEventQuery(D2H done)"), nullptr);
          return true;
        }
        complete(dev, b);
        dev->inflight.pop_front();
        end_busy();
        any = true;
      }
    }
    if (any) notify_progress();
    return any;
  }

  // A batch whose completion event fired: its bytes are in the host ring. Publish its records
  // (ring order is already fixed: the writer waits at the head of the line), then free space.
  void complete(DeviceCtx* dev, InFlight& b) {
    for (const Item& it : b.items) prod->publish(it.res);
    {
      std::lock_guard<std::mutex> g(dev->mu);
      for (const Item& it : b.items) dev->regions.at(it.region).pending--;
      reclaim_locked(dev);
      dev->free_events.push_back(b.done);
    }
    n_published.fetch_add(b.items.size(), std::memory_order_relaxed);
    d2h_bytes.fetch_add(b.bytes, std::memory_order_relaxed);
    dev->finished.fetch_add(b.items.size(), std::memory_order_release);
    completed.fetch_add(b.items.size());
  }

  // Unrecoverable CUDA error in the drain: stop CUDA staging (stage() returns kDisabled from now
  // on) and make sure the writer never waits for a record we hold: batches that did complete are
  // published, everything else becomes padding. Queued copies may still be running unless the
  // context is dead, so the side streams are drained first.
  void fail_all(const std::string& msg, std::vector<Item>* extra) {
    broken.store(true);
    set_error(msg);
    std::fprintf(stderr, "fastdump: CUDA staging stopped: %s\n", msg.c_str());
    for (int i = 0; i < device_count; ++i) {
      DeviceCtx* dev = devs[i].load(std::memory_order_acquire);
      if (!dev) continue;
      if (cudaSetDevice(dev->index) == cudaSuccess) (void)cudaStreamSynchronize(dev->side);
      (void)cudaGetLastError();
      while (!dev->inflight.empty()) {
        InFlight& b = dev->inflight.front();
        if (cudaEventQuery(b.done) == cudaSuccess) {
          complete(dev, b);
        } else {
          (void)cudaGetLastError();
          abandon(b.items);
          give_event(dev, b.done);
        }
        dev->inflight.pop_front();
        end_busy();
      }
    }
    if (extra) {
      abandon(*extra);
      extra->clear();
    }
    std::vector<Item> queued;
    {
      std::lock_guard<std::mutex> g(q_mu);
      queued.swap(queue);
    }
    abandon(queued);
    notify_progress();
  }

  // Records that will never be copied: padding for the writer, their region references dropped.
  void abandon(std::vector<Item>& items) {
    for (Item& it : items) {
      if (it.snap) {
        give_event(it.dev, it.snap);
        it.snap = nullptr;
      }
      cancel(it.res);
      {
        std::lock_guard<std::mutex> g(it.dev->mu);
        it.dev->regions.at(it.region).pending--;
        reclaim_locked(it.dev);
      }
      it.dev->finished.fetch_add(1, std::memory_order_release);
      completed.fetch_add(1);
    }
  }

  // -- host registration, flush, stats, close ----------------------------------------------------
  // Allocate `index`'s device ring, side stream and events now (at attach, before a serving
  // engine sizes its KV cache to the free memory). Throws when the ring cannot be had.
  void prepare(int index) {
    if (index < 0 || index >= device_count) throw std::invalid_argument("no CUDA device " + std::to_string(index));
    if (closed.load()) return;
    DeviceGuard guard(index);
    (void)device(index);
  }

  // A device for host-side calls that need a context (pinning): the one asked for, else the
  // lowest one the process already uses, so no call creates a context on an unused GPU.
  int context_device(int asked) {
    if (asked >= 0) return asked;
    for (int i = 0; i < device_count; ++i)
      if (primary_context_active(i)) return i;
    int cur = 0;
    if (cudaGetDevice(&cur) != cudaSuccess) cur = 0;
    return cur;
  }

  double register_host(int device) {
    std::lock_guard<std::mutex> g(reg_mu);
    if (host_pinned.load() || closed.load()) return 0.0;
    DeviceGuard guard(context_device(device));
    uint8_t* base = prod->region().data();
    const long page = ::sysconf(_SC_PAGESIZE) > 0 ? ::sysconf(_SC_PAGESIZE) : 4096;
    const uint64_t len = align_to(prod->region().capacity(), static_cast<uint64_t>(page));
    RelaxedCapture relaxed;
    const double t0 = now_s();
    for (uint64_t off = 0; off < len; off += reg_piece) {
      const uint64_t n = std::min<uint64_t>(reg_piece, len - off);
      cudaError_t e = cudaHostRegister(base + off, n, cudaHostRegisterPortable);
      if (e == cudaErrorHostMemoryAlreadyRegistered) {
        (void)cudaGetLastError();
        continue;  // someone else pinned it: use it, leave it to them
      }
      if (e != cudaSuccess) {
        (void)cudaGetLastError();
        for (auto& p : registered) (void)cudaHostUnregister(p.first);
        registered.clear();
        throw_cuda(e, "cudaHostRegister(host ring)");
      }
      registered.emplace_back(base + off, n);
    }
    const double dt = now_s() - t0;
    reg_base = base;
    reg_len = len;
    host_pinned.store(true);
    std::lock_guard<std::mutex> s(st_mu);
    register_s = dt;
    return dt;
  }

  bool flush(double timeout_s) {
    seal_all(/*wait_for_lock=*/true);
    const uint64_t target = submitted.load(std::memory_order_acquire);
    const double deadline = now_s() + timeout_s;
    if (completed.load(std::memory_order_acquire) >= target) return true;
    prog_waiters.fetch_add(1);
    bool ok = true;
    {
      std::unique_lock<std::mutex> lk(prog_mu);
      while (completed.load(std::memory_order_acquire) < target) {
        if (now_s() > deadline) {
          ok = false;
          break;
        }
        {
          std::lock_guard<std::mutex> g(q_mu);
          if (!drain_running) {
            ok = false;
            break;
          }
        }
        prog_cv.wait_for(lk, std::chrono::milliseconds(2));
      }
    }
    prog_waiters.fetch_sub(1);
    return ok;
  }

  void close(double timeout_s) {
    if (closed.exchange(true)) return;
    if (forked_child() && ::getpid() != owner_pid) {
      // Forked child: no drain thread here, and CUDA cannot be used after fork. Leak quietly.
      if (drain.joinable()) drain.detach();
      return;
    }
    // Let stage() calls in progress return (their waits see `closed`).
    const double deadline = now_s() + timeout_s;
    while (active.load() > 0 && now_s() < deadline) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    try {
      flush(std::max(0.0, deadline - now_s()));
    } catch (...) {  // the drain thread must be joined below whatever happens
    }
    cancel_open_batches();
    {
      std::lock_guard<std::mutex> g(q_mu);
      stop = true;
    }
    q_cv.notify_all();
    if (drain.joinable()) drain.join();  // it finishes every queued and in-flight copy first
    RelaxedCapture relaxed;
    int prev_device = -1;
    if (cudaGetDevice(&prev_device) != cudaSuccess) prev_device = -1;
    std::lock_guard<std::mutex> init_lock(init_mu);
    for (int i = 0; i < kMaxDevices; ++i) {
      DeviceCtx* dev = devs[i].exchange(nullptr);
      if (!dev) continue;
      if (cudaSetDevice(dev->index) == cudaSuccess) {
        (void)cudaStreamSynchronize(dev->side);
        for (cudaEvent_t ev : dev->all_events) (void)cudaEventDestroy(ev);
        (void)cudaStreamDestroy(dev->side);
        if (dev->ring_in_foreign_graph.load()) {
          std::fprintf(stderr, "fastdump: the CUDA staging ring of device %d is left allocated (%llu bytes): a "
                       "graph captured mid-pass writes into it at each replay\n", dev->index,
                       static_cast<unsigned long long>(dev->cap));
        } else {
          (void)cudaFree(dev->ring);
        }
      }
      (void)cudaGetLastError();
      delete dev;
    }
    restore_device(prev_device);  // the caller's current device (unless it has no context)
    (void)cudaGetLastError();
    std::lock_guard<std::mutex> g(reg_mu);
    if (!registered.empty()) {  // (close() may run on a fresh thread, on device 0 without a context)
      const int switched_from = switch_to_a_used_device();
      for (auto& p : registered) (void)cudaHostUnregister(p.first);
      if (switched_from >= 0) restore_device(switched_from);
    }
    (void)cudaGetLastError();
    registered.clear();
    host_pinned.store(false);
    reg_base = nullptr;
    torn_down.store(true);
  }

  CudaStagerStats stats() {
    CudaStagerStats s;
    s.tensors = n_tensors.load();
    s.records = n_records.load();
    s.snapshots = n_snapshots.load();
    s.snapshot_kernels = n_kernels.load();
    s.snapshot_2d = n_2d.load();
    s.snapshot_bytes = snapshot_bytes.load();
    s.d2h_copies = n_copies.load();
    s.d2h_batches = n_batches.load();
    s.d2h_bytes = d2h_bytes.load();
    s.published = n_published.load();
    s.cancelled = n_cancelled.load();
    s.dropped = n_dropped.load();
    s.capturing_skipped = n_capturing.load();
    s.lean_tensors = n_lean.load();
    s.lean_checks = n_checks.load();
    s.snapshot_events = n_snap_events.load();
    s.drain_wakeups = n_wakeups.load();
    s.timer_seals = n_timer_seals.load();
    s.events_every = events_every.load();
    s.device_ring_full_waits = dev_waits.load();
    s.host_ring_full_waits = host_waits.load();
    s.registered_bytes = host_pinned.load() ? reg_len : 0;
    s.broken = broken.load();
    s.drain_timer_slack_ns = drain_slack_ns.load();
    s.batch_api = use_batch.load() && host_pinned.load();
    {
      std::lock_guard<std::mutex> g(st_mu);
      s.device_ring_wait_seconds = dev_wait_s;
      s.drain_seconds = drain_s;
      s.register_seconds = register_s;
      s.last_error = last_error;
      s.batch_api_fallback = batch_fallback;
    }
    if (broken.load() && s.last_error.empty()) s.last_error = "CUDA staging stopped";
    std::lock_guard<std::mutex> init_lock(init_mu);
    for (int i = 0; i < device_count; ++i) {
      DeviceCtx* dev = devs[i].load(std::memory_order_acquire);
      if (!dev) continue;
      CudaDeviceStats d;
      d.device = dev->index;
      d.ring_bytes = dev->cap;
      std::lock_guard<std::mutex> g(dev->mu);
      d.ring_used = dev->head - dev->tail;
      d.in_flight_batches = dev->regions.size();
      s.devices.push_back(d);
    }
    return s;
  }
};

CudaStager::CudaStager(Producer* producer, uint64_t device_ring_bytes)
    : impl_(new Impl(producer, device_ring_bytes)) {}

CudaStager::~CudaStager() = default;

int CudaStager::stage(uint32_t channel, uint32_t name_id, int64_t pass_id, uint16_t dtype, const CudaSource& src,
                      bool block, BlockHook* hook, double timeout_s) {
  return impl_->stage(channel, name_id, pass_id, dtype, src, block, hook, timeout_s);
}

int CudaStager::stage_lean(CudaLane* lane, uint32_t channel, uint32_t name_id, int64_t pass_id, uint16_t dtype,
                           const CudaSource& src, bool block, BlockHook* hook, double timeout_s) {
  return impl_->stage_lean(lane, channel, name_id, pass_id, dtype, src, block, hook, timeout_s);
}
void CudaStager::end_pass(CudaLane* lane) { impl_->end_pass(lane); }
void CudaStager::note_capture_begin() { g_capture_epoch.fetch_add(1, std::memory_order_acq_rel); }
void CudaStager::capture_gate(bool enter) {
  if (enter == t_holds_capture_gate) return;
  if (enter) g_capture_gate.lock();
  else g_capture_gate.unlock();
  t_holds_capture_gate = enter;
}
CudaLane* CudaStager::open_lane() { return impl_->open_lane(); }
void CudaStager::set_events_every(uint32_t n) { impl_->events_every.store(std::max<uint32_t>(n, 1)); }
uint32_t CudaStager::events_every() const { return impl_->events_every.load(); }
double CudaStager::register_host(int device) { return impl_->register_host(device); }
void CudaStager::prepare(int device) { impl_->prepare(device); }
uint64_t CudaStager::submitted(int device) const {
  if (device < 0 || device >= kMaxDevices) return 0;
  DeviceCtx* d = impl_->devs[device].load(std::memory_order_acquire);
  return d ? d->pushed.load(std::memory_order_acquire) : 0;
}
uint64_t CudaStager::completed(int device) const {
  if (impl_->torn_down.load(std::memory_order_acquire)) return UINT64_MAX;
  if (device < 0 || device >= kMaxDevices) return 0;
  DeviceCtx* d = impl_->devs[device].load(std::memory_order_acquire);
  return d ? d->finished.load(std::memory_order_acquire) : 0;
}
bool CudaStager::flush(double timeout_s) { return impl_->flush(timeout_s); }
CudaStagerStats CudaStager::stats() { return impl_->stats(); }
void CudaStager::close(double timeout_s) { impl_->close(timeout_s); }
uint64_t CudaStager::device_ring_bytes() const { return impl_->dcap; }
Producer* CudaStager::producer() const { return impl_->prod; }

}  // namespace fastdump
