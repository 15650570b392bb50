"""Errors raised by jax_moe_comm: named, so that callers can tell a stalled peer from bad data."""


class MoECommError(RuntimeError):
    """Base class of the runtime errors reported by the all-to-all kernels."""


class PeerTimeoutError(MoECommError):
    """A bounded wait for a peer ran out: the peer never sent (crashed, or skipped a call)."""


class InvalidRoutingError(MoECommError):
    """Routing data seen at run time was out of range (expert index, num_tokens)."""


class PeerAbortedError(MoECommError):
    """Another rank reported an error on this handle first; its message names the rank and
    what it saw (that rank raises the original error)."""


class CorruptDataError(MoECommError):
    """A value read from a peer or from the routing passed to combine was out of range; it was
    dropped instead of being written out of bounds."""


class CapacityExceededError(MoECommError):
    """More rows arrived at a rank than its capacity holds, with overflow="fail": the packed
    layout's rows per rank (AllToAll(max_recv_rows=...)) or the padded layout's rows per local
    expert (AllToAll(expert_capacity=...)). The rows past the capacity were not written; the
    message (starting "CapacityExceeded:") names the rank, the rows that arrived (past the
    capacity, for expert_capacity) and the capacity. The error stays recorded until recover().
    Raise the capacity (or the capacity factor), or pass overflow="drop"."""


class ProtocolError(MoECommError):
    """The API was misused: a recv without its send, two sends in flight on one handle,
    another handle's pending, a call on a closed handle, a handle created while tracing.
    Raised at trace time where the traced function shows it, else by check() (the kernels
    refuse the launch; the handle is then unusable until recover() on every rank, or close
    it and create a new one)."""


class RecoveryError(MoECommError):
    """recover() found the ranks' counts of completed cycles more than one cycle apart (a rank
    that recovered on its own, or a process restarted on its own): no step exists that every
    rank can resume from. The message names each rank and its count; restart the job."""


class NativeUnavailableError(MoECommError):
    """The CUDA backend was asked for but cannot run here (not built, no GPU, wrong NVSHMEM)."""


class ReferenceFallbackWarning(UserWarning):
    """backend='auto' is on GPUs but cannot use the CUDA kernels, and took the (much slower)
    reference backend; the message says why and how to get the CUDA path."""
