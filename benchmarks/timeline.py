"""Where a dispatch/combine sample's time goes, from the kernels' %globaltimer stamps.

All ranks of the benchmark share one GPU, so their stamps are on one clock: the timeline shows
launch gaps, waits for peers and each rank's own work side by side (csrc/kernels/kernels.h
names the slots)."""

from __future__ import annotations

import numpy as np

# The kernels' stamps (csrc/kernels/kernels.h): per kernel start/end at 2k, 2k+1, block 0's
# "waited" / "worked" marks at 8 + 2k, 9 + 2k, and the barrier's end at 16.
KERNELS = ("dispatch_send", "dispatch_recv", "combine_send", "combine_recv")
BARRIER_END = 16


def phase_timeline(stamps) -> dict:
    """Where a sample's time goes, from every rank's stamps of one sample ([ranks, samples,
    17] ns, one GPU clock). Times are us after the first rank left the barrier; each event
    gives [earliest rank, latest rank], medians over samples. The gap from one rank's start
    to its "waited" mark is time spent waiting for peers (or their acknowledgement)."""
    s = np.asarray(stamps, dtype=np.int64)
    t0 = s[:, :, BARRIER_END].min(axis=0)  # [samples]
    rel = (s - t0[None, :, None]).astype(np.float64) / 1e3  # small ints: exact in float64
    out = {"barrier_end": rel[:, :, BARRIER_END]}
    for k, name in enumerate(KERNELS):
        for event, slot in (("start", 2 * k), ("waited", 8 + 2 * k), ("worked", 9 + 2 * k),
                            ("end", 2 * k + 1)):
            out[f"{name}.{event}"] = rel[:, :, slot]
    return {key: [round(float(np.median(v.min(axis=0))), 1),
                  round(float(np.median(v.max(axis=0))), 1)] for key, v in out.items()}


def format_timeline(phases: dict) -> str:
    lines = [f"  barrier end {phases['barrier_end'][0]:6.1f} ..{phases['barrier_end'][1]:6.1f}"]
    for name in KERNELS:
        lines.append(f"  {name:13s} " + "  ".join(
            f"{event} {phases[f'{name}.{event}'][0]:6.1f} ..{phases[f'{name}.{event}'][1]:6.1f}"
            for event in ("start", "waited", "worked", "end")))
    return "\n".join(lines)
