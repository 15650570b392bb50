// XLA FFI handlers of dispatch_send, dispatch_recv and the fused dispatch (host code only).
// Graph-safe (ffi/handlers.h): XLA may record their launches once and replay them.
#include <cuda_runtime.h>

#include "core/check.h"
#include "ffi/common.h"
#include "ffi/handlers.h"
#include "kernels/kernels.h"

namespace ffi = xla::ffi;

namespace jmc {
namespace {

// The send operands checked against the handle's shape, as the send body's parameters.
ffi::Error send_params(const Call& h, ffi::AnyBuffer x, ffi::AnyBuffer x_scale,
                       ffi::Buffer<ffi::S32> indices, ffi::Buffer<ffi::F32> weights,
                       ffi::Buffer<ffi::S32> num_tokens, DispatchSendParams* p) {
  const Shape& s = h->shape;
  const size_t m = s.max_num_tokens, k = s.experts_per_token;
  JMC_RETURN_IF_ERROR(check_bytes("x", x.size_bytes(), m * s.hidden * s.in_elem_bytes));
  JMC_RETURN_IF_ERROR(check_bytes("x_scale", x_scale.size_bytes(), m * s.num_scales * 4));
  JMC_RETURN_IF_ERROR(check_bytes("indices", indices.size_bytes(), m * k * 4));
  JMC_RETURN_IF_ERROR(check_optional_bytes("weights", weights.size_bytes(), m * k * 4));
  JMC_RETURN_IF_ERROR(check_bytes("num_tokens", num_tokens.size_bytes(), 4));
  *p = DispatchSendParams{
      h->common(), static_cast<const uint8_t*>(x.untyped_data()),
      s.num_scales ? static_cast<const float*>(x_scale.untyped_data()) : nullptr,
      indices.typed_data(), weights.size_bytes() ? weights.typed_data() : nullptr,
      num_tokens.typed_data()};
  return ffi::Error::Success();
}

// The recv results checked against the handle's shape, as the recv body's parameters.
ffi::Error recv_params(const Call& h, ffi::Result<ffi::AnyBuffer> expert_x,
                       ffi::Result<ffi::AnyBuffer> expert_x_scale,
                       ffi::Result<ffi::Buffer<ffi::S32>> expert_num_tokens,
                       ffi::Result<ffi::Buffer<ffi::S32>> row_source,
                       ffi::Result<ffi::Buffer<ffi::F32>> expert_weights,
                       ffi::Result<ffi::Buffer<ffi::S32>> dropped_rows, bool dequantize,
                       DispatchRecvParams* p) {
  const Shape& s = h->shape;
  const size_t rows = s.output_rows();  // [L, R] padded, [C] packed
  if (dequantize && (s.in_elem_bytes != 1 || s.hidden != s.num_scales * kScaleBlock))
    return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                      "dispatch_recv: dequantize is for fp8 handles with one scale per " +
                          std::to_string(kScaleBlock) + " elements");
  if (dequantize && expert_x->element_type() != ffi::DataType::BF16)
    return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                      "dispatch_recv: dequantize writes bf16 expert_x");
  // dequantize: bf16 rows, no scales
  JMC_RETURN_IF_ERROR(check_bytes("expert_x", expert_x->size_bytes(),
                                  rows * s.hidden * (dequantize ? 2 : s.in_elem_bytes)));
  JMC_RETURN_IF_ERROR(check_bytes("expert_x_scale", expert_x_scale->size_bytes(),
                                  dequantize ? 0 : rows * s.num_scales * 4));
  JMC_RETURN_IF_ERROR(check_bytes("expert_num_tokens", expert_num_tokens->size_bytes(),
                                  size_t(s.num_local_experts()) * 4));
  JMC_RETURN_IF_ERROR(check_bytes("row_source", row_source->size_bytes(),
                                  size_t(s.row_source_entries()) * 4));
  JMC_RETURN_IF_ERROR(check_bytes("expert_weights", expert_weights->size_bytes(), rows * 4));
  JMC_RETURN_IF_ERROR(check_bytes("dropped_rows", dropped_rows->size_bytes(), 4));
  *p = DispatchRecvParams{
      h->common(), static_cast<uint8_t*>(expert_x->untyped_data()),
      s.num_scales && !dequantize ? static_cast<float*>(expert_x_scale->untyped_data())
                                  : nullptr,
      expert_num_tokens->typed_data(), row_source->typed_data(), expert_weights->typed_data(),
      dropped_rows->typed_data(), dequantize};
  return ffi::Error::Success();
}

ffi::Error DispatchSend(cudaStream_t stream, int64_t handle, ffi::AnyBuffer x,
                        ffi::AnyBuffer x_scale, ffi::Buffer<ffi::S32> indices,
                        ffi::Buffer<ffi::F32> weights, ffi::Buffer<ffi::S32> num_tokens,
                        ffi::Result<ffi::AnyBuffer> ticket) {
  Call h;
  JMC_RETURN_IF_ERROR(begin(handle, Op::kDispatchSend, &h));
  DispatchSendParams p;
  JMC_RETURN_IF_ERROR(send_params(h, x, x_scale, indices, weights, num_tokens, &p));
  JMC_RETURN_IF_CUDA_ERROR(launch_dispatch_send(p, h->launch[kDispatchSendKernel], stream));
  return ffi::Error::Success();
}

ffi::Error DispatchRecv(cudaStream_t stream, int64_t handle, ffi::AnyBuffer ticket,
                        ffi::Result<ffi::AnyBuffer> expert_x,
                        ffi::Result<ffi::AnyBuffer> expert_x_scale,
                        ffi::Result<ffi::Buffer<ffi::S32>> expert_num_tokens,
                        ffi::Result<ffi::Buffer<ffi::S32>> row_source,
                        ffi::Result<ffi::Buffer<ffi::F32>> expert_weights,
                        ffi::Result<ffi::Buffer<ffi::S32>> dropped_rows, bool dequantize) {
  Call h;
  JMC_RETURN_IF_ERROR(begin(handle, Op::kDispatchRecv, &h));
  DispatchRecvParams p;
  JMC_RETURN_IF_ERROR(recv_params(h, expert_x, expert_x_scale, expert_num_tokens, row_source,
                                  expert_weights, dropped_rows, dequantize, &p));
  JMC_RETURN_IF_CUDA_ERROR(launch_dispatch_recv(p, h->launch[kDispatchRecvKernel], stream));
  return ffi::Error::Success();
}

// The fused op: the send operands in, the recv results out; one launch of one block when the
// handle's shape is small enough (handle.cc), else the two split kernels.
ffi::Error Dispatch(cudaStream_t stream, int64_t handle, ffi::AnyBuffer x,
                    ffi::AnyBuffer x_scale, ffi::Buffer<ffi::S32> indices,
                    ffi::Buffer<ffi::F32> weights, ffi::Buffer<ffi::S32> num_tokens,
                    ffi::Result<ffi::AnyBuffer> expert_x,
                    ffi::Result<ffi::AnyBuffer> expert_x_scale,
                    ffi::Result<ffi::Buffer<ffi::S32>> expert_num_tokens,
                    ffi::Result<ffi::Buffer<ffi::S32>> row_source,
                    ffi::Result<ffi::Buffer<ffi::F32>> expert_weights,
                    ffi::Result<ffi::Buffer<ffi::S32>> dropped_rows, bool dequantize) {
  Call h;
  JMC_RETURN_IF_ERROR(begin(handle, Op::kDispatch, &h));
  DispatchSendParams send;
  DispatchRecvParams recv;
  JMC_RETURN_IF_ERROR(send_params(h, x, x_scale, indices, weights, num_tokens, &send));
  JMC_RETURN_IF_ERROR(recv_params(h, expert_x, expert_x_scale, expert_num_tokens, row_source,
                                  expert_weights, dropped_rows, dequantize, &recv));
  const Launch fused = h->fused_launch[kFusedDispatch];
  if (fused.num_blocks > 0) {
    JMC_RETURN_IF_CUDA_ERROR(launch_dispatch(send, recv, fused, stream));
  } else {  // too much work for one block: the split kernels back to back (handle.cc)
    JMC_RETURN_IF_CUDA_ERROR(launch_dispatch_send(send, h->launch[kDispatchSendKernel], stream));
    JMC_RETURN_IF_CUDA_ERROR(launch_dispatch_recv(recv, h->launch[kDispatchRecvKernel], stream));
  }
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
                                  .Arg<ffi::Buffer<ffi::F32>>()    // weights (0 cols: none)
                                  .Arg<ffi::Buffer<ffi::S32>>()    // num_tokens
                                  .Ret<ffi::AnyBuffer>(),  // ticket
                              JMC_GRAPH_SAFE);

XLA_FFI_DEFINE_HANDLER_SYMBOL(kDispatchRecv, DispatchRecv,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Attr<int64_t>("handle")
                                  .Arg<ffi::AnyBuffer>()           // ticket
                                  .Ret<ffi::AnyBuffer>()           // expert_x
                                  .Ret<ffi::AnyBuffer>()           // expert_x_scale
                                  .Ret<ffi::Buffer<ffi::S32>>()    // expert_num_tokens
                                  .Ret<ffi::Buffer<ffi::S32>>()    // row_source
                                  .Ret<ffi::Buffer<ffi::F32>>()    // expert_weights
                                  .Ret<ffi::Buffer<ffi::S32>>()    // dropped_rows
                                  .Attr<bool>("dequantize"),  // fp8 rows out as bf16
                              JMC_GRAPH_SAFE);

XLA_FFI_DEFINE_HANDLER_SYMBOL(kDispatch, Dispatch,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Attr<int64_t>("handle")
                                  .Arg<ffi::AnyBuffer>()           // x
                                  .Arg<ffi::AnyBuffer>()           // x_scale (0 cols: bf16)
                                  .Arg<ffi::Buffer<ffi::S32>>()    // indices
                                  .Arg<ffi::Buffer<ffi::F32>>()    // weights (0 cols: none)
                                  .Arg<ffi::Buffer<ffi::S32>>()    // num_tokens
                                  .Ret<ffi::AnyBuffer>()           // expert_x
                                  .Ret<ffi::AnyBuffer>()           // expert_x_scale
                                  .Ret<ffi::Buffer<ffi::S32>>()    // expert_num_tokens
                                  .Ret<ffi::Buffer<ffi::S32>>()    // row_source
                                  .Ret<ffi::Buffer<ffi::F32>>()    // expert_weights
                                  .Ret<ffi::Buffer<ffi::S32>>()    // dropped_rows
                                  .Attr<bool>("dequantize"),  // fp8 rows out as bf16
                              JMC_GRAPH_SAFE);

}  // namespace jmc
