// dispatch_recv as a kernel of its own (the split op), its launcher and its occupancy.
// Protocol and body: kernels/dispatch_recv.cuh (the fused ops in kernels/fused.cu share it).
#include "core/launch.cuh"
#include "kernels/dispatch_recv.cuh"

namespace jmc {
namespace {

template <unsigned kPath>  // kDirectPadded, kDirectPacked or kGeneralPath (kernels.h)
__global__ void __launch_bounds__(kMaxWarpsPerBlock * kWarpSize, kMinBlocksPerSm)
    dispatch_recv_kernel(const __grid_constant__ DispatchRecvParams p) {
  wait_for_previous_kernels();
  dispatch_recv_body<kPath>(p);
}

}  // namespace

cudaError_t launch_dispatch_recv(const DispatchRecvParams& p, Launch l, cudaStream_t stream) {
  const size_t shared = dispatch_recv_shared_bytes(p.c.shape);
  return with_path(launch_path(p.c), [&](auto path) {
    return launch_kernel(dispatch_recv_kernel<decltype(path)::value>, l, shared, stream, p);
  });
}

int dispatch_recv_blocks_per_sm(int warps_per_block, size_t shared_bytes) {
  return fewest_blocks_per_sm(warps_per_block, shared_bytes, dispatch_recv_kernel<kDirectPadded>,
                              dispatch_recv_kernel<kDirectPacked>,
                              dispatch_recv_kernel<kGeneralPath>);
}

}  // namespace jmc
