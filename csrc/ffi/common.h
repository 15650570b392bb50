// What every handler does first: find the handle, refuse a poisoned one, check the stage.
#pragma once

#include <string>

#include "handle.h"
#include "kernels/kernels.h"
#include "xla/ffi/api/ffi.h"

namespace jmc {

inline const char* stage_name(Stage s) {
  switch (s) {
    case Stage::kIdle: return "idle";
    case Stage::kDispatchSent: return "dispatch sent";
    case Stage::kDispatchReceived: return "dispatch received";
    case Stage::kCombineSent: return "combine sent";
  }
  return "?";
}

// Looks up `id`, returns an error if the kernels recorded one in an earlier cycle (read from
// pinned memory, no sync) or if the handle is not in stage `expected`; on success moves it to `next`.
inline xla::ffi::Error enter(int64_t id, Stage expected, Stage next, const char* op,
                             Handle** out) {
  Handle* h = find_handle(id);
  if (h == nullptr)
    return xla::ffi::Error(xla::ffi::ErrorCode::kInvalidArgument,
                           std::string(op) + ": no all-to-all handle " + std::to_string(id) +
                               " (closed, or created in another order on this process)");
  // A recorded error refuses the next cycle, never the rest of the current one: the peers
  // are mid-cycle too, and aborting here would leave them waiting for our half.
  const std::string recorded = expected == Stage::kIdle ? describe_error(*h->error_host) : "";
  if (!recorded.empty())
    return xla::ffi::Error(xla::ffi::ErrorCode::kAborted,
                           recorded + " (handle " + std::to_string(id) + " is unusable)");
  if (h->stage != expected)
    return xla::ffi::Error(xla::ffi::ErrorCode::kFailedPrecondition,
                           std::string("ProtocolError: ") + op + " on handle " +
                               std::to_string(id) + " in stage '" + stage_name(h->stage) +
                               "'; expected '" + stage_name(expected) +
                               "' (dispatch_send -> dispatch_recv -> combine_send -> "
                               "combine_recv, one cycle at a time)");
  h->stage = next;
  *out = h;
  return xla::ffi::Error::Success();
}

// Launches `kernel` (a callable returning cudaError_t), bracketed by timestamps when the
// handle's timing is on.
template <typename Kernel>
inline cudaError_t timed(const Handle& h, int phase, cudaStream_t stream, Kernel kernel) {
  if (h.timing) {
    const cudaError_t err = launch_timestamp(h.timings + 2 * phase, stream);
    if (err != cudaSuccess) return err;
  }
  const cudaError_t err = kernel();
  if (err != cudaSuccess || !h.timing) return err;
  return launch_timestamp(h.timings + 2 * phase + 1, stream);
}

inline xla::ffi::Error check_bytes(const char* name, size_t got, size_t want) {
  if (got == want) return xla::ffi::Error::Success();
  return xla::ffi::Error(xla::ffi::ErrorCode::kInvalidArgument,
                         std::string(name) + " has " + std::to_string(got) +
                             " bytes; the handle expects " + std::to_string(want));
}

}  // namespace jmc
