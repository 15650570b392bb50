// combine_send as a kernel of its own (the split op), its launcher and its occupancy.
// Protocol and body: kernels/combine_send.cuh (the fused ops in kernels/fused.cu share it).
#include "core/launch.cuh"
#include "kernels/combine_send.cuh"

namespace jmc {
namespace {

template <Path kPath>
__global__ void __launch_bounds__(kMaxWarpsPerBlock * kWarpSize, kMinBlocksPerSm)
    combine_send_kernel(const CombineSendParams p) {
  wait_for_previous_kernels();
  combine_send_body<kPath>(p);
}

}  // namespace

cudaError_t launch_combine_send(const CombineSendParams& p, Launch l, cudaStream_t stream) {
  const size_t shared = combine_send_shared_bytes(p.c.shape);
  const auto kernel = by_path(p.c, combine_send_kernel<Path::kDirect>,
                              combine_send_kernel<Path::kDirectLL>,
                              combine_send_kernel<Path::kGeneral>);
  return launch_kernel(kernel, l, shared, stream, p);
}

int combine_send_blocks_per_sm(int warps_per_block, size_t shared_bytes) {
  return fewest_blocks_per_sm(warps_per_block, shared_bytes, combine_send_kernel<Path::kDirect>,
                              combine_send_kernel<Path::kDirectLL>,
                              combine_send_kernel<Path::kGeneral>);
}

}  // namespace jmc
