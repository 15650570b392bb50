"""examples/deepseek_decode.py, small, on 8 CPU devices: prefill and decode on two handles,
the breakdown timings, and the dense check (the MoE layers and the logits against the same
model with a dense MoE). The check must pass on a correct model, fail on a wrong MoE (expert 0
dropped from the distributed model), and pass when another rounding (every MoE output element
one bf16 ulp off) flips routing near-ties (~20 s, then ~8 s a run with the shared compilation
cache)."""

import os
import re
import subprocess
import sys
import tempfile

import pytest

from cpu_env import child_env

# Left out of `scripts/test.sh --quick`: runs the decode example end to end.
pytestmark = pytest.mark.slow

pytest.importorskip("flax.nnx", reason="flax is an optional extra: pip install jax_moe_comm[flax]")
EXAMPLE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples",
                       "deepseek_decode.py")
SMALL = ["--layers", "2", "--hidden", "128", "--heads", "2", "--vocab", "128", "--ffn", "128",
         "--experts-per-rank", "2", "--k", "2", "--check-every", "2"]
NEAR_TIE = 2.0 ** -6  # the example's threshold


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """A JAX compilation cache the runs share (most programs are the same: ~10 s a run)."""
    return str(tmp_path_factory.mktemp("jax_cache"))


def run(cache, *extra):
    env = child_env()
    env.update(JAX_COMPILATION_CACHE_DIR=cache, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
               JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
    r = subprocess.run([sys.executable, EXAMPLE, *SMALL, *extra], capture_output=True,
                       text=True, timeout=300, env=env, cwd=tempfile.gettempdir(), check=False)
    return r.returncode, r.stdout, r.stdout + r.stderr


def number(out, pattern):
    m = re.search(pattern, out)
    assert m, f"{pattern!r} not in:\n{out}"
    return int(m.group(1))


def check(out):
    """The dense check's counts, as printed; they add up."""
    c = {"layer_beyond": number(out, r"token-layers\): .*; beyond it (\d+),"),
         "layer_ties": number(out, r"identical inputs \(margin < 2\^-14\) (\d+) ->"),
         "rows": number(out, r"tokens: (\d+) rows"),
         "within": number(out, r"within tolerance (\d+);"),
         "explained": number(out, r"near-tie flip in their sequence (\d+);"),
         "unexplained": number(out, r"unexplained (\d+)"),
         "flips": number(out, r"position\): (\d+) of \d+ token-layers"),
         "not_ties": number(out, r"not at a near-tie (\d+)")}
    assert c["within"] + c["explained"] + c["unexplained"] == c["rows"], (c, out)
    assert re.search(r"dense check 1, .* -> (OK|FAILED)\n", out), out
    assert re.search(r"\) -> (OK|FAILED)\n", out), out
    return c


def test_deepseek_decode_example_runs_small_and_matches_the_dense_model(cache):
    rc, out, everything = run(cache, "--batch-per-rank", "1", "--prompt", "4", "--tokens", "3",
                              "--reps", "2")
    assert rc == 0, everything
    assert "backend=reference ranks=8" in out and "2 handles (budgets (1, 4) per rank)" in out
    assert "XLA collectives in the decode step: ['all-to-all']" in out, out
    for part in ("attention", "router", "dispatch", "combine", "experts", "per-token latency"):
        assert part in out, out
    c = check(out)
    assert c["rows"] == 32 and c["unexplained"] == 0 and c["layer_beyond"] == 0, out
    assert out.count("-> OK") == 2 and "FAILED" not in out, out


def test_the_dense_check_fails_on_a_wrong_moe(cache):
    """Expert 0's output weights zero in the distributed model only: its tokens' MoE outputs
    are wrong with no near-tie to excuse them, and logits differ before any flip."""
    rc, out, everything = run(cache, "--batch-per-rank", "1", "--prompt", "4", "--tokens", "3",
                              "--reps", "0", "--fault", "expert")
    assert rc == 1, everything
    c = check(out)
    assert c["layer_beyond"] > 0 and c["layer_ties"] == 0, out
    assert c["unexplained"] > 0, out
    assert out.count("-> FAILED") == 2 and "-> OK" not in out, out
    assert "where a decode step's time goes" not in out  # --reps 0: no breakdown


def test_routing_flips_from_another_rounding_are_explained_not_failed(cache):
    """Every distributed MoE output one bf16 ulp off (a kernel that rounds differently):
    routing near-ties flip and their sequences' logits then differ by O(1); the check must
    find each such row after a flip at a near-tie and pass."""
    rc, out, everything = run(cache, "--batch-per-rank", "1", "--prompt", "12", "--tokens", "6",
                              "--reps", "0", "--fault", "ulp")
    c = check(out)
    assert c["flips"] > 0 and c["explained"] > 0, ("no flip to explain", out)
    assert rc == 0, everything
    assert c["unexplained"] == 0 and c["not_ties"] == 0, out
    shown = re.search(r"at margins \(half the score gap\) ([-+.e\d ]+),",
                      out).group(1)
    margins = [float(m) for m in shown.split() if m != "..."]
    assert margins and max(margins) < NEAR_TIE, out  # the sequences' first flips
    assert out.count("-> OK") == 2, out
