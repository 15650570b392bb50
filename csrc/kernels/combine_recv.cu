// combine_recv as a kernel of its own (the split op), its launcher and its occupancy.
// Protocol and body: kernels/combine_recv.cuh (the fused ops in kernels/fused.cu share it).
#include "core/launch.cuh"
#include "kernels/combine_recv.cuh"

namespace jmc {
namespace {

template <typename T, unsigned kPath>  // kDirectOnly or kStagedOnly (kernels.h)
__global__ void __launch_bounds__(kMaxWarpsPerBlock * kWarpSize, kMinBlocksPerSm)
    combine_recv_kernel(const __grid_constant__ CombineRecvParams p) {
  wait_for_previous_kernels();
  combine_recv_body<T, kPath>(p);
}

template <typename T>
cudaError_t launch_typed(const CombineRecvParams& p, Launch l, cudaStream_t stream) {
  return with_staged_part(launch_path(p.c), [&](auto path) {
    return launch_kernel(combine_recv_kernel<T, decltype(path)::value>, l, 0, stream, p);
  });
}

}  // namespace

cudaError_t launch_combine_recv(const CombineRecvParams& p, Launch l, cudaStream_t stream) {
  if (p.c.shape.out_elem_bytes == 4) return launch_typed<float>(p, l, stream);
  return launch_typed<__nv_bfloat16>(p, l, stream);
}

int combine_recv_blocks_per_sm(int warps_per_block) {
  return fewest_blocks_per_sm(warps_per_block, 0, combine_recv_kernel<float, kDirectOnly>,
                              combine_recv_kernel<float, kStagedOnly>,
                              combine_recv_kernel<__nv_bfloat16, kDirectOnly>,
                              combine_recv_kernel<__nv_bfloat16, kStagedOnly>);
}

}  // namespace jmc
