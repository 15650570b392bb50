// combine_recv as a kernel of its own (the split op), its launcher and its occupancy.
// Protocol and body: kernels/combine_recv.cuh (the fused ops in kernels/fused.cu share it).
#include "kernels/combine_recv.cuh"

namespace jmc {
namespace {

template <typename T>
__global__ void __launch_bounds__(kMaxWarpsPerBlock * kWarpSize, kMinBlocksPerSm)
    combine_recv_kernel(const CombineRecvParams p) {
  combine_recv_body<T>(p);
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

int combine_recv_blocks_per_sm(int warps_per_block) {
  int a = 0, b = 0;
  cudaOccupancyMaxActiveBlocksPerMultiprocessor(&a, combine_recv_kernel<float>,
                                                warps_per_block * kWarpSize, 0);
  cudaOccupancyMaxActiveBlocksPerMultiprocessor(&b, combine_recv_kernel<__nv_bfloat16>,
                                                warps_per_block * kWarpSize, 0);
  return min(a, b);
}

}  // namespace jmc
