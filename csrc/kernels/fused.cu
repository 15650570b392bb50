// The fused ops: dispatch (send + recv) and combine (send + recv), one launch each.
//
// Why: each kernel boundary costs a launch gap (4-7 us with 8 ranks under MPS on one GPU, 1-2
// us as dependent launches: core/launch.cuh), and at decode sizes each launch is host work the
// GPU may wait for (docs/notes.md: the host's launch rate). One launch per op halves the
// launches, and a rank's recv starts the moment its own sends are out.
//
// The bodies are the split kernels' own (kernels/*.cuh), unchanged: every block runs the send
// body, then the recv body. Recv blocks spin on records (rows) that other blocks of this grid
// may still have to send, so the grid must be co-resident; handle.cc launches ONE block (a
// 28-block grid deadlocked under MPS, where the SM share is not reserved) and leaves larger
// shapes to the split kernels. The send body's last block closes the send launch (its epoch,
// its counts) before the recv body starts; the halves keep separate epochs and tickets.
#define JMC_COPY_UNROLL 8  // core/vec.cuh: one block has the registers for it
#include "core/launch.cuh"
#include "kernels/combine_recv.cuh"
#include "kernels/combine_send.cuh"
#include "kernels/dispatch_recv.cuh"
#include "kernels/dispatch_send.cuh"

namespace jmc {
namespace {

// One block per launch, so no second block per SM to leave registers for (the split kernels'
// kMinBlocksPerSm cap made the fused dispatch spill).
// kPath: kDirectPadded, kDirectPacked or kGeneralPath (kernels.h, PathBits); the send body of
// dispatch and the recv body of combine read only its staged part.
template <unsigned kPath>
__global__ void __launch_bounds__(kMaxWarpsPerBlock * kWarpSize, 1)
    dispatch_kernel(const __grid_constant__ DispatchSendParams send,
                    const __grid_constant__ DispatchRecvParams recv) {
  wait_for_previous_kernels();
  dispatch_send_body<staged_part(kPath)>(send);
  __syncthreads();  // thread 0 closed the send launch: the recv body's order check reads it
  dispatch_recv_body<kPath>(recv);
}

template <typename T, unsigned kPath>
__global__ void __launch_bounds__(kMaxWarpsPerBlock * kWarpSize, 1)
    combine_kernel(const __grid_constant__ CombineSendParams send,
                   const __grid_constant__ CombineRecvParams recv) {
  wait_for_previous_kernels();
  combine_send_body<kPath>(send);
  __syncthreads();  // thread 0 closed the send launch: the recv body's order check reads it
  combine_recv_body<T, staged_part(kPath)>(recv);
}

template <typename T>
cudaError_t launch_combine_typed(const CombineSendParams& send, const CombineRecvParams& recv,
                                 Launch l, size_t shared, cudaStream_t stream) {
  return with_path(launch_path(send.c), [&](auto path) {
    return launch_kernel(combine_kernel<T, decltype(path)::value>, l, shared, stream, send,
                         recv);
  });
}

}  // namespace

cudaError_t launch_dispatch(const DispatchSendParams& send, const DispatchRecvParams& recv,
                            Launch l, cudaStream_t stream) {
  if (l.num_blocks != 1) return cudaErrorInvalidConfiguration;  // see the top of this file
  const size_t shared = dispatch_recv_shared_bytes(send.c.shape);
  return with_path(launch_path(send.c), [&](auto path) {
    return launch_kernel(dispatch_kernel<decltype(path)::value>, l, shared, stream, send, recv);
  });
}

cudaError_t launch_combine(const CombineSendParams& send, const CombineRecvParams& recv,
                           Launch l, cudaStream_t stream) {
  if (l.num_blocks != 1) return cudaErrorInvalidConfiguration;  // see the top of this file
  const size_t shared = combine_send_shared_bytes(send.c.shape);
  if (send.c.shape.out_elem_bytes == 4)
    return launch_combine_typed<float>(send, recv, l, shared, stream);
  return launch_combine_typed<__nv_bfloat16>(send, recv, l, shared, stream);
}

}  // namespace jmc
