// 16-byte vector copies: every row is a multiple of 16 bytes (checked in Python and in C++).
#pragma once

#include <cstdint>

namespace jmc {

constexpr int kWarpSize = 32;
constexpr int kVecBytes = 16;

// Whole warp copies `bytes` (multiple of 16) from src to dst, 16 bytes per lane per step.
__device__ __forceinline__ void warp_copy(void* dst, const void* src, uint32_t bytes,
                                          int lane) {
  auto* d = static_cast<int4*>(dst);
  const auto* s = static_cast<const int4*>(src);
  const uint32_t n = bytes / kVecBytes;
  for (uint32_t i = lane; i < n; i += kWarpSize) d[i] = s[i];
}

}  // namespace jmc
