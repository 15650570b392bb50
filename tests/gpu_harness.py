"""What every GPU worker shares: rank-0 logging, named cases that report instead of stopping
the suite, and forgetting the failures a case provoked on purpose.

The workers run as scripts under the launcher (`python tests/gpu_*_worker.py`), so this file
is imported from their own folder.
"""

from __future__ import annotations

import io
import time
import traceback

import jax
import numpy as np


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
            try:
                detail = fn()
                self.log(f"PASS {name} ({time.time() - t0:.1f}s)"
                         f"{' ' + detail if detail else ''}")
            except Exception as e:  # noqa: BLE001 - report every case, then fail at the end
                self.failures.append(name)
                print(f"FAIL {name} on rank {self.rank}: {type(e).__name__}: {e}", flush=True)
                traceback.print_exc()
            finally:
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


def kv_allgather(tag: str, value: np.ndarray, rank: int, world: int) -> list[np.ndarray]:
    """Every rank's array, in rank order, through JAX's key-value store: no XLA collective,
    which NCCL refuses with several ranks on one GPU ("Duplicate GPU detected")."""
    from jax._src import distributed

    client = distributed.global_state.client
    if client is None:
        return [value]
    value = np.asarray(value)
    buf = io.BytesIO()  # as unsigned ints: np.save cannot name bfloat16 or fp8
    np.save(buf, value.view(f"u{value.dtype.itemsize}"), allow_pickle=False)
    client.key_value_set_bytes(f"jmc_gather:{tag}:{rank}", buf.getvalue())
    return [np.load(io.BytesIO(client.blocking_key_value_get_bytes(
        f"jmc_gather:{tag}:{r}", 300_000))).view(value.dtype) for r in range(world)]


def gather_global(tag: str, arr: jax.Array, rank: int, world: int) -> np.ndarray:
    """The whole of a global array whose shards live on other processes (sharded on its
    first axis over one device per process, or replicated), as numpy on every process."""
    if arr.is_fully_addressable:
        return np.asarray(arr)
    shard = arr.addressable_shards[0]
    if arr.sharding.is_fully_replicated:
        return np.asarray(shard.data)
    start = shard.index[0].start or 0
    parts = kv_allgather(tag, np.asarray(shard.data), rank, world)
    starts = kv_allgather(tag + ":start", np.array([start]), rank, world)
    order = np.argsort([int(s[0]) for s in starts])
    return np.concatenate([parts[i] for i in order], axis=0)
