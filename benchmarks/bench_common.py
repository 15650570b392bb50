"""What the benchmarks share: the configs, gathering every rank's results, the host's cost of a
trivial jitted call, and the commit a run names. Import after jax_moe_comm.distributed has
initialized (the gathers go through JAX's key-value store)."""

from __future__ import annotations

import json
import os
import subprocess
import time

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

from jax_moe_comm import bootstrap

CONFIGS = {"V2Lite": (64, 6, 2048), "R1": (256, 8, 7168)}  # (experts, k, hidden)


def kv_gather(tag: str, payload) -> list:
    """Every rank's JSON payload, in rank order, through JAX's key-value store."""
    return [json.loads(v) for v in bootstrap.all_gather(f"bench:{tag}", json.dumps(payload))]


def measure_host_call_us(mesh, world: int, per_rank=lambda v: v + 1,
                         tag: str = "trivial") -> float:
    """The host's time per call of a jitted shard_map of `per_rank` (default a trivial add) on
    an int32 [1] per rank, enqueued back to back: what any jitted step costs the host before its
    own work (slowest rank)."""
    spec = P("ep")
    fn = jax.jit(jax.shard_map(per_rank, mesh=mesh, in_specs=spec, out_specs=spec))
    x = jax.make_array_from_callback((world,), jax.sharding.NamedSharding(mesh, spec),
                                     lambda idx: np.zeros((1,), np.int32))
    jax.block_until_ready(fn(x))
    reps = 200
    t0 = time.perf_counter()
    for _ in range(reps):
        x = fn(x)
    host_us = (time.perf_counter() - t0) / reps * 1e6
    jax.block_until_ready(x)
    return max(kv_gather(f"host_call:{tag}", host_us))


def fit_line(points):
    """Least-squares (a, b) of y = a + b * K over [(K, y)]; (None, None) without 2 distinct K."""
    pts = [(k, y) for k, y in points if y is not None]
    if len({k for k, _ in pts}) < 2:
        return None, None
    n = len(pts)
    sx, sy = sum(k for k, _ in pts), sum(y for _, y in pts)
    sxx, sxy = sum(k * k for k, _ in pts), sum(k * y for k, y in pts)
    b = (n * sxy - sx * sy) / (n * sxx - sx * sx)
    return (sy - b * sx) / n, b


def git_commit() -> str:
    """GIT_COMMIT if set (on the GPU machine `git rev-parse` may name a stale commit), else git."""
    env = os.environ.get("GIT_COMMIT")
    if env:
        return env
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


# -- collective steps (benchmarks whose rows must not crash and whose ranks stay in step) -------
def short(e: BaseException) -> str:
    """An exception as one line for a row's error field."""
    return f"{type(e).__name__}: {e}".strip().replace("\n", " ")[:500]


class Sync:
    """Every rank's JSON payload under a fresh tag: the n-th gather of each rank meets the n-th
    of every other (the same sequence of calls on every rank), so no tag is ever reused."""

    def __init__(self, prefix: str):
        self.prefix, self.n = prefix, 0

    def gather(self, name: str, payload) -> list:
        self.n += 1
        return [json.loads(v) for v in bootstrap.all_gather(f"{self.prefix}:{self.n}:{name}",
                                                            json.dumps(payload))]


class Attempt:
    """The phases of one row, on every rank in step: a phase runs only while no rank has
    failed, and after each one every rank learns whether any failed (the first error wins).
    The Sync is passed in: its tag prefix names the benchmark."""

    def __init__(self, tag: str, sync: Sync):
        self.tag, self.sync, self.error = tag, sync, ""

    @property
    def failed(self) -> bool:
        return bool(self.error)

    def do(self, name: str, fn, *, payload=lambda r: None):
        """fn() on this rank (unless a rank failed before); returns (fn's result or None, every
        rank's payload(result)). Collective: every rank calls it, failed or not."""
        result, mine, err = None, None, ""
        if not self.failed:
            try:
                result = fn()
                mine = payload(result)
            except Exception as e:  # noqa: BLE001 -- recorded in the row, never a crash
                err = short(e)
        got = self.sync.gather(f"{self.tag}:{name}", [err, mine])
        if not self.failed:
            bad = [(r, e) for r, (e, _) in enumerate(got) if e]
            if bad:
                self.error = f"{name} on rank {bad[0][0]}: {bad[0][1]}"
        return result, [m for _, m in got]
