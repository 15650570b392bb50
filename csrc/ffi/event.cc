// jmc_record_event: cudaEventRecord(slot) on XLA's stream, once the operand exists.
//
// Why a custom call: JAX exposes no stream, and a benchmark that claims "ours against
// pplx-kernels by one clock" must time both with CUDA events around K back-to-back cycles
// (pplx: torch.cuda.Event around a replayed graph). Deliberately NOT command-buffer compatible:
// XLA then keeps it out of its CUDA graphs and runs the handler at every execution, so the event
// is recorded each time while the cycles between two events still replay as one graph.
#include "ffi/event.h"

#include <cuda_runtime.h>

#include <mutex>

#include "core/check.h"
#include "ffi/handlers.h"

namespace ffi = xla::ffi;

namespace jmc {
namespace {

std::mutex g_mutex;
cudaEvent_t g_events[kNumEvents] = {};

ffi::Error RecordEvent(cudaStream_t stream, int64_t slot, ffi::AnyBuffer,
                       ffi::Result<ffi::AnyBuffer>) {
  if (slot < 0 || slot >= kNumEvents)
    return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                      "event slot " + std::to_string(slot) + " outside [0, " +
                          std::to_string(kNumEvents) + ")");
  std::lock_guard<std::mutex> lock(g_mutex);
  if (g_events[slot] == nullptr) JMC_RETURN_IF_CUDA_ERROR(cudaEventCreate(&g_events[slot]));
  JMC_RETURN_IF_CUDA_ERROR(cudaEventRecord(g_events[slot], stream));
  return ffi::Error::Success();
}

}  // namespace

float event_elapsed_ms(int from, int to, std::string* error) {
  std::lock_guard<std::mutex> lock(g_mutex);
  if (from < 0 || to < 0 || from >= kNumEvents || to >= kNumEvents || !g_events[from] ||
      !g_events[to]) {
    *error = "event slots " + std::to_string(from) + " and " + std::to_string(to) +
             " must both have been recorded";
    return 0.0f;
  }
  float ms = 0.0f;
  cudaError_t err = cudaEventSynchronize(g_events[to]);
  if (err == cudaSuccess) err = cudaEventElapsedTime(&ms, g_events[from], g_events[to]);
  if (err != cudaSuccess) *error = std::string("cudaEventElapsedTime: ") + cudaGetErrorString(err);
  return ms;
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(kRecordEvent, RecordEvent,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Attr<int64_t>("slot")
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>());  // not JMC_GRAPH_SAFE: see above

}  // namespace jmc
