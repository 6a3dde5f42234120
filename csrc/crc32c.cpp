// CRC32C: the SSE4.2 crc32 instruction where the CPU has it (chosen at run time, so one build runs
// everywhere), otherwise a slicing-by-8 table. Both give identical results.
#include "crc32c.h"

#include <cstring>

namespace fastdump {
namespace {

constexpr uint32_t kPoly = 0x82F63B78u;  // CRC32C, reflected

struct Tables {
  uint32_t t[8][256];
  Tables() {
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c >> 1) ^ (kPoly & (0u - (c & 1u)));
      t[0][i] = c;
    }
    for (uint32_t i = 0; i < 256; ++i)
      for (int s = 1; s < 8; ++s) t[s][i] = (t[s - 1][i] >> 8) ^ t[0][t[s - 1][i] & 0xFF];
  }
};

const Tables& tables() {
  static const Tables instance;
  return instance;
}

uint32_t crc_table(const uint8_t* p, size_t n, uint32_t c) {
  const Tables& T = tables();
  while (n && (reinterpret_cast<uintptr_t>(p) & 7)) {
    c = T.t[0][(c ^ *p++) & 0xFF] ^ (c >> 8);
    --n;
  }
  while (n >= 8) {
    uint64_t w;
    std::memcpy(&w, p, 8);  // little-endian hosts only (as the ring itself)
    w ^= c;
    c = T.t[7][w & 0xFF] ^ T.t[6][(w >> 8) & 0xFF] ^ T.t[5][(w >> 16) & 0xFF] ^ T.t[4][(w >> 24) & 0xFF] ^
        T.t[3][(w >> 32) & 0xFF] ^ T.t[2][(w >> 40) & 0xFF] ^ T.t[1][(w >> 48) & 0xFF] ^ T.t[0][w >> 56];
    p += 8;
    n -= 8;
  }
  while (n--) c = T.t[0][(c ^ *p++) & 0xFF] ^ (c >> 8);
  return c;
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define FASTDUMP_HAVE_SSE42 1

__attribute__((target("sse4.2"))) uint32_t crc_sse42(const uint8_t* p, size_t n, uint32_t c) {
  uint64_t c64 = c;
  while (n && (reinterpret_cast<uintptr_t>(p) & 7)) {
    c64 = __builtin_ia32_crc32qi(static_cast<uint32_t>(c64), *p++);
    --n;
  }
  // One stream, 8 bytes per instruction: ~8 GB/s, far above what the writer's disk takes.
  while (n >= 8) {
    uint64_t w;
    std::memcpy(&w, p, 8);
    c64 = __builtin_ia32_crc32di(c64, w);
    p += 8;
    n -= 8;
  }
  uint32_t c32 = static_cast<uint32_t>(c64);
  while (n--) c32 = __builtin_ia32_crc32qi(c32, *p++);
  return c32;
}

bool cpu_has_sse42() {
  static const bool has = __builtin_cpu_supports("sse4.2");
  return has;
}
#endif

}  // namespace

uint32_t crc32c(const void* data, size_t len, uint32_t crc, bool portable) {
  const uint8_t* p = static_cast<const uint8_t*>(data);
  uint32_t c = ~crc;
#ifdef FASTDUMP_HAVE_SSE42
  if (!portable && cpu_has_sse42()) return ~crc_sse42(p, len, c);
#endif
  return ~crc_table(p, len, c);
}

const char* crc32c_impl() {
#ifdef FASTDUMP_HAVE_SSE42
  if (cpu_has_sse42()) return "sse4.2";
#endif
  return "table";
}

}  // namespace fastdump
