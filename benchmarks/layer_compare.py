"""Our MoE layer beside the peer layer, by one clock: loop_layer.py's rows and layer_pplx.py's.

    python benchmarks/layer_compare.py OUT.md ours=layer_ours.json pplx=layer_pplx.json

Both tools time K layers back to back in one recorded graph between two CUDA events and fit
elapsed = a + per_layer * K (max over ranks, median over repetitions). Rows are joined by
(config, tokens per rank, variant "graph", shared experts); the table gives per_layer_us of
each, ours / pplx, our floor (max of the busiest rank's live expert weights read once and the
data-free cycle, both measured in our run) with the peer's own weight floor beside it, ours /
floor, and the goal marks (ours / pplx <= 0.8, ours / floor <= 1.25). Our forward + backward
rows follow (the peer has no backward). Writes OUT.md and, with matplotlib, OUT.png.
"""

from __future__ import annotations

import json
import os
import sys

CONFIG_NAMES = {"V2Lite": "V2-Lite", "R1": "R1"}
GOAL_PEER, GOAL_FLOOR = 0.8, 1.25  # issue 47: ours / pplx, ours / floor


def load(path: str) -> tuple[dict, dict]:
    """({(config, tokens, variant, shared): row}, the run's header) of one layer JSON: rows
    with a per_layer_us only, the first of a key kept."""
    with open(path) as f:
        run = json.load(f)
    out = {}
    for r in run.get("rows", []):
        if r.get("per_layer_us") is None:
            continue
        key = (r["config"], r["tokens_per_rank"], r.get("variant", "graph"),
               r.get("num_shared_experts") or 0)
        out.setdefault(key, r)
    return out, run


def fmt(v, nd=1) -> str:
    return "" if v is None else f"{v:.{nd}f}"


def ratio(a, b):
    return None if a is None or not b else a / b


def mark(v, goal) -> str:
    return "" if v is None else ("yes" if v <= goal else "no")


def order(key):
    return (key[0] != "V2Lite", key[0], key[3], key[1])


def table(ours: dict, pplx: dict) -> list[str]:
    head = ["config", "tokens", "shared", "ours µs/layer", "pplx µs/layer", "ours / pplx",
            "floor µs (ours)", "weights / issue formula / comm µs", "pplx weight floor µs",
            "ours / floor",
            f"ours/pplx <= {GOAL_PEER}", f"ours/floor <= {GOAL_FLOOR}", "correct (ours, pplx)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for key in sorted((k for k in ours if k[2] == "graph"), key=order):
        o, p = ours[key], pplx.get(key)
        op = ratio(o["per_layer_us"], p and p["per_layer_us"])
        of = ratio(o["per_layer_us"], o.get("floor_us"))
        cells = [CONFIG_NAMES.get(key[0], key[0]), str(key[1]), str(key[3]),
                 fmt(o["per_layer_us"]), fmt(p and p["per_layer_us"]), fmt(op, 2),
                 fmt(o.get("floor_us")),
                 f"{fmt(o.get('weight_floor_us'))} / {fmt(o.get('weight_floor_busiest_us'))} / "
                 f"{fmt(o.get('comm_floor_us'))}",
                 fmt(p and p.get("weight_floor_us")), fmt(of, 2), mark(op, GOAL_PEER),
                 mark(of, GOAL_FLOOR), f"{o.get('correct')}, {p and p.get('correct')}"]
        lines.append("| " + " | ".join(cells) + " |")
    unlike = sorted({(k[0], k[1]) for k in ours if k[2] == "graph" and k in pplx and
                     ours[k].get("loop_input") != pplx[k].get("loop_input")})
    if unlike:  # chained inputs route unevenly (busiest rank 1.2-1.3x the mean): not alike
        lines += ["", "**Layer inputs differ** (ours / pplx loop_input) at " + ", ".join(
            f"{CONFIG_NAMES.get(c, c)} {t}: {ours[(c, t, 'graph', 0)].get('loop_input')} / "
            f"{pplx[(c, t, 'graph', 0)].get('loop_input')}" for c, t in unlike
            if (c, t, "graph", 0) in ours and (c, t, "graph", 0) in pplx)
            + ": run both with the same --loop-input."]
    return lines


def training_table(ours: dict) -> list[str]:
    head = ["config", "tokens", "shared", "fwd+bwd µs/layer", "forward µs/layer",
            "fwd+bwd / forward", "floor µs (forward's)", "compiled programs by K", "recompiles"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for key in sorted((k for k in ours if k[2] == "fwd+bwd"), key=order):
        o, fwd = ours[key], ours.get((key[0], key[1], "graph", key[3]))
        f = fwd and fwd["per_layer_us"]
        cells = [CONFIG_NAMES.get(key[0], key[0]), str(key[1]), str(key[3]),
                 fmt(o["per_layer_us"]), fmt(f), fmt(ratio(o["per_layer_us"], f), 2),
                 fmt(o.get("floor_us")),
                 ", ".join(f"K={k}: {n}" for k, n in zip(o.get("ks", []),
                                                          o.get("compiled_programs_by_k", []))),
                 str(o.get("recompiles", ""))]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def plot(path: str, ours: dict, pplx: dict) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib missing: no plot"
    configs = [c for c in ("V2Lite", "R1") if any(k[0] == c for k in ours)] or \
        sorted({k[0] for k in ours})
    if not configs:
        return "no rows: no plot"
    fig, axes = plt.subplots(1, len(configs), figsize=(5.5 * len(configs), 4), squeeze=False)
    for ax, config in zip(axes[0], configs):
        for label, data, variant, field, style in (
                ("ours graph", ours, "graph", "per_layer_us", "o-"),
                ("pplx graph", pplx, "graph", "per_layer_us", "s-"),
                ("ours fwd+bwd", ours, "fwd+bwd", "per_layer_us", "^-"),
                ("floor (ours)", ours, "graph", "floor_us", "k--")):
            for shared in sorted({k[3] for k in data if k[0] == config}):
                pts = sorted((k[1], r[field]) for k, r in data.items()
                             if k[0] == config and k[2] == variant and k[3] == shared
                             and r.get(field) is not None)
                if pts:
                    ax.plot(*zip(*pts), style, label=label + (f" S={shared}" if shared else ""))
        ax.set(title=f"{CONFIG_NAMES.get(config, config)}: MoE layer (CUDA events, slope over K)",
               xlabel="tokens per rank", ylabel="µs per layer", xscale="log", yscale="log")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return os.path.basename(path)


def main(out_md: str, *labelled: str) -> int:
    runs = dict(arg.split("=", 1) for arg in labelled if "=" in arg)
    if "ours" not in runs or "pplx" not in runs:
        print("need ours=JSON and pplx=JSON", file=sys.stderr)
        return 2
    (ours, om), (pplx, pm) = load(runs["ours"]), load(runs["pplx"])
    lines = ["# The MoE layer per layer (µs, slope over K), one clock for both", "",
             f"ours: commit {om.get('commit')}, {om.get('date')}, expert_gemm "
             f"{om.get('expert_gemm')}, clock {om.get('clock')}, layer inputs "
             f"{om.get('loop_input')}; pplx: commit {str(pm.get('commit'))[:7]}, "
             f"{pm.get('date')}; GPU {om.get('gpu')}, {om.get('world')} ranks (MPS share "
             f"{om.get('mps_share')} %)", "",
             "floor: max(weights, the data-free dispatch + combine cycle); weights: per layer "
             "max(the busiest rank's live experts' weights at one rank's HBM rate alone, every "
             "rank's on the GPU at their all-at-once rate); the issue formula (the busiest "
             "rank's at the all-at-once rate, the peer's weight floor) beside it. Goals: "
             "ours / pplx <= 0.8 and ours / floor <= 1.25.", ""]
    lines += table(ours, pplx)
    if any(k[2] == "fwd+bwd" for k in ours):
        lines += ["", "## Forward + backward (ours; value_and_grad w.r.t. x and the expert "
                  "weights)", ""] + training_table(ours)
    lines += ["", f"plot: {plot(os.path.splitext(out_md)[0] + '.png', ours, pplx)}"]
    with open(out_md, "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
