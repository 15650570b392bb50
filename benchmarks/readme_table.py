"""The README's headline table, from one device call's loop JSONs (ours and pplx-kernels).

    python benchmarks/readme_table.py DIR/loop_ours.json DIR/loop_pplx.json [DIR/loop_old.json]

Each cell is the steady per-cycle cost of dispatch + combine, µs: the slope over K of K
back-to-back cycles timed by CUDA events (bench_loop.py for ours, shared/peer/loop_pplx.py for
pplx-kernels; loop_compare.py has every variant).
"""

from __future__ import annotations

import sys

from loop_compare import CONFIG_NAMES, fmt, ratio, slopes  # benchmarks/loop_compare.py


def table(ours_path: str, pplx_path: str, old_path: str | None = None) -> list[str]:
    ours, _ = slopes(ours_path)
    pplx, _ = slopes(pplx_path)
    old = slopes(old_path)[0] if old_path else {}
    old_commit = slopes(old_path)[1].get("commit") if old_path else None
    head = ("| config | tokens | ours µs/cycle | pplx-kernels µs/cycle | ours / pplx | "
            "ours, barrier per cycle | pplx, barrier per cycle | ours / pplx |")
    lines = [head + (f" {old_commit} µs/cycle |" if old else ""),
             "|---|---|---|---|---|---|---|---|" + ("---|" if old else "")]
    cases = sorted({(c, t) for c, t, _ in ours}, key=lambda ct: (ct[0] != "V2Lite", ct[1]))
    for c, t in cases:
        og, ob = ours.get((c, t, "graph")), ours.get((c, t, "graph+barrier"))
        pg, pb = pplx.get((c, t, "graph")), pplx.get((c, t, "graph+barrier"))
        row = (f"| {CONFIG_NAMES.get(c, c)} | {t} | {fmt(og)} | {fmt(pg)} | {ratio(og, pg)} | "
               f"{fmt(ob)} | {fmt(pb)} | {ratio(ob, pb)} |")
        lines.append(row + (f" {fmt(old.get((c, t, 'graph')))} |" if old else ""))
    return lines


if __name__ == "__main__":
    print("\n".join(table(*sys.argv[1:])))
