// dispatch_recv as a kernel of its own (the split op), its launcher and its occupancy.
// Protocol and body: kernels/dispatch_recv.cuh (the fused ops in kernels/fused.cu share it).
#include "kernels/dispatch_recv.cuh"

namespace jmc {
namespace {

__global__ void __launch_bounds__(kMaxWarpsPerBlock * kWarpSize, kMinBlocksPerSm)
    dispatch_recv_kernel(const DispatchRecvParams p) {
  dispatch_recv_body(p);
}

}  // namespace

cudaError_t launch_dispatch_recv(const DispatchRecvParams& p, Launch l, cudaStream_t stream) {
  const size_t shared = dispatch_recv_shared_bytes(p.c.shape);
  dispatch_recv_kernel<<<l.num_blocks, l.warps_per_block * kWarpSize, shared, stream>>>(p);
  return cudaGetLastError();
}

int dispatch_recv_blocks_per_sm(int warps_per_block, size_t shared_bytes) {
  int n = 0;
  cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, dispatch_recv_kernel,
                                                warps_per_block * kWarpSize, shared_bytes);
  return n;
}

}  // namespace jmc
