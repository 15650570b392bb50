// order_after on the GPU (jax_moe_comm/api.py): a custom call that returns its first operands
// unchanged (each result aliases its operand) once all operands exist. It launches nothing; it
// is a data edge XLA keeps. The optimization_barrier it replaces lost the edge to an unused
// output on XLA GPU (jax 0.11.2): the scheduler ran a later sample's barrier and
// dispatch_send before an earlier sample's recv (docs/notes.md).
#include "ffi/handlers.h"

namespace ffi = xla::ffi;

namespace jmc {
namespace {

ffi::Error OrderAfter(ffi::RemainingArgs, ffi::RemainingRets) {
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(kOrderAfter, OrderAfter,
                              ffi::Ffi::Bind().RemainingArgs().RemainingRets(),
                              JMC_GRAPH_SAFE);

}  // namespace jmc
