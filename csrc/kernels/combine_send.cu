// combine_send: tell every peer this rank is past dispatch, then put each expert output row
// back to its token's home rank(s). Non-blocking.
//
// 1. Inputs: expert_y [L, R, H] (bf16 or f32), expert_num_tokens [L], row_source [L, R] from
//    dispatch_recv. Output: none (a ticket).
// 2. Symmetric memory written on peers: combine_flag[my_rank] (SET 1, block 0 first),
//    combine_rows[t][j] and combine_arrived[t] on every rank of the token's DP group.
// 3. The flag is the only global barrier: a rank whose combine_recv has seen every peer's
//    flag knows that every peer finished reading its dispatch buffers, so its next
//    dispatch_send may overwrite them.
// 4. Warp roles: warps stride over the filled rows of all local experts (numbered through a
//    prefix of expert_num_tokens in shared memory); for each row, one
//    putmem_signal_nbi_warp per DP-group member adds 1 to combine_arrived[t] after the data.
// 5. expert_y is read straight from XLA's buffer: fine for peers reached by load/store (NVLink,
//    one GPU); a remote network transport would need it registered (see docs/notes.md).
#include <nvshmem.h>
#include <nvshmemx.h>

#include "core/vec.cuh"
#include "kernels/kernels.h"

namespace jmc {
namespace {

__global__ void combine_send_kernel(const CombineSendParams p) {
  const Shape& s = p.c.shape;
  const SymmetricLayout& sym = p.c.sym;
  const int warp = (blockIdx.x * blockDim.x + threadIdx.x) / kWarpSize;
  const int total_warps = gridDim.x * blockDim.x / kWarpSize;
  const int k = s.experts_per_token;
  const int R = s.max_recv_tokens();

  // Step 1: the barrier flag, before any row.
  if (blockIdx.x == 0) {
    for (int peer = threadIdx.x; peer < s.world_size; peer += blockDim.x)
      nvshmemx_signal_op(&sym.combine_flag[p.c.rank], 1, NVSHMEM_SIGNAL_SET, peer);
  }

  // Step 2: every filled row goes home to each member of its token's DP group. Rows of all
  // experts are numbered through a prefix of the counts, so every warp shares the work.
  extern __shared__ int first_row[];  // [L + 1]
  const int L = s.num_local_experts();
  if (threadIdx.x == 0) {
    first_row[0] = 0;
    for (int e = 0; e < L; ++e) first_row[e + 1] = first_row[e] + min(p.expert_num_tokens[e], R);
  }
  __syncthreads();
  for (int i = warp; i < first_row[L]; i += total_warps) {
    int e = 0;  // largest e with first_row[e] <= i
    for (int lo = 0, hi = L; hi - lo > 1;) {
      const int mid = (lo + hi) / 2;
      (first_row[mid] <= i ? lo : hi) = mid;
      e = lo;
    }
    const size_t at = static_cast<size_t>(e) * R + (i - first_row[e]);
    const int src = p.row_source[at];
    const int j = src % k;
    const int t = (src / k) % s.max_num_tokens;
    const int group = src / k / s.max_num_tokens;
    const uint8_t* y_row = p.expert_y + at * sym.combine_row_bytes;
    for (int member = 0; member < s.dp_size; ++member) {
      const int home = group * s.dp_size + member;
      nvshmemx_putmem_signal_nbi_warp(sym.combine_row(t, j, k), y_row, sym.combine_row_bytes,
                                      &sym.combine_arrived[t], 1, NVSHMEM_SIGNAL_ADD, home);
    }
  }
}

}  // namespace

cudaError_t launch_combine_send(const CombineSendParams& p, Launch l, cudaStream_t stream) {
  const size_t shared = sizeof(int) * (p.c.shape.num_local_experts() + 1);
  combine_send_kernel<<<l.num_blocks, l.warps_per_block * kWarpSize, shared, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace jmc
