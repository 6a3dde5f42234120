// Optional parts of fastdump._C, compiled in or stubbed out by setup.py.
#pragma once

#include <pybind11/pybind11.h>

#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

namespace fastdump {
// Copies and checksums of at least this many bytes release the GIL (a thread writer must not
// hold the serving thread up); below it, releasing and retaking the GIL costs more than the copy.
constexpr uint64_t kReleaseGilBytes = 64 * 1024;

// The bytes of a C-contiguous buffer (bytes, memoryview, numpy array of any dtype); `what` names
// the caller in the error for any other buffer. `info` keeps the buffer alive while it is used.
struct ContiguousBytes {
  pybind11::buffer_info info;
  const uint8_t* ptr;
  size_t n;
};
inline ContiguousBytes contiguous_bytes(const pybind11::buffer& data, const char* what) {
  pybind11::buffer_info info = data.request();
  for (pybind11::ssize_t i = info.ndim - 1, want = info.itemsize; i >= 0; --i) {
    if (info.shape[i] > 1 && info.strides[i] != want)
      throw std::invalid_argument(std::string(what) + " needs a contiguous buffer");
    want *= info.shape[i];
  }
  const auto* ptr = static_cast<const uint8_t*>(info.ptr);
  const size_t n = static_cast<size_t>(info.size) * static_cast<size_t>(info.itemsize);
  return ContiguousBytes{std::move(info), ptr, n};
}

// Defines cuda_compiled(), cuda_info() and the CUDA staging entry points (csrc/cuda_bindings.cpp),
// or their CPU-only stand-ins (csrc/cuda_stub.cpp).
void bind_cuda(pybind11::module_& m);
// fastdump._C.ForwardWrapper and CaptureState (csrc/forward_wrapper.cpp).
void bind_forward_wrapper(pybind11::module_& m);
// For forward_wrapper.cpp (csrc/module.cpp): the C++ object behind a ChannelStager (throws when
// `lane` is not one), and its stage_tensor, the one per-tensor hot path (the pybind method is the
// same function): a _C status or ChannelStager.NOT_FAST; throws py::error_already_set & co.
void* channel_stager_ptr(pybind11::handle lane);
int stage_tensor_on(void* lane, uint32_t name_id, pybind11::handle tensor);
// The same lane's pass records, for the C root wrapper's pass (CaptureState.root_pass): whether
// its producer saw the writer alive within max_age_s and the writer still writes its channel;
// open_pass (the plain begin record without waiting, then the pass's settings: its seq, or 0 when
// nothing was done); put_plain_end (its seq, or 0; the record carries the lane's own count of the
// pass's tensors, ChannelStager::sent_in). None of them waits or raises a Python exception.
bool lane_writer_seen_alive(void* lane, double max_age_s);
uint64_t lane_open_pass(void* lane, int64_t pass_id, bool block, double timeout_s);
uint64_t lane_put_plain_end(void* lane, int64_t pass_id, uint64_t dropped);
// fastdump._C.PagePool, PageBuffer, RowSink (csrc/writer_rows_bindings.cpp).
void bind_writer_rows(pybind11::module_& m);
// fastdump._C.GraphRecorder (csrc/cuda_graph_bindings.cpp; CUDA builds only).
void bind_graph_recorder(pybind11::module_& m);

// The CUDA half of ChannelStager::stage_tensor, the one per-tensor entry of the extension
// (csrc/cuda_bindings.cpp): a tensor that says it is CUDA, whose dtype, layout and lazy bits the
// caller already checked, staged through the CudaStager's lean path (CudaStager::stage_lean).
class CudaTensorLane {
 public:
  static constexpr int kNotFast = -1;  // ChannelStager::kNotFast: the caller's general path
  virtual ~CudaTensorLane() = default;
  // A staging status, or kNotFast: capturing (the graph recorder runs in Python), a device ring
  // that could not be had, an error before anything was staged. `tensor`: borrowed.
  virtual int stage(uint32_t channel, uint32_t name_id, int64_t pass_id, bool block, double timeout_s,
                    PyObject* tensor, uint16_t code, uint64_t elem_size, const std::vector<int64_t>& shape,
                    const std::vector<int64_t>& strides, uintptr_t ptr) = 0;
  // The pass ended: its last snapshots get their event and go to the drain.
  virtual void end_pass() = 0;
};

// For ChannelStager.set_cuda: `stager` a _C.CudaStager; raw_stream(device) -> the current
// cudaStream_t as an int (called per tensor); stream_object(device) -> the stream object passed to
// tensor.record_stream (called when the raw stream changes). CUDA builds only (else it raises).
std::shared_ptr<CudaTensorLane> make_cuda_tensor_lane(pybind11::object stager, pybind11::object raw_stream,
                                                      pybind11::object stream_object);
}  // namespace fastdump
