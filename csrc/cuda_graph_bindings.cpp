// fastdump._C.GraphRecorder: CUDA-graph record mode (csrc/cuda_graph_record.h), pointers and
// stream handles as integers, no libtorch.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <string>
#include <vector>

#include "bindings.h"
#include "cuda_graph_record.h"

namespace py = pybind11;

namespace fastdump {

void bind_graph_recorder(py::module_& m) {
  m.attr("GRAPH_PASS_BASE") = kGraphPassBase;
  m.attr("NO_SPACE") = static_cast<int>(kNoSpace);  // GraphRecorder.record: no slot or ring room
  py::class_<GraphRecorder>(m, "GraphRecorder")
      .def(py::init<CudaStager*, uint32_t, int, uint64_t, uint64_t, uint32_t>(), py::arg("stager"),
           py::arg("channel"), py::arg("device"), py::arg("slot_bytes"), py::arg("ring_bytes"),
           py::arg("log_entries") = 1024,
           py::keep_alive<1, 2>(),  // the stager outlives the recorder
           "One per Dumper and GPU; allocates its device memory now (call it outside any capture).")
      .def("begin_graph", &GraphRecorder::begin_graph, py::arg("stream"),
           "A captured pass starts on `stream` (capturing); returns the graph id.")
      .def(
          "record",
          [](GraphRecorder& r, uint32_t name_id, uint16_t dtype, uint64_t elem_size, std::vector<int64_t> shape,
             std::vector<int64_t> strides, uintptr_t ptr, int device, uintptr_t stream) {
            CudaSource src{ptr, elem_size, std::move(shape), std::move(strides), device, stream, 0};
            return r.record(name_id, dtype, src);
          },
          py::arg("name_id"), py::arg("dtype"), py::arg("elem_size"), py::arg("shape"), py::arg("strides"),
          py::arg("ptr"), py::arg("device"), py::arg("stream"),
          "Record the tensor's snapshot into the graph being captured: STAGED, TOO_LARGE or NO_SPACE.")
      .def("end_graph", &GraphRecorder::end_graph, py::arg("meta_json"), py::arg("skipped_json") = "[]",
           "Record the commit kernels; returns the graph id, or -1 when nothing was recorded.")
      .def("abort_graph", &GraphRecorder::abort_graph)
      .def_property_readonly("capturing", &GraphRecorder::capturing)
      .def("set_paused", &GraphRecorder::set_paused, py::arg("paused"))
      .def(
          "flush",
          [](GraphRecorder& r, double timeout_s) {
            py::gil_scoped_release nogil;
            return r.flush(timeout_s);
          },
          py::arg("timeout_s") = 600.0)
      .def("stats",
           [](GraphRecorder& r) {
             GraphRecorderStats s = r.stats();
             py::dict d;
             d["graphs"] = s.graphs;
             d["captured_tensors"] = s.captured_tensors;
             d["replays"] = s.replays;
             d["dropped_replays"] = s.dropped_replays;
             d["tensors"] = s.tensors;
             d["bytes"] = s.bytes;
             d["dropped_tensors"] = s.dropped_tensors;
             d["lost_pass_ends"] = s.lost_pass_ends;
             d["slot_bytes"] = s.slot_bytes;
             d["slot_used"] = s.slot_used;
             d["ring_bytes"] = s.ring_bytes;
             d["last_error"] = s.last_error;
             d["broken"] = s.broken;
             return d;
           })
      .def(
          "close",
          [](GraphRecorder& r, double timeout_s, bool free_memory) {
            py::gil_scoped_release nogil;
            r.close(timeout_s, free_memory);
          },
          py::arg("timeout_s") = 60.0, py::arg("free_memory") = false);
}

}  // namespace fastdump
