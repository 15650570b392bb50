"""Side-by-side table of benchmark JSONs written in the DESIGN section 8 schema (ours, an older
commit of ours, pplx-kernels from shared/peer), all from one device call.

    python benchmarks/compare.py OUT.md ours.json [label=]other.json ...

Also writes OUT.png (with matplotlib): total µs against tokens per rank, one panel per config,
one line per file's main method. Rows are matched on (config, tokens_per_rank, dispatch_dtype);
each file contributes its dispatch-combine method's total (the slowest rank per sample, median)
and its per-half medians.
"""

from __future__ import annotations

import json
import sys

DENSE = ("nvshmem_dense_a2a", "pplx-nvshmem-dense-a2a")
OURS = "jax_moe_comm_nvshmem"


def load(arg: str):
    """One (label, run, rows) per dispatch/combine method in the file: the main method under the
    file's label, our variants (`jax_moe_comm_nvshmem_split`, `..._blocksN`) under "label split",
    "label blocksN"."""
    label, _, path = arg.rpartition("=")
    with open(path) as f:
        run = json.load(f)
    label = label or run.get("commit", path)
    dense, by_method = {}, {}
    for r in run["rows"]:
        dtype = r["dispatch_dtype"].split("_")[0]  # pplx writes fp8_e4m3, we write fp8
        key = (r["config"], r["tokens_per_rank"], dtype)
        if r["method"] in DENSE:
            dense[key] = r["total_us"]
        elif "expert_padded" not in r["method"]:
            by_method.setdefault(r["method"], {})[key] = dict(r)
    out = []
    variant = lambda m: m.startswith(OURS + "_")  # noqa: E731
    for method, rows in sorted(by_method.items(), key=lambda m: (variant(m[0]), m[0])):
        suffix = method[len(OURS) + 1:] if variant(method) else ""
        for key, r in rows.items():
            r["dense"] = dense.get(key)
        out.append((f"{label} {suffix}".strip(), run, rows))
    return out


def main(argv) -> int:
    out, *inputs = argv
    runs = [r for a in inputs for r in load(a)]
    keys = sorted({k for _, _, rows in runs for k in rows},
                  key=lambda k: (k[0], k[2], k[1]))
    head = ["config", "tokens", "dtype"]
    for label, _, _ in runs:
        head += [f"{label} dispatch / combine µs", f"{label} total µs"]
    head += [f"{runs[0][0]} / {label}" for label, _, _ in runs[1:]]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for key in keys:
        cells = [key[0], str(key[1]), key[2]]
        totals = []
        for _, _, rows in runs:
            r = rows.get(key)
            if r is None or "total_us" not in r:
                cells += ["", ""]
                totals.append(None)
                continue
            cells += [f"{r['dispatch_us']:.1f} / {r['combine_us']:.1f}", f"{r['total_us']:.1f}"]
            totals.append(r["total_us"])
        for t in totals[1:]:
            cells.append(f"{totals[0] / t:.2f}" if totals[0] and t else "")
        lines.append("| " + " | ".join(cells) + " |")
    sources = [f"- {label}: commit {run.get('commit')}, {run.get('date')}, {run.get('gpu')}, "
               f"`{run.get('command')}`" for label, run, _ in runs]
    with open(out, "w") as f:
        f.write("\n".join(sources + [""] + lines) + "\n")
    print("\n".join(lines))
    plot(out.rsplit(".", 1)[0] + ".png", [r for r in runs if " " not in r[0]])
    return 0


def plot(path: str, runs) -> None:
    """Total µs against tokens per rank, fp8 rows, one panel per config, one line per run."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plot")
        return
    configs = sorted({k[0] for _, _, rows in runs for k in rows}, key=lambda c: c != "V2Lite")
    fig, axes = plt.subplots(1, len(configs), figsize=(5.5 * len(configs), 4), squeeze=False)
    for ax, config in zip(axes[0], configs):
        for label, run, rows in runs:
            pts = sorted((k[1], r["total_us"]) for k, r in rows.items()
                         if k[0] == config and k[2] == "fp8" and "total_us" in r)
            if pts:
                ax.plot(*zip(*pts), marker="o", label=f"{label} ({run.get('commit', '')[:7]})")
        ax.set(title=f"{config}, fp8 dispatch + bf16 combine", xlabel="tokens per rank",
               ylabel="dispatch + combine (µs)", xscale="log", yscale="log")
        ax.legend(fontsize=8)
    gpu = runs[0][1].get("gpu", "")
    fig.suptitle(f"{runs[0][1].get('world', '')} ranks, {gpu}; each sample the slowest rank, "
                 "medians", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
