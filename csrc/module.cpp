// fastdump._C: the staging engine's Python face. No libtorch: tensors arrive as raw pointers,
// element sizes, shapes and strides, so one build serves every torch version (and CuPy/DLPack).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cstring>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "bindings.h"
#include "crc32c.h"
#include "ring.h"
#include "writer_rows.h"
#include "strided_copy.h"
#include "tensor_reader.h"

namespace py = pybind11;
using namespace fastdump;

namespace {

// A tensor with elements but a null data pointer: its storage was freed or resized to 0 bytes
// under it (untyped_storage().resize_(0), as FSDP does). Reading it would fault: the caller
// records the tensor as skipped with this reason (exported as _C.NO_DATA for the Python paths).
constexpr const char* kNoData =
    "its storage holds no data (freed, resized to 0 bytes, or a tensor subclass without storage of its own): not read";
// The tensor reader's -1: the storage is null or ends before the tensor's last element.
constexpr const char* kStorageShort =
    "its storage holds no data or ends before its last element (freed or resized under it): not read";

// `src` copied into this thread's own scratch, for use while the GIL is released: `src` may be a
// ChannelStager's scratch, which another thread staging through the same channel then refills
// (a mixed pass: the copy under way read the other tensor's shape and strides, looped or read
// past its own tensor). No allocation once warm.
const HostSource& own_source(const HostSource& src) {
  thread_local HostSource mine{};
  mine.ptr = src.ptr;
  mine.elem_size = src.elem_size;
  mine.shape.assign(src.shape.begin(), src.shape.end());
  mine.strides.assign(src.strides.begin(), src.strides.end());
  return mine;
}

// Stages `src` (GIL held by the caller; released around long copies and waits, which read this
// thread's own copy of `src`).
int stage_source(Producer& p, uint32_t channel, uint32_t name_id, int64_t pass_id, uint16_t dtype,
                 const HostSource& src, bool block, double timeout_s) {
  if (src.shape.size() != src.strides.size()) throw std::invalid_argument("shape and strides differ in length");
  uint64_t nbytes = src.elem_size;
  for (int64_t d : src.shape) nbytes *= static_cast<uint64_t>(d);
  if (src.ptr == nullptr && nbytes != 0) throw std::invalid_argument(kNoData);
  StageStatus st;
  if (nbytes < kReleaseGilBytes) {
    st = p.stage_host(channel, name_id, pass_id, dtype, src, /*block=*/false);
    if (st == kNoSpace && block) {
      // Waiting for the writer: a thread writer needs the GIL to make progress.
      const HostSource& mine = own_source(src);
      py::gil_scoped_release nogil;
      st = p.stage_host(channel, name_id, pass_id, dtype, mine, true, timeout_s);
    }
  } else {
    const HostSource& mine = own_source(src);
    py::gil_scoped_release nogil;
    st = p.stage_host(channel, name_id, pass_id, dtype, mine, block, timeout_s);
  }
  if (st == kNoSpace || st == kTimedOut) {  // dropped whole; TIMED_OUT tells the caller it waited
    p.count_dropped(1);
    return st == kNoSpace ? static_cast<int>(kDropped) : static_cast<int>(kTimedOut);
  }
  return st;
}

int stage_host(Producer& p, uint32_t channel, uint32_t name_id, int64_t pass_id, uint16_t dtype,
               uint64_t elem_size, std::vector<int64_t> shape, std::vector<int64_t> strides,
               uintptr_t ptr, bool block, double timeout_s) {
  HostSource src{reinterpret_cast<const uint8_t*>(ptr), elem_size, std::move(shape), std::move(strides)};
  return stage_source(p, channel, name_id, pass_id, dtype, src, block, timeout_s);
}

bool has_no_elements(const std::vector<int64_t>& shape) {
  for (int64_t d : shape)
    if (d == 0) return true;
  return false;
}

// Whether every element of a tensor at `data` (shape, strides in elements) lies within the
// `nbytes` of its storage at `base`. The copy reads exactly that range: outside it, it faults (a
// storage freed or resized under a view) and the served model would crash.
bool within_storage(uintptr_t base, uint64_t nbytes, uintptr_t data, const std::vector<int64_t>& shape,
                    const std::vector<int64_t>& strides, uint64_t itemsize) {
  if (has_no_elements(shape)) return true;
  if (nbytes == 0 || base == 0 || shape.size() != strides.size()) return false;
  __int128 lo = 0, hi = 0;  // byte offsets of the lowest and highest element from `data`
  for (size_t i = 0; i < shape.size(); ++i) {
    const __int128 span = static_cast<__int128>(shape[i] - 1) * strides[i] * static_cast<__int128>(itemsize);
    (span < 0 ? lo : hi) += span;
  }
  const __int128 first = static_cast<__int128>(data) + lo - base;
  const __int128 end = static_cast<__int128>(data) + hi + itemsize - base;
  return first >= 0 && end <= static_cast<__int128>(nbytes);
}

// A Python int sequence (torch.Size, tuple, list) into int64s. Tuples (what torch returns) are
// read directly: pybind's generic list caster costs more than the rest of a small tensor's staging.
void read_dims(py::handle seq, std::vector<int64_t>* out) {
  PyObject* obj = seq.ptr();
  if (!PyTuple_Check(obj)) {
    *out = py::cast<std::vector<int64_t>>(seq);
    return;
  }
  const Py_ssize_t n = PyTuple_GET_SIZE(obj);
  out->resize(static_cast<size_t>(n));
  for (Py_ssize_t i = 0; i < n; ++i) {
    long long v = PyLong_AsLongLong(PyTuple_GET_ITEM(obj, i));
    if (v == -1 && PyErr_Occurred()) throw py::error_already_set();
    (*out)[static_cast<size_t>(i)] = v;
  }
}

static_assert(kReaderMaxDims == static_cast<int>(kMaxDims), "tensor_reader.h and ring.h disagree on dims");

// The torch-aware tensor reader (fastdump._torch_reader, through set_tensor_reader), or nullptr:
// stage_tensor reads tensors through their Python attributes. One per process (one torch).
const TensorReader* g_reader = nullptr;
uint64_t g_reader_epoch = 0;  // bumped by each set_tensor_reader: stagers rebuild their dtype table

// One Dumper's hot path into the ring: the channel, pass and wait settings are set once per pass
// (begin), so staging a CPU tensor is one call with only the tensor's own facts.
struct ChannelStager {
  Producer* producer;
  uint32_t channel;
  int64_t pass_id = -1;
  bool block = true;
  double timeout_s = kWaitForever;
  HostSource src{};  // its shape/strides vectors are reused: no allocation per tensor once warm
  // stage_tensor's torch facts, given at construction (the extension never links libtorch):
  py::dict fast_codes;  // torch.dtype -> (wire code, element size): dtypes staged without checks
  py::object strided;   // torch.strided
  py::object tensor_type;  // torch.Tensor: its subclasses' Python attributes are not believed here
  uint64_t staged_tensors = 0, staged_bytes = 0;  // by stage_tensor, until take_counts()
  // The tensors of pass `sent_pass` put into the ring whole (STAGED), by stage_tensor and, through
  // add_sent, the Dumper's general paths: its end record carries the count, the writer stores it
  // with the pass, and `fastdump verify` fails a pass holding other than that many (tensors written
  // into it afterwards; whole-rank totals could not tell). Tagged with its pass, not reset at a
  // begin: a pass whose begin never reached this lane (Ctrl-C, a full ring) reads 0, not the last
  // pass's count. One compare and add per tensor.
  int64_t sent_pass = -1;
  uint64_t sent_count = 0;
  void add_sent(int64_t pass, uint64_t n) {
    if (sent_pass != pass) {
      sent_pass = pass;
      sent_count = 0;
    }
    sent_count += n;
  }
  uint64_t sent_in(int64_t pass) const { return sent_pass == pass ? sent_count : 0; }
  // This channel's word of the ring header's failed_channels (set at construction: the hot path
  // loads it directly, not through the producer's mapping).
  const std::atomic<uint64_t>* failed_word = nullptr;
  bool channel_failed() const { return Producer::failed_bit_set(failed_word, channel); }
  // CUDA tensors' lane into the channel's CUDA stager (set_cuda, once; CUDA builds only). None:
  // stage_tensor leaves CUDA tensors to the caller's general path.
  std::shared_ptr<CudaTensorLane> cuda;
  // With a tensor reader: c10::ScalarType -> (wire code, element size) of fast_codes' dtypes
  // (code -1: not one of them), built for g_reader_epoch; and the reader's scratch.
  std::vector<std::pair<int32_t, uint32_t>> scalar_codes;
  uint64_t scalar_codes_epoch = 0;
  TensorFacts facts{};

  // A pass's begin and end records in the common case (no meta, nothing skipped, whole), put
  // without waiting: one C call instead of four Python frames and a dict each, at every pass
  // (issue 11: a begin/end pair cost the forward thread ~100 us between the model's kernels). The
  // text is protocol.py's (set_pass_templates: its plain_pass_templates, split around the numbers
  // put in). 0: no templates, no room now, or the producer is disabled; the caller takes its
  // general path, which may wait.
  std::string begin_text[2];  // begin_text[0] + pass + begin_text[1]
  std::string end_text[4];    // end_text[0] + pass + end_text[1] + dropped + end_text[2] + sent + end_text[3]
  bool has_templates = false;
  std::string message;  // reused: no allocation per pass once warm

  void set_pass_templates(const std::string& begin, const std::string& end, const std::string& pass_mark,
                          const std::string& dropped_mark, const std::string& sent_mark) {
    std::string rest, last;
    split_once(begin, pass_mark, &begin_text[0], &begin_text[1]);
    split_once(end, pass_mark, &end_text[0], &rest);
    split_once(rest, dropped_mark, &end_text[1], &last);
    split_once(last, sent_mark, &end_text[2], &end_text[3]);
    has_templates = true;
  }

  uint64_t put_plain_begin(int64_t pass) {
    if (!has_templates) return 0;
    message.assign(begin_text[0]).append(std::to_string(pass)).append(begin_text[1]);
    return producer->put_control(channel, message.data(), message.size(), /*block=*/false, 0);
  }

  // Also ends the CUDA lane's pass first: its last snapshots get their event and go to the drain now,
  // not when the drain's hold timer finds the batch.
  // `sent`: the pass's tensors put into the ring (sent_in, read by the caller when the pass ended).
  uint64_t put_plain_end(int64_t pass, uint64_t dropped, uint64_t sent) {
    if (cuda) cuda->end_pass();
    if (!has_templates) return 0;
    message.assign(end_text[0]).append(std::to_string(pass)).append(end_text[1]);
    message.append(std::to_string(dropped)).append(end_text[2]);
    message.append(std::to_string(sent)).append(end_text[3]);
    return producer->put_control(channel, message.data(), message.size(), /*block=*/false, 0);
  }

  // `text` around the one occurrence of `mark` (std::invalid_argument unless exactly one).
  static void split_once(const std::string& text, const std::string& mark, std::string* before, std::string* after) {
    const size_t at = mark.empty() ? std::string::npos : text.find(mark);
    if (at == std::string::npos || text.find(mark, at + 1) != std::string::npos)
      throw std::invalid_argument("a pass template must hold each mark exactly once, the pass before the count");
    *before = text.substr(0, at);
    *after = text.substr(at + mark.size());
  }

  // The general path's entry (Channel.stage): a CPU tensor's facts as its TensorImpl holds them
  // (channel.host_layout), checked here against its storage (`storage_base`, `storage_nbytes`) as
  // the fast paths check theirs: the copy reads exactly that range.
  int stage(uint32_t name_id, uint16_t dtype, uint64_t elem_size, py::handle shape_seq,
            py::handle strides_seq, uintptr_t ptr, uintptr_t storage_base, uint64_t storage_nbytes) {
    if (channel_failed()) return kDisabled;  // (as in stage_tensor)
    read_dims(shape_seq, &src.shape);
    read_dims(strides_seq, &src.strides);
    // (stage_source raises for mismatched lengths and a null pointer)
    if (ptr != 0 && src.shape.size() == src.strides.size() &&
        !within_storage(storage_base, storage_nbytes, ptr, src.shape, src.strides, elem_size))
      throw std::invalid_argument(kStorageShort);
    src.ptr = reinterpret_cast<const uint8_t*>(ptr);
    src.elem_size = elem_size;
    return stage_source(*producer, channel, name_id, pass_id, dtype, src, block, timeout_s);
  }

  // The whole per-tensor hot path: no Python frame. The tensor's facts come from the tensor reader
  // (its TensorImpl) when one is set and takes the tensor, else from its Python attributes through
  // the C API (issue 11: on a small model those reads cost the model's thread more than the rest of
  // staging). A plain CPU tensor goes to the host ring; a CUDA tensor to the CUDA stager's lean path
  // when set_cuda gave this channel one. kNotFast: anything else (another device or layout, a lazy
  // negation bit, a dtype that needs checks, a CUDA tensor during a graph capture or one the lean
  // path cannot take): the caller takes its general path.
  // The one entry every per-tensor caller uses (the Dumper, forward wrappers): keep its signature.
  static constexpr int kNotFast = CudaTensorLane::kNotFast;
  int stage_tensor(uint32_t name_id, py::handle tensor) {
    // The writer stopped writing this channel (its root's disk full): nothing more of it goes into
    // the ring, which the writer would throw away; the caller stops its Dumper at once (it learnt
    // of the failure only at the next pass start, after copying every tensor of this one). One
    // load of a header word no one writes but a failing writer: a line every core keeps shared.
    if (channel_failed()) return kDisabled;
    if (g_reader != nullptr) {
      const int read = g_reader->read(tensor.ptr(), &facts);
      if (read == 1) return stage_facts(name_id, tensor.ptr());
      if (read < 0) throw std::invalid_argument(kStorageShort);  // the caller records the skip
    }
    return stage_by_attributes(name_id, tensor);
  }

  // The tensor reader's facts (in `facts`) of `t`: what stage_by_attributes does with the same facts.
  int stage_facts(uint32_t name_id, PyObject* t) {
    if (scalar_codes_epoch != g_reader_epoch) build_scalar_codes();
    const auto st = static_cast<size_t>(facts.scalar_type);
    if (st >= scalar_codes.size() || scalar_codes[st].first < 0) return kNotFast;
    const auto code = static_cast<uint16_t>(scalar_codes[st].first);
    const uint64_t itemsize = scalar_codes[st].second;
    const auto n = static_cast<size_t>(facts.ndim);
    copy_dims(facts.sizes, n, &src.shape);  // src's vectors: no allocation once warm
    copy_dims(facts.strides, n, &src.strides);
    const auto ptr = reinterpret_cast<uintptr_t>(facts.data);
    const uint64_t nbytes = bytes_of(src.shape, itemsize);  // (src is refilled if another thread stages meanwhile)
    int status;
    if (facts.device == kReaderCpu) {
      src.ptr = static_cast<const uint8_t*>(facts.data);
      src.elem_size = itemsize;
      status = stage_source(*producer, channel, name_id, pass_id, code, src, block, timeout_s);
    } else {
      if (!cuda) return kNotFast;
      status = cuda->stage(channel, name_id, pass_id, block, timeout_s, t, code, itemsize, src.shape, src.strides, ptr);
    }
    count_staged(status, nbytes);
    return status;
  }

  // `n` dims into `out`, in place: vector::assign's out-of-line call cost ~48 instructions per
  // vector, twice per dumped tensor, for the one to four dims a tensor has (RESULTS.md 0w).
  static void copy_dims(const int64_t* dims, size_t n, std::vector<int64_t>* out) {
    if (out->size() != n) out->resize(n);
    int64_t* to = out->data();
    for (size_t i = 0; i < n; ++i) to[i] = dims[i];
  }

  void build_scalar_codes() {
    scalar_codes.clear();
    for (auto item : fast_codes) {
      const int st = g_reader->scalar_type(item.first.ptr());
      if (st < 0 || st > 1024) continue;
      if (static_cast<size_t>(st) >= scalar_codes.size()) scalar_codes.resize(static_cast<size_t>(st) + 1, {-1, 0});
      auto entry = py::reinterpret_borrow<py::tuple>(item.second);
      scalar_codes[static_cast<size_t>(st)] = {py::cast<int32_t>(entry[0]), py::cast<uint32_t>(entry[1])};
    }
    scalar_codes_epoch = g_reader_epoch;
  }

  static uint64_t bytes_of(const std::vector<int64_t>& shape, uint64_t itemsize) {
    uint64_t nbytes = itemsize;
    for (int64_t d : shape) nbytes *= static_cast<uint64_t>(d);
    return nbytes;
  }

  void count_staged(int status, uint64_t nbytes) {
    if (status != kStaged) return;
    staged_tensors++;
    staged_bytes += nbytes;
    add_sent(pass_id, 1);
  }

  // Without a reader, or for what it declines: the facts through the tensor's Python attributes.
  int stage_by_attributes(uint32_t name_id, py::handle tensor) {
    static PyObject* s_dtype = PyUnicode_InternFromString("dtype");
    static PyObject* s_layout = PyUnicode_InternFromString("layout");
    static PyObject* s_is_cpu = PyUnicode_InternFromString("is_cpu");
    static PyObject* s_is_cuda = PyUnicode_InternFromString("is_cuda");
    static PyObject* s_is_neg = PyUnicode_InternFromString("is_neg");
    static PyObject* s_shape = PyUnicode_InternFromString("shape");
    static PyObject* s_stride = PyUnicode_InternFromString("stride");
    static PyObject* s_data_ptr = PyUnicode_InternFromString("data_ptr");
    static PyObject* s_untyped_storage = PyUnicode_InternFromString("untyped_storage");
    static PyObject* s_nbytes = PyUnicode_InternFromString("nbytes");
    PyObject* t = tensor.ptr();
    // A subclass can override any attribute read below (a property, __torch_function__), and a
    // wrong address or extent would make the copy read outside the tensor: the general path reads
    // what its TensorImpl holds instead (Channel.stage, host_layout).
    if (tensor_type && reinterpret_cast<PyObject*>(Py_TYPE(t)) != tensor_type.ptr()) return kNotFast;
    auto get = [&](PyObject* name) { return py::reinterpret_steal<py::object>(PyObject_GetAttr(t, name)); };
    auto call = [&](PyObject* name) { return py::reinterpret_steal<py::object>(PyObject_CallMethodNoArgs(t, name)); };
    py::object is_cpu = get(s_is_cpu);  // first: without a CUDA lane a CUDA tensor leaves after one read
    if (!is_cpu) throw py::error_already_set();
    const bool on_cpu = is_cpu.ptr() == Py_True;
    if (!on_cpu) {
      if (!cuda) return kNotFast;
      py::object is_cuda = get(s_is_cuda);
      if (!is_cuda) throw py::error_already_set();
      if (is_cuda.ptr() != Py_True) return kNotFast;
    }
    py::object dtype = get(s_dtype);
    if (!dtype) throw py::error_already_set();
    PyObject* fast = PyDict_GetItemWithError(fast_codes.ptr(), dtype.ptr());  // borrowed
    if (fast == nullptr) {
      if (PyErr_Occurred()) throw py::error_already_set();
      return kNotFast;
    }
    py::object layout = get(s_layout);
    if (!layout) throw py::error_already_set();
    if (layout.ptr() != strided.ptr()) return kNotFast;
    py::object neg = call(s_is_neg);
    if (!neg) throw py::error_already_set();
    if (neg.ptr() != Py_False) return kNotFast;
    py::object shape = get(s_shape), strides = call(s_stride), ptr = call(s_data_ptr);
    if (!shape || !strides || !ptr) throw py::error_already_set();
    auto code = py::cast<uint16_t>(PyTuple_GET_ITEM(fast, 0));
    auto itemsize = py::cast<uint64_t>(PyTuple_GET_ITEM(fast, 1));
    read_dims(shape, &src.shape);  // src's vectors as scratch: no allocation once warm
    read_dims(strides, &src.strides);
    const auto data = py::cast<uintptr_t>(ptr);
    const uint64_t nbytes = bytes_of(src.shape, itemsize);  // (src is refilled if another thread stages meanwhile)
    if (data == 0 && !has_no_elements(src.shape)) throw std::invalid_argument(kNoData);
    if (!has_no_elements(src.shape)) {  // the tensor reader's storage check, through the attributes
      py::object storage = call(s_untyped_storage);
      if (!storage) throw py::error_already_set();
      py::object base = py::reinterpret_steal<py::object>(PyObject_CallMethodNoArgs(storage.ptr(), s_data_ptr));
      py::object size = py::reinterpret_steal<py::object>(PyObject_CallMethodNoArgs(storage.ptr(), s_nbytes));
      if (!base || !size) throw py::error_already_set();
      if (!within_storage(py::cast<uintptr_t>(base), py::cast<uint64_t>(size), data, src.shape, src.strides, itemsize))
        throw std::invalid_argument(kStorageShort);
    }
    int st;
    if (on_cpu) {
      src.ptr = reinterpret_cast<const uint8_t*>(data);
      src.elem_size = itemsize;
      st = stage_source(*producer, channel, name_id, pass_id, code, src, block, timeout_s);
    } else {
      st = cuda->stage(channel, name_id, pass_id, block, timeout_s, t, code, itemsize, src.shape, src.strides, data);
    }
    count_staged(st, nbytes);
    return st;
  }
};

// CRC32C of any contiguous buffer (bytes, memoryview, numpy array), continuing from `value`.
uint32_t crc32c_buffer(py::buffer data, uint32_t value, bool portable) {
  const ContiguousBytes src = contiguous_bytes(data, "crc32c");
  if (src.n < kReleaseGilBytes) return crc32c(src.ptr, src.n, value, portable);
  py::gil_scoped_release nogil;
  return crc32c(src.ptr, src.n, value, portable);
}

py::object next_record(Consumer& c, double timeout_s) {
  RecordView v;
  bool ok;
  {
    py::gil_scoped_release nogil;
    ok = c.next(timeout_s, &v);
  }
  if (!ok) return py::none();
  py::tuple shape(v.shape.size());
  for (size_t i = 0; i < v.shape.size(); ++i) shape[i] = py::int_(v.shape[i]);
  // Read-only view into shared memory: valid until release().
  py::memoryview payload = py::memoryview::from_memory(const_cast<uint8_t*>(v.payload), static_cast<py::ssize_t>(v.payload_len), true);
  return py::make_tuple(v.kind, v.channel, v.name_id, v.pass_id, v.dtype, shape, payload, v.seq,
                        v.chunk.offset, v.chunk.total);
}

// Up to `max_records` ready records (waiting up to timeout_s for the first) in one call, which keeps
// the writer's per-record Python cost low.
// A tensor payload of `view_bytes` or more (0: never) comes as a read-only memoryview into the
// ring, and its space stays held until the caller's release(): the writer copies it once, into
// its own page-aligned buffers or straight into the file, and frees the batch. Any other payload
// is copied into a bytes object; its space is given back at once while no view is held.
// With views on, a control record (pass end, close...) ends its batch: every view before it is
// consumed by the time the caller reaches it, so the caller can release() the batch before the
// control's possibly slow work (an HDF5 segment write).
//
// `sinks` (a dict channel -> RowSink, or None): a tensor record its channel's RowSink takes (a pass
// and layout the channel writer knows, writer_rows.h) is consumed here and never handed out. The
// first record a sink does not take ends the batch, so the caller handles it before any later
// record is taken: index rows stay in arrival order.
py::list next_batch(Consumer& c, double timeout_s, size_t max_records, uint64_t max_bytes, uint64_t view_bytes,
                    py::object sinks) {
  py::list out;
  uint64_t bytes = 0;
  bool holding = c.holding();  // views the caller has not released yet: never free them here
  RecordView v;
  std::vector<std::pair<uint32_t, RowSink*>> fast;  // a few channels: a linear search beats a map
  if (!sinks.is_none()) {
    for (auto item : py::cast<py::dict>(sinks)) {
      // Another build's RowSink (the CUDA test double's extension beside the real one) is not
      // ours to call: its channel's records all go to Python.
      if (py::isinstance<RowSink>(item.second))
        fast.emplace_back(py::cast<uint32_t>(item.first), py::cast<RowSink*>(item.second));
    }
  }
  size_t taken = 0;  // records consumed here: they count as waited for
  auto sink_for = [&](uint32_t channel) -> RowSink* {
    for (auto& entry : fast)
      if (entry.first == channel) return entry.second;
    return nullptr;
  };
  while (out.size() < max_records && bytes < max_bytes) {
    bool ok;
    {
      // Without the GIL: the wait, and the records the fast path takes (C++ state only; the
      // sinks are the writer loop's, which is this thread). A thread writer must not hold the
      // serving thread up for a whole batch of copies.
      py::gil_scoped_release nogil;
      while (true) {
        ok = c.next(out.size() == 0 && taken == 0 ? timeout_s : 0.0, &v);
        if (!ok || v.kind != kTensor || fast.empty()) break;
        RowSink* sink = sink_for(v.channel);
        if (sink == nullptr || !sink->take(v)) break;
        bytes += v.payload_len;
        ++taken;
        holding = true;  // the caller's release() gives its space back with the batch
        if (taken + out.size() >= max_records || bytes >= max_bytes) {
          ok = false;  // the batch is full: nothing handed out from this round
          break;
        }
      }
    }
    if (!ok) break;
    py::tuple shape(v.shape.size());
    for (size_t i = 0; i < v.shape.size(); ++i) shape[i] = py::int_(v.shape[i]);
    bytes += v.payload_len;
    if (view_bytes && v.payload_len >= view_bytes && v.kind == kTensor) {
      holding = true;
      py::memoryview view = py::memoryview::from_memory(const_cast<uint8_t*>(v.payload),
                                                        static_cast<py::ssize_t>(v.payload_len), true);
      out.append(py::make_tuple(v.kind, v.channel, v.name_id, v.pass_id, v.dtype, shape, view, v.seq,
                                v.chunk.offset, v.chunk.total));
      if (!fast.empty()) break;  // see above: handled before anything after it is taken
      continue;
    }
    PyObject* raw = PyBytes_FromStringAndSize(nullptr, static_cast<Py_ssize_t>(v.payload_len));
    if (raw == nullptr) throw py::error_already_set();
    py::bytes payload = py::reinterpret_steal<py::bytes>(raw);
    char* dst = PyBytes_AS_STRING(raw);
    if (v.payload_len >= kReleaseGilBytes) {
      py::gil_scoped_release nogil;  // a thread writer must not hold the serving thread up
      std::memcpy(dst, v.payload, v.payload_len);
    } else {
      std::memcpy(dst, v.payload, v.payload_len);
    }
    out.append(py::make_tuple(v.kind, v.channel, v.name_id, v.pass_id, v.dtype, shape, payload, v.seq,
                              v.chunk.offset, v.chunk.total));
    if (view_bytes && v.kind == kControl) break;  // last in its batch: see above
    if (!fast.empty() && v.kind == kTensor) break;  // see above
    if (!holding) c.release();
  }
  return out;
}

}  // namespace

void* fastdump::channel_stager_ptr(py::handle lane) { return py::cast<ChannelStager*>(lane); }

int fastdump::stage_tensor_on(void* lane, uint32_t name_id, py::handle tensor) {
  return static_cast<ChannelStager*>(lane)->stage_tensor(name_id, tensor);
}

bool fastdump::lane_writer_seen_alive(void* lane, double max_age_s) {
  // (and still writing this lane's channel: one whose root failed stops its Dumper, not the others)
  auto* s = static_cast<ChannelStager*>(lane);
  return s->producer->writer_seen_alive(max_age_s) && !s->producer->channel_failed(s->channel);
}

uint64_t fastdump::lane_open_pass(void* lane, int64_t pass_id, bool block, double timeout_s) {
  auto* s = static_cast<ChannelStager*>(lane);
  const uint64_t seq = s->put_plain_begin(pass_id);
  if (seq != 0) {
    s->pass_id = pass_id;
    s->block = block;
    s->timeout_s = timeout_s;
  }
  return seq;
}

uint64_t fastdump::lane_put_plain_end(void* lane, int64_t pass_id, uint64_t dropped) {
  auto* s = static_cast<ChannelStager*>(lane);
  return s->put_plain_end(pass_id, dropped, s->sent_in(pass_id));
}

PYBIND11_MODULE(_C, m) {
  m.doc() = "fastdump staging engine (shared-memory ring, CPU and CUDA staging)";
  m.attr("STAGED") = static_cast<int>(kStaged);
  m.attr("DROPPED") = static_cast<int>(kDropped);
  m.attr("DISABLED") = static_cast<int>(kDisabled);
  m.attr("TOO_LARGE") = static_cast<int>(kTooLarge);
  m.attr("STORAGE_SHORT") = kStorageShort;  // why a tensor reaching outside its storage is not read
  m.attr("NO_DATA") = kNoData;  // why a tensor with elements and a null data pointer is not read
  m.attr("TIMED_OUT") = static_cast<int>(kTimedOut);
  m.attr("TORN") = static_cast<int>(kTorn);
  m.attr("RING_TOO_SMALL") = static_cast<int>(kRingTooSmall);
  m.attr("CAPTURING") = static_cast<int>(kCapturing);
  m.attr("RING_UNAVAILABLE") = static_cast<int>(kRingUnavailable);
  m.attr("KIND_TENSOR") = static_cast<int>(kTensor);
  m.attr("KIND_CONTROL") = static_cast<int>(kControl);
  m.attr("WRITER_RUNNING") = static_cast<int>(kWriterRunning);
  m.attr("WRITER_FAILED") = static_cast<int>(kWriterFailed);
  m.attr("WRITER_EXITED") = static_cast<int>(kWriterExited);
  m.attr("MAX_DIMS") = kMaxDims;
  m.attr("PAGE_BYTES") = kPageBytes;
  m.def("crc32c", &crc32c_buffer, py::arg("data"), py::arg("value") = 0u, py::arg("portable") = false,
        "CRC32C (Castagnoli) of a contiguous buffer, continuing from `value`; releases the GIL on large ones.");
  m.attr("CRC32C_IMPL") = crc32c_impl();
  m.attr("PAGE_ALIGNED_BYTES") = kPageAlignedBytes;

  py::class_<Producer>(m, "Producer")
      .def(py::init<const std::string&, uint64_t, uint64_t>(), py::arg("name"), py::arg("capacity"),
           py::arg("chunk_bytes") = 0)
      .def_property_readonly("capacity", [](Producer& p) { return p.region().capacity(); })
      .def_property_readonly("chunk_bytes", &Producer::chunk_bytes)
      .def_property_readonly(
          "max_control_bytes",
          [](Producer& p) { return p.region().capacity() / 2 - payload_offset(0); },
          "the largest control payload a record can carry (a record takes at most half the ring)")
      .def_property_readonly("name", [](Producer& p) { return p.region().name(); })
      .def("unlink", [](Producer& p) { p.region().unlink(); })
      .def("writer_attached",
           [](Producer& p) { return p.region().header()->writer_attached.load() != 0; })
      .def("writer_error", [](Producer& p) { return std::string(p.region().header()->error); })
      .def("take_channel_error", &Producer::take_channel_error, py::arg("channel"),
           "the writer's error for a failed channel, taken out of the ring header (its place goes to the "
           "next channel that fails): '' when it had no free place to say it in, or was taken already")
      .def("channel_failed", &Producer::channel_failed, py::arg("channel"),
           "whether the writer stopped writing this channel alone (Consumer.fail_channel)")
      .def("set_writer_fd", &Producer::set_writer_fd)
      .def("writer_alive", &Producer::writer_alive)
      .def("writer_seen_alive", &Producer::writer_seen_alive, py::arg("max_age_s"),
           "writer_alive(), its pipe polled only when the last poll that found it alive is older than max_age_s")
      .def_property_readonly("disabled", &Producer::disabled)
      .def("disable", &Producer::disable)
      .def("used_bytes",
           [](Producer& p) {
             RingHeader* h = p.region().header();
             return h->head.load() - h->tail.load();
           })
      .def_property_readonly("released_bytes",
                             [](Producer& p) { return p.region().header()->tail.load(); },
                             "ring bytes the writer has given back so far (monotonic)")
      .def("stage_host", &stage_host, py::arg("channel"), py::arg("name_id"), py::arg("pass_id"),
           py::arg("dtype"), py::arg("elem_size"), py::arg("shape"), py::arg("strides"), py::arg("ptr"),
           py::arg("block"), py::arg("timeout_s") = kWaitForever,
           "STAGED, DROPPED (no space, `drop`), TIMED_OUT (dropped after waiting timeout_s), TORN, "
           "RING_TOO_SMALL, TOO_LARGE or DISABLED")
      .def(
          "put_control",
          [](Producer& p, uint32_t channel, py::bytes payload, bool block, double timeout_s) {
            std::string s = payload;
            py::gil_scoped_release nogil;
            return p.put_control(channel, s.data(), s.size(), block, timeout_s);
          },
          py::arg("channel"), py::arg("payload"), py::arg("block") = true, py::arg("timeout_s") = kWaitForever)
      .def_property_readonly("acked_seq", &Producer::acked_seq)
      .def(
          "wait_acked",
          [](Producer& p, uint64_t seq, double timeout_s) {
            py::gil_scoped_release nogil;
            return p.wait_acked(seq, timeout_s);
          },
          py::arg("seq"), py::arg("timeout_s"))
      .def("count_dropped", &Producer::count_dropped)
      .def("stats", [](Producer& p) {
        ProducerStats s = p.stats();
        py::dict d;
        d["records"] = s.records;
        d["tensors"] = s.tensors;
        d["bytes"] = s.bytes;
        d["dropped"] = s.dropped;
        d["block_waits"] = s.block_waits;
        d["block_seconds"] = s.block_seconds;
        return d;
      });

  m.def(
      "set_tensor_reader",
      [](py::object capsule) {
        if (capsule.is_none()) {
          g_reader = nullptr;
        } else {
          auto* reader = static_cast<const TensorReader*>(PyCapsule_GetPointer(capsule.ptr(), "fastdump.TensorReader"));
          if (reader == nullptr) throw py::error_already_set();
          if (reader->abi != kTensorReaderAbi)
            throw std::invalid_argument("tensor reader ABI " + std::to_string(reader->abi) + ", this build takes " +
                                        std::to_string(kTensorReaderAbi));
          g_reader = reader;
        }
        ++g_reader_epoch;
      },
      py::arg("reader"),
      "ChannelStager.stage_tensor reads tensors through `reader` (fastdump._torch_reader.READER), or, "
      "with None, through their Python attributes");
  m.def(
      "read_tensor_facts",
      [](py::handle tensor) -> py::object {
        TensorFacts f{};
        const int read = g_reader == nullptr ? 0 : g_reader->read(tensor.ptr(), &f);
        if (read < 0) return py::str("storage short");
        if (read != 1) return py::none();
        py::tuple shape(f.ndim), strides(f.ndim);
        for (int i = 0; i < f.ndim; ++i) {
          shape[i] = py::int_(f.sizes[i]);
          strides[i] = py::int_(f.strides[i]);
        }
        return py::make_tuple(f.device == kReaderCpu ? "cpu" : "cuda", f.scalar_type, shape, strides,
                              reinterpret_cast<uintptr_t>(f.data));
      },
      py::arg("tensor"),
      "(device, scalar type, shape, strides, data pointer) as the tensor reader reads them, 'storage short' "
      "(its storage does not hold its elements) or None (no reader, or one that declines the tensor): for tests");
  m.def(
      "tensor_reader",
      []() -> py::object { return g_reader ? py::object(py::str(g_reader->torch_version)) : py::object(py::none()); },
      "the torch version of the tensor reader in use, or None (attribute reads)");

  py::class_<ChannelStager>(m, "ChannelStager")
      .def(py::init([](Producer& p, uint32_t channel, py::dict fast_codes, py::object strided, py::object tensor_type) {
             ChannelStager s{&p, channel};
             s.failed_word = p.failed_word(channel);
             s.fast_codes = std::move(fast_codes);
             s.strided = std::move(strided);
             if (!tensor_type.is_none()) s.tensor_type = std::move(tensor_type);
             return s;
           }),
           py::arg("producer"), py::arg("channel"), py::arg("fast_codes") = py::dict(),
           py::arg("strided") = py::none(), py::arg("tensor_type") = py::none(), py::keep_alive<1, 2>())
      .def("stage_tensor", &ChannelStager::stage_tensor, py::arg("name_id"), py::arg("tensor"),
           "stage a plain CPU tensor (the same statuses as stage), or NOT_FAST (-1): use the general path")
      .def(
          "take_counts",
          [](ChannelStager& s) {
            if (s.cuda) s.cuda->end_pass();  // (put_plain_end and end_pass do it at a pass's end)
            auto out = py::make_tuple(s.staged_tensors, s.staged_bytes);
            s.staged_tensors = s.staged_bytes = 0;
            return out;
          },
          "(tensors, bytes) stage_tensor staged since the last call; ends the CUDA lane's pass (its last "
          "snapshots get their event and go to the drain)")
      .def_property_readonly(
          "pending_tensors", [](const ChannelStager& s) { return s.staged_tensors; },
          "tensors stage_tensor staged since the last take_counts, which it leaves as they are (no CUDA "
          "batch ended): where a module's output lies among its pass's tensors (Dumper._staged_so_far)")
      .def(
          "set_cuda",
          [](ChannelStager& s, py::object stager, py::object raw_stream, py::object stream_object) {
            s.cuda = make_cuda_tensor_lane(std::move(stager), std::move(raw_stream), std::move(stream_object));
          },
          py::arg("stager"), py::arg("raw_stream"), py::arg("stream_object"),
          "stage CUDA tensors in stage_tensor through `stager` (a CudaStager): raw_stream(device) -> the "
          "current cudaStream_t as int, stream_object(device) -> the stream given to record_stream")
      .def_property_readonly("has_cuda", [](ChannelStager& s) { return static_cast<bool>(s.cuda); })
      .def(
          "end_pass", [](ChannelStager& s) { if (s.cuda) s.cuda->end_pass(); },
          "the CUDA lane's pass ended: its last snapshots get their event and go to the drain (put_plain_end "
          "and take_counts do it too)")
      .def_property_readonly_static("NOT_FAST", [](py::object) { return ChannelStager::kNotFast; })
      .def(
          "begin",
          [](ChannelStager& s, int64_t pass_id, bool block, double timeout_s) {
            s.pass_id = pass_id;
            s.block = block;
            s.timeout_s = timeout_s;
          },
          py::arg("pass_id"), py::arg("block"), py::arg("timeout_s"), "settings for the pass that starts")
      .def(
          "open_pass",
          [](ChannelStager& s, int64_t pass_id, bool block, double timeout_s) {
            return lane_open_pass(&s, pass_id, block, timeout_s);
          },
          py::arg("pass_id"), py::arg("block"), py::arg("timeout_s"),
          "put pass_id's plain begin record without waiting and, once it is in, take the pass's settings "
          "(begin): its seq, or 0 (nothing done: no templates, no room now, or disabled)")
      .def("put_plain_end", &ChannelStager::put_plain_end, py::arg("pass_id"), py::arg("dropped"), py::arg("sent"),
           "end the CUDA lane's pass (end_pass) and put pass_id's plain end record (no meta, nothing "
           "skipped; `sent` tensors) without waiting: its seq, or 0")
      .def("add_sent", &ChannelStager::add_sent, py::arg("pass_id"), py::arg("n") = 1,
           "count `n` tensors the general path staged (STAGED) into pass pass_id: its end record's count")
      .def("sent_in", &ChannelStager::sent_in, py::arg("pass_id"),
           "the tensors put into the ring for pass pass_id (stage_tensor's and add_sent's; 0 for a pass "
           "this lane counted nothing of, or once a later pass counted)")
      .def("set_pass_templates", &ChannelStager::set_pass_templates, py::arg("begin"), py::arg("end"),
           py::arg("pass_mark"), py::arg("dropped_mark"), py::arg("sent_mark"),
           "the plain begin/end messages open_pass and put_plain_end put (protocol.plain_pass_templates)")
      .def("stage", &ChannelStager::stage, py::arg("name_id"), py::arg("dtype"), py::arg("elem_size"),
           py::arg("shape"), py::arg("strides"), py::arg("ptr"), py::arg("storage_base"), py::arg("storage_nbytes"),
           "Producer.stage_host with this channel's pass settings, after checking the extent against the "
           "storage: the same statuses (ValueError NO_DATA / STORAGE_SHORT for a tensor it must not read)");

  py::class_<Consumer>(m, "Consumer")
      .def(py::init<const std::string&>(), py::arg("name"))
      .def("set_producer_fd", &Consumer::set_producer_fd)
      .def("producer_alive", &Consumer::producer_alive)
      .def("next", &next_record, py::arg("timeout_s"),
           "(kind, channel, name_id, pass_id, dtype, shape, payload, seq, chunk_offset, chunk_total) or None")
      .def("next_batch", &next_batch, py::arg("timeout_s"), py::arg("max_records") = 4096,
           py::arg("max_bytes") = 256ull << 20, py::arg("view_bytes") = 0, py::arg("sinks") = py::none(),
           "list of next() tuples; payloads >= view_bytes are views held until release(), others copies; "
           "tensor records a channel's RowSink in `sinks` takes are consumed, not listed")
      .def("release", &Consumer::release, "give back the space of every record handed out so far")
      .def_property_readonly("holding", &Consumer::holding)
      .def_property_readonly("capacity", [](Consumer& c) { return c.region().capacity(); })
      .def_property_readonly("drained", &Consumer::drained)
      .def_property_readonly("abandoned", &Consumer::abandoned)
      .def_property_readonly("producer_pid",
                             [](Consumer& c) { return c.region().header()->producer_pid; })
      .def("ack", &Consumer::ack)
      .def("set_state", &Consumer::set_state, py::arg("state"), py::arg("error") = "")
      .def(
          "fail_channel",
          [](Consumer& c, uint32_t channel, const std::string& error) {
            if (channel >= kFailedChannelBits) return false;
            RingHeader* h = c.region().header();
            for (ChannelError& e : h->channel_errors) {  // a free place (its Dumper took the last text there)
              uint32_t free_place = 0;
              if (!e.channel.compare_exchange_strong(free_place, kChannelErrorBusy, std::memory_order_acquire))
                continue;
              const size_t n = std::min(error.size(), sizeof(e.text) - 1);  // (text first, then the id
              std::memcpy(e.text, error.data(), n);                          // that makes it readable)
              e.text[n] = '\0';
              e.channel.store(channel + 1, std::memory_order_release);
              break;
            }
            h->failed_channels[channel / 64].fetch_or(1ull << (channel % 64), std::memory_order_release);
            return true;
          },
          py::arg("channel"), py::arg("error") = "",
          "tell the producer this channel's writing stopped, and why (False: its id is too high to say so)");
  m.attr("FAILED_CHANNEL_IDS") = kFailedChannelBits;  // channel ids fail_channel can report

  bind_cuda(m);
  bind_forward_wrapper(m);
  bind_writer_rows(m);
}
