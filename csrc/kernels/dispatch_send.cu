// dispatch_send: pack this rank's tokens and put each one, once, to every rank that holds one
// of its experts. Non-blocking: it never waits for a peer.
//
// 1. Inputs (this rank): x [max_m, H], x_scale [max_m, S] (fp8 only), indices [max_m, k]
//    (repeated experts already -1), num_tokens (device scalar). Output: none (a ticket).
// 2. Symmetric memory touched: send_records[t] (local, put source); on peer r:
//    recv_records[my_group][slot], dispatch_arrived[my_group], dispatch_count[my_group].
// 3. DP split: a token's experts on rank r are sent by the member of the token's DP group
//    with dp_rank == r % dp_size, so each rank receives one copy per DP group.
// 4. Warp roles: every warp owns tokens t = warp, warp + total_warps, ...: it packs the record
//    (header: t and the k expert ids; payload; scales), then, per distinct destination rank,
//    takes a slot with atomicAdd(send_count[r]) and calls putmem_signal_nbi_warp, which adds
//    1 to the receiver's dispatch_arrived[my_group] after the data (it fences first).
// 5. Last block (ticket in blocks_done[0]): for every rank r it sends to, SETs
//    dispatch_count[my_group] on r to count + 1 (0 means "not yet") with signal_op. signal_op
//    does not fence, but the receiver also waits for dispatch_arrived to reach the count, and
//    that counter only moves after each record's data.
// 6. After the kernel: send_count[] and blocks_done[0] are back at zero. Out-of-range expert
//    ids are recorded in the error record (kBadExpertIndex) and their slots skipped.
#include <nvshmem.h>
#include <nvshmemx.h>

#include "core/memory.cuh"
#include "core/vec.cuh"
#include "kernels/kernels.h"

namespace jmc {
namespace {

// Destination rank of slot j, or -1 when this rank does not send that slot.
__device__ __forceinline__ int slot_destination(const DispatchSendParams& p, int expert) {
  const Shape& s = p.c.shape;
  if (expert < 0 || expert >= s.num_experts) return -1;
  const int dst = expert / s.num_local_experts();
  return (dst % s.dp_size == p.c.rank % s.dp_size) ? dst : -1;
}

__global__ void dispatch_send_kernel(const DispatchSendParams p) {
  const Shape& s = p.c.shape;
  const SymmetricLayout& sym = p.c.sym;
  const int lane = threadIdx.x % kWarpSize;
  const int warp = (blockIdx.x * blockDim.x + threadIdx.x) / kWarpSize;
  const int total_warps = gridDim.x * blockDim.x / kWarpSize;
  const int k = s.experts_per_token;
  const int my_group = p.c.rank / s.dp_size;

  int num_tokens = *p.num_tokens;
  if (num_tokens < 0 || num_tokens > s.max_num_tokens) {
    if (blockIdx.x == 0 && threadIdx.x == 0)
      record_error(p.c.error, kBadNumTokens, kPhaseDispatchSend, -1, -1, s.max_num_tokens,
                   static_cast<uint64_t>(num_tokens));
    num_tokens = max(0, min(num_tokens, s.max_num_tokens));
  }

  for (int t = warp; t < num_tokens; t += total_warps) {
    const int32_t* ids = p.indices + static_cast<size_t>(t) * k;
    // Step 1: pack the record (header, payload, scales) into send_records[t].
    uint8_t* rec = sym.send_record(t);
    int32_t* header = reinterpret_cast<int32_t*>(rec);
    if (lane == 0) header[0] = t;
    for (int j = lane; j < k; j += kWarpSize) {
      int e = ids[j];
      if (e < -1 || e >= s.num_experts) {
        record_error(p.c.error, kBadExpertIndex, kPhaseDispatchSend, -1, t,
                     static_cast<uint64_t>(s.num_experts), static_cast<uint64_t>(e));
        e = -1;
      }
      header[1 + j] = e;
    }
    warp_copy(rec + sym.record.header_bytes, p.x + static_cast<size_t>(t) * sym.record.payload_bytes,
              sym.record.payload_bytes, lane);
    if (p.x_scale != nullptr) {
      float* scales = reinterpret_cast<float*>(rec + sym.record.header_bytes +
                                               sym.record.payload_bytes);
      for (int i = lane; i < s.num_scales; i += kWarpSize)
        scales[i] = p.x_scale[static_cast<size_t>(t) * s.num_scales + i];
    }
    __syncwarp();

    // Step 2: one put per distinct destination rank, in slot order.
    for (int j = 0; j < k; ++j) {
      const int dst = slot_destination(p, ids[j]);
      if (dst < 0) continue;
      bool seen_before = false;  // an earlier slot already sent this token to dst
      for (int base = 0; base < j; base += kWarpSize) {
        const int jj = base + lane;
        const bool same = jj < j && slot_destination(p, ids[jj]) == dst;
        seen_before |= __any_sync(0xffffffffu, same);
      }
      if (seen_before) continue;
      int slot = 0;
      if (lane == 0) slot = atomicAdd(&p.c.scratch.send_count[dst], 1u);
      slot = __shfl_sync(0xffffffffu, slot, 0);
      nvshmemx_putmem_signal_nbi_warp(sym.recv_record(my_group, slot, s.max_num_tokens), rec,
                                      sym.record.bytes, &sym.dispatch_arrived[my_group], 1,
                                      NVSHMEM_SIGNAL_ADD, dst);
    }
  }

  // Step 3: the last block to finish publishes the per-destination counts.
  __shared__ bool is_last;
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    is_last = atomicAdd(&p.c.scratch.blocks_done[0], 1u) == gridDim.x - 1;
  }
  __syncthreads();
  if (!is_last) return;
  __threadfence();
  for (int dst = threadIdx.x; dst < s.world_size; dst += blockDim.x) {
    if (dst % s.dp_size != p.c.rank % s.dp_size) continue;
    const uint32_t count = atomicExch(&p.c.scratch.send_count[dst], 0u);
    nvshmemx_signal_op(&sym.dispatch_count[my_group], static_cast<uint64_t>(count) + 1,
                       NVSHMEM_SIGNAL_SET, dst);
  }
  if (threadIdx.x == 0) p.c.scratch.blocks_done[0] = 0;
}

}  // namespace

cudaError_t launch_dispatch_send(const DispatchSendParams& p, Launch l, cudaStream_t stream) {
  dispatch_send_kernel<<<l.num_blocks, l.warps_per_block * kWarpSize, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace jmc
