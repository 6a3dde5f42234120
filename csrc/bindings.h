// Optional parts of fastdump._C, compiled in or stubbed out by setup.py.
#pragma once

#include <pybind11/pybind11.h>

#include <cstdint>

namespace fastdump {
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
// fastdump._C.GraphRecorder (csrc/cuda_graph_bindings.cpp; CUDA builds only).
void bind_graph_recorder(pybind11::module_& m);
}  // namespace fastdump
