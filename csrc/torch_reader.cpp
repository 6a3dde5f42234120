// fastdump._torch_reader: reads a tensor's facts straight from its TensorImpl (tensor_reader.h).
//
// Built only where torch is importable at build time (setup.py), against that torch's headers: the
// TensorImpl layout and inline accessors compiled in here are that version's. So the module refuses
// to import under any other torch (checked first thing in PyInit, before anything is read), and
// fastdump then keeps its attribute reads. The module's one export, READER, is a capsule holding
// the TensorReader table that fastdump._C.set_tensor_reader takes.
#include <torch/csrc/Dtype.h>
#include <torch/csrc/autograd/python_variable.h>

#include <cstring>

#include "tensor_reader.h"

#ifndef FASTDUMP_TORCH_VERSION
#error "setup.py defines FASTDUMP_TORCH_VERSION (the torch.__version__ this is built against)"
#endif

namespace {

using fastdump::TensorFacts;

// Whether the storage holds every element the tensor addresses. torch lets a storage be freed or
// shrunk under its tensors (untyped_storage().resize_(0), as FSDP does): their data pointer is then
// null or points at a smaller allocation, and a copy would fault or read someone else's memory.
bool storage_holds(const c10::TensorImpl& impl, c10::IntArrayRef sizes, c10::IntArrayRef strides) {
  // No elements: nothing is read. Looked for first: the reach of a dimension before the empty one
  // may overflow (empty_strided((5, 0), (2**62, 1))), which is no reason to refuse an empty tensor.
  for (const int64_t size : sizes)
    if (size == 0) return true;
  uint64_t last = 0;  // the last element's index from the first, in elements
  for (size_t d = 0; d < sizes.size(); ++d) {
    if (strides[d] < 0) return false;
    uint64_t reach;
    if (__builtin_mul_overflow(static_cast<uint64_t>(sizes[d] - 1), static_cast<uint64_t>(strides[d]), &reach) ||
        __builtin_add_overflow(last, reach, &last))
      return false;
  }
  const c10::Storage& storage = impl.storage();
  if (storage.data() == nullptr) return false;
  uint64_t end;  // one past the last element's last byte, from the storage's start
  if (__builtin_add_overflow(last, 1 + static_cast<uint64_t>(impl.storage_offset()), &end) ||
      __builtin_mul_overflow(end, static_cast<uint64_t>(impl.itemsize()), &end))
    return false;
  return end <= storage.nbytes();
}

int read_facts(PyObject* obj, TensorFacts* out) {
  // Any tensor, subclasses included, is read from its TensorImpl: that is what its memory holds,
  // whatever the subclass's Python .shape or .stride() claim (one that claimed more would have the
  // copy read past its elements). Subclasses with Python dispatch (FakeTensor, DTensor,
  // FunctionalTensor: their TensorImpl is a wrapper) are declined below, to the attribute path.
  // (A subtype check, not isinstance(): no __instancecheck__ to run, nothing to raise.)
  if (!THPVariable_CheckExact(obj) &&
      (THPVariableClass == nullptr || !PyObject_TypeCheck(obj, reinterpret_cast<PyTypeObject*>(THPVariableClass))))
    return 0;
  try {
    const at::Tensor& t = THPVariable_Unpack(obj);
    const c10::TensorImpl* impl = t.unsafeGetTensorImpl();
    if (impl->layout() != c10::kStrided || impl->is_nested() || impl->is_neg() || impl->is_conj() ||
        impl->is_python_dispatch() || impl->has_symbolic_sizes_strides() || !impl->has_storage())
      return 0;
    switch (impl->device_type()) {
      case c10::DeviceType::CPU: out->device = fastdump::kReaderCpu; break;
      case c10::DeviceType::CUDA: out->device = fastdump::kReaderCuda; break;
      default: return 0;
    }
    const int64_t ndim = impl->dim();
    if (ndim < 0 || ndim > fastdump::kReaderMaxDims) return 0;
    const c10::IntArrayRef sizes = impl->sizes(), strides = impl->strides();
    if (!storage_holds(*impl, sizes, strides)) return -1;
    std::memcpy(out->sizes, sizes.data(), static_cast<size_t>(ndim) * sizeof(int64_t));
    std::memcpy(out->strides, strides.data(), static_cast<size_t>(ndim) * sizeof(int64_t));
    out->ndim = static_cast<int32_t>(ndim);
    out->scalar_type = static_cast<int32_t>(t.scalar_type());
    out->data = impl->data();  // const: never materializes a copy-on-write storage
    return 1;
  } catch (...) {  // c10::Error from an accessor (no data, custom sizes...): the attribute path decides
    return 0;
  }
}

int scalar_type_of(PyObject* dtype) {
  if (!THPDtype_Check(dtype)) return -1;
  return static_cast<int>(reinterpret_cast<THPDtype*>(dtype)->scalar_type);
}

const fastdump::TensorReader kReader = {fastdump::kTensorReaderAbi, read_facts, scalar_type_of,
                                        FASTDUMP_TORCH_VERSION};

PyModuleDef kModule = {PyModuleDef_HEAD_INIT, "_torch_reader",
                       "fastdump's torch-aware tensor reader (built against torch " FASTDUMP_TORCH_VERSION ")",
                       -1, nullptr};

// ImportError unless the running torch is the one this was built against.
bool same_torch() {
  PyObject* torch = PyImport_ImportModule("torch");
  if (torch == nullptr) return false;
  PyObject* version = PyObject_GetAttrString(torch, "__version__");
  Py_DECREF(torch);
  if (version == nullptr) return false;
  PyObject* text = PyObject_Str(version);  // torch's TorchVersion is a str subclass
  Py_DECREF(version);
  if (text == nullptr) return false;
  const char* running = PyUnicode_AsUTF8(text);
  const bool same = running != nullptr && std::strcmp(running, FASTDUMP_TORCH_VERSION) == 0;
  if (running != nullptr && !same)
    PyErr_Format(PyExc_ImportError, "fastdump._torch_reader was built against torch %s, not torch %s",
                 FASTDUMP_TORCH_VERSION, running);
  Py_DECREF(text);
  return same;
}

}  // namespace

PyMODINIT_FUNC PyInit__torch_reader() {
  if (!same_torch()) return nullptr;
  PyObject* m = PyModule_Create(&kModule);
  if (m == nullptr) return nullptr;
  PyObject* capsule = PyCapsule_New(const_cast<fastdump::TensorReader*>(&kReader), "fastdump.TensorReader", nullptr);
  if (capsule == nullptr || PyModule_AddObject(m, "READER", capsule) < 0 ||
      PyModule_AddStringConstant(m, "TORCH_VERSION", FASTDUMP_TORCH_VERSION) < 0) {
    Py_XDECREF(capsule);
    Py_DECREF(m);
    return nullptr;
  }
  return m;
}
