"""What the CUDA kernels refuse, as cases that run the same on every backend (issue 26).

Run by tests/test_parity.py (reference backend, 8 CPU devices in one process) and by
tests/gpu_parity_worker.py (one process per rank: nvshmem on GPUs, or the reference backend on
CPU processes). Each case gets a `Ctx` and raises AssertionError when the backend did not
refuse as expected. Two kinds of refusal:

- trace time: one traced function shows the misuse; the API (api.py, shared by every backend)
  raises ProtocolError before anything runs;
- run time: the misuse spans jitted calls (a pending returned by one call and used by
  another); the kernels refuse the launch on the device and `check()` raises ProtocolError (or
  PeerAbortedError naming a ProtocolError: another rank's record came first). The reference
  backend counts sends and receives the same way on the host (backends/host_check.py).
  Afterwards the handle is unusable on both: closed, and a fresh one works.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jax_moe_comm import AllToAll, MoEConfig, PeerAbortedError, ProtocolError
from jax_moe_comm import testing as T

SPEC = P("ep")


@dataclasses.dataclass
class Ctx:
    mesh: jax.sharding.Mesh
    backend: str  # "reference" or "nvshmem"
    world: int
    after_failure: callable = lambda: None  # forget a failed execution (GPU harness)

    @property
    def cfg(self) -> MoEConfig:
        return MoEConfig(num_experts=2 * self.world, experts_per_token=2, hidden=128,
                         max_num_tokens=4, world_size=self.world)

    def handle(self, cfg: MoEConfig | None = None) -> AllToAll:
        return AllToAll(cfg or self.cfg, backend=self.backend)

    def inputs(self, seed: int = 0, cfg: MoEConfig | None = None):
        cfg = cfg or self.cfg
        inp = T.make_inputs(cfg, seed)
        x, _, idx, w, nt = T.global_inputs(cfg, self.mesh, inp)
        return inp, (x, idx, w, nt)

    def jit(self, fn, n_in: int, out_specs=SPEC):
        return jax.jit(jax.shard_map(fn, mesh=self.mesh, in_specs=(SPEC,) * n_in,
                                     out_specs=out_specs))


CASES: dict[str, callable] = {}


def case(fn):
    CASES[fn.__name__.replace("_", "-")] = fn
    return fn


def refused_at_trace(fn, match: str) -> str:
    """fn() must raise ProtocolError matching `match` (while tracing: nothing ran)."""
    try:
        fn()
    except ProtocolError as e:
        assert match in str(e), f"ProtocolError without {match!r}: {e}"
        return str(e).split(".")[0]
    raise AssertionError(f"not refused (expected a ProtocolError with {match!r})")


def refused_at_run(ctx: Ctx, a2a: AllToAll, run) -> str:
    """run() (jitted calls) then a2a.check() must report the kernels' ProtocolError."""
    error = None
    try:
        run()
        a2a.check()
    except Exception as e:  # noqa: BLE001 - check()'s error, or XLA's wrap of a handler's
        error = e
    finally:
        ctx.after_failure()
    assert error is not None, "the misuse was not reported by check()"
    text = f"{type(error).__name__}: {error}"
    if ctx.backend == "reference":  # no abort broadcast: every rank records its own
        assert isinstance(error, ProtocolError), text
    else:  # a peer's abort may come first (PeerAborted naming the ProtocolError)
        assert isinstance(error, (ProtocolError, PeerAbortedError)) or "ProtocolError" in str(
            error) or "PeerAborted" in str(error), text
    assert "ProtocolError" in text, text
    return str(error).splitlines()[0][:160]


def fresh_handle_works(ctx: Ctx, seed: int = 99) -> None:
    with ctx.handle() as a2a:
        T.run_and_check(a2a, ctx.mesh, T.make_inputs(ctx.cfg, seed))
        a2a.check()


def _with_rank_axis(tree):  # every leaf gets a leading axis, so out_specs P("ep") fits it
    return jax.tree.map(lambda a: a[None], tree)


def _without_rank_axis(tree):
    return jax.tree.map(lambda a: a[0], tree)


# -- trace time -----------------------------------------------------------------------------
@case
def two_dispatches_in_flight(ctx: Ctx):
    with ctx.handle() as a2a:
        _, (x, idx, _, nt) = ctx.inputs()

        def twice(x, idx, nt):
            first = a2a.dispatch_send(x, idx, nt.reshape(()))
            a2a.dispatch_send(x, idx, nt.reshape(()))
            return a2a.dispatch_recv(first).expert_num_tokens

        def fused_after_send(x, idx, nt):
            a2a.dispatch_send(x, idx, nt.reshape(()))
            return a2a.dispatch(x, idx, nt.reshape(())).expert_num_tokens

        a = refused_at_trace(lambda: ctx.jit(twice, 3)(x, idx, nt), "still in flight")
        refused_at_trace(lambda: ctx.jit(fused_after_send, 3)(x, idx, nt), "still in flight")
    return a


@case
def two_combines_in_flight(ctx: Ctx):
    with ctx.handle() as a2a:
        _, (x, idx, w, nt) = ctx.inputs()

        def twice(x, idx, w, nt):
            n = nt.reshape(())
            out = a2a.dispatch(x, idx, n)
            ey = out.expert_x.astype(a2a.config.combine_dtype)
            first = a2a.combine_send(ey, out.routing)
            a2a.combine_send(ey, out.routing)
            return a2a.combine_recv(first, idx, w, n)

        return refused_at_trace(lambda: ctx.jit(twice, 4)(x, idx, w, nt), "still in flight")


@case
def recv_without_send(ctx: Ctx):
    with ctx.handle() as a2a:
        _, (x, idx, w, nt) = ctx.inputs()

        def recv_twice(x, idx, nt):
            pending = a2a.dispatch_send(x, idx, nt.reshape(()))
            a2a.dispatch_recv(pending)
            return a2a.dispatch_recv(pending).expert_num_tokens

        def combine_recv_twice(x, idx, w, nt):
            n = nt.reshape(())
            out = a2a.dispatch(x, idx, n)
            sent = a2a.combine_send(out.expert_x.astype(a2a.config.combine_dtype), out.routing)
            a2a.combine_recv(sent, idx, w, n)
            return a2a.combine_recv(sent, idx, w, n)

        a = refused_at_trace(lambda: ctx.jit(recv_twice, 3)(x, idx, nt), "already received")
        refused_at_trace(lambda: ctx.jit(combine_recv_twice, 4)(x, idx, w, nt),
                         "already received")
    return a


@case
def another_handles_pending(ctx: Ctx):
    with ctx.handle() as a, ctx.handle() as b:
        _, (x, idx, w, nt) = ctx.inputs()

        def crossed(x, idx, nt):
            return b.dispatch_recv(a.dispatch_send(x, idx, nt.reshape(()))).expert_num_tokens

        def crossed_combine(x, idx, w, nt):
            n = nt.reshape(())
            out = a.dispatch(x, idx, n)
            sent = a.combine_send(out.expert_x.astype(a.config.combine_dtype), out.routing)
            return b.combine_recv(sent, idx, w, n)

        msg = refused_at_trace(lambda: ctx.jit(crossed, 3)(x, idx, nt), "another AllToAll")
        refused_at_trace(lambda: ctx.jit(crossed_combine, 4)(x, idx, w, nt), "another AllToAll")
    return msg


@case
def call_after_close(ctx: Ctx):
    a2a = ctx.handle()
    _, (x, idx, _, nt) = ctx.inputs()
    step = ctx.jit(lambda x, i, n: a2a.dispatch(x, i, n.reshape(())).expert_num_tokens, 3)
    jax.block_until_ready(step(x, idx, nt))
    a2a.check()
    a2a.close()
    fresh = ctx.jit(lambda x, i, n: a2a.dispatch(x, i, n.reshape(())).expert_num_tokens, 3)
    msg = refused_at_trace(lambda: fresh(x, idx, nt), "closed")
    if ctx.backend == "reference":
        # A step compiled before close() and run after it: the CUDA handlers refuse it, and
        # the reference records it. (Not run on the GPU: under XLA command buffers a replay
        # runs no handler and would use freed memory; AllToAll.close documents it.)
        jax.block_until_ready(step(x, idx, nt))
        try:
            a2a.check()
            raise AssertionError("a compiled step run after close() was not reported")
        except ProtocolError as e:
            assert "closed" in str(e), str(e)
    return msg


@case
def creation_under_a_trace(ctx: Ctx):
    cfg = ctx.cfg
    msg = refused_at_trace(lambda: jax.jit(lambda v: (ctx.handle(cfg), v)[1])(1.0),
                           "while JAX is tracing")
    refused_at_trace(lambda: jax.eval_shape(lambda: ctx.handle(cfg) and None),
                     "while JAX is tracing")
    fresh_handle_works(ctx)  # nothing collective happened: the processes are still in step
    return msg


# -- run time (a pending crossing jitted calls) ---------------------------------------------
def jitted_send(ctx: Ctx, a2a):
    """dispatch_send alone as a jitted call: (x, indices, num_tokens) -> its pending."""
    return ctx.jit(lambda x, i, n: _with_rank_axis(a2a.dispatch_send(x, i, n.reshape(()))), 3)


@case
def second_send_in_another_call(ctx: Ctx):
    a2a = ctx.handle()
    try:
        _, (x, idx, _, nt) = ctx.inputs()
        send = jitted_send(ctx, a2a)
        jax.block_until_ready(send(x, idx, nt))  # one dispatch in flight: fine
        msg = refused_at_run(ctx, a2a, lambda: jax.block_until_ready(send(x, idx, nt)))
        # The handle stays unusable (the kernels refuse every later launch): check() says so
        # again; close it and make a new one.
        kinds = ProtocolError if ctx.backend == "reference" else (ProtocolError,
                                                                  PeerAbortedError)
        try:
            a2a.check()
            raise AssertionError("check() forgot the protocol error: the handle is unusable")
        except kinds:
            pass
    finally:
        a2a.close()
        ctx.after_failure()
    fresh_handle_works(ctx)
    return msg


@case
def recv_again_in_another_call(ctx: Ctx):
    a2a = ctx.handle()
    try:
        _, (x, idx, _, nt) = ctx.inputs()
        send = jitted_send(ctx, a2a)
        recv = ctx.jit(lambda p: a2a.dispatch_recv(_without_rank_axis(p)).expert_num_tokens, 1)
        pending = send(x, idx, nt)
        jax.block_until_ready(recv(pending))  # the one recv of that send: fine
        msg = refused_at_run(ctx, a2a, lambda: jax.block_until_ready(recv(pending)))
    finally:
        a2a.close()
        ctx.after_failure()
    fresh_handle_works(ctx)
    return msg


# -- what must stay allowed -----------------------------------------------------------------
@case
def split_across_calls_and_layers_allowed(ctx: Ctx):
    """A send in one jitted call and its recv in another, several times; two cycles in one
    jit; two handles with their dispatches in flight together: no error, right values."""
    cfg = ctx.cfg
    with ctx.handle() as a, ctx.handle(dataclasses.replace(cfg, hidden=256)) as b:
        send = ctx.jit(lambda x, i, n: _with_rank_axis(a.dispatch_send(x, i, n.reshape(()))),
                       3)

        def finish(p, idx, w, nt):
            out = a.dispatch_recv(_without_rank_axis(p))
            rank = jax.lax.axis_index("ep")
            ey = T.expert_outputs(cfg, rank, out.expert_x, None)
            return a.combine(ey, out.routing, idx, w, nt.reshape(()))

        finish = ctx.jit(finish, 4)
        for seed in range(3):
            inp, (x, idx, w, nt) = ctx.inputs(seed)
            y = finish(send(x, idx, nt), idx, w, nt)
            for rank, yr in T.local_blocks(y, cfg.max_num_tokens).items():
                T.check_combine(cfg, inp, rank, yr)
        a.check()

        def two_cycles_two_handles(x, idx, w, nt, xb):
            n = nt.reshape(())
            rank = jax.lax.axis_index("ep")
            pa = a.dispatch_send(x, idx, n)
            pb = b.dispatch_send(xb, idx, n)  # another handle: may be in flight together
            ob, oa = b.dispatch_recv(pb), a.dispatch_recv(pa)
            yb = b.combine(ob.expert_x, ob.routing, idx, w, n)
            y = a.combine(T.expert_outputs(cfg, rank, oa.expert_x, None), oa.routing, idx, w, n)
            out2 = a.dispatch(y, idx, n)  # a second cycle on `a`, after the first
            y2 = a.combine(T.expert_outputs(cfg, rank, out2.expert_x, None), out2.routing,
                           idx, w, n)
            return y, y2, yb

        inp, (x, idx, w, nt) = ctx.inputs(7)
        xb = T.put_global(ctx.mesh, np.zeros((ctx.world * cfg.max_num_tokens, 256),
                                             jnp.bfloat16))
        y, y2, _ = ctx.jit(two_cycles_two_handles, 5, (SPEC, SPEC, SPEC))(x, idx, w, nt, xb)
        second = T.local_blocks(y2, cfg.max_num_tokens)
        for rank, yr in T.local_blocks(y, cfg.max_num_tokens).items():
            T.check_combine(cfg, inp, rank, yr)  # the second cycle dispatched y itself:
            want = T.combined_oracle(cfg, inp, rank, np.asarray(yr, np.float64))
            np.testing.assert_allclose(np.asarray(second[rank], np.float64), want, rtol=2e-2,
                                       atol=2e-2 * max(1.0, float(np.abs(want).max())))
        a.check()
        b.check()
    return "3 split cycles across calls, 2 cycles in one jit, 2 handles in flight: no error"
