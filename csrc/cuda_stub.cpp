// Built when no CUDA toolkit was found: fastdump runs its CPU path and says so.
#include "bindings.h"

#include <stdexcept>

namespace fastdump {

void bind_cuda(pybind11::module_& m) {
  m.def("cuda_compiled", []() { return false; });
  m.def("note_capture_begin", []() {});  // no lean CUDA lanes without CUDA
  m.def("capture_gate", [](bool) {}, pybind11::arg("enter"));
  m.def("cuda_info", []() {
    pybind11::dict d;
    d["compiled"] = false;
    d["reason"] = "built without a CUDA toolkit";
    return d;
  });
}

std::shared_ptr<CudaTensorLane> make_cuda_tensor_lane(pybind11::object, pybind11::object, pybind11::object) {
  throw std::runtime_error("fastdump was built without CUDA");
}

}  // namespace fastdump
