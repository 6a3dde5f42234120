// CRC32C (Castagnoli) of stored tensors: the writer computes it as it copies/writes each tensor,
// readers check it (docs/FORMAT.md, "Checksums").
#pragma once

#include <cstddef>
#include <cstdint>

namespace fastdump {

// CRC32C of `len` bytes at `data`, continuing from `crc` (0 to start). Standard CRC32C: the
// result equals RFC 3720's for one call, and crc32c(b, crc32c(a)) == crc32c(a + b).
// `portable` forces the table implementation (tests compare the two).
uint32_t crc32c(const void* data, size_t len, uint32_t crc = 0, bool portable = false);

// Which implementation runs: "sse4.2" (the CPU's crc32 instruction) or "table" (portable).
const char* crc32c_impl();

}  // namespace fastdump
