// Gather a strided tensor into contiguous C order, for any element size, by element range.
// Used for CPU tensors (straight into the ring) and for splitting large tensors into chunks.
#pragma once

#include <cstdint>
#include <cstring>
#include <vector>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

namespace fastdump {

// Copies elements [begin, end) of the C-order enumeration of `shape` from `src` (strides in
// elements, may be zero or negative) to `dst`, packed. Runs of a contiguous innermost dimension are
// copied with memcpy.
// memcpy with non-temporal (streaming) stores: the writer's copy from the ring into its page
// buffers, which go to the disk by DMA and are not read again by a CPU. Plain stores would pull a
// whole segment's worth of buffers (tens of MiB) through the last-level cache the model shares,
// evicting its weights; issue 11 measured that as model time per dumped tensor.
inline void copy_streaming(uint8_t* dst, const uint8_t* src, size_t n) {
#if defined(__SSE2__)
  if (n < 256) {  // a few lines: not worth the fence
    std::memcpy(dst, src, n);
    return;
  }
  const size_t head = (16 - reinterpret_cast<uintptr_t>(dst) % 16) % 16;
  std::memcpy(dst, src, head);
  dst += head, src += head, n -= head;
  for (; n >= 64; n -= 64, dst += 64, src += 64) {
    __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src));
    __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 16));
    __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 32));
    __m128i d = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 48));
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst), a);
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + 16), b);
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + 32), c);
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + 48), d);
  }
  std::memcpy(dst, src, n);
  _mm_sfence();  // the streamed bytes are visible before anyone (pwritev) reads the buffer
#else
  std::memcpy(dst, src, n);
#endif
}

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
    copy_streaming(dst, src + begin * elem, (end - begin) * elem);
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
