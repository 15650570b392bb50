"""benchmarks/: the loop benchmark's line fit, and the one-clock table beside pplx-kernels'."""

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
from bench_common import fit_line  # noqa: E402
from loop_compare import main as compare_main  # noqa: E402
from readme_table import table  # noqa: E402


def test_fit_line_recovers_slope_and_intercept():
    a, b = fit_line([(1, 40.0 + 30.0), (10, 40.0 + 300.0), (50, 40.0 + 1500.0)])
    assert a == pytest.approx(40.0) and b == pytest.approx(30.0)
    assert fit_line([(10, 1.0), (10, 2.0)]) == (None, None)  # one K: no slope
    assert fit_line([(1, None), (10, 5.0)]) == (None, None)  # missing points are dropped


def loop_json(path, rows, **header):
    with open(path, "w") as f:
        json.dump(dict(header, rows=rows), f)
    return str(path)


def row(config, tokens, variant, b):
    return dict(config=config, tokens_per_rank=tokens, variant=variant, K=50, fit_event_b_us=b)


def test_table_ratios_pair_like_variants(tmp_path):
    ours = loop_json(tmp_path / "ours.json", [row("R1", 1, "graph", 30.0),
                                              row("R1", 1, "graph+barrier", 36.0),
                                              row("V2Lite", 1, "graph", 20.0),
                                              row("R1", 1, "per-call", None)],
                     commit="abc", date="d", gpu="H200", world=8, mps_share="12")
    pplx = loop_json(tmp_path / "pplx.json", [row("R1", 1, "graph", 40.0),
                                              row("R1", 1, "graph+barrier", 45.0),
                                              row("R1", 1, "eager", 50.0),
                                              row("V2Lite", 1, "graph", 25.0)],
                     commit="12cecfd", date="d")
    old = loop_json(tmp_path / "old.json", [row("R1", 1, "graph", 60.0)], commit="old1")
    lines = table(ours, pplx, old)
    assert lines[0].endswith("old1 µs/cycle |")
    v2, r1 = lines[2], lines[3]  # V2-Lite sorts first
    assert v2.startswith("| V2-Lite | 1 | 20.0 | 25.0 | 0.80 |")
    # graph against graph, graph+barrier against graph+barrier, old graph last
    assert r1 == "| R1 | 1 | 30.0 | 40.0 | 0.75 | 36.0 | 45.0 | 0.80 | 60.0 |"
    out = tmp_path / "cmp.md"
    assert compare_main(str(out), f"ours={ours}", f"pplx={pplx}", f"old1={old}") == 0
    text = out.read_text()
    assert "| R1 | 1 | 30.0 | 40.0 | 0.75 | 36.0 | 45.0 | 0.80 | 50.0 | 60.0 | 0.50 |" in text
    assert compare_main(str(out), f"ours={ours}") == 2  # pplx is required
