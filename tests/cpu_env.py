"""The environment of the CPU tests (conftest.py applies it before jax is imported) and of the
processes they start."""

import os

DEVICES_FLAG = "--xla_force_host_platform_device_count"

# XLA:CPU compiling fast rather than well: the suite compiles thousands of small programs and
# runs each a few times, so its time is mostly compiles. jax's disable_most_optimizations (no
# LLVM optimization) and XLA's classic loop emitters instead of its fusion emitters run
# the same operations, but an unoptimized program need not keep one summation order across two
# shapes: a test comparing two programs bit for bit allows its dtype's last bit. Figures:
# docs/notes.md, "GPU workers on CPU". An explicit XLA_FLAGS or
# JAX_DISABLE_MOST_OPTIMIZATIONS=0 overrides this.
FAST_COMPILE_FLAGS = "--xla_cpu_use_fusion_emitters=false"


def apply() -> None:
    """8 emulated CPU devices and the fast-compile settings, unless already set."""
    os.environ.setdefault("XLA_FLAGS", f"{DEVICES_FLAG}=8 {FAST_COMPILE_FLAGS}")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")


def child_env(**extra: str) -> dict:
    """os.environ for a process a test starts that chooses its own platform and devices (the
    launcher, a script that sets its device count): without JAX_PLATFORMS and the device
    count, with the other XLA flags (the fast-compile ones), plus `extra`."""
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    flags = [f for f in env.pop("XLA_FLAGS", "").split() if not f.startswith(DEVICES_FLAG)]
    if flags:
        env["XLA_FLAGS"] = " ".join(flags)
    env.update(extra)
    return env
