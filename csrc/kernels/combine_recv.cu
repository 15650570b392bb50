// combine_recv: wait for every expert row of each of this rank's tokens, form the weighted
// sum in f32, write y; return only after every peer's combine flag was seen.
//
// 1. Inputs: indices [max_m, k] (repeated experts already -1), weights [max_m, k] (a
//    repeated expert's weights merged on its first slot), num_tokens. Output: y [max_m, H]
//    bf16, zero for rows >= num_tokens.
// 2. Symmetric memory read (local): combine_arrived[t], combine_rows[t][j], combine_flag[p].
// 3. Warp roles: warps stride over tokens. For token t: expected = slots j with a valid
//    expert; bounded wait for combine_arrived[t] >= expected (acquire); then each lane sums 8
//    hidden elements at a time over the k slots, y = sum_j w[t,j] * row(t, j) in f32.
//    Block 0, warp 0, at the end: bounded wait for combine_flag[p] >= 1 for every peer p.
// 4. After the kernel: combine_arrived[t] and combine_flag[p] are back at zero.
// 5. On timeout: kPeerTimeout (peer -1 for a token's rows, the peer's rank for its flag).
#include <cuda_bf16.h>

#include "core/memory.cuh"
#include "core/vec.cuh"
#include "kernels/kernels.h"

namespace jmc {
namespace {

constexpr int kElemsPerChunk = 8;  // one 16-byte bf16 store of y per lane per step

template <typename T>
__device__ __forceinline__ void load_chunk(const T* row, int chunk, float (&v)[kElemsPerChunk]);

template <>
__device__ __forceinline__ void load_chunk<__nv_bfloat16>(const __nv_bfloat16* row, int chunk,
                                                          float (&v)[kElemsPerChunk]) {
  const int4 raw = reinterpret_cast<const int4*>(row)[chunk];
  const __nv_bfloat162* pairs = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
  for (int i = 0; i < kElemsPerChunk / 2; ++i) {
    const float2 f = __bfloat1622float2(pairs[i]);
    v[2 * i] = f.x;
    v[2 * i + 1] = f.y;
  }
}

template <>
__device__ __forceinline__ void load_chunk<float>(const float* row, int chunk,
                                                  float (&v)[kElemsPerChunk]) {
  const float4 a = reinterpret_cast<const float4*>(row)[2 * chunk];
  const float4 b = reinterpret_cast<const float4*>(row)[2 * chunk + 1];
  v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w;
  v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
}

template <typename T>
__global__ void combine_recv_kernel(const CombineRecvParams p) {
  const Shape& s = p.c.shape;
  const SymmetricLayout& sym = p.c.sym;
  const int lane = threadIdx.x % kWarpSize;
  const int warp = (blockIdx.x * blockDim.x + threadIdx.x) / kWarpSize;
  const int total_warps = gridDim.x * blockDim.x / kWarpSize;
  const int k = s.experts_per_token;
  const int chunks = s.hidden / kElemsPerChunk;
  const uint64_t deadline = globaltimer_ns() + p.c.timeout_ns;
  const int num_tokens = max(0, min(*p.num_tokens, s.max_num_tokens));

  for (int t = warp; t < s.max_num_tokens; t += total_warps) {
    int4* y_row = reinterpret_cast<int4*>(p.y + static_cast<size_t>(t) * s.hidden);
    if (t >= num_tokens) {
      for (int c = lane; c < chunks; c += kWarpSize) y_row[c] = make_int4(0, 0, 0, 0);
      continue;
    }
    const int32_t* ids = p.indices + static_cast<size_t>(t) * k;
    const float* w = p.weights + static_cast<size_t>(t) * k;
    // Step 1: how many rows come back for t, and have they landed?
    uint64_t expected = 0;
    for (int base = 0; base < k; base += kWarpSize) {
      const int j = base + lane;
      const bool valid = j < k && ids[j] >= 0 && ids[j] < s.num_experts;
      expected += __popc(__ballot_sync(0xffffffffu, valid));
    }
    uint64_t seen = 0;
    const bool ok =
        warp_wait_ge_acquire_sys_u64(&sym.combine_arrived[t], expected, deadline, &seen, lane);
    if (!ok && lane == 0)
      record_error(p.c.error, kPeerTimeout, kPhaseCombineRecv, -1, t, expected, seen);
    // Step 2: weighted sum in f32, 8 elements per lane per step.
    for (int c = lane; c < chunks; c += kWarpSize) {
      float acc[kElemsPerChunk] = {};
      for (int j = 0; j < k; ++j) {
        if (!ok || ids[j] < 0 || ids[j] >= s.num_experts) continue;
        float v[kElemsPerChunk];
        load_chunk<T>(reinterpret_cast<const T*>(sym.combine_row(t, j, k)), c, v);
        const float wj = w[j];
#pragma unroll
        for (int i = 0; i < kElemsPerChunk; ++i) acc[i] += wj * v[i];
      }
      int4 out;
      __nv_bfloat162* pairs = reinterpret_cast<__nv_bfloat162*>(&out);
#pragma unroll
      for (int i = 0; i < kElemsPerChunk / 2; ++i)
        pairs[i] = __floats2bfloat162_rn(acc[2 * i], acc[2 * i + 1]);
      y_row[c] = out;
    }
    __syncwarp();
    if (lane == 0) st_relaxed_sys_u64(&sym.combine_arrived[t], 0);
  }

  // Step 3: every peer has entered combine_send, so dispatch buffers are free again.
  if (blockIdx.x == 0 && threadIdx.x < kWarpSize) {
    for (int peer = 0; peer < s.world_size; ++peer) {
      uint64_t seen = 0;
      if (warp_wait_ge_acquire_sys_u64(&sym.combine_flag[peer], 1, deadline, &seen, lane)) {
        if (lane == 0) st_relaxed_sys_u64(&sym.combine_flag[peer], 0);
      } else if (lane == 0) {
        record_error(p.c.error, kPeerTimeout, kPhaseCombineRecv, peer, -1, 1, seen);
      }
    }
  }
}

}  // namespace

cudaError_t launch_combine_recv(const CombineRecvParams& p, Launch l, cudaStream_t stream) {
  const dim3 grid(l.num_blocks), block(l.warps_per_block * kWarpSize);
  if (p.c.shape.out_elem_bytes == 4)
    combine_recv_kernel<float><<<grid, block, 0, stream>>>(p);
  else
    combine_recv_kernel<__nv_bfloat16><<<grid, block, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace jmc
