"""benchmarks/timeline.py: the per-rank phase timeline built from the kernels' stamps."""

import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
from timeline import KERNELS, format_timeline, phase_timeline  # noqa: E402


def synthetic_stamps(ranks=4, samples=5, skew_ns=700):
    """Rank r leaves the barrier r * skew_ns after rank 0; every event of kernel k follows
    1 us apart, on a clock near today's %globaltimer (ns since 1970: float64 would round)."""
    base = 1_764_770_000_123_456_789
    s = np.zeros((ranks, samples, 17), dtype=np.int64)
    for r in range(ranks):
        for i in range(samples):
            t = base + i * 1_000_000 + r * skew_ns
            s[r, i, 16] = t
            for k in range(4):
                s[r, i, 2 * k] = t + 1000 * (4 * k + 1)
                s[r, i, 8 + 2 * k] = t + 1000 * (4 * k + 2)
                s[r, i, 9 + 2 * k] = t + 1000 * (4 * k + 3)
                s[r, i, 2 * k + 1] = t + 1000 * (4 * k + 4)
    return s


def test_events_relative_to_first_rank_out_of_the_barrier():
    phases = phase_timeline(synthetic_stamps(ranks=4, skew_ns=700).tolist())
    assert phases["barrier_end"] == [0.0, 2.1]  # rank 3 left 3 x 0.7 us later
    assert phases["dispatch_send.start"] == [1.0, 3.1]
    assert phases["dispatch_recv.waited"] == [6.0, 8.1]
    assert phases["combine_recv.end"] == [16.0, 18.1]
    assert len(phases) == 1 + 4 * len(KERNELS)


def test_medians_over_samples_ignore_one_slow_sample():
    s = synthetic_stamps(ranks=2, samples=5, skew_ns=0)
    s[1, 2, 3] += 50_000  # one sample: rank 1's dispatch_send ends 50 us late
    phases = phase_timeline(s)
    assert phases["dispatch_send.end"] == [4.0, 4.0]


def test_format_names_every_kernel():
    text = format_timeline(phase_timeline(synthetic_stamps()))
    for name in KERNELS:
        assert name in text
