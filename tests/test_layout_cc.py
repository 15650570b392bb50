"""The symmetric buffer's LL areas and tags (csrc/core/layout.h, issue 23), checked on the host:
tests/layout_probe.cc carves the buffer as handle.cc does and prints where each area lies.
The LL areas must sit in the flag region (zeroed at creation and by recover(), so a zeroed unit
is never a cycle's), hold twice the plain areas at the same places, and ll_tag must never be 0
and differ between consecutive epochs."""

import json
import os
import shutil
import subprocess

import pytest

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


def cuda_include() -> str | None:
    """CUDA's headers (layout.h needs cuda_runtime.h for __host__ __device__)."""
    roots = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"]
    nvcc = shutil.which("nvcc")
    if nvcc:  # (nvcc may be a wrapper script elsewhere: the roots above come first)
        roots.append(os.path.dirname(os.path.dirname(os.path.realpath(nvcc))))
    for root in filter(None, roots):
        if os.path.exists(os.path.join(root, "include", "cuda_runtime.h")):
            return os.path.join(root, "include")
    return None


@pytest.fixture(scope="module")
def probe(tmp_path_factory):
    compiler, include = shutil.which("c++"), cuda_include()
    if compiler is None or include is None:
        why = (f"needs a C++ compiler and CUDA's headers (c++: {compiler}, "
               f"cuda_runtime.h: {include})")
        if os.environ.get("CI"):  # CI builds the CUDA module, so it has both
            pytest.fail(why)
        pytest.skip(why)
    exe = str(tmp_path_factory.mktemp("probe") / "layout_probe")
    subprocess.run([compiler, "-std=c++17", "-O1", "-I", os.path.join(ROOT, "csrc"), "-I",
                    include, os.path.join(ROOT, "tests", "layout_probe.cc"), "-o", exe],
                   check=True)

    def run(E, k, H, m, world, dp, in_bytes, scales, out_bytes, staged, ll):
        out = subprocess.run([exe] + [str(v) for v in (E, k, H, m, world, dp, in_bytes, scales,
                                                        out_bytes, int(staged), int(ll))],
                             check=True, capture_output=True, text=True).stdout
        return json.loads(out)
    return run


SHAPES = {  # E, k, H, max_m, world, dp, dispatch bytes, scales, combine bytes
    "v2lite-fp8-1-token": (64, 6, 2048, 1, 8, 1, 1, 16, 2),
    "r1-fp8-4-tokens": (256, 8, 7168, 4, 8, 1, 1, 56, 2),
    "bf16-f32-dp2": (32, 4, 256, 16, 4, 2, 2, 0, 4),
}


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_ll_areas_sit_in_the_zeroed_flag_region_at_twice_the_plain_size(probe, name):
    E, k, H, m, world, dp, *_ = shape = SHAPES[name]
    G = world // dp
    ll, plain = probe(*shape, staged=False, ll=True), probe(*shape, staged=False, ll=False)
    rec, row = ll["record_bytes"], ll["row_bytes"]
    assert plain["recv_records_ll"] == plain["combine_rows_ll"] == -1 and plain["ll"] == 0
    assert ll["ll"] == 1
    # After the flags, inside the region the memset covers, one after the other, 128-aligned.
    assert ll["barrier_flag"] < ll["recv_records_ll"]
    assert ll["recv_records_ll"] + 2 * G * m * rec <= ll["combine_rows_ll"]
    assert ll["combine_rows_ll"] + 2 * m * k * row <= ll["flag_bytes"] <= ll["recv_records"]
    assert ll["recv_records_ll"] % 128 == 0 and ll["combine_rows_ll"] % 128 == 0
    # The same places as the plain areas, at twice the stride.
    assert ll["recv_record_ll_1_0"] - ll["recv_records_ll"] == 2 * m * rec
    assert ll["combine_row_ll_0_1"] - ll["combine_rows_ll"] == 2 * row
    # Everything after the flag region is where it was, shifted by the LL areas only.
    shift = ll["flag_bytes"] - plain["flag_bytes"]
    assert shift >= 2 * (G * m * rec + m * k * row)
    assert ll["recv_records"] - plain["recv_records"] == shift
    assert ll["combine_rows"] - plain["combine_rows"] == shift
    assert ll["total"] - plain["total"] == shift


def test_ll_tags_are_never_zero_and_consecutive_epochs_differ(probe):
    tags = probe(*SHAPES["v2lite-fp8-1-token"], staged=False, ll=True)["tags"]
    # epochs 1, 2^32 - 2, 2^32 - 1, 2^33 - 2, 2^64 - 1: the fold's edges
    assert tags == [2, 0xFFFFFFFF, 1, 1, 1]
    assert all(t != 0 for t in tags) and tags[1] != tags[2]
