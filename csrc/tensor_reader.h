// The table through which fastdump._C (no libtorch) calls the optional torch-aware tensor reader,
// fastdump._torch_reader (csrc/torch_reader.cpp, built against the installed torch's headers).
//
// Issue 11: reading a tensor's seven facts (device, dtype, layout, negation bit, shape, strides,
// data pointer) through Python attributes costs a small model's decode loop more than fastdump's
// ring copy and bookkeeping together; the reader takes them from the tensor's TensorImpl in a few
// loads. Only plain C types cross this line: the two builds share nothing else, and _C keeps its
// attribute reads for everything the reader declines (subclasses, other devices and layouts, a
// torch other than the one the reader was built against, no reader at all).
#pragma once

#include <Python.h>

#include <cstdint>

namespace fastdump {

constexpr uint32_t kTensorReaderAbi = 2;  // 2: read() may return -1
constexpr int kReaderMaxDims = 32;  // ring.h's kMaxDims (asserted where both are seen)

enum ReaderDevice : int32_t { kReaderCpu = 0, kReaderCuda = 1 };

struct TensorFacts {
  int32_t device;       // ReaderDevice
  int32_t scalar_type;  // c10::ScalarType
  int32_t ndim;
  const void* data;  // the first element (storage + offset); nullptr for some empty tensors
  int64_t sizes[kReaderMaxDims];
  int64_t strides[kReaderMaxDims];  // in elements, as torch gives them
};

struct TensorReader {
  uint32_t abi;  // kTensorReaderAbi
  // 1: `tensor` is an exact torch.Tensor (or nn.Parameter) that is dense, strided, on the CPU or a
  // CUDA device, without lazy conj/neg bits, with at most kReaderMaxDims dims: its facts are in
  // *out. -1: such a tensor whose elements its storage does not hold (storage freed, or resized
  // smaller under it, as FSDP does to parameters): reading it would fault or read another
  // allocation, so the caller must not. 0: anything else (the caller's attribute path decides).
  // Never raises; GIL held.
  int (*read)(PyObject* tensor, TensorFacts* out);
  // A torch.dtype's c10::ScalarType, or -1 for anything else. Never raises.
  int (*scalar_type)(PyObject* dtype);
  const char* torch_version;  // the torch.__version__ it was built against
};

}  // namespace fastdump
