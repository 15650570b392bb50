"""JMC_DEBUG=1: each AllToAll says, on stderr when it is created, what was chosen and why: the
backend (and why `auto` chose it), the layout and capacity, the dtypes, the symmetric memory
of each native handle, the kernels' grids, the transport to peers and the protocol options.
One block per handle, every line prefixed with the process index."""

from __future__ import annotations

import os
import sys


def enabled() -> bool:
    return os.environ.get("JMC_DEBUG", "").strip().lower() not in ("", "0", "false", "no")


def _backend_reason(requested: str, chosen: str, config) -> str:
    if requested != "auto":
        return f"asked for backend={requested!r}"
    if chosen == "nvshmem":
        return "auto: a CUDA GPU where the CUDA module runs"
    from . import api

    if api._platform() not in ("gpu", "cuda"):
        return f"auto: jax's platform is {api._platform()!r}, not a GPU"
    return f"auto: {api._gpu_problem(config)}"


def handle_lines(a2a, requested: str) -> list[str]:
    """The report of AllToAll `a2a`, created with backend=`requested`."""
    cfg = a2a.config
    why = _backend_reason(requested, a2a.backend_name, cfg)
    lines = [
        f"AllToAll #{a2a._serial}: backend {a2a.backend_name} ({why})",
        f"  experts {cfg.num_experts} (top-{cfg.experts_per_token}) over {cfg.world_size} ranks"
        f" (token_replicas {cfg.token_replicas}), hidden {cfg.hidden},"
        f" max_num_tokens {cfg.max_num_tokens}",
        f"  dtypes: dispatch {cfg.dispatch_dtype.name}, combine {cfg.combine_dtype.name}",
        f"  layout {a2a.layout}, capacity "
        + (f"max_recv_rows={a2a.max_recv_rows} of {cfg.max_recv_total} worst case"
           if a2a.layout == "packed" else
           f"expert_capacity={a2a.expert_capacity} of {cfg.max_recv_tokens} worst case")
        + f", overflow {a2a.overflow!r}",
        f"  differentiable: {a2a.differentiable} ({len(a2a._backends)} native handle(s)),"
        f" symmetric memory {a2a.symmetric_bytes} bytes per rank",
    ]
    for i, b in enumerate(a2a._backends):
        shape = getattr(b, "launch_shape", None)
        if shape is None:
            continue
        grids = shape()
        names = ("dispatch_send", "dispatch_recv", "combine_send", "combine_recv",
                 "fused dispatch", "fused combine")
        lines.append(f"  handle {i}: " + ", ".join(
            f"{n} {blocks}x{warps} warps" if blocks else f"{n} split"
            for n, (blocks, warps) in zip(names, grids)))
        from . import bootstrap

        lines.append(f"  handle {i}: transport "
                     + ("staged through NVSHMEM's proxy to peers not reachable by load/store"
                        if bootstrap.staged() else "load/store (NVLink or P2P) to every peer")
                     + f", options {b.protocol_options()}, timeout {a2a._timeout_s} s")
    return lines


def report(a2a, requested: str) -> None:
    """Writes a2a's report to stderr when JMC_DEBUG is set."""
    if not enabled():
        return
    import jax

    rank = jax.process_index()
    sys.stderr.write("".join(f"[jax_moe_comm {rank}] {line}\n"
                             for line in handle_lines(a2a, requested)))
    sys.stderr.flush()
