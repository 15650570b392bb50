// 16-byte vector copies: every row is a multiple of 16 bytes (checked in Python and in C++).
#pragma once

#include <cstdint>

namespace jmc {

constexpr int kVecBytes = 16;
constexpr int kCopyUnroll = 4;  // 16-byte loads in flight per lane before the stores

// The whole warp copies `bytes` (a multiple of 16) from src to dst. Each lane keeps
// kCopyUnroll loads in flight, so a 7 KB row is two round trips, not fifteen (DESIGN §11).
// dst may be a peer's memory reached through nvshmem_ptr.
__device__ __forceinline__ void warp_copy(void* dst, const void* src, uint32_t bytes, int lane) {
  auto* d = static_cast<int4*>(dst);
  const auto* s = static_cast<const int4*>(src);
  const uint32_t n = bytes / kVecBytes;
  uint32_t i = lane;
  for (; i + (kCopyUnroll - 1) * 32 < n; i += kCopyUnroll * 32) {
    int4 v[kCopyUnroll];
#pragma unroll
    for (int u = 0; u < kCopyUnroll; ++u) v[u] = s[i + u * 32];
#pragma unroll
    for (int u = 0; u < kCopyUnroll; ++u) d[i + u * 32] = v[u];
  }
  for (; i < n; i += 32) d[i] = s[i];
}

__device__ __forceinline__ void warp_zero(void* dst, uint32_t bytes, int lane) {
  auto* d = static_cast<int4*>(dst);
  for (uint32_t i = lane; i < bytes / kVecBytes; i += 32) d[i] = make_int4(0, 0, 0, 0);
}

}  // namespace jmc
