// 16-byte vector copies: every row is a multiple of 16 bytes (checked in Python and in C++).
#pragma once

#include <cstdint>

namespace jmc {

constexpr int kVecBytes = 16;
// 16-byte loads in flight per lane before the stores. The fused kernels (one block, up to 128
// registers: kernels/fused.cu) take 8; the split kernels, capped at 64 registers for two blocks
// per SM, take 4 (8 spilled ~130 bytes there).
#ifndef JMC_COPY_UNROLL
#define JMC_COPY_UNROLL 4
#endif
constexpr int kCopyUnroll = JMC_COPY_UNROLL;

// The whole warp copies `bytes` (a multiple of 16) from src to dst. Each lane issues up to
// kCopyUnroll loads (predicated, so a short last round is one round trip too) before it stores
// them: at 8, a 7 KB R1 fp8 record is two round trips and a 14 KB bf16 row four (each ~0.3 us
// under MPS, DESIGN §11); a remainder loop of dependent load/store pairs made them 5 and 7.
// dst may be a peer's memory reached through nvshmem_ptr.
__device__ __forceinline__ void warp_copy(void* dst, const void* src, uint32_t bytes, int lane) {
  auto* d = static_cast<int4*>(dst);
  const auto* s = static_cast<const int4*>(src);
  const uint32_t n = bytes / kVecBytes;
  for (uint32_t i = lane; i < n; i += kCopyUnroll * 32) {
    int4 v[kCopyUnroll];
#pragma unroll
    for (int u = 0; u < kCopyUnroll; ++u)
      if (i + u * 32 < n) v[u] = s[i + u * 32];
#pragma unroll
    for (int u = 0; u < kCopyUnroll; ++u)
      if (i + u * 32 < n) d[i + u * 32] = v[u];
  }
}

// The whole warp copies n floats (a token's block scales): vector copies when both ends are
// 16-byte aligned (n % 4 == 0: every shape with H % 512 == 0), one float per lane otherwise.
__device__ __forceinline__ void warp_copy_floats(float* dst, const float* src, int n, int lane) {
  const auto misaligned = (reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(src) |
                           static_cast<uintptr_t>(n) * 4) % kVecBytes;
  if (misaligned == 0) {
    warp_copy(dst, src, static_cast<uint32_t>(n) * 4, lane);
  } else {
    for (int i = lane; i < n; i += 32) dst[i] = src[i];
  }
}

// A token's block scales loaded ahead of the record's other copies and stored after them: in
// program order each copy's stores wait for its loads and the next copy's loads issue behind
// them (a round trip each, ~0.5 us under MPS). One 16-byte vector per lane where the source
// is aligned and n <= 128 floats; otherwise store_scales copies them then.
struct ScalesAhead {
  int4 v = make_int4(0, 0, 0, 0);
  bool early = false;
};

__device__ __forceinline__ ScalesAhead load_scales_ahead(const float* src, int n, int lane) {
  ScalesAhead a;
  const int vecs = n * 4 / kVecBytes;
  a.early = (reinterpret_cast<uintptr_t>(src) | static_cast<uintptr_t>(n) * 4) % kVecBytes == 0 &&
            vecs <= 32;
  if (a.early && lane < vecs) a.v = reinterpret_cast<const int4*>(src)[lane];
  return a;
}

__device__ __forceinline__ void store_scales(const ScalesAhead& a, float* dst, const float* src,
                                             int n, int lane) {
  if (a.early && reinterpret_cast<uintptr_t>(dst) % kVecBytes == 0) {
    if (lane < n * 4 / kVecBytes) reinterpret_cast<int4*>(dst)[lane] = a.v;
  } else {
    warp_copy_floats(dst, src, n, lane);
  }
}

__device__ __forceinline__ void warp_zero(void* dst, uint32_t bytes, int lane) {
  auto* d = static_cast<int4*>(dst);
  for (uint32_t i = lane; i < bytes / kVecBytes; i += 32) d[i] = make_int4(0, 0, 0, 0);
}

}  // namespace jmc
