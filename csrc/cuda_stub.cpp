// Built when no CUDA toolkit was found: fastdump runs its CPU path and says so.
#include "bindings.h"

namespace fastdump {

void bind_cuda(pybind11::module_& m) {
  m.def("cuda_compiled", []() { return false; });
  m.def("cuda_info", []() {
    pybind11::dict d;
    d["compiled"] = false;
    d["reason"] = "built without a CUDA toolkit";
    return d;
  });
}

}  // namespace fastdump
