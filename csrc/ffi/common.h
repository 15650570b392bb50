// What every handler does first: find the handle and hold its lock, refuse a closed or poisoned
// one. No per-call state lives here: XLA may record a handler's launches into a command buffer
// once and replay them without calling it again, so the kernels keep the protocol's state and
// check its order on the device (core/protocol.cuh: refused_at_start).
#pragma once

#include <memory>
#include <mutex>
#include <string>

#include "handle.h"
#include "kernels/kernels.h"
#include "xla/ffi/api/ffi.h"

namespace jmc {

// kDispatch and kCombine are the fused ops: a whole half in one call, nothing left in flight.
enum class Op { kDispatchSend, kDispatchRecv, kCombineSend, kCombineRecv, kDispatch, kCombine,
                kBarrier };

inline const char* op_name(Op op) {
  switch (op) {
    case Op::kDispatchSend: return "dispatch_send";
    case Op::kDispatchRecv: return "dispatch_recv";
    case Op::kCombineSend: return "combine_send";
    case Op::kCombineRecv: return "combine_recv";
    case Op::kDispatch: return "dispatch";
    case Op::kCombine: return "combine";
    case Op::kBarrier: return "barrier";
  }
  return "?";
}

// A handler's hold on its handle: the handle stays alive (shared_ptr, close() cannot free it
// under us) and locked for the whole call.
struct Call {
  std::shared_ptr<Handle> handle;
  std::unique_lock<std::mutex> lock;
  Handle* operator->() const { return handle.get(); }
};

inline xla::ffi::Error protocol_error(Op op, int64_t id, const std::string& why) {
  return xla::ffi::Error(xla::ffi::ErrorCode::kFailedPrecondition,
                         std::string("ProtocolError: ") + op_name(op) + " on handle " +
                             std::to_string(id) + ": " + why);
}

// Looks up `id` and refuses it if closed (or its creation failed). A handle whose kernels
// recorded an error is NOT refused here: its kernels refuse on the device (they do nothing and
// write NaN rows of y; check() and poll() report), and a handler error while XLA records a
// command buffer breaks that executable's recording for good ("Command executor can be
// recorded into the command buffer at most once", seen on the H200 with jax 0.11.2), so the
// same compiled step could not run again after recover(). `op` names the caller in messages.
inline xla::ffi::Error begin(int64_t id, Op op, Call* call) {
  call->handle = find_open_or_closed_handle(id);
  if (call->handle == nullptr)
    return xla::ffi::Error(xla::ffi::ErrorCode::kInvalidArgument,
                           std::string(op_name(op)) + ": no all-to-all handle " +
                               std::to_string(id) +
                               " (closed, or created in another order on this process)");
  call->lock = std::unique_lock<std::mutex>(call->handle->mutex);
  Handle& h = *call->handle;
  ++h.handler_calls;
  if (h.closed) return protocol_error(op, id, "the handle is closed");
  if (!h.create_error.empty())
    return protocol_error(op, id, "its creation failed: " + h.create_error);
  return xla::ffi::Error::Success();
}

inline xla::ffi::Error check_bytes(const char* name, size_t got, size_t want) {
  if (got == want) return xla::ffi::Error::Success();
  return xla::ffi::Error(xla::ffi::ErrorCode::kInvalidArgument,
                         std::string(name) + " has " + std::to_string(got) +
                             " bytes; the handle expects " + std::to_string(want));
}

// An optional operand or result: 0 bytes means "not given".
inline xla::ffi::Error check_optional_bytes(const char* name, size_t got, size_t want) {
  return got == 0 ? xla::ffi::Error::Success() : check_bytes(name, got, want);
}

}  // namespace jmc
