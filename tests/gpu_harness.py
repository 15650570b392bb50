"""What every GPU worker shares: rank-0 logging, named cases that report instead of stopping
the suite, and forgetting the failures a case provoked on purpose.

The workers run as scripts under the launcher (`python tests/gpu_*_worker.py`), so this file
is imported from their own folder.
"""

from __future__ import annotations

import base64
import faulthandler
import io
import os
import sys
import time
import traceback

# XLA records only runs of >= 5 commands as a command buffer (xla_gpu_graph_min_graph_size);
# with 1 the small programs of the workers that import this before starting JAX are recorded,
# as a model's whole decode step would be: every case then runs under CUDA graph replay (XLA's
# default) or without it (the check's nocmdbuf stage turns command buffers off).
if "xla_gpu_graph_min_graph_size" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_gpu_graph_min_graph_size=1").strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jax_moe_comm import MoEConfig, bootstrap  # noqa: E402


# A case still running after this many seconds dumps every thread's Python stack to stderr (and
# goes on): a hung case then says where each rank was (in a compile, a block_until_ready, a
# collective close) before the launcher's timeout kills it.
CASE_STACKS_S = float(os.environ.get("JMC_CASE_STACKS_S", "120"))


class Suite:
    def __init__(self, rank: int):
        self.rank = rank
        self.failures: list[str] = []
        self.only: list[str] = []  # run only the cases whose name contains one of these

    def log(self, msg: str) -> None:
        if self.rank == 0:
            print(msg, flush=True)

    def case(self, name: str):
        """Decorator: runs the case at once, prints PASS (rank 0) or FAIL (any rank)."""
        def wrap(fn):
            if self.only and not any(o in name for o in self.only):
                return fn
            t0 = time.time()
            if CASE_STACKS_S > 0:
                sys.stderr.write(f"[case] {name}\n")  # the dump below names no case itself
                faulthandler.dump_traceback_later(CASE_STACKS_S, exit=False)
            try:
                detail = fn()
                self.log(f"PASS {name} ({time.time() - t0:.1f}s)"
                         f"{' ' + detail if detail else ''}")
            except Exception as e:  # noqa: BLE001 - report every case, then fail at the end
                self.failures.append(name)
                print(f"FAIL {name} on rank {self.rank}: {type(e).__name__}: {e}", flush=True)
                traceback.print_exc()
            finally:
                faulthandler.cancel_dump_traceback_later()
                clear_runtime_tokens()
            return fn
        return wrap

    def finish(self, title: str) -> int:
        ok = not self.failures
        self.log(f"{title} " + ("PASSED" if ok else f"FAILED: {self.failures}"))
        return 0 if ok else 1


def clear_runtime_tokens() -> None:
    """JAX keeps a failed execution's runtime token and re-raises it at every later effectful
    call and at exit; the failures these cases provoke are the point, so forget them."""
    from jax._src import dispatch
    dispatch.runtime_tokens.clear()


def run_cycle(step, args, rank: int) -> None:
    """One step whose handlers may refuse the rest of the cycle once a kernel recorded an
    error (the error itself is then raised by check())."""
    try:
        jax.block_until_ready(step(*args))
    except Exception as e:  # noqa: BLE001 - XLA wraps the handler's error
        print(f"rank {rank}: the cycle was refused: {str(e).splitlines()[0][:200]}", flush=True)
    clear_runtime_tokens()


def kv_allgather(tag: str, value: np.ndarray) -> list[np.ndarray]:
    """Every process's array, in rank order, through the library's key-value all_gather: no
    XLA collective, which NCCL refuses with several ranks on one GPU ("Duplicate GPU
    detected")."""
    value = np.asarray(value)
    buf = io.BytesIO()  # as unsigned ints: np.save cannot name bfloat16 or fp8
    np.save(buf, value.view(f"u{value.dtype.itemsize}"), allow_pickle=False)
    return [np.load(io.BytesIO(base64.b64decode(v))).view(value.dtype)
            for v in bootstrap.all_gather(f"test:{tag}",
                                          base64.b64encode(buf.getvalue()).decode())]


def gather_global(tag: str, arr: jax.Array) -> np.ndarray:
    """The whole of a global array whose shards live on other processes (sharded on its
    first axis over one device per process, or replicated), as numpy on every process."""
    if arr.is_fully_addressable:
        return np.asarray(arr)
    shard = arr.addressable_shards[0]
    if arr.sharding.is_fully_replicated:
        return np.asarray(shard.data)
    start = shard.index[0].start or 0
    parts = kv_allgather(tag, np.asarray(shard.data))
    starts = kv_allgather(tag + ":start", np.array([start]))
    order = np.argsort([int(s[0]) for s in starts])
    return np.concatenate([parts[i] for i in order], axis=0)


def small_configs(world: int) -> list[tuple[str, MoEConfig]]:
    """The GPU suites' small layer shapes: tiny bf16, fp8 with scales, and (even worlds) token
    groups of 2 (token_replicas=2) with an f32 combine."""
    fp8, f32 = jnp.float8_e4m3fn, jnp.float32
    out = [("tiny-bf16", MoEConfig(num_experts=max(8, world), experts_per_token=2, hidden=128,
                                   max_num_tokens=4, world_size=world)),
           ("small-fp8", MoEConfig(num_experts=16 if 16 % world == 0 else 2 * world,
                                   experts_per_token=4, hidden=256, max_num_tokens=16,
                                   world_size=world, dispatch_dtype=fp8))]
    if world % 2 == 0:
        out.append(("dp2-bf16-f32", MoEConfig(num_experts=4 * world, experts_per_token=3,
                                              hidden=512, max_num_tokens=8, world_size=world,
                                              token_replicas=2, combine_dtype=f32)))
    return out
