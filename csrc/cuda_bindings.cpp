// fastdump._C's CUDA part (built when a CUDA toolkit is found; cuda_stub.cpp otherwise).
// Tensors arrive as raw pointers, shapes, strides and stream handles: no libtorch.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <chrono>
#include <cstring>
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
  d["device_ring_full_waits"] = st.device_ring_full_waits;
  d["device_ring_wait_seconds"] = st.device_ring_wait_seconds;
  d["host_ring_full_waits"] = st.host_ring_full_waits;
  d["drain_seconds"] = st.drain_seconds;
  d["register_seconds"] = st.register_seconds;
  d["registered_bytes"] = st.registered_bytes;
  d["batch_api"] = st.batch_api;
  d["last_error"] = st.last_error;
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
          bool block) {
  CudaSource src;
  src.ptr = ptr;
  src.elem_size = elem_size;
  src.shape = std::move(shape);
  src.strides = std::move(strides);
  src.device = device;
  src.stream = stream;
  GilRelease gil;  // declared before the call: re-acquired after it, even when it throws
  return s.stage(channel, name_id, pass_id, dtype, src, block, &gil);
}

#ifdef FASTDUMP_CUDA_MOCK
// Test build only (tests/cuda_mock): drive the mock runtime from Python.
void bind_mock(py::module_& m) {
  py::module_ k = m.def_submodule("_mock", "controls of the mock CUDA runtime (tests only)");
  k.def("set", [](const std::string& name, int64_t v) {
    auto& c = fdmock::config();
    if (name == "device_count") c.device_count = static_cast<int>(v);
    else if (name == "max_delay_us") c.max_delay_us = static_cast<int>(v);
    else if (name == "fail_batch") c.fail_batch = static_cast<int>(v);
    else if (name == "fail_event_query") c.fail_event_query = static_cast<int>(v);
    else if (name == "fail_malloc") c.fail_malloc = static_cast<int>(v);
    else if (name == "capturing") c.capturing = static_cast<int>(v);
    else throw std::invalid_argument(name);
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
    return d;
  });
  k.def("stream_create", []() {
    cudaStream_t s;
    (void)cudaStreamCreateWithPriority(&s, cudaStreamNonBlocking, 0);
    return reinterpret_cast<uintptr_t>(s);
  });
  k.def("stream_destroy", [](uintptr_t s) { (void)cudaStreamDestroy(reinterpret_cast<cudaStream_t>(s)); });
  k.def("sync", [](uintptr_t s) {
    py::gil_scoped_release nogil;
    fdmock::stream_of(reinterpret_cast<cudaStream_t>(s))->sync();
  });
  // In stream order: fill n bytes at ptr with `value` (a kernel that overwrites a tensor).
  k.def("enqueue_fill", [](uintptr_t s, uintptr_t ptr, uint64_t n, int value) {
    fdmock::stream_of(reinterpret_cast<cudaStream_t>(s))->enqueue(
        [=] { std::memset(reinterpret_cast<void*>(ptr), value, n); });
  });
  // In stream order: copy n bytes (a kernel that produces a tensor).
  k.def("enqueue_copy", [](uintptr_t s, uintptr_t dst, uintptr_t src, uint64_t n) {
    fdmock::stream_of(reinterpret_cast<cudaStream_t>(s))->enqueue(
        [=] { std::memcpy(reinterpret_cast<void*>(dst), reinterpret_cast<const void*>(src), n); });
  });
  k.def("enqueue_sleep", [](uintptr_t s, double seconds) {
    fdmock::stream_of(reinterpret_cast<cudaStream_t>(s))->enqueue(
        [=] { std::this_thread::sleep_for(std::chrono::duration<double>(seconds)); });
  });
}
#endif

}  // namespace

void bind_cuda(py::module_& m) {
#ifdef FASTDUMP_CUDA_MOCK
  bind_mock(m);
#endif
  m.def("cuda_compiled", []() { return true; });
  m.def("cuda_info", &info_dict,
        "CUDA build and run-time facts: compiled, built_with, runtime_version, driver_version, device_count, "
        "devices [{index, name, uuid, pci_bus_id, total_memory, ...}], reason (when no GPU is usable)");
  m.def("cuda_pointer_device", &cuda_pointer_device, py::arg("ptr"),
        "GPU ordinal owning a device (or managed) pointer; -1 for host memory");
  m.attr("CAPTURING") = kStageCapturing;

  py::class_<CudaStager>(m, "CudaStager")
      .def(py::init<Producer*, uint64_t>(), py::arg("producer"), py::arg("device_ring_bytes"),
           py::keep_alive<1, 2>(),  // the producer (and its mapping) outlives the stager
           "One per process. Raises RuntimeError when no GPU is usable.")
      .def("stage", &stage, py::arg("channel"), py::arg("name_id"), py::arg("pass_id"), py::arg("dtype"),
           py::arg("elem_size"), py::arg("shape"), py::arg("strides"), py::arg("ptr"), py::arg("device"),
           py::arg("stream"), py::arg("block"),
           "Snapshot a device tensor on `stream` and queue it for the host ring. Returns STAGED, DROPPED, "
           "DISABLED, TOO_LARGE or CAPTURING. Strides in elements; stream is a cudaStream_t as int (0: legacy).")
      .def(
          "register_host",
          [](CudaStager& s) {
            py::gil_scoped_release nogil;
            return s.register_host();
          },
          "Pin the host ring (cudaHostRegister, once); returns the seconds it took.")
      .def(
          "flush",
          [](CudaStager& s, double timeout_s) {
            py::gil_scoped_release nogil;
            return s.flush(timeout_s);
          },
          py::arg("timeout_s") = 600.0, "Wait until every staged record is published; False on timeout.")
      .def("stats", &stats_dict)
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
