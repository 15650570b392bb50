// The FFI handler symbols the module registers with XLA (defined in csrc/ffi/*.cc).
#pragma once

#include "xla/ffi/api/ffi.h"

// The trait of every handler of ours whose launches XLA may record once into a CUDA graph
// (command buffers) and replay without calling the handler: nothing a kernel needs changes
// between calls (DeviceState holds the epochs and the timing counter), and the host-side
// checks (order of halves, a poisoned or closed handle) run whenever the handler does: on
// every call with command buffers off, once per recording with them on (then
// AllToAll.check() reports what a replayed kernel recorded; docs/notes.md).
#define JMC_GRAPH_SAFE {::xla::ffi::Traits::kCmdBufferCompatible}

namespace jmc {
XLA_FFI_DECLARE_HANDLER_SYMBOL(kDispatchSend);
XLA_FFI_DECLARE_HANDLER_SYMBOL(kDispatchRecv);
XLA_FFI_DECLARE_HANDLER_SYMBOL(kCombineSend);
XLA_FFI_DECLARE_HANDLER_SYMBOL(kCombineRecv);
XLA_FFI_DECLARE_HANDLER_SYMBOL(kDispatch);  // send + recv in one launch
XLA_FFI_DECLARE_HANDLER_SYMBOL(kCombine);   // send + recv in one launch
XLA_FFI_DECLARE_HANDLER_SYMBOL(kBarrier);
XLA_FFI_DECLARE_HANDLER_SYMBOL(kFloorKernels);  // bench_loop's floor: empty or barrier kernels
XLA_FFI_DECLARE_HANDLER_SYMBOL(kDenseAllToAll);  // not graph-safe: NVSHMEM's collective
XLA_FFI_DECLARE_HANDLER_SYMBOL(kOrderAfter);  // order_after's data edge, no launch
XLA_FFI_DECLARE_HANDLER_SYMBOL(kRecordEvent);  // benchmarks' clock; not graph-safe (event.cc)
}  // namespace jmc
