// XLA FFI handlers of combine_send, combine_recv and the fused combine (host code only).
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
ffi::Error send_params(const Call& h, ffi::AnyBuffer expert_y,
                       ffi::Buffer<ffi::S32> expert_num_tokens, ffi::Buffer<ffi::S32> row_source,
                       ffi::Buffer<ffi::S32> dropped_rows, CombineSendParams* p) {
  const Shape& s = h->shape;
  const size_t rows = s.output_rows();  // [L, R] padded, [C] packed
  JMC_RETURN_IF_ERROR(check_bytes("expert_y", expert_y.size_bytes(),
                                  rows * s.hidden * s.out_elem_bytes));
  JMC_RETURN_IF_ERROR(check_bytes("expert_num_tokens", expert_num_tokens.size_bytes(),
                                  size_t(s.num_local_experts()) * 4));
  JMC_RETURN_IF_ERROR(check_bytes("row_source", row_source.size_bytes(),
                                  size_t(s.row_source_entries()) * 4));
  JMC_RETURN_IF_ERROR(check_bytes("dropped_rows", dropped_rows.size_bytes(), 4));
  *p = CombineSendParams{h->common(), static_cast<const uint8_t*>(expert_y.untyped_data()),
                         expert_num_tokens.typed_data(), row_source.typed_data(),
                         dropped_rows.typed_data()};
  return ffi::Error::Success();
}

// The recv operands and results checked against the handle's shape, as the recv body's
// parameters.
ffi::Error recv_params(const Call& h, ffi::Buffer<ffi::S32> indices,
                       ffi::Buffer<ffi::F32> weights, ffi::Buffer<ffi::S32> num_tokens,
                       ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::AnyBuffer> slot_rows,
                       CombineRecvParams* p) {
  const Shape& s = h->shape;
  const size_t m = s.max_num_tokens, k = s.experts_per_token;
  JMC_RETURN_IF_ERROR(check_bytes("indices", indices.size_bytes(), m * k * 4));
  JMC_RETURN_IF_ERROR(check_bytes("weights", weights.size_bytes(), m * k * 4));
  JMC_RETURN_IF_ERROR(check_bytes("num_tokens", num_tokens.size_bytes(), 4));
  JMC_RETURN_IF_ERROR(check_bytes("y", y->size_bytes(), m * s.hidden * 2));
  JMC_RETURN_IF_ERROR(check_optional_bytes("slot_rows", slot_rows->size_bytes(),
                                           m * k * s.hidden * s.out_elem_bytes));
  *p = CombineRecvParams{
      h->common(), indices.typed_data(), weights.typed_data(), num_tokens.typed_data(),
      static_cast<uint16_t*>(y->untyped_data()),
      slot_rows->size_bytes() ? static_cast<uint8_t*>(slot_rows->untyped_data()) : nullptr};
  return ffi::Error::Success();
}

ffi::Error CombineSend(cudaStream_t stream, int64_t handle, ffi::AnyBuffer expert_y,
                       ffi::Buffer<ffi::S32> expert_num_tokens,
                       ffi::Buffer<ffi::S32> row_source, ffi::Buffer<ffi::S32> dropped_rows,
                       ffi::Result<ffi::AnyBuffer> ticket) {
  Call h;
  JMC_RETURN_IF_ERROR(begin(handle, Op::kCombineSend, &h));
  CombineSendParams p;
  JMC_RETURN_IF_ERROR(send_params(h, expert_y, expert_num_tokens, row_source, dropped_rows, &p));
  JMC_RETURN_IF_CUDA_ERROR(launch_combine_send(p, h->launch[kCombineSendKernel], stream));
  return ffi::Error::Success();
}

ffi::Error CombineRecv(cudaStream_t stream, int64_t handle, ffi::AnyBuffer ticket,
                       ffi::Buffer<ffi::S32> indices, ffi::Buffer<ffi::F32> weights,
                       ffi::Buffer<ffi::S32> num_tokens, ffi::Result<ffi::AnyBuffer> y,
                       ffi::Result<ffi::AnyBuffer> slot_rows) {
  Call h;
  JMC_RETURN_IF_ERROR(begin(handle, Op::kCombineRecv, &h));
  CombineRecvParams p;
  JMC_RETURN_IF_ERROR(recv_params(h, indices, weights, num_tokens, y, slot_rows, &p));
  JMC_RETURN_IF_CUDA_ERROR(launch_combine_recv(p, h->launch[kCombineRecvKernel], stream));
  return ffi::Error::Success();
}

// The fused op: expert rows in, y out; one block or the two split kernels (as Dispatch).
ffi::Error Combine(cudaStream_t stream, int64_t handle, ffi::AnyBuffer expert_y,
                   ffi::Buffer<ffi::S32> expert_num_tokens, ffi::Buffer<ffi::S32> row_source,
                   ffi::Buffer<ffi::S32> dropped_rows, ffi::Buffer<ffi::S32> indices,
                   ffi::Buffer<ffi::F32> weights,
                   ffi::Buffer<ffi::S32> num_tokens, ffi::Result<ffi::AnyBuffer> y,
                   ffi::Result<ffi::AnyBuffer> slot_rows) {
  Call h;
  JMC_RETURN_IF_ERROR(begin(handle, Op::kCombine, &h));
  CombineSendParams send;
  CombineRecvParams recv;
  JMC_RETURN_IF_ERROR(
      send_params(h, expert_y, expert_num_tokens, row_source, dropped_rows, &send));
  JMC_RETURN_IF_ERROR(recv_params(h, indices, weights, num_tokens, y, slot_rows, &recv));
  const Launch fused = h->fused_launch[kFusedCombine];
  if (fused.num_blocks > 0) {
    JMC_RETURN_IF_CUDA_ERROR(launch_combine(send, recv, fused, stream));
  } else {  // too much work for one block: the split kernels back to back (handle.cc)
    JMC_RETURN_IF_CUDA_ERROR(launch_combine_send(send, h->launch[kCombineSendKernel], stream));
    JMC_RETURN_IF_CUDA_ERROR(launch_combine_recv(recv, h->launch[kCombineRecvKernel], stream));
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(kCombineSend, CombineSend,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Attr<int64_t>("handle")
                                  .Arg<ffi::AnyBuffer>()         // expert_y
                                  .Arg<ffi::Buffer<ffi::S32>>()  // expert_num_tokens
                                  .Arg<ffi::Buffer<ffi::S32>>()  // row_source
                                  .Arg<ffi::Buffer<ffi::S32>>()  // dropped_rows
                                  .Ret<ffi::AnyBuffer>(),  // ticket
                              JMC_GRAPH_SAFE);

XLA_FFI_DEFINE_HANDLER_SYMBOL(kCombineRecv, CombineRecv,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Attr<int64_t>("handle")
                                  .Arg<ffi::AnyBuffer>()         // ticket
                                  .Arg<ffi::Buffer<ffi::S32>>()  // indices
                                  .Arg<ffi::Buffer<ffi::F32>>()  // weights
                                  .Arg<ffi::Buffer<ffi::S32>>()  // num_tokens
                                  .Ret<ffi::AnyBuffer>()         // y
                                  .Ret<ffi::AnyBuffer>(),  // slot_rows (0 bytes: none)
                              JMC_GRAPH_SAFE);

XLA_FFI_DEFINE_HANDLER_SYMBOL(kCombine, Combine,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Attr<int64_t>("handle")
                                  .Arg<ffi::AnyBuffer>()         // expert_y
                                  .Arg<ffi::Buffer<ffi::S32>>()  // expert_num_tokens
                                  .Arg<ffi::Buffer<ffi::S32>>()  // row_source
                                  .Arg<ffi::Buffer<ffi::S32>>()  // dropped_rows
                                  .Arg<ffi::Buffer<ffi::S32>>()  // indices
                                  .Arg<ffi::Buffer<ffi::F32>>()  // weights
                                  .Arg<ffi::Buffer<ffi::S32>>()  // num_tokens
                                  .Ret<ffi::AnyBuffer>()         // y
                                  .Ret<ffi::AnyBuffer>(),  // slot_rows (0 bytes: none)
                              JMC_GRAPH_SAFE);

}  // namespace jmc
