"""The README's benchmark table, from one device call's JSONs (ours and pplx-kernels).

    python benchmarks/readme_table.py benchmarks/results/DIR/bench_ep8.json \
        benchmarks/results/DIR/pplx_ep8.json
"""

from __future__ import annotations

import json
import sys

OURS, DENSE = "jax_moe_comm_nvshmem", "nvshmem_dense_a2a"


def rows_by_key(path: str, methods) -> dict:
    with open(path) as f:
        run = json.load(f)
    out = {}
    for r in run["rows"]:
        if r["method"] in methods:
            key = (r["config"], r["tokens_per_rank"], r["dispatch_dtype"].split("_")[0])
            out.setdefault(key, {})[r["method"]] = r
    return out


def main(ours_path: str, pplx_path: str) -> int:
    ours = rows_by_key(ours_path, (OURS, DENSE))
    pplx = rows_by_key(pplx_path, ("pplx-kernels",))
    print("| config | tokens | ours dispatch / combine = total µs | pplx-kernels µs | ours / pplx "
          "| dense all-to-all µs | floor µs |")
    print("|---|---|---|---|---|---|---|")
    for key in sorted(ours, key=lambda k: (k[0] != "V2Lite", k[1])):
        o, d = ours[key].get(OURS), ours[key].get(DENSE)
        p = pplx.get(key, {}).get("pplx-kernels")
        if o is None:
            continue
        ratio = f"{o['total_us'] / p['total_us']:.2f}" if p else ""
        print(f"| {key[0]} | {key[1]} | {o['dispatch_us']:.1f} / {o['combine_us']:.1f} = "
              f"{o['total_us']:.1f} | {p['total_us']:.1f} | {ratio} | "
              f"{d['total_us']:.0f} | {o['floor_us']:.1f} |" if p else
              f"| {key[0]} | {key[1]} | {o['total_us']:.1f} | | | | |")
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
