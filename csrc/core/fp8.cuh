// Dequantize on receive: fp8 e4m3 rows with their 1x128 block scales written out as bf16, so
// that no XLA pass reads and writes the whole expert_x buffer after dispatch (its rows past
// the counts included: at R1 with 128 tokens per rank that pass moved ~180 MB per rank).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>

#include "core/layout.h"
#include "core/vec.cuh"

namespace jmc {
namespace {  // one copy per translation unit (-rdc: the called function is a symbol)

// 16 e4m3 values (one 16-byte vector, element 0 in the lowest byte) times `scale`, as 16 bf16
// (two vectors). Each value: fp8 -> f32 (exact, through f16), one f32 multiply, one rounding to
// bf16 (nearest even): what XLA does for quant.dequantize(q, s).astype(bfloat16), so the two
// agree bit for bit on every non-NaN value (checked on the host for all 256 codes times 4,012
// scales; SASS: FMUL then F2FP.BF16, no FMA, no flush to zero). A NaN comes out as the
// canonical bf16 NaN, sign dropped.
__device__ __forceinline__ void dequantize16(const int4 q, float scale, int4* out) {
  const uint32_t words[4] = {static_cast<uint32_t>(q.x), static_cast<uint32_t>(q.y),
                             static_cast<uint32_t>(q.z), static_cast<uint32_t>(q.w)};
  uint32_t bf[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const auto pair = static_cast<__nv_fp8x2_storage_t>(words[i / 2] >> (16 * (i % 2)));
    const __half2 h = __half2(__nv_cvt_fp8x2_to_halfraw2(pair, __NV_E4M3));
    const float2 f = __half22float2(h);
    const __nv_bfloat162 b = __floats2bfloat162_rn(f.x * scale, f.y * scale);
    bf[i] = *reinterpret_cast<const uint32_t*>(&b);
  }
  out[0] = make_int4(static_cast<int>(bf[0]), static_cast<int>(bf[1]), static_cast<int>(bf[2]),
                     static_cast<int>(bf[3]));
  out[1] = make_int4(static_cast<int>(bf[4]), static_cast<int>(bf[5]), static_cast<int>(bf[6]),
                     static_cast<int>(bf[7]));
}

// The whole warp writes `elems` bf16 (a multiple of kScaleBlock) to dst from `elems` fp8 at src
// and their elems / kScaleBlock scales; loads first, kCopyUnroll per lane, as warp_copy does.
// Not inlined: inlined (at any unroll) it made the fused dispatch kernel spill on every path,
// the fp8-copying one included (sm_90: 0 -> 28-56 bytes); called, the fused kernel has no
// spills (119 -> 127 registers). The split dispatch_recv (64 registers at most) spills 12 B
// more than without it (28 -> 40 stores: the call's saves; it spilled before too).
__device__ __noinline__ void warp_dequantize_fp8(void* dst, const void* src, const float* scales,
                                                 uint32_t elems, int lane) {
  constexpr uint32_t kVecsPerScale = kScaleBlock / 16;
  auto* d = static_cast<int4*>(dst);
  const auto* s = static_cast<const int4*>(src);
  const uint32_t n = elems / 16;
  for (uint32_t i = lane; i < n; i += kCopyUnroll * 32) {
    int4 v[kCopyUnroll];
    float scale[kCopyUnroll];
#pragma unroll
    for (int u = 0; u < kCopyUnroll; ++u) {
      if (i + u * 32 < n) {
        v[u] = s[i + u * 32];
        scale[u] = scales[(i + u * 32) / kVecsPerScale];
      }
    }
#pragma unroll
    for (int u = 0; u < kCopyUnroll; ++u)
      if (i + u * 32 < n) dequantize16(v[u], scale[u], d + 2 * (i + u * 32));
  }
}

}  // namespace
}  // namespace jmc
