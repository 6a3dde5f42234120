// Gather a strided tensor into contiguous C order, for any element size, by element range.
// Used for CPU tensors (straight into the ring) and for splitting large tensors into chunks.
#pragma once

#include <cstdint>
#include <cstring>
#include <vector>

namespace fastdump {

// Copies elements [begin, end) of the C-order enumeration of `shape` from `src` (strides in
// elements, may be zero or negative) to `dst`, packed. Runs of a contiguous innermost dimension are
// copied with memcpy.
inline void copy_strided(uint8_t* dst, const uint8_t* src, uint64_t elem, const std::vector<int64_t>& shape,
                         const std::vector<int64_t>& strides, uint64_t begin, uint64_t end) {
  if (begin >= end) return;
  const size_t nd = shape.size();
  // Contiguous (C order, ignoring size-1 dims): one memcpy.
  bool contiguous = true;
  int64_t expect = 1;
  for (size_t i = nd; i-- > 0;) {
    if (shape[i] != 1 && strides[i] != expect) {
      contiguous = false;
      break;
    }
    expect *= shape[i];
  }
  if (nd == 0 || contiguous) {
    std::memcpy(dst, src + begin * elem, (end - begin) * elem);
    return;
  }
  // Odometer over the outer dimensions, the innermost dimension copied as a run.
  const int64_t inner = shape[nd - 1];
  const int64_t inner_stride = strides[nd - 1];
  std::vector<int64_t> idx(nd, 0);
  uint64_t rem = begin;
  for (size_t i = nd; i-- > 0;) {
    idx[i] = static_cast<int64_t>(rem % static_cast<uint64_t>(shape[i]));
    rem /= static_cast<uint64_t>(shape[i]);
  }
  uint64_t pos = begin;
  while (pos < end) {
    int64_t off = 0;
    for (size_t i = 0; i < nd; ++i) off += idx[i] * strides[i];
    const uint8_t* s = src + off * static_cast<int64_t>(elem);
    int64_t run = inner - idx[nd - 1];
    if (static_cast<uint64_t>(run) > end - pos) run = static_cast<int64_t>(end - pos);
    if (inner_stride == 1) {
      std::memcpy(dst, s, run * elem);
      dst += run * elem;
    } else {
      for (int64_t j = 0; j < run; ++j) {
        std::memcpy(dst, s + j * inner_stride * static_cast<int64_t>(elem), elem);
        dst += elem;
      }
    }
    pos += run;
    idx[nd - 1] += run;
    for (size_t i = nd - 1; i > 0 && idx[i] >= shape[i]; --i) {
      idx[i] = 0;
      idx[i - 1]++;
    }
  }
}

}  // namespace fastdump
