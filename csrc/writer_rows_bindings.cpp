// fastdump._C.PagePool, PageBuffer and RowSink: the writer's row buffers and its per-channel
// fast path (csrc/writer_rows.h), for fastdump/writer/{pages,channel_writer,segment_file}.py.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>


#include "bindings.h"
#include "ring.h"
#include "writer_rows.h"

namespace py = pybind11;

namespace fastdump {
namespace {

// Read-only views of the buffer's memory: valid until free() (the pages are then reused).
py::memoryview view_of(const uint8_t* ptr, size_t n) {
  return py::memoryview::from_memory(ptr, static_cast<py::ssize_t>(n));
}

py::list views(const PageBuffer& b) {
  py::list out;
  const auto& pages = b.pages();
  for (size_t i = 0; i < pages.size(); ++i)
    out.append(view_of(pages[i].ptr, i + 1 == pages.size() ? b.fill() : pages[i].size));
  return out;
}

// (body, tail): body, whole kPageBytes multiples at aligned addresses (O_DIRECT takes them); tail,
// the rest of the last page (shorter than kPageBytes), or None.
py::tuple split_aligned(const PageBuffer& b) {
  py::list body;
  const auto& pages = b.pages();
  if (pages.empty()) return py::make_tuple(body, py::none());
  for (size_t i = 0; i + 1 < pages.size(); ++i) body.append(view_of(pages[i].ptr, pages[i].size));
  const size_t cut = b.fill() - b.fill() % kPageBytes;
  if (cut) body.append(view_of(pages.back().ptr, cut));
  py::object tail = cut < b.fill() ? py::object(view_of(pages.back().ptr + cut, b.fill() - cut)) : py::none();
  return py::make_tuple(body, tail);
}

std::vector<int64_t> dims_of(py::handle seq) {
  std::vector<int64_t> dims;
  for (py::handle d : seq) dims.push_back(py::cast<int64_t>(d));
  return dims;
}

}  // namespace

void bind_writer_rows(py::module_& m) {
  m.attr("MIN_PAGE") = kMinPage;
  m.attr("MAX_PAGE") = kMaxPage;
  m.def("page_size_for", &page_size_for, py::arg("nbytes"), py::arg("previous") = 0);

  py::class_<PagePool, std::shared_ptr<PagePool>>(m, "PagePool", "Free lists of pre-faulted, page-aligned pages.")
      .def(py::init<>())
      .def_property_readonly("allocated", &PagePool::allocated, "bytes mapped so far");

  py::class_<PageBuffer, std::shared_ptr<PageBuffer>>(m, "PageBuffer",
                                                      "A byte stream (one block's rows) in pool pages.")
      .def(py::init([](std::shared_ptr<PagePool> pool) { return std::make_shared<PageBuffer>(std::move(pool)); }),
           py::arg("pool") = nullptr)
      .def(
          "append",
          [](PageBuffer& b, py::buffer data) {
            const ContiguousBytes src = contiguous_bytes(data, "PageBuffer.append");
            if (src.n < kReleaseGilBytes) return b.append(src.ptr, src.n);
            py::gil_scoped_release nogil;
            b.append(src.ptr, src.n);
          },
          py::arg("data"), "copy `data` (any C-contiguous buffer) in, with streaming stores")
      .def("views", &views, "read-only views covering the stream, in order (valid until free())")
      .def("split_aligned", &split_aligned)
      .def_property_readonly("pages", [](const PageBuffer& b) {
        py::list out;
        for (const auto& p : b.pages()) out.append(view_of(p.ptr, p.size));
        return out;
      })
      .def("free", &PageBuffer::free, "give the pages back to the pool (the buffer is empty again)")
      .def_property_readonly("nbytes", &PageBuffer::nbytes)
      .def_property_readonly("fill", &PageBuffer::fill)
      .def_readwrite("rows", &PageBuffer::rows);

  py::class_<RowSink, std::shared_ptr<RowSink>>(m, "RowSink",
                                                "One channel's pending rows and index; the writer's fast path.")
      .def(py::init<>())
      .def(
          "add_layout",
          [](RowSink& s, uint32_t name_id, uint16_t dtype, py::object row_shape, int32_t block, int32_t name_slot,
             uint64_t row_bytes, std::shared_ptr<PageBuffer> buf) {
            if (!buf) throw std::invalid_argument("add_layout needs a PageBuffer");
            const bool scalar = row_shape.is_none();
            s.add_layout(name_id, dtype, scalar, scalar ? std::vector<int64_t>{} : dims_of(row_shape), block,
                         name_slot, row_bytes, std::move(buf));
          },
          py::arg("name_id"), py::arg("dtype"), py::arg("row_shape"), py::arg("block"), py::arg("name_slot"),
          py::arg("row_bytes"), py::arg("buf"), "row_shape None: rows are 0-d tensors")
      .def(
          "append",
          [](RowSink& s, int32_t block, int64_t pass_id, py::buffer data, int64_t rows) {
            const ContiguousBytes src = contiguous_bytes(data, "RowSink.append");
            s.append(block, pass_id, src.ptr, src.n, rows);
          },
          py::arg("block"), py::arg("pass_id"), py::arg("data"), py::arg("rows"))
      .def(
          "add_index",
          [](RowSink& s, int64_t pass_id, int32_t name_slot, int32_t block, int64_t first_row, int64_t rows,
             uint32_t crc, uint64_t nbytes) {
            s.add_index(IndexRow{pass_id, name_slot, block, first_row, rows, crc}, nbytes);
          },
          py::arg("pass_id"), py::arg("name_slot"), py::arg("block"), py::arg("first_row"), py::arg("rows"),
          py::arg("crc32c"), py::arg("nbytes"))
      .def("set_pass", &RowSink::set_pass)
      .def("clear_pass", &RowSink::clear_pass)
      .def("reset", &RowSink::reset)
      .def(
          "index_bytes",
          [](const RowSink& s) {
            const auto& index = s.index();
            return py::bytes(reinterpret_cast<const char*>(index.data()), index.size() * sizeof(IndexRow));
          },
          "the index rows as format.INDEX_DTYPE bytes, in arrival order")
      .def_property_readonly("tensors", [](const RowSink& s) { return s.index().size(); })
      .def_property_readonly("nbytes", &RowSink::nbytes)
      .def_property_readonly("taken", &RowSink::taken)
      .def_readwrite("accepting", &RowSink::accepting);
}

}  // namespace fastdump
