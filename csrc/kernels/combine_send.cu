// combine_send as a kernel of its own (the split op), its launcher and its occupancy.
// Protocol and body: kernels/combine_send.cuh (the fused ops in kernels/fused.cu share it).
#include "core/launch.cuh"
#include "kernels/combine_send.cuh"

namespace jmc {
namespace {

template <unsigned kPath>  // kDirectPadded, kDirectPacked or kGeneralPath (kernels.h)
__global__ void __launch_bounds__(kMaxWarpsPerBlock * kWarpSize, kMinBlocksPerSm)
    combine_send_kernel(const __grid_constant__ CombineSendParams p) {
  wait_for_previous_kernels();
  combine_send_body<kPath>(p);
}

}  // namespace

cudaError_t launch_combine_send(const CombineSendParams& p, Launch l, cudaStream_t stream) {
  const size_t shared = combine_send_shared_bytes(p.c.shape);
  return with_path(launch_path(p.c), [&](auto path) {
    return launch_kernel(combine_send_kernel<decltype(path)::value>, l, shared, stream, p);
  });
}

int combine_send_blocks_per_sm(int warps_per_block, size_t shared_bytes) {
  return fewest_blocks_per_sm(warps_per_block, shared_bytes, combine_send_kernel<kDirectPadded>,
                              combine_send_kernel<kDirectPacked>,
                              combine_send_kernel<kGeneralPath>);
}

}  // namespace jmc
