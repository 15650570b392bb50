"""What every GPU worker shares: rank-0 logging, named cases that report instead of stopping
the suite, and forgetting the failures a case provoked on purpose.

The workers run as scripts under the launcher (`python tests/gpu_*_worker.py`), so this file
is imported from their own folder.
"""

from __future__ import annotations

import time
import traceback

import jax


class Suite:
    def __init__(self, rank: int):
        self.rank = rank
        self.failures: list[str] = []

    def log(self, msg: str) -> None:
        if self.rank == 0:
            print(msg, flush=True)

    def case(self, name: str):
        """Decorator: runs the case at once, prints PASS (rank 0) or FAIL (any rank)."""
        def wrap(fn):
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
