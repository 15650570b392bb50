"""Diagnostic trees for issue 23: a commit's source with one fixed cost taken out, to time by
removal what a 1-token cycle spends on it (scripts/lab/gpu_bisect.sh times each tree).

    python scripts/lab/diag_trees.py d2745f9      # -> .old/d2745f9, .old/diag-{gpu,noack,...}
    COMMITS="d2745f9 diag-gpu diag-noack diag-notimer diag-all" TOKENS=1,4 \
      bash scripts/lab/gpu_bisect.sh             # on the device, .old carried

These trees are measurements, never code to merge: each is wrong somewhere else.
- diag-gpu: every flag load/store of ours at GPU scope instead of system scope. Correct with
  every rank on one GPU (the device machine), wrong across GPUs: it prices MEMBAR.SYS.
- diag-noack: no acknowledgements (not waited by the sends, not published by the recvs).
  Safe in bench_loop's lockstep cycles only. diag-nodack and diag-nocack: the dispatch half's
  or the combine half's alone (diag-nocack bounds what implicit combine acknowledgements,
  docs/design-decisions.md, could give: they drop exactly those, and add an order check at launch).
- diag-notimer: no %globaltimer read in a wait (before 2026-12-06 evening each kernel body read
  it for its deadline and each poll checked it: 1.5-1.8 µs per 1-token cycle; now a wait reads
  it every 16 polls, protocol.cuh).
- diag-all: the three together.
- diag-ackload: the sends load the previous cycle's acknowledgements relaxed, not acquire
  (no CCTL.IVALL; the stores after it wait on the value anyway): prices the acquire.
Each edit asserts that the text it replaces is there once, so a tree whose code moved fails
here instead of timing something else. The trees leave out benchmarks/results (the device's
carry is 64 MiB in all).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def sub(tree: str, path: str, old: str, new: str) -> None:
    full = os.path.join(tree, path)
    text = open(full).read()
    if text.count(old) != 1:
        sys.exit(f"diag_trees: {path} holds {text.count(old)} copies of {old!r}, expected 1")
    open(full, "w").write(text.replace(old, new))


def gpu_scope(tree: str) -> None:
    for op in ("ld.relaxed", "ld.acquire", "st.release", "st.relaxed"):
        sub(tree, "csrc/core/memory.cuh", f"{op}.sys.global", f"{op}.gpu.global")


def _no_send_ack_wait(tree: str, path: str, peers: str) -> None:
    sub(tree, path, f"  const bool ack_lane = threadIdx.x < kWarpSize && threadIdx.x < {peers};",
        "  const bool ack_lane = false;  // DIAG: no ack load")
    sub(tree, path, "  if (ok && threadIdx.x < kWarpSize) {\n    for (int ",
        "  if (false && ok && threadIdx.x < kWarpSize) {  // DIAG: no ack wait\n    for (int ")


def no_dispatch_ack(tree: str) -> None:
    _no_send_ack_wait(tree, "csrc/kernels/dispatch_send.cuh", "G")
    sub(tree, "csrc/kernels/dispatch_recv.cuh", "  if (healthy) {\n    for (int g = threadIdx.x;",
        "  if (false && healthy) {  // DIAG: no ack\n    for (int g = threadIdx.x;")


def no_combine_ack(tree: str) -> None:
    _no_send_ack_wait(tree, "csrc/kernels/combine_send.cuh", "s.world_size")
    sub(tree, "csrc/kernels/combine_recv.cuh", "  if (acknowledge) {",
        "  if (false && acknowledge) {  // DIAG: no ack")


OLD_DEADLINE = "const uint64_t deadline = globaltimer_ns() + c.timeout_ns;"
OLD_KERNELS = ("csrc/kernels/dispatch_send.cuh", "csrc/kernels/dispatch_recv.cuh",
               "csrc/kernels/combine_send.cuh", "csrc/kernels/combine_recv.cuh")


def no_timer(tree: str) -> None:
    protocol = os.path.join(tree, "csrc", "core", "protocol.cuh")
    if "kPollsPerClockRead" in open(protocol).read():
        sub(tree, "csrc/core/protocol.cuh", "      if (polls % kPollsPerClockRead == 0) {",
            "      if (false && polls % kPollsPerClockRead == 0) {  // DIAG: no clock read")
        return
    # before c9cc5e9: a deadline per kernel body, the clock checked at every poll
    for path in OLD_KERNELS:
        sub(tree, path, OLD_DEADLINE, "const uint64_t deadline = ~0ull;  // DIAG: no timer read")
    sub(tree, "csrc/core/protocol.cuh", "      if (globaltimer_ns() > deadline) {",
        "      if (deadline != ~0ull && globaltimer_ns() > deadline) {  // DIAG")


def relaxed_ack_load(tree: str) -> None:
    sub(tree, "csrc/kernels/dispatch_send.cuh",
        "ack_lane ? ld_acquire_sys_u64(&sym.dispatch_ack[",
        "ack_lane ? ld_relaxed_sys_u64(&sym.dispatch_ack[  /* DIAG */")
    sub(tree, "csrc/kernels/combine_send.cuh", "ack_lane ? ld_acquire_sys_u64(&sym.combine_ack[",
        "ack_lane ? ld_relaxed_sys_u64(&sym.combine_ack[  /* DIAG */")


VARIANTS = {"diag-gpu": (gpu_scope,), "diag-noack": (no_dispatch_ack, no_combine_ack),
            "diag-nodack": (no_dispatch_ack,), "diag-nocack": (no_combine_ack,),
            "diag-notimer": (no_timer,),
            "diag-all": (gpu_scope, no_dispatch_ack, no_combine_ack, no_timer),
            "diag-ackload": (relaxed_ack_load,)}


def main(commit: str) -> None:
    old = os.path.join(ROOT, ".old")
    base = os.path.join(old, commit)
    if not os.path.isdir(base):
        os.makedirs(base)
        archive = subprocess.run(["git", "-C", ROOT, "archive", commit], check=True,
                                 capture_output=True).stdout
        subprocess.run(["tar", "x", "-C", base], input=archive, check=True)
    shutil.rmtree(os.path.join(base, "benchmarks", "results"), ignore_errors=True)
    for name, edits in VARIANTS.items():
        tree = os.path.join(old, name)
        shutil.rmtree(tree, ignore_errors=True)
        shutil.copytree(base, tree)
        for edit in edits:
            edit(tree)
        print(f"diag_trees: .old/{name} = {commit} with {', '.join(e.__name__ for e in edits)}")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    main(sys.argv[1])
