// dispatch_recv: wait for every DP group's tokens, then lay them out per local expert.
//
// 1. Outputs: expert_x [L, R, H], expert_x_scale [L, R, S] (fp8), expert_num_tokens [L],
//    row_source [L, R] (pack_source(group, token, slot); undefined past the count). R = max_m * G.
// 2. Symmetric memory read: dispatch_count[g], dispatch_arrived[g], recv_records[g][*], all
//    local; written only by the senders' dispatch_send.
// 3. Step 1, per block: one thread per group g waits (bounded) for dispatch_count[g] >= 1,
//    so n_g = count - 1 records are coming; a prefix over groups goes to shared memory.
//    Step 2: warps stride over all records of all groups; before reading a record of group g
//    a warp waits (acquire) for dispatch_arrived[g] >= n_g, so the record's bytes are visible.
//    For each expert id that is local, a row is taken with atomicAdd(expert_fill[e]) and the
//    payload, scales and source are copied.
// 4. Last block (ticket blocks_done[1]): writes expert_num_tokens from expert_fill and resets
//    expert_fill, dispatch_count, dispatch_arrived and the ticket to zero. The senders touch
//    these counters again only after this rank's combine_send flag (the global barrier).
// 5. On timeout: kPeerTimeout with the sender's rank, expected and seen values; the warp skips
//    that group. The outputs are then incomplete and the handle reports the error.
#include "core/memory.cuh"
#include "core/vec.cuh"
#include "kernels/kernels.h"

namespace jmc {
namespace {

__global__ void dispatch_recv_kernel(const DispatchRecvParams p) {
  const Shape& s = p.c.shape;
  const SymmetricLayout& sym = p.c.sym;
  const int lane = threadIdx.x % kWarpSize;
  const int warp = (blockIdx.x * blockDim.x + threadIdx.x) / kWarpSize;
  const int total_warps = gridDim.x * blockDim.x / kWarpSize;
  const int k = s.experts_per_token;
  const int L = s.num_local_experts();
  const int R = s.max_recv_tokens();
  const int first_expert = p.c.rank * L;
  const uint64_t deadline = globaltimer_ns() + p.c.timeout_ns;

  // Step 1: how many records will each group send? One thread per group polls its count.
  extern __shared__ uint32_t first_record[];  // [G + 1] prefix of the groups' record counts
  const int G = s.num_dp_groups();
  for (int g = threadIdx.x; g < G; g += blockDim.x) {
    uint64_t seen = 0;
    uint32_t n = 0;
    if (wait_ge_acquire_sys_u64(&sym.dispatch_count[g], 1, deadline, &seen)) {
      n = static_cast<uint32_t>(seen - 1);
    } else if (blockIdx.x == 0) {
      record_error(p.c.error, kPeerTimeout, kPhaseDispatchRecv,
                   g * s.dp_size + p.c.rank % s.dp_size, -1, 1, seen);
    }
    first_record[g + 1] = n;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    first_record[0] = 0;
    for (int g = 0; g < G; ++g) first_record[g + 1] += first_record[g];
  }
  __syncthreads();

  // Step 2: warps stride over every record of every group, so all warps share the work.
  const uint32_t total = first_record[G];
  for (uint32_t i = warp; i < total; i += total_warps) {
    int g = 0;  // the group whose records cover i: largest g with first_record[g] <= i
    for (int lo = 0, hi = G; hi - lo > 1;) {
      const int mid = (lo + hi) / 2;
      (first_record[mid] <= i ? lo : hi) = mid;
      g = lo;
    }
    const uint32_t n = first_record[g + 1] - first_record[g];
    uint64_t seen = 0;
    if (!warp_wait_ge_acquire_sys_u64(&sym.dispatch_arrived[g], n, deadline, &seen, lane)) {
      if (lane == 0)
        record_error(p.c.error, kPeerTimeout, kPhaseDispatchRecv,
                     g * s.dp_size + p.c.rank % s.dp_size, -1, n, seen);
      continue;
    }
    const uint8_t* rec = sym.recv_record(g, static_cast<int>(i - first_record[g]),
                                         s.max_num_tokens);
    const int32_t* header = reinterpret_cast<const int32_t*>(rec);
    const int t = header[0];
    for (int j = 0; j < k; ++j) {
      const int e = header[1 + j] - first_expert;
      if (e < 0 || e >= L) continue;
      int row = 0;
      if (lane == 0) row = atomicAdd(&p.c.scratch.expert_fill[e], 1u);
      row = __shfl_sync(0xffffffffu, row, 0);
      const size_t out_row = static_cast<size_t>(e) * R + row;
      warp_copy(p.expert_x + out_row * sym.record.payload_bytes, rec + sym.record.header_bytes,
                sym.record.payload_bytes, lane);
      if (p.expert_x_scale != nullptr) {
        const float* scales = reinterpret_cast<const float*>(rec + sym.record.header_bytes +
                                                             sym.record.payload_bytes);
        for (int q = lane; q < s.num_scales; q += kWarpSize)
          p.expert_x_scale[out_row * s.num_scales + q] = scales[q];
      }
      if (lane == 0) p.row_source[out_row] = pack_source(g, t, j, s.max_num_tokens, k);
    }
  }

  // Step 3: the last block publishes the counts and re-arms every counter.
  __shared__ bool is_last;
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    is_last = atomicAdd(&p.c.scratch.blocks_done[1], 1u) == gridDim.x - 1;
  }
  __syncthreads();
  if (!is_last) return;
  __threadfence();
  for (int e = threadIdx.x; e < L; e += blockDim.x) {
    const uint32_t filled = atomicExch(&p.c.scratch.expert_fill[e], 0u);
    p.expert_num_tokens[e] = static_cast<int32_t>(filled);
  }
  for (int g = threadIdx.x; g < s.num_dp_groups(); g += blockDim.x) {
    st_relaxed_sys_u64(&sym.dispatch_count[g], 0);
    st_relaxed_sys_u64(&sym.dispatch_arrived[g], 0);
  }
  if (threadIdx.x == 0) p.c.scratch.blocks_done[1] = 0;
}

}  // namespace

cudaError_t launch_dispatch_recv(const DispatchRecvParams& p, Launch l, cudaStream_t stream) {
  const size_t shared = sizeof(uint32_t) * (p.c.shape.num_dp_groups() + 1);
  dispatch_recv_kernel<<<l.num_blocks, l.warps_per_block * kWarpSize, shared, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace jmc
