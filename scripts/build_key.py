"""Prints a key of everything the wheel is built from, so scripts/setup.sh can reuse a build.

    python scripts/build_key.py [ROOT]

The key is a hash of the files under csrc/, build_backend/ and jax_moe_comm/ (not caches or
built modules), CMakeLists.txt and pyproject.toml (path and contents), plus the build settings
that change the module: JMC_CUDA, JMC_CUDA_ARCHS, the CUDA compiler and its version, and the
Python version. Two trees with the same key build the same wheel.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys

SOURCES = ("csrc", "build_backend", "jax_moe_comm", "CMakeLists.txt", "pyproject.toml")
SKIP_DIRS = {"__pycache__"}
SKIP_SUFFIXES = (".pyc", ".so")
SKIP_NAMES = {"_native_build.py"}  # written by CMake


def source_files(root: str) -> list[str]:
    """The files the wheel is built from, relative to root, sorted."""
    found = []
    for top in SOURCES:
        path = os.path.join(root, top)
        if os.path.isfile(path):
            found.append(top)
            continue
        for d, dirs, files in os.walk(path):
            dirs[:] = sorted(x for x in dirs if x not in SKIP_DIRS)
            for f in files:
                if f.endswith(SKIP_SUFFIXES) or f in SKIP_NAMES:
                    continue
                found.append(os.path.relpath(os.path.join(d, f), root))
    return sorted(found)


def nvcc_identity() -> str:
    """Which CUDA compiler a build would use, and its version ('' without one)."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..",
                                    "build_backend"))
    try:
        from jmc_build import find_nvcc  # the same search as the build
    except ImportError:  # scikit-build-core not installed yet: no build can run either
        return "unknown"
    nvcc = find_nvcc()
    if not nvcc:
        return ""
    try:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=60)
        return nvcc + "\n" + out.stdout
    except (OSError, subprocess.SubprocessError):
        return nvcc


def build_key(root: str) -> str:
    h = hashlib.sha256()
    for rel in source_files(root):
        h.update(rel.encode() + b"\0")
        with open(os.path.join(root, rel), "rb") as f:
            h.update(hashlib.sha256(f.read()).digest())
    for name in ("JMC_CUDA", "JMC_CUDA_ARCHS"):
        h.update(f"{name}={os.environ.get(name, '')}\0".encode())
    h.update(nvcc_identity().encode() + b"\0")
    h.update(sys.version.encode())
    return h.hexdigest()[:16]


if __name__ == "__main__":
    print(build_key(sys.argv[1] if len(sys.argv) > 1 else
                    os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")))
