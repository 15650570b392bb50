"""The reference backend against the numpy oracle on 8 emulated CPU devices."""

import dataclasses
import functools

import jax.numpy as jnp
import numpy as np
import pytest

from cases import Case

from jax_moe_comm import AllToAll, InvalidRoutingError, MoEConfig
from jax_moe_comm import testing as T

bf16, fp8, f32 = jnp.bfloat16, jnp.float8_e4m3fn, jnp.float32


CASES = [Case(f"EP{ep}-{n}", *shape, ep=ep, dtype=dt, out=out)
         for ep in (1, 2, 4, 8)
         for n, shape, dt, out in (("tiny-bf16", (8, 2, 128, 4), bf16, bf16),
                                   ("small-fp8", (16, 4, 256, 16), fp8, bf16),
                                   ("odd-E-f32", (24, 5, 64, 6), bf16, f32))]
CASES += [Case("EP8-dp2-bf16", 16, 3, 128, 8, 8, dp=2), Case("EP4-dp2-fp8", 8, 2, 256, 8, 4,
                                                                dp=2, dtype=fp8),
          Case("EP2-dp2-k=E", 4, 4, 128, 4, 2, dp=2)]


@functools.cache
def handle_and_step(case, split):
    """One handle and compiled step per case and API, shared by the routings (the routing is
    data: every routing of a case compiles the same program)."""
    a2a = AllToAll(case.cfg())
    return a2a, T.make_step(a2a, T.make_mesh(case.ep), split)


# A case's routings run one after another (and so mostly on one xdist worker).
@pytest.mark.parametrize("routing", ["random", "skewed", "duplicates", "empty_ranks"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_dispatch_combine_match_oracle(case, routing):
    cfg = case.cfg()
    split = routing == "skewed"
    a2a, step = handle_and_step(case, split)
    seed = np.random.SeedSequence().entropy % 2**31  # fresh data every run
    inp = T.make_inputs(cfg, seed, routing)
    T.run_and_check(a2a, T.make_mesh(case.ep), inp, split=split, step=step)


@pytest.mark.slow
@pytest.mark.parametrize("ep", [1, 2, 4, 8])
def test_r1_shape(ep):
    """DeepSeek-R1's experts, top-k and hidden size with fp8 dispatch. Every rank's padded
    worst-case buffers are [256 / ep, m * ep, 7168], and all ep ranks live in this process:
    m * ep is at most 256 tokens (m = 128 at EP8 held 13.5 GB, over the suite's budget)."""
    cfg = MoEConfig(num_experts=256, experts_per_token=8, hidden=7168,
                    max_num_tokens=min(128, 256 // ep), world_size=ep, dispatch_dtype=fp8)
    T.run_and_check(AllToAll(cfg), T.make_mesh(ep), T.make_inputs(cfg, ep, "random"))


def test_zero_tokens_everywhere():
    cfg = Case("z", 16, 4, 128, 8, 8).cfg()
    inp = T.make_inputs(cfg, 3)
    inp = dataclasses.replace(inp, num_tokens=np.zeros_like(inp.num_tokens))
    T.run_and_check(AllToAll(cfg), T.make_mesh(8), inp)


def test_every_token_to_one_expert_fills_max_recv():
    cfg = Case("one", 16, 1, 128, 8, 8).cfg()
    inp = T.make_inputs(cfg, 4, ragged=False)
    inp = dataclasses.replace(inp, indices=np.full_like(inp.indices, 5))
    a2a = AllToAll(cfg)
    mesh = T.make_mesh(8)
    T.run_and_check(a2a, mesh, inp)
    _, _, counts, _ = T.make_step(a2a, mesh)(*T.global_inputs(cfg, mesh, inp))
    assert int(np.asarray(counts)[5]) == cfg.max_recv_tokens  # expert 5 is rank 2's expert 1


def test_one_handle_many_steps_and_two_handles():
    a_cfg, b_cfg = Case("a", 16, 4, 128, 8, 8).cfg(), Case("b", 32, 3, 256, 4, 8, dtype=fp8).cfg()
    a, b = AllToAll(a_cfg), AllToAll(b_cfg)
    mesh = T.make_mesh(8)
    sa, sb = T.make_step(a, mesh), T.make_step(b, mesh, split=True)
    for i in range(6):
        T.run_and_check(a, mesh, T.make_inputs(a_cfg, 100 + i), step=sa)
        T.run_and_check(b, mesh, T.make_inputs(b_cfg, 200 + i), step=sb)
    a.close()
    b.close()


def test_repeated_expert_in_a_row_is_sent_once_with_summed_weight():
    cfg = Case("dup", 8, 3, 128, 4, 2).cfg()
    inp = T.make_inputs(cfg, 11, "duplicates", ragged=False)
    inp.indices[:, :, 2] = inp.indices[:, :, 0]  # three slots, one expert
    want = T.expected_rows(cfg, inp, 0)
    assert all(n == 1 for c in want.values() for n in c.values())
    T.run_and_check(AllToAll(cfg), T.make_mesh(2), inp)


def test_expert_index_out_of_range_is_reported():
    cfg = Case("bad", 8, 2, 128, 4, 2).cfg()
    inp = T.make_inputs(cfg, 5, "bad_index")
    a2a = AllToAll(cfg)
    mesh = T.make_mesh(2)
    # The bad slot is skipped (the oracle skips it too) and every other slot is right...
    T.run_and_check(a2a, mesh, inp)
    # ...and the error is reported, not silent.
    with pytest.raises(InvalidRoutingError, match="has expert index .* outside"):
        a2a.check()


def test_oracle_catches_a_wrong_backend(monkeypatch):
    """The checks fail when the backend misroutes: swap two experts' rows after dispatch."""
    from jax_moe_comm.backends import reference

    cfg = Case("mut", 16, 4, 128, 8, 4).cfg()
    inp = T.make_inputs(cfg, 6, ragged=False)
    real = reference.ReferenceBackend.dispatch_recv

    def broken(self, pending):
        ex, *rest = real(self, pending)
        return (ex[::-1], *rest)

    monkeypatch.setattr(reference.ReferenceBackend, "dispatch_recv", broken)
    with pytest.raises(AssertionError):
        T.run_and_check(AllToAll(cfg), T.make_mesh(4), inp)


def test_poll_reports_like_check_and_recover_needs_an_open_handle():
    """poll() (the server's per-step check, no device sync on the GPU) reports the same error
    as check(); recover() refuses a closed handle."""
    from jax_moe_comm import ProtocolError

    cfg = Case("bad", 8, 2, 128, 4, 2).cfg()
    a2a = AllToAll(cfg)
    T.run_and_check(a2a, T.make_mesh(2), T.make_inputs(cfg, 5, "bad_index"))
    with pytest.raises(InvalidRoutingError, match="has expert index .* outside"):
        a2a.poll()
    a2a.recover()  # collective on the GPU; nothing to clear here
    a2a.close()
    with pytest.raises(ProtocolError, match="closed"):
        a2a.recover()


def test_combine_wrong_flags_a_wrong_y_and_passes_the_right_one():
    """The in-loop oracle of the protocol and soak workers (testing.combine_wrong)."""
    cfg = MoEConfig(num_experts=8, experts_per_token=2, hidden=16, max_num_tokens=4,
                    world_size=2)
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((4, 16)), jnp.bfloat16)
    ids = jnp.asarray([[0, 5], [3, -1], [7, 2], [1, 4]], jnp.int32)
    w = jnp.asarray(rng.uniform(0.1, 1.0, (4, 2)), jnp.float32)
    c = jnp.asarray(T.expert_factor(cfg), jnp.float32)[jnp.clip(ids, 0)]
    rows = (c[:, :, None] * x.astype(jnp.float32)[:, None, :]).astype(cfg.combine_dtype)
    y = jnp.sum(jnp.where(ids[:, :, None] >= 0, w[:, :, None] * rows.astype(jnp.float32), 0),
                axis=1).at[3].set(0.0)  # num_tokens = 3: the last row stays zero
    assert int(T.combine_wrong(cfg, y, x, ids, w, 3)) == 0
    assert int(T.combine_wrong(cfg, y.at[1, 5].add(1.0), x, ids, w, 3)) == 1
    assert int(T.combine_wrong(cfg, y.at[3].set(y[2]), x, ids, w, 3)) == 1  # past num_tokens
