// fastdump._C's CUDA part (built when a CUDA toolkit is found; cuda_stub.cpp otherwise).
// Tensors arrive as raw pointers, shapes, strides and stream handles: no libtorch.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <chrono>
#include <condition_variable>
#include <cstring>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>
#include <stdexcept>
#include <string>
#include <vector>

#include "bindings.h"
#include "cuda_staging.h"
#include "ring.h"

#ifdef FASTDUMP_CUDA_MOCK
#include <cuda_runtime.h>  // tests/cuda_mock/cuda_runtime.h
#include <pthread.h>

#include <new>

// Test build only: count, per thread, the heap allocations (operator new) and mutex acquisitions
// (pthread_mutex_lock) made by this module's code outside the mock runtime's own calls. Both
// definitions are hidden (-fvisibility=hidden): they replace the library's only inside this .so, so
// torch, Python and the real fastdump._C are untouched; they forward to malloc and glibc's lock.
extern "C" int __pthread_mutex_lock(pthread_mutex_t* m);
extern "C" int pthread_mutex_lock(pthread_mutex_t* m) noexcept {
  fdmock::ThreadCounts& c = fdmock::thread_counts();
  if (c.in_mock == 0) ++c.locks;
  return __pthread_mutex_lock(m);
}
namespace {
void* counted_alloc(std::size_t n) {
  fdmock::ThreadCounts& c = fdmock::thread_counts();
  if (c.in_mock == 0) ++c.allocs;
  void* p = std::malloc(n ? n : 1);
  return p;
}
}  // namespace
void* operator new(std::size_t n) {
  void* p = counted_alloc(n);
  if (!p) throw std::bad_alloc();
  return p;
}
void* operator new[](std::size_t n) {
  void* p = counted_alloc(n);
  if (!p) throw std::bad_alloc();
  return p;
}
void* operator new(std::size_t n, const std::nothrow_t&) noexcept { return counted_alloc(n); }
void* operator new[](std::size_t n, const std::nothrow_t&) noexcept { return counted_alloc(n); }
void operator delete(void* p) noexcept { std::free(p); }
void operator delete[](void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }
void operator delete[](void* p, std::size_t) noexcept { std::free(p); }
#endif

namespace py = pybind11;

namespace fastdump {

namespace {

// Releases the GIL the first time stage() is about to wait, and takes it back when the binding
// returns (also when an exception unwinds through it).
class GilRelease : public BlockHook {
 public:
  void before_block() override {
    if (!released_) released_.emplace();
  }

 private:
  std::optional<py::gil_scoped_release> released_;
};

py::dict info_dict() {
  CudaInfo info = cuda_query_info();
  py::dict d;
  d["compiled"] = true;
  d["built_with"] = info.built_with;
  d["runtime_version"] = info.runtime_version;
  d["driver_version"] = info.driver_version;
  d["device_count"] = info.device_count;
  py::list devices;
  for (const CudaDeviceInfo& dev : info.devices) {
    py::dict x;
    x["index"] = dev.index;
    x["name"] = dev.name;
    x["uuid"] = dev.uuid;
    x["pci_bus_id"] = dev.pci_bus_id;
    x["total_memory"] = dev.total_memory;
    x["compute_capability"] = std::to_string(dev.major) + "." + std::to_string(dev.minor);
    x["multiprocessors"] = dev.multiprocessors;
    devices.append(x);
  }
  d["devices"] = devices;
  if (!info.reason.empty()) d["reason"] = info.reason;
  return d;
}

py::dict stats_dict(CudaStager& s) {
  CudaStagerStats st = s.stats();
  py::dict d;
  d["tensors"] = st.tensors;
  d["records"] = st.records;
  d["snapshots"] = st.snapshots;
  d["snapshot_kernels"] = st.snapshot_kernels;
  d["snapshot_2d"] = st.snapshot_2d;
  d["snapshot_bytes"] = st.snapshot_bytes;
  d["d2h_copies"] = st.d2h_copies;
  d["d2h_batches"] = st.d2h_batches;
  d["d2h_bytes"] = st.d2h_bytes;
  d["published"] = st.published;
  d["cancelled"] = st.cancelled;
  d["dropped"] = st.dropped;
  d["capturing_skipped"] = st.capturing_skipped;
  d["lean_tensors"] = st.lean_tensors;
  d["lean_checks"] = st.lean_checks;
  d["snapshot_events"] = st.snapshot_events;
  d["drain_wakeups"] = st.drain_wakeups;
  d["timer_seals"] = st.timer_seals;
  d["events_every"] = st.events_every;
  d["device_ring_full_waits"] = st.device_ring_full_waits;
  d["device_ring_wait_seconds"] = st.device_ring_wait_seconds;
  d["host_ring_full_waits"] = st.host_ring_full_waits;
  d["drain_seconds"] = st.drain_seconds;
  d["register_seconds"] = st.register_seconds;
  d["registered_bytes"] = st.registered_bytes;
  d["batch_api"] = st.batch_api;
  d["batch_api_fallback"] = st.batch_api_fallback;
  d["last_error"] = st.last_error;
  d["broken"] = st.broken;
  d["drain_timer_slack_ns"] = st.drain_timer_slack_ns;
  py::list devices;
  for (const CudaDeviceStats& dev : st.devices) {
    py::dict x;
    x["device"] = dev.device;
    x["ring_bytes"] = dev.ring_bytes;
    x["ring_used"] = dev.ring_used;
    x["open_regions"] = dev.in_flight_batches;
    devices.append(x);
  }
  d["devices"] = devices;
  return d;
}

int stage(CudaStager& s, uint32_t channel, uint32_t name_id, int64_t pass_id, uint16_t dtype, uint64_t elem_size,
          std::vector<int64_t> shape, std::vector<int64_t> strides, uintptr_t ptr, int device, uintptr_t stream,
          bool block, uintptr_t producer_stream, double timeout_s) {
  CudaSource src{ptr, elem_size, std::move(shape), std::move(strides), device, stream, producer_stream};
  GilRelease gil;  // declared before the call: re-acquired after it, even when it throws
  return s.stage(channel, name_id, pass_id, dtype, src, block, &gil, timeout_s);
}

// ChannelStager's CUDA lane (bindings.h): one CudaLane of the stager, the tensor's facts read
// through the C API, the current stream asked per tensor (cheap: torch keeps it per thread) and
// its stream object (for record_stream) fetched only when the raw stream changes.
class StagerTensorLane : public CudaTensorLane {
 public:
  StagerTensorLane(py::object stager, py::object raw_stream, py::object stream_object)
      : stager_obj_(std::move(stager)),
        stager_(stager_obj_.cast<CudaStager*>()),
        lane_(stager_->open_lane()),
        raw_stream_(std::move(raw_stream)),
        stream_object_(std::move(stream_object)) {}

  int stage(uint32_t channel, uint32_t name_id, int64_t pass_id, bool block, double timeout_s, PyObject* tensor,
            uint16_t code, uint64_t elem_size, const std::vector<int64_t>& shape, const std::vector<int64_t>& strides,
            uintptr_t ptr) override {
    if (off_) return kNotFast;
    static PyObject* s_get_device = PyUnicode_InternFromString("get_device");
    static PyObject* s_record_stream = PyUnicode_InternFromString("record_stream");
    py::object dev = py::reinterpret_steal<py::object>(PyObject_CallMethodNoArgs(tensor, s_get_device));
    if (!dev) return python_error();
    const long device = PyLong_AsLong(dev.ptr());
    if (device == -1 && PyErr_Occurred()) return python_error();
    if (device != device_ || !stream_obj_) {  // the stream object is per device
      stream_obj_ = py::object();
      device_ = device;
    }
    py::object raw = py::reinterpret_steal<py::object>(PyObject_CallOneArg(raw_stream_.ptr(), dev.ptr()));
    if (!raw) return python_error();
    const uintptr_t stream = static_cast<uintptr_t>(PyLong_AsUnsignedLongLong(raw.ptr()));
    if (PyErr_Occurred()) return python_error();
    if (stream != raw_ || !stream_obj_) {
      py::object obj = py::reinterpret_steal<py::object>(PyObject_CallOneArg(stream_object_.ptr(), dev.ptr()));
      if (!obj) return python_error();
      stream_obj_ = std::move(obj);
      raw_ = stream;
    }
    // This thread's own source and stream object: once the GIL is released (a wait for space),
    // another thread may stage through this lane and refill the lane's members.
    thread_local CudaSource src;
    src.ptr = ptr;
    src.elem_size = elem_size;
    src.shape.assign(shape.begin(), shape.end());  // capacity kept: no allocation once warm
    src.strides.assign(strides.begin(), strides.end());
    src.device = static_cast<int>(device);
    src.stream = stream;
    src.producer_stream = 0;
    const py::object stream_obj = stream_obj_;
    int st;
    try {
      GilRelease gil;  // released only if the stager has to wait
      st = stager_->stage_lean(lane_, channel, name_id, pass_id, code, src, block, &gil, timeout_s);
    } catch (const std::exception& ex) {
      // Nothing of the tensor was staged: the general path stages it again and handles the error.
      // A device ring that cannot be had stays so: stop asking (the general path records why).
      if (std::strstr(ex.what(), "device staging ring")) off_ = true;
      return kNotFast;
    }
    if (st == kCapturing) return kNotFast;  // the graph recorder (Python) takes it
    if (st == kStaged) {
      // The caching allocator must not hand the block out again before the snapshot on this
      // stream has read it (the tensor may come from another stream). Memory torch does not own
      // refuses: nothing to protect then.
      PyObject* r = PyObject_CallMethodOneArg(tensor, s_record_stream, stream_obj.ptr());
      if (r) Py_DECREF(r);
      else PyErr_Clear();
    }
    return st;
  }

  void end_pass() override { stager_->end_pass(lane_); }

 private:
  int python_error() {
    PyErr_Clear();
    return kNotFast;  // the general path asks again and reports it
  }

  py::object stager_obj_;  // keeps the stager (and its lanes) alive
  CudaStager* stager_;
  CudaLane* lane_;
  py::object raw_stream_, stream_object_;
  py::object stream_obj_;  // the stream object of (device_, raw_)
  long device_ = -1;
  uintptr_t raw_ = 0;
  bool off_ = false;
};

#ifdef FASTDUMP_CUDA_MOCK
// Test build only (tests/cuda_mock): drive the mock runtime from Python.
struct MockGate {  // enqueue_gate / open_gate
  std::mutex mu;
  std::condition_variable cv;
  bool open = false;
};
std::mutex& mock_gates_mu() {
  static std::mutex mu;
  return mu;
}
std::map<uint64_t, std::shared_ptr<MockGate>>& mock_gates() {
  static std::map<uint64_t, std::shared_ptr<MockGate>> gates;
  return gates;
}
uint64_t& mock_gate_serial() {
  static uint64_t serial = 0;
  return serial;
}

void bind_mock(py::module_& m) {
  py::module_ k = m.def_submodule("_mock", "controls of the mock CUDA runtime (tests only)");
  k.def("set", [](const std::string& name, int64_t v) {
    auto& c = fdmock::config();
    if (name == "device_count") c.device_count = static_cast<int>(v);
    else if (name == "max_delay_us") c.max_delay_us = static_cast<int>(v);
    else if (name == "graph_node_us") c.graph_node_us = static_cast<int>(v);
    else if (name == "external_record_captures") c.external_record_captures = static_cast<int>(v);
    else if (name == "seed") c.seed = static_cast<uint64_t>(v);
    else if (name == "device_free") c.device_free = static_cast<uint64_t>(v);
    else if (name == "fail_batch") fdmock::inject("cudaMemcpyBatchAsync", v ? 1 << 30 : 0, cudaErrorNotSupported);
    else if (name == "fail_event_query") fdmock::inject("cudaEventQuery", static_cast<int>(v), cudaErrorUnknown);
    else if (name == "fail_malloc") fdmock::inject("cudaMalloc", v ? 1 << 30 : 0, cudaErrorMemoryAllocation);
    else if (name == "capturing") c.capturing = static_cast<int>(v);
    else throw std::invalid_argument(name);
  });
  // The next `count` calls of `api` (a runtime function's name, or "kernel") fail with `error`,
  // after `skip` more calls that succeed (a failure mid-run: the second D2H copy of a tensor).
  k.def("fail", [](const std::string& api, int count, int error, int skip) {
    fdmock::inject(api, count, static_cast<cudaError_t>(error), skip);
  }, py::arg("api"), py::arg("count") = 1, py::arg("error") = static_cast<int>(cudaErrorUnknown),
     py::arg("skip") = 0);
  // The next `count` calls of `api` wait `seconds` before they take effect (released GIL: the test
  // acts meanwhile); delayed() counts the waits begun since the last reset.
  k.def("delay", [](const std::string& api, int count, double seconds) { fdmock::delay(api, count, seconds); },
        py::arg("api"), py::arg("count") = 1, py::arg("seconds") = 0.1);
  k.def("delayed", []() { return fdmock::delayed_calls().load(); });
  k.def("reset", []() { fdmock::reset_device_state(); });
  // The calling thread's counts (see the top of this file): {"calls": {api: n}, "allocs", "locks"}.
  k.def("thread_counts", []() {
    fdmock::ThreadCounts& c = fdmock::thread_counts();
    std::map<std::string, uint64_t> calls;
    ++c.in_mock;  // building the answer is not the code's cost
    for (const auto& kv : c.calls) calls[kv.first] += kv.second;
    const uint64_t allocs = c.allocs, locks = c.locks;
    py::dict d;
    d["calls"] = calls;
    d["allocs"] = allocs;
    d["locks"] = locks;
    --c.in_mock;
    return d;
  });
  k.def("reset_thread_counts", []() {
    fdmock::ThreadCounts& c = fdmock::thread_counts();
    ++c.in_mock;
    c.calls.clear();
    c.allocs = c.locks = 0;
    --c.in_mock;
  });
  k.def("error_name", [](int e) { return std::string(cudaGetErrorName(static_cast<cudaError_t>(e))); });
  // The calling thread's last runtime error, cleared (cudaGetLastError): a failed call the staging
  // code handled must not stay there, where the next launch check on this thread would report it.
  k.def("last_error", []() { return static_cast<int>(cudaGetLastError()); });
  k.def("contexts", []() {
    py::list l;
    for (int d = 0; d < fdmock::config().device_count.load() && d < fdmock::kMaxDevices; ++d)
      l.append(fdmock::config().contexts[d].load());
    return l;
  });
  k.def("reset_contexts", []() {
    for (auto& c : fdmock::config().contexts) c = 0;
  });
  k.def("get_device", []() { return fdmock::current_device(); });
  k.def("set_device", [](int d) { return static_cast<int>(cudaSetDevice(d)); });
  k.def("malloc", [](uint64_t n) {
    void* p = nullptr;
    cudaError_t e = cudaMalloc(&p, n);
    if (e != cudaSuccess) throw std::runtime_error(cudaGetErrorName(e));
    return reinterpret_cast<uintptr_t>(p);
  });
  k.def("free", [](uintptr_t p) { return static_cast<int>(cudaFree(reinterpret_cast<void*>(p))); });
  // Synchronous host<->device transfers for tests (through the copy engine, checked like any copy).
  auto sync_copy = [](uintptr_t dst, uintptr_t src, uint64_t n, cudaMemcpyKind kind) {
    py::gil_scoped_release nogil;
    cudaError_t e = cudaMemcpyAsync(reinterpret_cast<void*>(dst), reinterpret_cast<const void*>(src), n, kind,
                                    cudaStreamLegacy);
    if (e == cudaSuccess) e = cudaStreamSynchronize(cudaStreamLegacy);
    return static_cast<int>(e);
  };
  k.def("upload", [sync_copy](uintptr_t dst, uintptr_t src, uint64_t n) {
    return sync_copy(dst, src, n, cudaMemcpyHostToDevice);
  });
  k.def("download", [sync_copy](uintptr_t dst, uintptr_t src, uint64_t n) {
    return sync_copy(dst, src, n, cudaMemcpyDeviceToHost);
  });
  k.def("memcpy_async", [](uintptr_t dst, uintptr_t src, uint64_t n, int kind, uintptr_t s) {
    py::gil_scoped_release nogil;
    return static_cast<int>(cudaMemcpyAsync(reinterpret_cast<void*>(dst), reinterpret_cast<const void*>(src), n,
                                            static_cast<cudaMemcpyKind>(kind), reinterpret_cast<cudaStream_t>(s)));
  });
  k.def("host_register", [](uintptr_t p, uint64_t n) {
    return static_cast<int>(cudaHostRegister(reinterpret_cast<void*>(p), n, cudaHostRegisterPortable));
  });
  k.def("host_unregister", [](uintptr_t p) { return static_cast<int>(cudaHostUnregister(reinterpret_cast<void*>(p))); });
  k.def("pointer_device", [](uintptr_t p) {
    cudaPointerAttributes a;
    if (cudaPointerGetAttributes(&a, reinterpret_cast<const void*>(p)) != cudaSuccess) return -3;
    return a.type == cudaMemoryTypeDevice ? a.device : -1;
  });
  // Deliberately read device memory from the host (a test expects this to kill the process).
  k.def("host_read", [](uintptr_t p) { return static_cast<int>(*reinterpret_cast<volatile uint8_t*>(p)); });
  k.def("stream_create_flags", [](unsigned flags) {
    cudaStream_t s = nullptr;
    cudaError_t e = cudaStreamCreateWithPriority(&s, flags, 0);
    if (e != cudaSuccess) throw std::runtime_error(cudaGetErrorName(e));
    return reinterpret_cast<uintptr_t>(s);
  });
  k.def("stream_synchronize", [](uintptr_t s) {
    py::gil_scoped_release nogil;
    return static_cast<int>(cudaStreamSynchronize(reinterpret_cast<cudaStream_t>(s)));
  });
  k.def("event_create", []() {
    cudaEvent_t e = nullptr;
    cudaError_t r = cudaEventCreateWithFlags(&e, cudaEventDisableTiming);
    if (r != cudaSuccess) throw std::runtime_error(cudaGetErrorName(r));
    return reinterpret_cast<uintptr_t>(e);
  });
  k.def("event_destroy", [](uintptr_t e) { (void)cudaEventDestroy(reinterpret_cast<cudaEvent_t>(e)); });
  k.def("event_record", [](uintptr_t e, uintptr_t s) {
    return static_cast<int>(cudaEventRecord(reinterpret_cast<cudaEvent_t>(e), reinterpret_cast<cudaStream_t>(s)));
  });
  k.def("event_query", [](uintptr_t e) { return static_cast<int>(cudaEventQuery(reinterpret_cast<cudaEvent_t>(e))); });
  k.def("stream_wait_event", [](uintptr_t s, uintptr_t e) {
    return static_cast<int>(
        cudaStreamWaitEvent(reinterpret_cast<cudaStream_t>(s), reinterpret_cast<cudaEvent_t>(e), 0));
  });
  k.def("capture_mode", [](int mode) {  // cudaThreadExchangeStreamCaptureMode; returns the old one
    cudaStreamCaptureMode m = static_cast<cudaStreamCaptureMode>(mode);
    (void)cudaThreadExchangeStreamCaptureMode(&m);
    return static_cast<int>(m);
  });
  k.def("begin_capture", [](uintptr_t s, int mode) {
    return static_cast<int>(
        cudaStreamBeginCapture(reinterpret_cast<cudaStream_t>(s), static_cast<cudaStreamCaptureMode>(mode)));
  });
  // Returns (error, graph handle or 0).
  k.def("end_capture", [](uintptr_t s) {
    cudaGraph_t g = nullptr;
    cudaError_t e = cudaStreamEndCapture(reinterpret_cast<cudaStream_t>(s), &g);
    return py::make_tuple(static_cast<int>(e), reinterpret_cast<uintptr_t>(g));
  });
  // Returns (error, status, capture id).
  k.def("capture_info", [](uintptr_t s) {
    cudaStreamCaptureStatus st = cudaStreamCaptureStatusNone;
    unsigned long long id = 0;
    cudaError_t e = cudaStreamGetCaptureInfo(reinterpret_cast<cudaStream_t>(s), &st, &id);
    return py::make_tuple(static_cast<int>(e), static_cast<int>(st), id);
  });
  k.def("graph_instantiate", [](uintptr_t g) {
    cudaGraphExec_t x = nullptr;
    cudaError_t e = cudaGraphInstantiate(&x, reinterpret_cast<cudaGraph_t>(g), 0);
    if (e != cudaSuccess) throw std::runtime_error(cudaGetErrorName(e));
    return reinterpret_cast<uintptr_t>(x);
  });
  k.def("graph_launch", [](uintptr_t x, uintptr_t s) {
    return static_cast<int>(cudaGraphLaunch(reinterpret_cast<cudaGraphExec_t>(x), reinterpret_cast<cudaStream_t>(s)));
  });
  k.def("graph_destroy", [](uintptr_t g) { (void)cudaGraphDestroy(reinterpret_cast<cudaGraph_t>(g)); });
  k.def("graph_exec_destroy", [](uintptr_t x) { (void)cudaGraphExecDestroy(reinterpret_cast<cudaGraphExec_t>(x)); });
  // A kernel that faults when it runs (an illegal address): the device's context gets a sticky error.
  k.def("enqueue_fault", [](uintptr_t s, int error) {
    const int dev = fdmock::stream_of(reinterpret_cast<cudaStream_t>(s))->device();
    return static_cast<int>(fdmock::enqueue(reinterpret_cast<cudaStream_t>(s),
                                            [dev, error] { fdmock::fault(dev, static_cast<cudaError_t>(error)); }));
  });
  k.def("counters", []() {
    auto& c = fdmock::config();
    py::dict d;
    d["batch_calls"] = c.batch_calls.load();
    d["memcpy_calls"] = c.memcpy_calls.load();
    d["memcpy2d_calls"] = c.memcpy2d_calls.load();
    d["kernel_calls"] = c.kernel_calls.load();
    d["crossing_copies"] = c.crossing_copies.load();
    d["unpinned_copies"] = c.unpinned_copies.load();
    d["syncs"] = c.syncs.load();
    d["live_allocs"] = c.live_allocs.load();
    d["live_streams"] = c.live_streams.load();
    d["live_events"] = c.live_events.load();
    d["registered_ranges"] = c.registered_ranges.load();
    d["live_graphs"] = c.live_graphs.load();
    d["captures_invalidated"] = c.captures_invalidated.load();
    return d;
  });
  k.def("stream_create", []() {
    cudaStream_t s = nullptr;
    (void)cudaStreamCreateWithPriority(&s, cudaStreamNonBlocking, 0);
    return reinterpret_cast<uintptr_t>(s);
  });
  k.def("stream_destroy", [](uintptr_t s) { (void)cudaStreamDestroy(reinterpret_cast<cudaStream_t>(s)); });
  k.def("sync", [](uintptr_t s) {
    py::gil_scoped_release nogil;
    fdmock::stream_of(reinterpret_cast<cudaStream_t>(s))->sync();
  });
  // Kernels, in stream order (captured when the stream captures). Device pointers only.
  // Fill n bytes at ptr with `value` (a kernel that overwrites a tensor).
  k.def("enqueue_fill", [](uintptr_t s, uintptr_t ptr, uint64_t n, int value) {
    return static_cast<int>(fdmock::enqueue(reinterpret_cast<cudaStream_t>(s), [=] {
      std::memset(fdmock::dev_bytes(reinterpret_cast<uint8_t*>(ptr)), value, n);
    }));
  });
  // Copy n bytes between device buffers (a kernel that produces a tensor).
  k.def("enqueue_copy", [](uintptr_t s, uintptr_t dst, uintptr_t src, uint64_t n) {
    return static_cast<int>(fdmock::enqueue(reinterpret_cast<cudaStream_t>(s), [=] {
      std::memcpy(fdmock::dev_bytes(reinterpret_cast<uint8_t*>(dst)),
                  fdmock::dev_bytes(reinterpret_cast<const uint8_t*>(src)), n);
    }));
  });
  // Add 1 to every byte (a kernel whose result depends on what ran before it).
  k.def("enqueue_increment", [](uintptr_t s, uintptr_t ptr, uint64_t n) {
    return static_cast<int>(fdmock::enqueue(reinterpret_cast<cudaStream_t>(s), [=] {
      uint8_t* p = fdmock::dev_bytes(reinterpret_cast<uint8_t*>(ptr));
      for (uint64_t i = 0; i < n; ++i) p[i] = static_cast<uint8_t>(p[i] + 1);
    }));
  });
  k.def("enqueue_sleep", [](uintptr_t s, double seconds) {
    return static_cast<int>(fdmock::enqueue(reinterpret_cast<cudaStream_t>(s), [=] {
      std::this_thread::sleep_for(std::chrono::duration<double>(seconds));
    }));
  });
  // A gate: the stream's later work waits until open_gate(id) (a pause that, unlike a sleep, cannot
  // end before the test has seen what it waits for). Returns the gate's id.
  k.def("enqueue_gate", [](uintptr_t s) {
    auto gate = std::make_shared<MockGate>();
    uint64_t id;
    {
      std::lock_guard<std::mutex> g(mock_gates_mu());
      id = ++mock_gate_serial();
      mock_gates()[id] = gate;
    }
    const int e = static_cast<int>(fdmock::enqueue(reinterpret_cast<cudaStream_t>(s), [gate] {
      std::unique_lock<std::mutex> lk(gate->mu);
      gate->cv.wait(lk, [&] { return gate->open; });
    }));
    if (e != 0) throw std::runtime_error("enqueue_gate: error " + std::to_string(e));
    return id;
  });
  k.def("open_gate", [](uint64_t id) {
    std::shared_ptr<MockGate> gate;
    {
      std::lock_guard<std::mutex> g(mock_gates_mu());
      auto it = mock_gates().find(id);
      if (it == mock_gates().end()) return false;
      gate = it->second;
      mock_gates().erase(it);
    }
    {
      std::lock_guard<std::mutex> g(gate->mu);
      gate->open = true;
    }
    gate->cv.notify_all();
    return true;
  });
}
#endif

}  // namespace

std::shared_ptr<CudaTensorLane> make_cuda_tensor_lane(py::object stager, py::object raw_stream,
                                                      py::object stream_object) {
  return std::make_shared<StagerTensorLane>(std::move(stager), std::move(raw_stream), std::move(stream_object));
}

void bind_cuda(py::module_& m) {
#ifdef FASTDUMP_CUDA_MOCK
  bind_mock(m);
#endif
  m.def("cuda_compiled", []() { return true; });
  m.def("note_capture_begin", &CudaStager::note_capture_begin,
        "a CUDA graph capture is about to begin (torch's CUDAGraph.capture_begin): every lean lane checks its "
        "stream again at its next tensor");
  m.def(
      "capture_gate",
      [](bool enter) {
        if (!enter) return CudaStager::capture_gate(false);
        py::gil_scoped_release nogil;  // a seal under way holds it for a moment
        CudaStager::capture_gate(true);
      },
      py::arg("enter"),
      "held around torch's CUDAGraph.capture_begin (True, then False on the same thread): seals from other "
      "threads than the lane's never straddle the capture's beginning");
  m.def("cuda_info", &info_dict,
        "CUDA build and run-time facts: compiled, built_with, runtime_version, driver_version, device_count, "
        "devices [{index, name, uuid, pci_bus_id, total_memory, ...}], reason (when no GPU is usable)");
  m.def("cuda_pointer_device", &cuda_pointer_device, py::arg("ptr"),
        "GPU ordinal owning a device (or managed) pointer; -1 for host memory");
  bind_graph_recorder(m);

  py::class_<CudaStager>(m, "CudaStager")
      .def(py::init<Producer*, uint64_t>(), py::arg("producer"), py::arg("device_ring_bytes"),
           py::keep_alive<1, 2>(),  // the producer (and its mapping) outlives the stager
           "One per process. Raises RuntimeError when no GPU is usable.")
      .def("stage", &stage, py::arg("channel"), py::arg("name_id"), py::arg("pass_id"), py::arg("dtype"),
           py::arg("elem_size"), py::arg("shape"), py::arg("strides"), py::arg("ptr"), py::arg("device"),
           py::arg("stream"), py::arg("block"), py::arg("producer_stream") = 0, py::arg("timeout_s") = kWaitForever,
           "Snapshot a device tensor on `stream` and queue it for the host ring. Returns STAGED, DROPPED, "
           "TIMED_OUT (dropped after waiting timeout_s for host-ring space), TORN, RING_TOO_SMALL, "
           "DISABLED, TOO_LARGE or CAPTURING. Strides in elements; stream is a cudaStream_t as int (0: legacy); "
           "producer_stream (if not 0 or `stream`): the stream that produced the tensor, waited for first.")
      .def(
          "register_host",
          [](CudaStager& s, int device) {
            py::gil_scoped_release nogil;
            return s.register_host(device);
          },
          py::arg("device") = -1,
          "Pin the host ring (cudaHostRegister, once) on `device` (-1: one that already has a context); "
          "returns the seconds it took.")
      .def(
          "prepare",
          [](CudaStager& s, int device) {
            py::gil_scoped_release nogil;
            s.prepare(device);
          },
          py::arg("device"), "Allocate `device`'s staging ring now; RuntimeError when it cannot be had.")
      .def("submitted", &CudaStager::submitted, py::arg("device"))
      .def("completed", &CudaStager::completed, py::arg("device"))
      .def(
          "flush",
          [](CudaStager& s, double timeout_s) {
            py::gil_scoped_release nogil;
            return s.flush(timeout_s);
          },
          py::arg("timeout_s") = 600.0, "Wait until every staged record is published; False on timeout.")
      .def("stats", &stats_dict)
      .def_property("events_every", &CudaStager::events_every, &CudaStager::set_events_every,
                    "lean-path snapshots per completion event (N; FASTDUMP_CUDA_EVENTS_EVERY, default 64)")
      .def_property_readonly("device_ring_bytes", &CudaStager::device_ring_bytes)
      .def_property_readonly("producer", &CudaStager::producer, py::return_value_policy::reference)
      .def(
          "close",
          [](CudaStager& s, double timeout_s) {
            py::gil_scoped_release nogil;
            s.close(timeout_s);
          },
          py::arg("timeout_s") = 60.0);
}

}  // namespace fastdump
