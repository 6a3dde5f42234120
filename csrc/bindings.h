// Optional parts of fastdump._C, compiled in or stubbed out by setup.py.
#pragma once

#include <pybind11/pybind11.h>

namespace fastdump {
// Defines cuda_compiled(), cuda_info() and the CUDA staging entry points (csrc/cuda_bindings.cpp),
// or their CPU-only stand-ins (csrc/cuda_stub.cpp).
void bind_cuda(pybind11::module_& m);
// fastdump._C.GraphRecorder (csrc/cuda_graph_bindings.cpp; CUDA builds only).
void bind_graph_recorder(pybind11::module_& m);
}  // namespace fastdump
