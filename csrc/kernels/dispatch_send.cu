// dispatch_send as a kernel of its own (the split op), its launcher and its occupancy.
// Protocol and body: kernels/dispatch_send.cuh (the fused ops in kernels/fused.cu share it).
#include "core/launch.cuh"
#include "kernels/dispatch_send.cuh"

namespace jmc {
namespace {

template <unsigned kPath>  // kDirectOnly or kStagedOnly (kernels.h)
__global__ void __launch_bounds__(kMaxWarpsPerBlock * kWarpSize, kMinBlocksPerSm)
    dispatch_send_kernel(const __grid_constant__ DispatchSendParams p) {
  wait_for_previous_kernels();
  dispatch_send_body<kPath>(p);
}

}  // namespace

cudaError_t launch_dispatch_send(const DispatchSendParams& p, Launch l, cudaStream_t stream) {
  return with_staged_part(launch_path(p.c), [&](auto path) {
    return launch_kernel(dispatch_send_kernel<decltype(path)::value>, l, 0, stream, p);
  });
}

int dispatch_send_blocks_per_sm(int warps_per_block) {
  return fewest_blocks_per_sm(warps_per_block, 0, dispatch_send_kernel<kDirectOnly>,
                              dispatch_send_kernel<kStagedOnly>);
}

}  // namespace jmc
