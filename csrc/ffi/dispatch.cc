// XLA FFI handlers of dispatch_send and dispatch_recv (host code only).
// No kCmdBufferCompatible trait: the handlers keep per-call host state (the stage, the error
// check), so XLA must call them on every execution instead of replaying a captured graph.
#include <cuda_runtime.h>

#include "core/check.h"
#include "ffi/common.h"
#include "ffi/handlers.h"
#include "kernels/kernels.h"

namespace ffi = xla::ffi;

namespace jmc {
namespace {

ffi::Error DispatchSend(cudaStream_t stream, int64_t handle, ffi::AnyBuffer x,
                        ffi::AnyBuffer x_scale, ffi::Buffer<ffi::S32> indices,
                        ffi::Buffer<ffi::S32> num_tokens, ffi::Result<ffi::AnyBuffer> ticket) {
  Handle* h = nullptr;
  JMC_RETURN_IF_ERROR(enter(handle, Stage::kIdle, Stage::kDispatchSent, "dispatch_send", &h));
  const Shape& s = h->shape;
  JMC_RETURN_IF_ERROR(check_bytes("x", x.size_bytes(),
                                  size_t(s.max_num_tokens) * s.hidden * s.in_elem_bytes));
  JMC_RETURN_IF_ERROR(check_bytes("x_scale", x_scale.size_bytes(),
                                  size_t(s.max_num_tokens) * s.num_scales * 4));
  JMC_RETURN_IF_ERROR(check_bytes("indices", indices.size_bytes(),
                                  size_t(s.max_num_tokens) * s.experts_per_token * 4));
  DispatchSendParams p{h->common(),
                       static_cast<const uint8_t*>(x.untyped_data()),
                       s.num_scales ? static_cast<const float*>(x_scale.untyped_data()) : nullptr,
                       indices.typed_data(), num_tokens.typed_data()};
  JMC_RETURN_IF_CUDA_ERROR(
      timed(*h, 0, stream, [&] { return launch_dispatch_send(p, h->launch, stream); }));
  return ffi::Error::Success();
}

ffi::Error DispatchRecv(cudaStream_t stream, int64_t handle, ffi::AnyBuffer ticket,
                        ffi::Result<ffi::AnyBuffer> expert_x,
                        ffi::Result<ffi::AnyBuffer> expert_x_scale,
                        ffi::Result<ffi::Buffer<ffi::S32>> expert_num_tokens,
                        ffi::Result<ffi::Buffer<ffi::S32>> row_source) {
  Handle* h = nullptr;
  JMC_RETURN_IF_ERROR(
      enter(handle, Stage::kDispatchSent, Stage::kDispatchReceived, "dispatch_recv", &h));
  const Shape& s = h->shape;
  const size_t rows = size_t(s.num_local_experts()) * s.max_recv_tokens();
  JMC_RETURN_IF_ERROR(check_bytes("expert_x", expert_x->size_bytes(),
                                  rows * s.hidden * s.in_elem_bytes));
  JMC_RETURN_IF_ERROR(check_bytes("row_source", row_source->size_bytes(), rows * 4));
  DispatchRecvParams p{
      h->common(), static_cast<uint8_t*>(expert_x->untyped_data()),
      s.num_scales ? static_cast<float*>(expert_x_scale->untyped_data()) : nullptr,
      expert_num_tokens->typed_data(), row_source->typed_data()};
  JMC_RETURN_IF_CUDA_ERROR(
      timed(*h, 1, stream, [&] { return launch_dispatch_recv(p, h->launch, stream); }));
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(kDispatchSend, DispatchSend,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Attr<int64_t>("handle")
                                  .Arg<ffi::AnyBuffer>()           // x
                                  .Arg<ffi::AnyBuffer>()           // x_scale (0 cols: bf16)
                                  .Arg<ffi::Buffer<ffi::S32>>()    // indices
                                  .Arg<ffi::Buffer<ffi::S32>>()    // num_tokens
                                  .Ret<ffi::AnyBuffer>());         // ticket

XLA_FFI_DEFINE_HANDLER_SYMBOL(kDispatchRecv, DispatchRecv,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Attr<int64_t>("handle")
                                  .Arg<ffi::AnyBuffer>()           // ticket
                                  .Ret<ffi::AnyBuffer>()           // expert_x
                                  .Ret<ffi::AnyBuffer>()           // expert_x_scale
                                  .Ret<ffi::Buffer<ffi::S32>>()    // expert_num_tokens
                                  .Ret<ffi::Buffer<ffi::S32>>());  // row_source

}  // namespace jmc
