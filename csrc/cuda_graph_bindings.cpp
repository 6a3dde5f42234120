// fastdump._C.GraphRecorder: CUDA-graph record mode (csrc/cuda_graph_record.h), pointers and
// stream handles as integers, no libtorch.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstddef>
#include <string>
#include <vector>

#include "bindings.h"
#include "cuda_graph_record.h"

namespace py = pybind11;

namespace fastdump {

void bind_graph_recorder(py::module_& m) {
  m.attr("GRAPH_PASS_BASE") = kGraphPassBase;
  m.attr("NO_SPACE") = static_cast<int>(kNoSpace);  // GraphRecorder.record: no slot or ring room
  // The replay span record (fastdump/protocol.py re-exports these; the writer splits the record).
  m.attr("REPLAY_SPAN_DTYPE") = static_cast<int>(kReplaySpanDtype);
  m.attr("GRAPH_SPAN_NAME_BASE") = kGraphSpanNameBase;
  m.attr("GRAPHS_PER_RECORDER") = kMaxGraphsPerRecorder;
  m.attr("REPLAY_HEADER_BYTES") = kReplayHeaderBytes;
  m.attr("REPLAY_MAGIC") = kReplayMagic;
  m.attr("REPLAY_HEADER_FIELDS") = py::make_tuple(  // ReplayHeader: little-endian uint64 each, in order
      py::make_tuple("magic", offsetof(ReplayHeader, magic)), py::make_tuple("pass_id", offsetof(ReplayHeader, pass_id)),
      py::make_tuple("replay", offsetof(ReplayHeader, replay)),
      py::make_tuple("span_name_id", offsetof(ReplayHeader, span_name_id)),
      py::make_tuple("span_bytes", offsetof(ReplayHeader, span_bytes)),
      py::make_tuple("graph", offsetof(ReplayHeader, graph)));
  py::class_<GraphRecorder>(m, "GraphRecorder")
      .def(py::init<CudaStager*, uint32_t, int, uint64_t, uint64_t, uint32_t, const std::string&,
                    const std::string&>(),
           py::arg("stager"), py::arg("channel"), py::arg("device"), py::arg("slot_bytes"), py::arg("ring_bytes"),
           py::arg("log_entries") = 1024, py::arg("drop_note") = "", py::arg("drop_mark") = "",
           py::keep_alive<1, 2>(),  // the stager outlives the recorder
           "One per Dumper and GPU; allocates its device memory now (call it outside any capture).")
      .def("begin_graph", &GraphRecorder::begin_graph, py::arg("stream"),
           "A captured pass starts on `stream` (capturing); returns the graph id (OverflowError: no id free).")
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
      .def("end_graph", &GraphRecorder::end_graph,
           "Record the commit kernels; returns the graph id, or -1 when nothing was recorded.")
      .def(
          "layout",
          [](GraphRecorder& r, int graph) {
            py::list tensors;
            for (const GraphTensorLayout& t : r.layout(graph))
              tensors.append(py::make_tuple(t.name_id, t.dtype, py::tuple(py::cast(t.shape)), t.offset, t.nbytes));
            py::dict d;
            d["span_name_id"] = r.span_name_id(graph);
            d["span_bytes"] = r.span_bytes(graph);
            d["graph_number"] = r.graph_number(graph);  // never reused (the id is, once reclaimed)
            d["tensors"] = tensors;  // (name_id, dtype, shape, offset, nbytes), offsets from the span's start
            return d;
          },
          py::arg("graph"), "A committed graph's span record: its name id, size and tensor layout.")
      .def_property_readonly("dropped_replays", &GraphRecorder::dropped_replays)
      .def("abort_graph", &GraphRecorder::abort_graph)
      .def("capture_ending", &GraphRecorder::capture_ending,
           "The open graph's capture ends before its pass: record its done event now (see reclaim).")
      .def_property_readonly("open_serial", &GraphRecorder::open_serial,
                             "The open capture's serial (0: none), which reclaim() takes.")
      .def(
          "reclaim",
          [](GraphRecorder& r, std::vector<uint64_t> serials) {
            py::gil_scoped_release nogil;  // (it waits for the graphs' last launches)
            return r.reclaim(serials);
          },
          py::arg("serials"),
          "Give back the slots of captures whose graphs can never run again; returns the serials given back.")
      .def("wait_launched", &GraphRecorder::wait_launched, py::call_guard<py::gil_scoped_release>(),
           "Wait until the latest launch of every committed graph ran its commit kernels; False on an error.")
      .def("capture_ended", &GraphRecorder::capture_ended,
           "The open graph's capture is over (ended, or another since on its stream): not committable.")
      .def("capture_invalidated", &GraphRecorder::capture_invalidated,
           "The open graph's capture is invalidated, not ended yet: it yields no graph (nothing to dump).")
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
             d["live_graphs"] = s.live_graphs;
             d["captured_tensors"] = s.captured_tensors;
             d["replays"] = s.replays;
             d["dropped_replays"] = s.dropped_replays;
             d["unwritten_replays"] = s.unwritten_replays;
             d["tensors"] = s.tensors;
             d["bytes"] = s.bytes;
             d["span_records"] = s.span_records;
             d["slot_bytes"] = s.slot_bytes;
             d["slot_used"] = s.slot_used;
             d["reclaimed_graphs"] = s.reclaimed_graphs;
             d["reclaimed_bytes"] = s.reclaimed_bytes;
             d["claimed_replays"] = s.claimed_replays;
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
