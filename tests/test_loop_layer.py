"""benchmarks/loop_layer.py (issue 47: our layer timed by one clock, its floor) and
benchmarks/layer_compare.py: the slope and floor arithmetic as pure functions, the comparison
table on synthetic rows, and one CPU smoke run of the script (8 emulated devices, the reference
backend, wall clock), so that the script the GPU session runs once cannot rot."""

import dataclasses
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest

from cpu_env import child_env

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
SCRIPT = os.path.join(ROOT, "benchmarks", "loop_layer.py")
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import layer_compare  # noqa: E402
import loop_layer as L  # noqa: E402
from jax_moe_comm.moe import MoELayerConfig  # noqa: E402

# Left out of `scripts/test.sh --quick`: runs the layer loop benchmark end to end.
pytestmark = pytest.mark.slow

HAS_GATED = "gated" in {f.name for f in dataclasses.fields(MoELayerConfig)}


def test_slowest_rank_then_median():
    # [rank][rep]: rep maxima 5, 7, 9 -> median 7
    assert L.slowest_median([[5.0, 1.0, 9.0], [2.0, 7.0, 3.0]]) == 7.0


def test_fit_per_layer_and_per_iteration():
    a, b = L.fit_per_layer([(1, 12.0 + 30.0), (4, 12.0 + 120.0), (16, 12.0 + 480.0)])
    assert a == pytest.approx(12.0) and b == pytest.approx(30.0)
    assert L.fit_per_layer([(4, 1.0)]) == (None, None)  # one K: no slope
    assert L.per_iteration([(1, 110.0), (4, 410.0)]) == pytest.approx(100.0)
    # a slope lost in noise (far below t(N)/N) falls back to t(N)/N, an upper bound
    assert L.per_iteration([(1, 400.0), (4, 401.0)]) == pytest.approx(401.0 / 4)
    assert L.per_iteration([]) is None


def test_live_experts_per_rank():
    counts = np.zeros((2, 16), int)  # 2 layers, 16 experts on 4 ranks (4 each)
    counts[0, [0, 1, 2, 5]] = 3  # layer 0: rank 0 has 3 live experts, rank 1 one
    counts[1, [4, 5, 6, 7, 8]] = 1  # layer 1: rank 1 four, rank 2 one
    assert L.live_per_rank(counts, world=4) == [[3, 1, 0, 0], [0, 4, 1, 0]]


def test_weight_floor_is_the_busiest_rank_or_its_gpu_whichever_takes_longer():
    H, F = 2048, 1408
    per = L.expert_bytes(H, F, gated=True)
    assert per == (H * 2 * F + F * H) * 2
    assert L.expert_bytes(H, F, gated=False) == 2 * H * F * 2
    live = [[4, 0, 0, 0], [2, 2, 2, 2]]  # one busy rank, then four even ones
    one_gpu = ["gpu0"] * 4
    # a rank reads 1e11 B/s while all 4 read (the GPU: 4e11), 2e11 alone
    w = L.weight_floors(live, one_gpu, per, 0, bps_rank_all=1e11, bps_alone=2e11)
    busy_alone = [4 * per / 2e11 * 1e6, 2 * per / 2e11 * 1e6]
    gpu = [4 * per / 4e11 * 1e6, 8 * per / 4e11 * 1e6]
    assert w["weight_floor_alone_us"] == pytest.approx(np.mean(busy_alone))
    assert w["weight_floor_gpu_us"] == pytest.approx(np.mean(gpu))
    assert w["weight_floor_us"] == pytest.approx(np.mean([max(a, g) for a, g in
                                                          zip(busy_alone, gpu)]))
    # issue 47's formula: the busiest rank's bytes at the all-at-once rate, whatever the balance
    assert w["weight_floor_busiest_us"] == pytest.approx(3 * per / 1e11 * 1e6)
    assert w["busiest_rank_live_experts"] == 3 and w["weight_bytes_busiest"] == 3 * per
    # even ranks: the floor is that formula, as the issue states it
    even = L.weight_floors([[2, 2, 2, 2]], one_gpu, per, per, 1e11, 1e12)
    assert even["weight_floor_us"] == pytest.approx(even["weight_floor_busiest_us"])
    assert even["weight_bytes_busiest"] == 3 * per  # with one shared expert's weights
    # one rank per GPU: each GPU serves its own rank, the busiest rank's read is the floor
    apart = L.weight_floors(live, ["a", "b", "c", "d"], per, 0, 2e11, 2e11)
    assert apart["weight_floor_us"] == pytest.approx(np.mean(busy_alone))
    assert L.weight_floors(None, one_gpu, per, 0, 1e11, 2e11)["weight_floor_us"] is None
    no_alone = L.weight_floors(live, one_gpu, per, 0, 1e11, None)
    assert no_alone["weight_floor_us"] == pytest.approx(np.mean(gpu))


def test_floor_is_the_max_of_weights_and_the_cycle():
    fl = L.floors(30.0, 13.0)
    assert fl == dict(weight_floor_us=30.0, comm_floor_us=13.0, floor_us=30.0,
                      floor_sum_us=43.0)
    assert L.floors(30.0, None)["floor_us"] is None  # no floor kernels (CPU): no max
    assert L.floors(None, 13.0)["floor_sum_us"] is None
    assert L.ratio(30.0, 20.0) == 1.5 and L.ratio(30.0, None) is None


def test_symmetric_heap_sizes():
    assert L.symmetric_bytes("2G") == 2**31 and L.symmetric_bytes("512M") == 2**29
    assert L.symmetric_bytes("1048576") == 2**20 and L.symmetric_bytes(None) == 2**30


def test_check_case_shrinks_only_what_does_not_fit():
    assert L.check_dims(L.LAYERS["V2Lite"], 3.0) == L.LAYERS["V2Lite"]
    E, k, H, F = L.check_dims(L.LAYERS["R1"], 3.0)
    assert (E, k) == (256, 8) and H % 128 == 0 and F % 128 == 0
    assert E * H * 3 * F * 4 <= 3 * 2**30 and (H, F) == (1792, 512)  # halved twice


def test_param_shapes_and_rel_err():
    s = L.param_shapes((16, 4, 256, 128), gated=True, shared=2)
    assert s == {"router": (256, 16), "w_in": (16, 256, 256), "w_out": (16, 128, 256),
                 "shared_in": (256, 512), "shared_out": (256, 256)}
    assert "shared_in" not in L.param_shapes((16, 4, 256, 128), gated=False, shared=0)
    ref = np.array([[1.0, -2.0], [10.0, 0.0]])
    assert L.rel_err(ref + [[0.1, 0.0], [0.0, 0.5]], ref) == pytest.approx(0.05)
    assert L.rel_err(np.array([[np.nan, 1.0]]), np.ones((1, 2))) == math.inf


def test_builds_without_the_fields_say_so():
    if HAS_GATED:
        assert L.layer_config(L.LAYERS["tiny"], 4, 2, True).num_shared_experts == 2
    else:
        with pytest.raises(NotImplementedError, match="no gated experts"):
            L.layer_config(L.LAYERS["tiny"], 4, 0, True)


def layer_row(config, tokens, variant, per_layer, **kw):
    return dict(dict(config=config, tokens_per_rank=tokens, variant=variant,
                     num_shared_experts=0, per_layer_us=per_layer), **kw)


def write(path, rows, **header):
    with open(path, "w") as f:
        json.dump(dict(header, rows=rows), f)
    return str(path)


def test_compare_joins_graph_rows_and_marks_the_goals(tmp_path):
    ours = write(tmp_path / "ours.json", [
        layer_row("R1", 1, "graph", 40.0, floor_us=35.0, weight_floor_us=35.0,
                  weight_floor_busiest_us=38.0, comm_floor_us=13.0, correct=True,
                  loop_input="first"),
        layer_row("R1", 1, "fwd+bwd", 150.0, floor_us=35.0, ks=[1, 4],
                  compiled_programs_by_k=[1, 1], recompiles=0),
        layer_row("V2Lite", 4, "graph", 30.0, floor_us=20.0, correct=True,
                  loop_input="output"),
        layer_row("V2Lite", 4, "graph", 99.0),  # a duplicate key: the first row is kept
        layer_row("V2Lite", 16, "graph", None, error="boom")],  # no figure: left out
        commit="abc", gpu="H100", world=8)
    pplx = write(tmp_path / "pplx.json", [
        layer_row("R1", 1, "graph", 60.0, weight_floor_us=33.0, correct=True,
                  method="pplx_torch_layer", loop_input="first"),
        layer_row("V2Lite", 4, "graph", 25.0, method="pplx_torch_layer", loop_input="first")],
        commit="12cecfd")
    out = tmp_path / "cmp.md"
    assert layer_compare.main(str(out), f"ours={ours}", f"pplx={pplx}") == 0
    text = out.read_text()
    lines = [ln for ln in text.splitlines() if ln.startswith("| ")]
    v2 = next(ln for ln in lines if ln.startswith("| V2-Lite | 4 |"))
    r1 = next(ln for ln in lines if ln.startswith("| R1 | 1 | 0 | 40.0"))
    assert v2.startswith("| V2-Lite | 4 | 0 | 30.0 | 25.0 | 1.20 | 20.0 |")
    assert "| no | no |" in v2  # 1.20 > 0.8 and 1.50 > 1.25
    assert r1.startswith("| R1 | 1 | 0 | 40.0 | 60.0 | 0.67 | 35.0 | 35.0 / 38.0 / 13.0 | 33.0 "
                         "| 1.14 | yes | yes |")
    # unlike layer inputs are called out (V2-Lite: ours chained, the peer's the first x)
    assert "**Layer inputs differ**" in text and "V2-Lite 4: output / first" in text
    assert "R1 1:" not in text.split("**Layer inputs differ**")[1]
    assert not any(ln.startswith("| V2-Lite | 16 |") for ln in lines)
    assert "| R1 | 1 | 0 | 150.0 | 40.0 | 3.75 | 35.0 | K=1: 1, K=4: 1 | 0 |" in text
    assert layer_compare.main(str(out), f"ours={ours}") == 2  # pplx is required


def test_smoke_run_on_cpu(tmp_path):
    """The whole script, tiny config, 4 tokens, K = 1, 2, one repetition: every row written,
    timed by the wall clock, checked against the oracle, with its floor fields."""
    out = tmp_path / "layer_ours.json"
    env = child_env()
    cmd = [sys.executable, SCRIPT, "--configs", "tiny", "--tokens", "4", "--ks", "1,2",
           "--reps", "1", "--warmup", "0", "--hbm-n", "2", "--out", str(out)]
    if not HAS_GATED:  # this build's layer has no gated experts: time the plain ones
        cmd.append("--ungated")
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env,
                       cwd=str(tmp_path), check=False)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    run = json.loads(out.read_text())
    assert run["finished"] and run["clock"] == "wall" and run["world"] == 8
    assert run["backend"] == "reference" and run["expert_gemm"] == "einsum"
    rows = run["rows"]
    assert [r["variant"] for r in rows] == ["graph", "fwd+bwd"]
    for row in rows:
        assert row["status"] == "ok", row
        assert row["method"] == "jax_moe_comm_layer" and row["dispatch_dtype"] == "fp8_e4m3"
        assert row["layout"] == "packed" and row["clock"] == "wall"
        assert row["ks"] == [1, 2] and len(row["elapsed_us"]) == 2
        assert all(math.isfinite(v) and v > 0 for v in row["elapsed_us"])
        assert math.isfinite(row["per_layer_us"]) and math.isfinite(row["intercept_us"])
        # one XLA program per K, the same for every K, none compiled again by later calls
        assert row["compiled_programs_by_k"] == [1, 1] and row["recompiles"] == 0
        assert row["correct"] is True and row["max_rel_err"] <= 3e-2, row
        assert row["oracle"] == ("layer_oracle" if HAS_GATED and os.path.exists(
            os.path.join(ROOT, "benchmarks", "layer_oracle.py")) else "moe.dense_forward")
        assert 1 <= row["busiest_rank_live_experts"] <= row["local_experts"]
        assert len(row["live_experts_per_rank"]) == 2  # the chain's two layer inputs
        assert row["hbm_bytes_per_s"] > 0 and row["hbm_bytes_per_s_alone"] > 0
        assert row["weight_floor_us"] > 0 and row["weight_floor_busiest_us"] > 0
        assert row["comm_floor_us"] is None and row["floor_us"] is None  # no floor kernels
    assert rows[1]["loop_input"] == "output"
