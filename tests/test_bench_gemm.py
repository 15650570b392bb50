"""benchmarks/bench_gemm.py's tokamax kernel-spec options, in process on CPU: tokamax_cfg_<spec>
and the preset `sweep` parse, and a spec's row records the Config it asked for. (The script end
to end, with a stand-in tokamax: tests/test_bench_layer.py's gemm smoke test.)"""

import importlib.util
import math
import os

import jax
import jax.numpy as jnp
import pytest

from jax_moe_comm import expert_gemm as G

# Left out of `scripts/test.sh --quick`: runs the GEMM benchmark's rows.
pytestmark = pytest.mark.slow

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
_spec = importlib.util.spec_from_file_location(
    "bench_gemm", os.path.join(ROOT, "benchmarks", "bench_gemm.py"))
B = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(B)  # imported, not run: ARGS holds the defaults

TOKAMAX = G.tokamax_problem()
needs_tokamax = pytest.mark.skipif(TOKAMAX is not None, reason=f"tokamax unusable: {TOKAMAX}")


@pytest.mark.parametrize("option,want", [
    ("tokamax_cfg_m128s4p1", ("mosaic:m128s4p1", False)),
    ("tokamax_cfg_m128s4p1gn_unfused", ("mosaic:m128s4p1gn", True)),
    ("tokamax_cfg_gnw2", ("mosaic:gnw2", False)),
    # the names that were there before keep their meaning
    ("tokamax", (None, False)), ("tokamax_unfused", (None, True)),
    ("tokamax_mosaic_persistent", ("mosaic_persistent", False)),
    ("tokamax_xla_unfused", ("xla", True)),
])
def test_tokamax_variant_reads_kernel_specs(option, want):
    assert B.tokamax_variant(option) == want
    layout, _ = B.option_fn(option)  # what main() checks before any work
    assert layout == "packed"


@pytest.mark.parametrize("option,why", [
    ("tokamax_cfg_m60", r"option 'tokamax_cfg_m60': .*m60: block_m must be a positive multiple"),
    ("tokamax_cfg_m128x2", r"option 'tokamax_cfg_m128x2': .*unknown letter 'x'"),
    ("tokamax_cfg_", r"option 'tokamax_cfg_': .*empty"),
    ("tokamax_cfg_unfused", r"unknown tokamax implementation 'cfg'.*tokamax_cfg_<kernel spec>"),
    ("tokamax_cfg", r"unknown tokamax implementation 'cfg'"),
])
def test_bad_kernel_spec_options_fail_before_any_work(option, why):
    with pytest.raises(ValueError, match=why):
        B.option_fn(option)


def test_sweep_preset_expands_to_specs_that_separate_the_hypotheses():
    specs = [G.parse_tokamax_spec(s) for s in B.SWEEP]
    assert len(B.SWEEP) == 8 and len({tuple(f.items()) for f in specs}) == 8  # all distinct
    assert B.expand_options("tokamax,sweep") == ["tokamax"] + [
        f"tokamax_cfg_{s}" for s in B.SWEEP]
    assert specs[0] == G.TOKAMAX_SM90_DEFAULT  # tokamax's own config through the spec path

    def differ(a, b):
        return {k for k in a if a[k] != b[k]}

    # (a) block_m, (b) persistent, (c) num_stages: each alone against the default; and M vs N
    for field, value in (("block_m", 128), ("persistent", True), ("num_stages", 4)):
        assert any(differ(f, specs[0]) == {field} and f[field] == value for f in specs), field
    assert any(f["grid_minor_dim"] == "n" for f in specs)
    for o in B.expand_options("sweep"):
        assert B.option_fn(o)[0] == "packed"


def test_expand_options_keeps_order_and_drops_repeats():
    got = B.expand_options("einsum,sweep,tokamax_cfg_m64s2p0,tokamax,,einsum")
    assert got == ["einsum"] + [f"tokamax_cfg_{s}" for s in B.SWEEP] + ["tokamax"]
    assert B.expand_options("einsum,tokamax_cfg_m128") == ["einsum", "tokamax_cfg_m128"]


def test_full_spec_spells_out_every_letter():
    assert B.full_spec("m128s4p1") == "m128n64k128s4p1gmw1"
    assert B.full_spec("gnw2k256") == "m64n64k256s2p0gnw2"


class Recorder:
    """tokamax's ragged_dot on XLA's, recording the implementation= it was given."""

    def __init__(self):
        self.seen = []

    def ragged_dot(self, x, w, gs, preferred_element_type=None, implementation=None):
        self.seen.append(implementation)
        return jax.lax.ragged_dot(x, w, gs, preferred_element_type=preferred_element_type)


@needs_tokamax
def test_unfused_variant_runs_the_spec_kernel_first(monkeypatch):
    rec = Recorder()
    monkeypatch.setattr(G, "_tokamax", lambda: (rec, None))
    L, T, H, F = 2, 8, 16, 24
    x = jnp.ones((T, H), jnp.bfloat16)
    w_in, w_out = jnp.ones((L, H, F), jnp.bfloat16), jnp.ones((L, F, H), jnp.bfloat16)
    B.tokamax_unfused_mlp(x, jnp.asarray([3, 5], jnp.int32), w_in, w_out, "mosaic:m128s4p1")
    assert len(rec.seen) == 2
    for impl in rec.seen:
        first, *rest = impl
        assert (first.config.block_m, first.config.num_stages, first.config.persistent) == (
            128, 4, True)
        assert rest[0] == "mosaic" and rest[-1] == "xla"  # then tokamax's own order


@needs_tokamax
def test_a_spec_row_records_the_config_it_asked_for(monkeypatch):
    """On CPU tokamax's Mosaic GPU kernel refuses every problem: the row computes on the
    fallback and says so, beside the Config it asked for and tokamax's own choices."""
    monkeypatch.setattr(B.ARGS, "runs", 3)
    monkeypatch.setattr(B.ARGS, "target_ms", 1.0)
    monkeypatch.setattr(B.ARGS, "budget_s", 1e9)
    case = B.Case("tiny", 4)
    ref_row, ref = B.bench_option(case, "einsum", None, {})
    assert ref is not None, ref_row["error"]
    row, _ = B.bench_option(case, "tokamax_cfg_m128s4p1", ref, {})
    assert row["error"] == "" and row["correct"] is True, row["error"]
    assert math.isfinite(row["fwd_us"]) and math.isfinite(row["fwd_bwd_us"])
    cfg = row["tokamax_config"]
    assert cfg["spec"] == "m128s4p1" and cfg["full_spec"] == "m128n64k128s4p1gmw1"
    assert "block_m=128" in cfg["config"] and "num_stages=4" in cfg["config"]
    assert "persistent=True" in cfg["config"]
    for gemm in ("w_in", "w_out"):
        assert cfg[gemm].startswith("refused, fell back: NotImplementedError"), cfg[gemm]
    assert "mosaic_gpu:w_in" in cfg  # the fallback's own choice beside it
    plain, _ = B.bench_option(case, "tokamax", ref, {})
    assert "spec" not in plain["tokamax_config"]  # tokamax's own choice: as before
    assert row["err_y"] == plain["err_y"]  # both on XLA's ragged_dot here
    meta = {"device": "cpu", "date": "-", "jax": "-", "tokamax": "-", "tokamax_problem": None,
            "runs": 3, "packed_rows_factor": 0.0}
    md = B.markdown(meta, [ref_row, row, plain])
    assert "- tokamax_cfg_m128s4p1 = m128n64k128s4p1gmw1: w_in refused" in md
