// combine_recv as a kernel of its own (the split op), its launcher and its occupancy.
// Protocol and body: kernels/combine_recv.cuh (the fused ops in kernels/fused.cu share it).
#include "core/launch.cuh"
#include "kernels/combine_recv.cuh"

namespace jmc {
namespace {

template <typename T, bool kGeneral>
__global__ void __launch_bounds__(kMaxWarpsPerBlock * kWarpSize, kMinBlocksPerSm)
    combine_recv_kernel(const __grid_constant__ CombineRecvParams p) {
  wait_for_previous_kernels();
  combine_recv_body<T, kGeneral>(p);
}

template <typename T>
cudaError_t launch_typed(const CombineRecvParams& p, Launch l, cudaStream_t stream) {
  if (general_path(p.c)) return launch_kernel(combine_recv_kernel<T, true>, l, 0, stream, p);
  return launch_kernel(combine_recv_kernel<T, false>, l, 0, stream, p);
}

}  // namespace

cudaError_t launch_combine_recv(const CombineRecvParams& p, Launch l, cudaStream_t stream) {
  if (p.c.shape.out_elem_bytes == 4) return launch_typed<float>(p, l, stream);
  return launch_typed<__nv_bfloat16>(p, l, stream);
}

int combine_recv_blocks_per_sm(int warps_per_block) {
  return min(fewer_blocks_per_sm(combine_recv_kernel<float, true>,
                                 combine_recv_kernel<float, false>, warps_per_block, 0),
             fewer_blocks_per_sm(combine_recv_kernel<__nv_bfloat16, true>,
                                 combine_recv_kernel<__nv_bfloat16, false>, warps_per_block, 0));
}

}  // namespace jmc
