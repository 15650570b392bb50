"""The README's benchmark table, from one device call's JSONs (ours and pplx-kernels).

    python benchmarks/readme_table.py benchmarks/results/DIR/bench_ep8.json \
        benchmarks/results/DIR/pplx_ep8.json
"""

from __future__ import annotations

import sys

from compare import load  # benchmarks/compare.py: rows per method, dense total attached


def main(ours_path: str, pplx_path: str) -> int:
    _, _, ours = load(ours_path)[0]  # the main method (grid-sweep rows come after it)
    _, _, pplx = load(pplx_path)[0]
    print("| config | tokens | ours dispatch / combine = total µs | pplx-kernels µs | ours / pplx "
          "| dense all-to-all µs | floor µs |")
    print("|---|---|---|---|---|---|---|")
    for key in sorted(ours, key=lambda k: (k[0] != "V2Lite", k[1])):
        o, p = ours[key], pplx.get(key)
        if p is None:
            print(f"| {key[0]} | {key[1]} | {o['total_us']:.1f} | | | | |")
            continue
        print(f"| {key[0]} | {key[1]} | {o['dispatch_us']:.1f} / {o['combine_us']:.1f} = "
              f"{o['total_us']:.1f} | {p['total_us']:.1f} | "
              f"{o['total_us'] / p['total_us']:.2f} | {o['dense']:.0f} | {o['floor_us']:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
