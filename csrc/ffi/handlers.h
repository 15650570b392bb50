// The FFI handler symbols the module registers with XLA (defined in csrc/ffi/*.cc).
#pragma once

#include "xla/ffi/api/ffi.h"

namespace jmc {
XLA_FFI_DECLARE_HANDLER_SYMBOL(kDispatchSend);
XLA_FFI_DECLARE_HANDLER_SYMBOL(kDispatchRecv);
XLA_FFI_DECLARE_HANDLER_SYMBOL(kCombineSend);
XLA_FFI_DECLARE_HANDLER_SYMBOL(kCombineRecv);
XLA_FFI_DECLARE_HANDLER_SYMBOL(kDispatch);  // send + recv in one launch
XLA_FFI_DECLARE_HANDLER_SYMBOL(kCombine);   // send + recv in one launch
XLA_FFI_DECLARE_HANDLER_SYMBOL(kBarrier);
XLA_FFI_DECLARE_HANDLER_SYMBOL(kDenseAllToAll);
XLA_FFI_DECLARE_HANDLER_SYMBOL(kOrderAfter);  // order_after's data edge, no launch
}  // namespace jmc
