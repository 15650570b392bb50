"""jax_moe_comm: expert-parallel MoE dispatch/combine for JAX (NVSHMEM kernels + reference).

The public surface is `__all__` below, plus the modules a user imports by name:
`jax_moe_comm.moe` (the MoE layer), `jax_moe_comm.sharded` (the layer under plain jax.jit),
`jax_moe_comm.flax` (its Flax NNX module, extra `[flax]`),
`jax_moe_comm.train` (a training step), `jax_moe_comm.native` (is the CUDA backend usable
here, and why not) and `python -m jax_moe_comm.launch` / `python -m jax_moe_comm.demo`.
`jax_moe_comm.testing` is the oracle and the rigs of the test suites, not library API.
"""

from . import distributed  # registers the launcher's variables with jax.distributed.initialize()
from .api import (CHECKPOINT_NAME, AllToAll, DispatchOutput, PendingCombine, PendingDispatch,
                  order_after, resolve_backend)
from .config import KernelTuning, MoEConfig
from . import expert_gemm
from .expert_gemm import expert_mlp
from .errors import (CapacityExceededError, CorruptDataError, InvalidRoutingError, MoECommError,
                     NativeUnavailableError, PeerAbortedError, PeerTimeoutError, ProtocolError,
                     RecoveryError, ReferenceFallbackWarning)
from .bootstrap import finalize, init
from .sizes import symmetric_bytes
from .sharded import moe_layer

__all__ = [
    "AllToAll", "CHECKPOINT_NAME", "DispatchOutput", "order_after", "PendingCombine",
    "PendingDispatch", "resolve_backend",
    "KernelTuning", "MoEConfig", "InvalidRoutingError", "MoECommError",
    "NativeUnavailableError", "PeerTimeoutError", "ProtocolError", "PeerAbortedError",
    "CorruptDataError", "CapacityExceededError", "ReferenceFallbackWarning", "init",
    "finalize", "expert_gemm", "expert_mlp", "distributed", "symmetric_bytes",
    "RecoveryError", "moe_layer",
]
__version__ = "0.2.0"
