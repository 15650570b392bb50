"""Per-cycle cost by one clock: our loop rows (bench_loop.py) beside pplx-kernels' (loop_pplx.py).

    python benchmarks/loop_compare.py OUT.md ours=loop_ours.json pplx=loop_pplx.json \
        [8a9226e=loop_old.json ...]

Both tools time K back-to-back dispatch + combine cycles with CUDA events and fit elapsed =
a + b * K; the table gives b (µs per cycle, max over ranks, median over repetitions) for each
variant, and the ratios ours / pplx for the recorded loop (ours `graph` against pplx `graph`)
and with a barrier per cycle (`graph+barrier` against `graph+barrier`). Writes OUT.md and, with
matplotlib, OUT.png. The first label is "ours"; any other label not "pplx" is another build of
ours (an older commit) and gets its own columns.
"""

from __future__ import annotations

import json
import os
import sys

CONFIG_NAMES = {"V2Lite": "V2-Lite", "R1": "R1"}


def slopes(path: str) -> tuple[dict, dict]:
    """({(config, tokens, variant): b}, the run's header) of one loop JSON (either tool)."""
    with open(path) as f:
        run = json.load(f)
    out = {}
    for r in run["rows"]:
        if r.get("fit_event_b_us") is not None:
            out[(r["config"], r["tokens_per_rank"], r["variant"])] = r["fit_event_b_us"]
    return out, run


def fmt(v) -> str:
    return "" if v is None else f"{v:.1f}"


def ratio(a, b) -> str:
    return "" if a is None or b is None else f"{a / b:.2f}"


def main(out_md: str, *labelled: str) -> int:
    runs = dict(arg.split("=", 1) for arg in labelled)
    if "ours" not in runs or "pplx" not in runs:
        print("need ours=JSON and pplx=JSON", file=sys.stderr)
        return 2
    data = {label: slopes(path) for label, path in runs.items()}
    others = [label for label in runs if label not in ("ours", "pplx")]
    ours, pplx = data["ours"][0], data["pplx"][0]
    cases = sorted({(c, t) for c, t, _ in ours}, key=lambda ct: (ct[0] != "V2Lite", ct[1]))
    head = ["config", "tokens", "ours graph", "pplx graph", "ours / pplx graph", "ours +barrier",
            "pplx graph+barrier", "ours / pplx (+barrier)", "pplx eager"]
    head += [f"{label} graph" for label in others] + [f"ours / {label}" for label in others]
    lines = ["# dispatch + combine per cycle (µs, slope over K), one clock for both", "",
             f"ours: commit {data['ours'][1].get('commit')}, {data['ours'][1].get('date')}; "
             f"pplx-kernels @{str(data['pplx'][1].get('commit'))[:7]}, "
             f"{data['pplx'][1].get('date')}; GPU {data['ours'][1].get('gpu')}, "
             f"{data['ours'][1].get('world')} ranks (MPS share "
             f"{data['ours'][1].get('mps_share')} %)", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for c, t in cases:
        og, ob = ours.get((c, t, "graph")), ours.get((c, t, "graph+barrier"))
        pg, pb = pplx.get((c, t, "graph")), pplx.get((c, t, "graph+barrier"))
        cells = [CONFIG_NAMES.get(c, c), str(t), fmt(og), fmt(pg), ratio(og, pg), fmt(ob),
                 fmt(pb), ratio(ob, pb), fmt(pplx.get((c, t, "eager")))]
        olds = [data[label][0].get((c, t, "graph")) for label in others]
        cells += [fmt(v) for v in olds] + [ratio(og, v) for v in olds]
        lines.append("| " + " | ".join(cells) + " |")
    with open(out_md, "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plot")
        return 0
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    series = [("ours", "graph"), ("ours", "graph+barrier"), ("pplx", "graph"),
              ("pplx", "graph+barrier"), ("pplx", "eager")] + [(o, "graph") for o in others]
    for ax, config in zip(axes, ("V2Lite", "R1")):
        for label, variant in series:
            pts = sorted((t, b) for (c, t, v), b in data[label][0].items()
                         if c == config and v == variant)
            if pts:
                ax.plot(*zip(*pts), marker="o", label=f"{label} {variant}")
        ax.set(title=f"{CONFIG_NAMES[config]}: per-cycle cost (CUDA events, slope over K)",
               xlabel="tokens per rank", ylabel="µs per dispatch + combine", xscale="log",
               yscale="log")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.splitext(out_md)[0] + ".png", dpi=110)
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
