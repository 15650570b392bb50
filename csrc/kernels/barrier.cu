// barrier: every rank of a handle meets here, on the stream (benchmarks: one per sample).
//
// 1. Symmetric memory: barrier_flag[p] on every rank; rank p SETs barrier_flag[p] = epoch on
//    every peer, then waits (bounded) until barrier_flag[q] >= epoch for every q.
// 2. epoch strictly increases per handle (host counter), so no reset is needed.
// timestamp: one thread writes %globaltimer, for timing between ops on XLA's stream.
#include <nvshmem.h>
#include <nvshmemx.h>

#include "core/memory.cuh"
#include "kernels/kernels.h"

namespace jmc {
namespace {

__global__ void barrier_kernel(const BarrierParams p) {
  const Shape& s = p.c.shape;
  const uint64_t deadline = globaltimer_ns() + p.c.timeout_ns;
  for (int peer = threadIdx.x; peer < s.world_size; peer += blockDim.x)
    nvshmemx_signal_op(&p.c.sym.barrier_flag[p.c.rank], p.epoch, NVSHMEM_SIGNAL_SET, peer);
  for (int peer = threadIdx.x; peer < s.world_size; peer += blockDim.x) {
    uint64_t seen = 0;
    if (!wait_ge_acquire_sys_u64(&p.c.sym.barrier_flag[peer], p.epoch, deadline, &seen))
      record_error(p.c.error, kPeerTimeout, kPhaseBarrier, peer, -1, p.epoch, seen);
  }
}

__global__ void timestamp_kernel(uint64_t* out) { *out = globaltimer_ns(); }

}  // namespace

cudaError_t launch_barrier(const BarrierParams& p, cudaStream_t stream) {
  barrier_kernel<<<1, 128, 0, stream>>>(p);
  return cudaGetLastError();
}

cudaError_t launch_timestamp(uint64_t* out, cudaStream_t stream) {
  timestamp_kernel<<<1, 1, 0, stream>>>(out);
  return cudaGetLastError();
}

}  // namespace jmc
