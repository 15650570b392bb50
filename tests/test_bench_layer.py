"""CPU smoke runs of benchmarks/bench_layer.py and benchmarks/bench_gemm.py (issue 24), so that
the scripts the GPU session runs once cannot rot between sessions: tiny shapes, 8 emulated
devices, the reference backend, a few samples; the JSON must hold the fields with finite numbers.

tokamax needs Python >= 3.12 (not this venv): a stand-in package (jax.lax.ragged_dot behind
tokamax's ragged_dot signature, with implementation="mosaic" deliberately wrong from the third
row of every group on) checks the tokamax rows' plumbing and that bench_gemm's per-output errors
and bad-row diagnosis catch a wrong kernel. The capacity rows run on the real capacity API (the
packed max_recv_rows, the padded expert_capacity; overflow, dropped_rows(),
CapacityExceededError) and, through a stand-in AllToAll without it, fall back to the worst case
as on a build that lacks it."""

import json
import math
import os
import subprocess
import sys

import pytest

from cpu_env import child_env

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
LAYER = os.path.join(ROOT, "benchmarks", "bench_layer.py")
GEMM = os.path.join(ROOT, "benchmarks", "bench_gemm.py")
FAST = ["--samples", "2", "--target-ms", "2", "--max-loop", "3", "--step-calls", "2"]

# Left out of `scripts/test.sh --quick`: runs the layer benchmark's rows end to end.
pytestmark = pytest.mark.slow

FAKE_TOKAMAX = '''
"""A stand-in for tokamax's ragged_dot API (tests only)."""
import os

import jax
import jax.numpy as jnp

__version__ = "0.0.0+stand-in"
IMPLEMENTATIONS = {"xla": None, "mosaic_gpu": None}


def _chain(implementation):
    """A kernel spec's chain (its kernel, then "mosaic", "xla"): the kernel's config is logged
    to $FAKE_TOKAMAX_LOG (so a test sees which spec reached tokamax) and the chain runs as its
    last name; the kernel alone runs as tokamax's default here."""
    if not isinstance(implementation, tuple):
        return implementation
    log = os.environ.get("FAKE_TOKAMAX_LOG")
    if log and getattr(implementation[0], "config", None) is not None:
        c = implementation[0].config
        with open(log, "a") as f:
            f.write(f"block_m={c.block_m} block_n={c.block_n} persistent={c.persistent}\\n")
    last = implementation[-1]
    return last if isinstance(last, str) else None


def ragged_dot(lhs, rhs, group_sizes, precision=None, preferred_element_type=None,
               group_offset=None, activation=None, manual_axis_type=None, *,
               implementation=None, **kwargs):
    implementation = _chain(implementation)
    if implementation not in (None, "mosaic", *IMPLEMENTATIONS):
        raise ValueError(f"Unknown implementation: {implementation}")
    out = jax.lax.ragged_dot(lhs, rhs, group_sizes, preferred_element_type=jnp.float32)
    if implementation == "mosaic":  # wrong on purpose: rows 2, 3, ... of each group doubled
        ends = jnp.cumsum(group_sizes)
        i = jnp.arange(lhs.shape[0])
        g = jnp.minimum(jnp.searchsorted(ends, i, side="right"), group_sizes.shape[0] - 1)
        within = i - (ends - group_sizes)[g]
        out = jnp.where((within >= 2)[:, None], 2 * out, out)
    if activation is not None:
        out = activation(out)
    return out.astype(preferred_element_type or lhs.dtype)


def ragged_dot_general(lhs, rhs, group_sizes, ragged_dot_dimension_numbers, precision=None,
                       preferred_element_type=None, *, implementation=None, **kwargs):
    """Right for every implementation (grouped_vjp's backward and its differentiated forward
    use it): only the primal ragged_dot of "mosaic" is wrong."""
    implementation = _chain(implementation)
    if implementation not in (None, "mosaic", *IMPLEMENTATIONS):
        raise ValueError(f"Unknown implementation: {implementation}")
    return jax.lax.ragged_dot_general(lhs, rhs, group_sizes, ragged_dot_dimension_numbers,
                                      preferred_element_type=preferred_element_type)
'''

# What expert_gemm builds a kernel spec's implementation from (tokamax's private modules).
FAKE_MOSAIC = '''
class PallasMosaicGpuRaggedDot:
    def __init__(self, config=None):
        self.config = config
'''
FAKE_MOSAIC_COMMON = '''
import dataclasses
import enum


class MatmulDimension(enum.Enum):
    M = 0
    N = 1


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config:
    block_m: int
    block_n: int
    block_k: int
    num_stages: int
    split_k: int
    persistent: bool
    grid_minor_dim: MatmulDimension
    grid_tile_width: int
'''

NO_CAPACITY_RUNNER = '''
import os, runpy, sys
import jax_moe_comm

Base = jax_moe_comm.AllToAll

class NoCapacityAllToAll(Base):  # a build without either capacity argument
    def __init__(self, config, *, axis_name="ep", backend="auto", layout="padded",
                 tuning=None, timeout_s=30.0, differentiable=False):
        super().__init__(config, axis_name=axis_name, backend=backend, layout=layout,
                         tuning=tuning, timeout_s=timeout_s, differentiable=differentiable)

jax_moe_comm.AllToAll = NoCapacityAllToAll
script = sys.argv[1]
sys.argv = sys.argv[1:]
sys.path.insert(0, os.path.dirname(os.path.abspath(script)))  # as `python script` does
runpy.run_path(script, run_name="__main__")
'''


@pytest.fixture(scope="module")
def fake_site(tmp_path_factory):
    site = tmp_path_factory.mktemp("site")
    pkg = site / "tokamax"
    (pkg / "_src" / "ops" / "ragged_dot").mkdir(parents=True)
    (pkg / "__init__.py").write_text(FAKE_TOKAMAX)
    for sub in ("_src", "_src/ops", "_src/ops/ragged_dot"):
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "_src" / "ops" / "ragged_dot" / "api.py").write_text(
        "from tokamax import IMPLEMENTATIONS\n")
    (pkg / "_src" / "ops" / "ragged_dot" / "pallas_mosaic_gpu.py").write_text(FAKE_MOSAIC)
    (pkg / "_src" / "ops" / "ragged_dot" / "pallas_mosaic_gpu_common.py").write_text(
        FAKE_MOSAIC_COMMON)
    (site / "no_capacity_runner.py").write_text(NO_CAPACITY_RUNNER)
    return str(site)


def run(cmd, site, tmp_path):
    env = child_env()
    env["PYTHONPATH"] = os.pathsep.join([site] + [p for p in [env.get("PYTHONPATH")] if p])
    r = subprocess.run([sys.executable, *cmd], capture_output=True, text=True, timeout=240,
                       env=env, cwd=str(tmp_path), check=False)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    return r.stdout


def finite(v):
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def layer_json(out_dir):
    with open(os.path.join(out_dir, "smoke.json")) as f:
        return json.load(f)


def test_layer_smoke(tmp_path, fake_site, monkeypatch):
    out = tmp_path / "out"
    spec_log = tmp_path / "specs.log"  # the stand-in logs the kernel config each call asked for
    monkeypatch.setenv("FAKE_TOKAMAX_LOG", str(spec_log))
    run([LAYER, "--configs", "tiny", "--tokens", "4", "--layouts", "padded,packed",
         "--expert-gemm", "einsum,tokamax,tokamax@m128p1", "--capacity-configs", "tiny",
         "--capacity-tokens",
         "4", "--skew", "0.9", "--padded-capacity-tokens", "", "--commit", "smoke123", "--name",
         "smoke", "--out", str(out), *FAST], fake_site, tmp_path)
    run_ = layer_json(out)
    for key in ("gpu", "jax", "date", "command", "world", "ranks_per_gpu", "weights",
                "capacity_support", "expert_capacity_support"):
        assert key in run_, key
    assert run_["commit"] == "smoke123" and run_["world"] == 8 and run_["finished"] is True
    w = run_["weights"]["tiny"]
    assert finite(w["read_us"]) and finite(w["copy_us"]) and finite(w["nominal_us"])
    rows = {(r["layout"], r["expert_gemm"], r["capacity_factor"], r["skew"], r["kind"]): r
            for r in run_["rows"]}
    assert len(rows) == len(run_["rows"])
    plain = [rows[("padded", "einsum", None, 0.0, "layer")],
             rows[("packed", "einsum", None, 0.0, "layer")],
             rows[("packed", "tokamax", None, 0.0, "layer")],
             rows[("packed", "tokamax@m128p1", None, 0.0, "layer")]]
    # a kernel-spec row runs tokamax with JMC_TOKAMAX_IMPL set for it alone: its config reached
    # tokamax (and no other row's), and the probe says the kernel took it for both GEMMs; the
    # plain tokamax row keeps tokamax's own choice off sm90 (the tile rule's architecture)
    assert [r["tokamax_impl"] for r in plain] == [None, None, None, "mosaic:m128p1"]
    assert plain[3]["expert_gemm_resolved"] == "tokamax"
    asked = set(spec_log.read_text().splitlines())
    assert asked == {"block_m=128 block_n=64 persistent=True"}, asked
    assert plain[3]["tokamax_spec_probe"] == {"w_in": "spec", "w_out": "spec"}, plain[3]
    assert "tokamax_spec_probe" not in plain[2]
    for r in plain:
        assert r["status"] == "ok", r
        for key in ("loop_us", "comm_us", "step_us", "weight_read_us", "floor_us", "ratio"):
            assert finite(r[key]) and r[key] > 0, (key, r)
        assert r["ok"] == (r["ratio"] <= 1.5)
        assert r["ratio"] == pytest.approx(r["loop_us"] / r["floor_us"], rel=1e-2)
        pb = r["peak_bytes"]
        assert all(isinstance(pb[k], int) for k in ("temp", "argument", "output", "alias"))
        assert pb["peak"] == pb["argument"] + pb["output"] + pb["temp"] - pb["alias"] > 0
        assert r["finite"] is True and r["correct"] is True and r["err"] <= 0.05, r
        # the busiest rank's rows over the mean, at the loop's first and last layer input
        assert 1.0 <= r["load_first"] < 8 and 1.0 <= r["load_last"] < 8, r
    assert plain[0]["err"] == 0.0  # the reference itself
    # comm is timed again for every row; comm_first_us is its handle's first row's figure
    assert plain[1]["comm_first_us"] == plain[1]["comm_us"]
    assert plain[2]["comm_first_us"] == plain[3]["comm_first_us"] == plain[1]["comm_us"]
    assert plain[0]["comm_first_us"] == plain[0]["comm_us"]
    assert run_["capacity_support"] is True and run_["expert_capacity_support"] is True
    skew = rows[("packed", "tokamax", 1.25, 0.9, "layer")]
    fail = rows[("packed", "tokamax", 1.25, 0.9, "fail_check")]
    assert skew["status"] == "ok" and skew["dropped_rows"] > 0 and skew["finite"] is True
    # the skew pushes every rank's 4 tokens (ceil(0.9 * 4)) toward experts 0..3, ranks 0 and 1
    # of 8 (2 experts a rank): at most 4x the mean there
    assert 3.0 <= skew["load_first"] <= 4.0 and skew["load_first"] > plain[2]["load_first"], \
        (skew, plain[2])
    assert fail["fail_raised"] is True, fail
    assert not any(r["layout"] == "padded" and r["capacity_factor"] for r in run_["rows"])
    md = (out / "smoke.md").read_text()
    assert "| tiny | 4 | padded | einsum |" in md and "## Goals" in md
    assert f"| {plain[0]['load_first']:.2f} -> {plain[0]['load_last']:.2f} |" in md
    if run_.get("png") == "smoke.png":
        assert (out / "smoke.png").stat().st_size > 1000
    # --replot redraws the report from the JSON alone (the GPU machine may lack matplotlib)
    (out / "smoke.md").unlink()
    run([LAYER, "--replot", str(out / "smoke.json")], fake_site, tmp_path)
    assert (out / "smoke.md").read_text() == md


def test_layer_capacity_rows(tmp_path, fake_site):
    """The capacity rows alone on the real API, in plan order: the padded einsum at
    expert_capacity = rows_per_expert_for(1.25), the packed rows at max_recv_rows =
    recv_rows_for(1.25), the padded skew rows; dropped rows are read back (a skewed layer
    drops on rank 0), overflow="fail" must raise CapacityExceededError."""
    out = tmp_path / "out"
    run([LAYER, "--configs", "tiny", "--tokens", "", "--capacity-configs", "tiny",
         "--capacity-tokens", "4", "--capacity-gemm", "einsum", "--skew", "0.9",
         "--budget-s", "200", "--name", "smoke", "--out", str(out), *FAST], fake_site, tmp_path)
    run_ = layer_json(out)
    assert run_["capacity_support"] is True and run_["expert_capacity_support"] is True
    rows = run_["rows"]
    assert [(r["layout"], r["skew"], r["kind"], r["overflow"]) for r in rows] == [
        ("padded", 0.0, "layer", "drop"),
        ("packed", 0.0, "layer", "drop"), ("packed", 0.9, "layer", "drop"),
        ("packed", 0.9, "fail_check", "fail"),
        ("padded", 0.9, "layer", "drop"), ("padded", 0.9, "fail_check", "fail")]
    for r in rows:
        assert r["status"] == "ok", r
        if r["kind"] == "fail_check":
            assert r["fail_raised"] is True and "CapacityExceededError" in r["raised"], r
            continue
        assert finite(r["loop_us"]) and r["finite"] is True, r
        assert r["capacity_factor"] == 1.25
        if r["layout"] == "packed":  # 1.25 x 4 tokens x k=4 rows
            assert r["max_recv_rows"] == 24 and r["expert_capacity"] is None
        else:  # 1.25 x (8 ranks x 4 tokens x k=4 / 16 experts) rows per expert, up to 16
            assert r["expert_capacity"] == 16 < r["max_recv_tokens"] == 32
            assert r["max_recv_rows"] is None
        if r["skew"]:
            assert r["dropped_rows"] > 0 and max(r["dropped_rows_one_layer"]) > 0, r
    assert "einsum (expert_capacity 16 of 32)" in (out / "smoke.md").read_text()


def _plan(site, tmp_path, *args, runner=None):
    script = [os.path.join(site, runner), LAYER] if runner else [LAYER]
    out = run([*script, "--plan", *args], site, tmp_path)
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def test_default_plan_puts_the_padded_capacity_rows_first(tmp_path, fake_site):
    """gpu_final's layer step (--tokens 1..4096): the padded einsum with expert_capacity at R1
    128 right after the decode rows, its prefill sizes before every plain prefill row; on a
    build without the capacity arguments the capacity rows say what they wanted and run the
    worst case."""
    rows = _plan(fake_site, tmp_path, "--tokens", "1,16,128,512,1024,2048,4096")
    key = [(r["config"], r["tokens"], r["layout"], r["gemm"], r["capacity"], r["skew"],
            r["kind"]) for r in rows]
    first_cap = next(i for i, r in enumerate(rows) if r["capacity"])
    assert key[first_cap] == ("R1", 128, "padded", "einsum", 1.25, 0.0, "layer")
    assert all(r["phase"] == "decode" and not r["capacity"] for r in rows[:first_cap])
    padded_cap = [k[1] for k in key if k[2:5] == ("padded", "einsum", 1.25) and not k[5]]
    assert padded_cap == [128, 512, 1024, 2048, 4096]
    first_plain_prefill = next(i for i, r in enumerate(rows) if r["phase"] == "prefill"
                               and not r["capacity"] and not r["skew"])
    last_padded_cap = max(i for i, k in enumerate(key) if k[2:5] == ("padded", "einsum", 1.25))
    assert last_padded_cap < first_plain_prefill
    assert ("R1", 4096, "padded", "einsum", 1.25, 0.9, "fail_check") in key
    old = _plan(fake_site, tmp_path, "--tokens", "128", runner="no_capacity_runner.py")
    capped = [r for r in old if r["wanted"]]
    assert capped and all(r["capacity"] == 0 for r in capped)
    assert {r["layout"] for r in capped} == {"padded", "packed"}


def test_gemm_smoke_diagnoses_a_wrong_kernel(tmp_path, fake_site):
    """bench_gemm's tokamax variants, each output's error, the group sizes, and the bad-row
    diagnosis: the stand-in's "mosaic" doubles rows 2.. of every group."""
    out = tmp_path / "gemm"
    run([GEMM, "--cpu-smoke", "--tokens", "4", "--options",
         "einsum,tokamax_unfused,tokamax_mosaic,tokamax_triton", "--out", str(out)],
        fake_site, tmp_path)
    with open(out / "gemm.json") as f:
        got = json.load(f)
    rows = {r["option"]: r for r in got["rows"]}
    assert got["meta"]["tokamax"] == "0.0.0+stand-in"
    assert "mosaic" in got["meta"]["tokamax_implementations"]
    good, bad = rows["tokamax_unfused"], rows["tokamax_mosaic"]
    for r in (good, bad):
        assert finite(r["fwd_us"]) and finite(r["fwd_bwd_us"])
        for key in ("err_y", "err_y_fb", "err_dx", "err_dw_in", "err_dw_out"):
            assert finite(r[key]), (key, r)
        assert sum(r["group_sizes"]) == r["live_rows"]
        assert r["group_min"] == min(r["group_sizes"]) and r["group_max"] == max(r["group_sizes"])
    assert good["correct"] is True and good["bad_rows_y"] == 0 and good["bad_experts_y"] == []
    expected = sum(max(0, g - 2) for g in bad["group_sizes"])
    assert expected > 0, "the case needs a group of 3 or more rows"
    assert bad["correct"] is False and bad["err_y"] > 0.5 and bad["bad_rows_y"] == expected
    assert all(e[3] == 2 for e in bad["bad_experts_y"])  # first bad row: the third of the group
    assert "worst:" in bad["error"]
    assert "Unknown implementation" in rows["tokamax_triton"]["error"]
    assert "| y | y (fwd+bwd) | d x | d w_in | d w_out |" in (out / "gemm.md").read_text()


def test_capacity_gemm_list_gives_a_capacity_row_per_option(tmp_path, fake_site):
    """--capacity-gemm a,b: one packed capacity row per option (each spec its own row); the
    skew and fail rows run the first option only."""
    rows = _plan(fake_site, tmp_path, "--tokens", "", "--capacity-configs", "V2Lite",
                 "--capacity-tokens", "128", "--padded-capacity-tokens=",
                 "--capacity-gemm", "tokamax@m128,tokamax")
    packed = [(r["gemm"], r["skew"], r["kind"]) for r in rows if r["layout"] == "packed"]
    assert packed == [("tokamax@m128", 0.0, "layer"), ("tokamax", 0.0, "layer"),
                      ("tokamax@m128", 0.9, "layer"), ("tokamax@m128", 0.9, "fail_check")]


def test_row_bucket_rows_run_on_packed_rows_only(tmp_path, fake_site):
    """--expert-gemm tokamax~0.5/1: MoELayerConfig(gemm_row_buckets=(0.5, 1.0)) on the packed
    layout alone (buckets cut packed rows); the row records its buckets, runs and is right.
    With --loop-input first (each looped layer on the first input, as bucket rows are
    compared on the GPU), recorded in the run's metadata."""
    rows = _plan(fake_site, tmp_path, "--configs", "tiny", "--tokens", "4", "--layouts",
                 "padded,packed", "--expert-gemm", "einsum,tokamax~0.5/1", "--capacity-factor",
                 "0", "--skew", "0")
    assert [(r["layout"], r["gemm"]) for r in rows] == [
        ("padded", "einsum"), ("packed", "einsum"), ("packed", "tokamax~0.5/1")]
    out = tmp_path / "out"
    run([LAYER, "--configs", "tiny", "--tokens", "4", "--layouts", "padded,packed",
         "--expert-gemm", "einsum,tokamax~0.5/1", "--capacity-factor", "0", "--skew", "0",
         "--loop-input", "first", "--name", "smoke", "--out", str(out), *FAST], fake_site,
        tmp_path)
    assert layer_json(out)["loop_input"] == "first"
    reference, _, row = layer_json(out)["rows"]  # (the padded einsum: the others' reference)
    assert reference["gemm_row_buckets"] is None and reference["err"] == 0.0
    assert row["gemm_row_buckets"] == [0.5, 1.0] and row["expert_gemm_resolved"] == "tokamax"
    assert row["status"] == "ok" and row["correct"] is True and row["err"] <= 0.05, row


def plan_fails(tmp_path, fake_site, *args) -> str:
    env = child_env()
    env["PYTHONPATH"] = os.pathsep.join([fake_site] + [p for p in [env.get("PYTHONPATH")] if p])
    r = subprocess.run([sys.executable, LAYER, "--plan", *args], env=env, capture_output=True,
                       text=True, timeout=240, cwd=str(tmp_path))
    assert r.returncode != 0, r.stdout[-2000:]
    return r.stderr


@pytest.mark.parametrize("entry,why", [("tokamax~", "capacity factors joined by '/'"),
                                       ("tokamax~1.25/x", "capacity factors joined by '/'"),
                                       ("tokamax~0", "finite number > 0"),
                                       ("einsum~1.25", "need packed rows")])
def test_bad_row_bucket_entries_are_refused(tmp_path, fake_site, entry, why):
    assert why in plan_fails(tmp_path, fake_site, "--expert-gemm", entry)


def test_padded_capacity_rows_take_no_buckets(tmp_path, fake_site):
    stderr = plan_fails(tmp_path, fake_site, "--padded-capacity-gemm", "tokamax~1.25")
    assert "row buckets cut packed rows only" in stderr, stderr[-2000:]
