// dispatch_send as a kernel of its own (the split op), its launcher and its occupancy.
// Protocol and body: kernels/dispatch_send.cuh (the fused ops in kernels/fused.cu share it).
#include "core/launch.cuh"
#include "kernels/dispatch_send.cuh"

namespace jmc {
namespace {

template <bool kGeneral>
__global__ void __launch_bounds__(kMaxWarpsPerBlock * kWarpSize, kMinBlocksPerSm)
    dispatch_send_kernel(const __grid_constant__ DispatchSendParams p) {
  wait_for_previous_kernels();
  dispatch_send_body<kGeneral>(p);
}

}  // namespace

cudaError_t launch_dispatch_send(const DispatchSendParams& p, Launch l, cudaStream_t stream) {
  if (general_path(p.c)) return launch_kernel(dispatch_send_kernel<true>, l, 0, stream, p);
  return launch_kernel(dispatch_send_kernel<false>, l, 0, stream, p);
}

int dispatch_send_blocks_per_sm(int warps_per_block) {
  return fewer_blocks_per_sm(dispatch_send_kernel<true>, dispatch_send_kernel<false>,
                             warps_per_block, 0);
}

}  // namespace jmc
