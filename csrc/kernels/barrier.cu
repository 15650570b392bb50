// barrier: every rank of a handle meets here, on the stream (benchmarks: one per sample).
//
// 1. Symmetric memory: barrier_flag[p] on every rank; rank p SETs barrier_flag[p] = epoch on
//    every peer, then waits (bounded, abort-aware) until barrier_flag[q] >= epoch for every q.
// 2. epoch strictly increases per handle (DeviceState::barrier_epoch: kept on the device so a
//    launch replayed from a CUDA graph counts too), so no reset is needed.
// 3. A barrier with a dispatch or combine in flight is a ProtocolError (checked here, not by the
//    handler, which a replayed command buffer does not run).
// 4. With timing on, it opens a sample: the last sample's stamps (the current row) go into the
//    ring, and the current row starts empty with this barrier's end.
// timestamp: one thread writes %globaltimer (the dense all-to-all baseline's stamps).
// empty: waits for the kernels before it and ends (the loop benchmark's floor).
// blocks_per_sm: the occupancy of each all-to-all kernel, for sizing grids on the host.
#include "core/launch.cuh"
#include "core/protocol.cuh"

namespace jmc {

int dispatch_send_blocks_per_sm(int warps_per_block);
int dispatch_recv_blocks_per_sm(int warps_per_block, size_t shared_bytes);
int combine_send_blocks_per_sm(int warps_per_block, size_t shared_bytes);
int combine_recv_blocks_per_sm(int warps_per_block);

namespace {

// Files the current row as sample opened - 1 and clears it (threads < kTimingSlots).
__device__ void open_sample(const BarrierParams& p, uint32_t opened) {
  uint64_t* current = p.c.timings;
  const int slot = threadIdx.x;
  if (slot >= kTimingSlots) return;
  if (opened > 0)
    p.timing_ring[size_t((opened - 1) % kTimingSamples) * kTimingSlots + slot] = current[slot];
  current[slot] = 0;
}

__global__ void barrier_kernel(const __grid_constant__ BarrierParams p) {
  wait_for_previous_kernels();
  const CommonParams& c = p.c;
  DeviceState* state = c.scratch.state;
  if (handle_closed(c)) {  // replayed after close(): its flags may be another handle's now
    if (blockIdx.x == 0 && threadIdx.x == 0)
      fail(c, kStaleLaunch, kPhaseBarrier, -1, -1, 0, 0, kWhatNone);
    return;
  }
  const uint64_t epoch = *reinterpret_cast<volatile uint64_t*>(&state->barrier_epoch) + 1;
  const uint32_t opened = *reinterpret_cast<volatile uint32_t*>(&state->timing_opened);
  if (c.timings != nullptr) open_sample(p, opened);
  uint64_t sent = 0, received = 0;
  if (threadIdx.x == 0 && !(launch_in_order(c, kDispatchSendKernel, &sent, &received) &&
                            launch_in_order(c, kCombineSendKernel, &sent, &received)))
    fail(c, kOutOfOrder, kPhaseBarrier, -1, -1, sent, received, kWhatNone);  // waits then abort
  for (int peer = threadIdx.x; peer < c.shape.world_size; peer += blockDim.x)
    set_flag(c, &c.sym.barrier_flag[c.rank], epoch, peer);
  for (int peer = threadIdx.x; peer < c.shape.world_size; peer += blockDim.x) {
    uint64_t seen = 0;
    const Wait w = wait_ge(c, &c.sym.barrier_flag[peer], epoch, &seen);
    check_wait(c, w, kPhaseBarrier, peer, -1, epoch, seen, kWhatNone);
  }
  __syncthreads();  // every thread has read the counters and filed its slot
  if (threadIdx.x == 0) {
    state->barrier_epoch = epoch;
    if (c.timings != nullptr) {
      state->timing_opened = opened + 1;
      c.timings[kBarrierEndSlot] = globaltimer_ns();
    }
  }
}

__global__ void timestamp_kernel(uint64_t* out) { *out = globaltimer_ns(); }

__global__ void empty_kernel() { wait_for_previous_kernels(); }

}  // namespace

cudaError_t launch_barrier(const BarrierParams& p, bool dependent_launch, cudaStream_t stream) {
  return launch_kernel(barrier_kernel, Launch{1, 4, dependent_launch}, 0, stream, p);
}

cudaError_t launch_empty(bool dependent_launch, cudaStream_t stream) {
  return launch_kernel(empty_kernel, Launch{1, 1, dependent_launch}, 0, stream);
}

bool kernels_wait_for_previous() {
  // Every .cu is built for the same architectures, so the barrier kernel stands for all.
  cudaFuncAttributes attributes{};
  return cudaFuncGetAttributes(&attributes, barrier_kernel) == cudaSuccess &&
         attributes.ptxVersion >= 90;
}

cudaError_t launch_timestamp(uint64_t* out, cudaStream_t stream) {
  timestamp_kernel<<<1, 1, 0, stream>>>(out);
  return cudaGetLastError();
}

int blocks_per_sm(const Shape& s, KernelId kernel, int warps_per_block) {
  switch (kernel) {
    case kDispatchSendKernel: return dispatch_send_blocks_per_sm(warps_per_block);
    case kDispatchRecvKernel:
      return dispatch_recv_blocks_per_sm(warps_per_block, dispatch_recv_shared_bytes(s));
    case kCombineSendKernel:
      return combine_send_blocks_per_sm(warps_per_block, combine_send_shared_bytes(s));
    case kCombineRecvKernel: return combine_recv_blocks_per_sm(warps_per_block);
  }
  return 1;
}

}  // namespace jmc
