// combine_recv as a kernel of its own (the split op), its launcher and its occupancy.
// Protocol and body: kernels/combine_recv.cuh (the fused ops in kernels/fused.cu share it).
#include "core/launch.cuh"
#include "kernels/combine_recv.cuh"

namespace jmc {
namespace {

template <typename T>
__global__ void __launch_bounds__(kMaxWarpsPerBlock * kWarpSize, kMinBlocksPerSm)
    combine_recv_kernel(const CombineRecvParams p) {
  wait_for_previous_kernels();
  combine_recv_body<T>(p);
}

}  // namespace

cudaError_t launch_combine_recv(const CombineRecvParams& p, Launch l, cudaStream_t stream) {
  if (p.c.shape.out_elem_bytes == 4)
    return launch_kernel(combine_recv_kernel<float>, l, 0, stream, p);
  return launch_kernel(combine_recv_kernel<__nv_bfloat16>, l, 0, stream, p);
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
