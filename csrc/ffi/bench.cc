// Benchmark helpers as FFI handlers: an on-stream barrier between ranks, the loop benchmark's
// floor kernels and the dense NVSHMEM all-to-all baseline (nvshmemx_alltoallmem_on_stream).
#include <cuda_runtime.h>
#include <nvshmem.h>
#include <nvshmemx.h>

#include "core/check.h"
#include "ffi/common.h"
#include "ffi/handlers.h"
#include "kernels/kernels.h"

namespace ffi = xla::ffi;

namespace jmc {
namespace {

// Only between whole cycles: the barrier shares no counters with dispatch/combine. With timing
// on, each barrier opens the next sample's stamps (kernels/barrier.cu).
ffi::Error Barrier(cudaStream_t stream, int64_t handle, ffi::AnyBuffer dep,
                   ffi::Result<ffi::AnyBuffer> out) {
  Call h;
  JMC_RETURN_IF_ERROR(begin(handle, Op::kBarrier, &h));
  const BarrierParams p{h->common(), h->timings};
  JMC_RETURN_IF_CUDA_ERROR(launch_barrier(p, h->dependent_launch, stream));
  return ffi::Error::Success();
}

// The loop benchmark's floor (bench_loop --variants floor-*): `count` kernels in one call, each
// a programmatic dependent of the one before where the handle launches so (Hopper, unless
// JMC_PDL=0): kind 0 empty (a kernel boundary and nothing else), kind 1 the barrier (a
// boundary and one all-rank crossing). Two calls of one kernel per cycle against one call of
// two price XLA's graph edge between our custom calls against a dependent launch inside one.
ffi::Error FloorKernels(cudaStream_t stream, int64_t handle, int64_t kind, int64_t count,
                        ffi::AnyBuffer dep, ffi::Result<ffi::AnyBuffer> out) {
  if ((kind != 0 && kind != 1) || count < 1 || count > 16)
    return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                      "floor kernels: kind 0 (empty) or 1 (barrier), count in [1, 16]");
  Call h;
  JMC_RETURN_IF_ERROR(begin(handle, Op::kBarrier, &h));
  const BarrierParams p{h->common(), h->timings};
  for (int64_t i = 0; i < count; ++i) {
    JMC_RETURN_IF_CUDA_ERROR(kind == 0 ? launch_empty(h->dependent_launch, stream)
                                       : launch_barrier(p, h->dependent_launch, stream));
  }
  return ffi::Error::Success();
}

// Moves world * chunk bytes from every rank to every rank. copy != 0 also copies `x` in and the
// result out (for the correctness check); timing runs use copy = 0 (the a2a alone).
ffi::Error DenseAllToAll(cudaStream_t stream, int64_t handle, int64_t copy, ffi::AnyBuffer x,
                         ffi::Result<ffi::AnyBuffer> out) {
  const std::shared_ptr<DenseHandle> h = find_dense_handle(handle);
  if (h == nullptr)
    return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                      "no dense all-to-all handle " + std::to_string(handle));
  const size_t total = h->chunk_bytes * h->world_size;
  if (copy) {
    JMC_RETURN_IF_ERROR(check_bytes("x", x.size_bytes(), total));
    JMC_RETURN_IF_CUDA_ERROR(
        cudaMemcpyAsync(h->src, x.untyped_data(), total, cudaMemcpyDeviceToDevice, stream));
  }
  JMC_RETURN_IF_CUDA_ERROR(launch_timestamp(h->timings, stream));
  const int rc = nvshmemx_alltoallmem_on_stream(NVSHMEM_TEAM_WORLD, h->dst, h->src,
                                                h->chunk_bytes, stream);
  JMC_RETURN_IF_CUDA_ERROR(launch_timestamp(h->timings + 1, stream));
  if (rc != 0)
    return ffi::Error(ffi::ErrorCode::kInternal,
                      "nvshmemx_alltoallmem_on_stream returned " + std::to_string(rc));
  if (copy) {
    JMC_RETURN_IF_ERROR(check_bytes("out", out->size_bytes(), total));
    JMC_RETURN_IF_CUDA_ERROR(
        cudaMemcpyAsync(out->untyped_data(), h->dst, total, cudaMemcpyDeviceToDevice, stream));
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(kBarrier, Barrier,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Attr<int64_t>("handle")
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>(),
                              JMC_GRAPH_SAFE);

XLA_FFI_DEFINE_HANDLER_SYMBOL(kFloorKernels, FloorKernels,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Attr<int64_t>("handle")
                                  .Attr<int64_t>("kind")
                                  .Attr<int64_t>("count")
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>(),
                              JMC_GRAPH_SAFE);

XLA_FFI_DEFINE_HANDLER_SYMBOL(kDenseAllToAll, DenseAllToAll,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Attr<int64_t>("handle")
                                  .Attr<int64_t>("copy")
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>());

}  // namespace jmc
