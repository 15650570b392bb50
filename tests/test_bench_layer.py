"""CPU smoke runs of benchmarks/bench_layer.py and benchmarks/bench_gemm.py (issue 24), so that
the scripts the GPU session runs once cannot rot between sessions: tiny shapes, 8 emulated
devices, the reference backend, a few samples; the JSON must hold the fields with finite numbers.

tokamax needs Python >= 3.12 (not this venv): a stand-in package (jax.lax.ragged_dot behind
tokamax's ragged_dot signature, with implementation="mosaic" deliberately wrong from the third
row of every group on) checks the tokamax rows' plumbing and that bench_gemm's per-output errors
and bad-row diagnosis catch a wrong kernel. The capacity rows run against a stand-in of the
capacity API (max_recv_rows/overflow, dropped_rows(), CapacityExceededError) until the real one
lands."""

import json
import math
import os
import subprocess
import sys

import pytest

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
LAYER = os.path.join(ROOT, "benchmarks", "bench_layer.py")
GEMM = os.path.join(ROOT, "benchmarks", "bench_gemm.py")
FAST = ["--samples", "2", "--target-ms", "2", "--max-loop", "3", "--step-calls", "2"]

FAKE_TOKAMAX = '''
"""A stand-in for tokamax's ragged_dot API (tests only)."""
import jax
import jax.numpy as jnp

__version__ = "0.0.0+stand-in"
IMPLEMENTATIONS = {"xla": None, "mosaic_gpu": None}


def ragged_dot(lhs, rhs, group_sizes, precision=None, preferred_element_type=None,
               group_offset=None, activation=None, manual_axis_type=None, *,
               implementation=None, **kwargs):
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
'''

CAPACITY_RUNNER = '''
import math, runpy, sys
import jax_moe_comm
from jax_moe_comm import config, errors

class CapacityExceededError(errors.MoECommError):
    pass

errors.CapacityExceededError = CapacityExceededError
Base = jax_moe_comm.AllToAll

class CapacityAllToAll(Base):  # the API only: buffers stay worst-case, nothing is dropped
    def __init__(self, config, *, max_recv_rows=None, overflow="fail", **kw):
        super().__init__(config, **kw)
        self.max_recv_rows, self.overflow = max_recv_rows, overflow

    def dropped_rows(self):
        return 3 if self.overflow == "drop" else 0

    def check(self):
        super().check()
        if self.max_recv_rows is not None and self.overflow == "fail":
            raise CapacityExceededError("stand-in: more rows than max_recv_rows")

jax_moe_comm.AllToAll = CapacityAllToAll
config.MoEConfig.recv_rows_for = lambda self, cf: int(
    math.ceil(cf * self.max_num_tokens * self.experts_per_token))
script = sys.argv[1]
sys.argv = sys.argv[1:]
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
    (site / "capacity_runner.py").write_text(CAPACITY_RUNNER)
    return str(site)


def run(cmd, site, tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
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


def test_layer_smoke(tmp_path, fake_site):
    out = tmp_path / "out"
    run([LAYER, "--configs", "tiny", "--tokens", "4", "--layouts", "padded,packed",
         "--expert-gemm", "einsum,tokamax", "--capacity-configs", "tiny", "--capacity-tokens",
         "4", "--skew", "0.9", "--commit", "smoke123", "--name", "smoke", "--out", str(out),
         *FAST], fake_site, tmp_path)
    run_ = layer_json(out)
    for key in ("gpu", "jax", "date", "command", "world", "ranks_per_gpu", "weights",
                "capacity_support"):
        assert key in run_, key
    assert run_["commit"] == "smoke123" and run_["world"] == 8 and run_["finished"] is True
    w = run_["weights"]["tiny"]
    assert finite(w["read_us"]) and finite(w["copy_us"]) and finite(w["nominal_us"])
    rows = {(r["layout"], r["expert_gemm"], r["skew"], r["kind"]): r for r in run_["rows"]}
    plain = [rows[("padded", "einsum", 0.0, "layer")], rows[("packed", "einsum", 0.0, "layer")],
             rows[("packed", "tokamax", 0.0, "layer")]]
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
    assert plain[0]["err"] == 0.0  # the reference itself
    skew = rows[("packed", "tokamax", 0.9, "layer")]
    fail = rows[("packed", "tokamax", 0.9, "fail_check")]
    if run_["capacity_support"]:  # the real capacity API has landed
        assert skew["status"] == "ok" and isinstance(skew["dropped_rows"], int)
        assert fail["fail_raised"] is True
    else:
        assert skew["status"] == "ok" and "not supported" in skew["note"]
        assert finite(skew["loop_us"]) and skew["finite"] is True
        assert fail["status"] == "skipped" and "not supported" in fail["error"]
    md = (out / "smoke.md").read_text()
    assert "| tiny | 4 | padded | einsum |" in md and "## Goals" in md
    if run_.get("png") == "smoke.png":
        assert (out / "smoke.png").stat().st_size > 1000
    # --replot redraws the report from the JSON alone (the GPU machine may lack matplotlib)
    (out / "smoke.md").unlink()
    run([LAYER, "--replot", str(out / "smoke.json")], fake_site, tmp_path)
    assert (out / "smoke.md").read_text() == md


def test_layer_capacity_rows(tmp_path, fake_site):
    """Capacity rows through a stand-in of the capacity API: the handle gets max_recv_rows and
    overflow, dropped rows are read back, overflow="fail" must raise CapacityExceededError."""
    out = tmp_path / "out"
    run([os.path.join(fake_site, "capacity_runner.py"), LAYER, "--configs", "tiny",
         "--tokens", "", "--capacity-configs", "tiny", "--capacity-tokens", "4",
         "--capacity-gemm", "einsum", "--skew", "0.9", "--budget-s", "200", "--name", "smoke",
         "--out", str(out), *FAST], fake_site, tmp_path)
    run_ = layer_json(out)
    assert run_["capacity_support"] is True
    rows = run_["rows"]
    assert [(r["skew"], r["kind"], r["overflow"]) for r in rows] == [
        (0.0, "layer", "drop"), (0.9, "layer", "drop"), (0.9, "fail_check", "fail")]
    for r in rows[:2]:
        assert r["status"] == "ok", r
        assert r["capacity_factor"] == 1.25 and r["max_recv_rows"] == math.ceil(1.25 * 4 * 4)
        assert r["dropped_rows"] == 3 and r["dropped_rows_one_layer"] == [0]
        assert finite(r["loop_us"]) and r["finite"] is True
    assert rows[2]["status"] == "ok" and rows[2]["fail_raised"] is True
    assert "CapacityExceededError" in rows[2]["raised"]


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
