"""PEP 517 backend: scikit-build-core, plus the CUDA module's build requirements when a CUDA
compiler is present.

With nvcc on the machine (and JMC_CUDA not OFF), an isolated build (`pip install .`,
`pip install '.[cuda]'`, `pip wheel .`) also gets NVSHMEM and the XLA FFI headers (jax), so
CMake builds the CUDA module; if anything is still missing CMake stops with the reason. It
never quietly produces a reference-only package on a machine that could build the module.
Without nvcc the package is reference-only (CMake says so). JMC_CUDA=ON/OFF (environment or
-C cmake.define.JMC_CUDA=...) forces either way.
"""

from __future__ import annotations

import os
import shutil

from scikit_build_core import build as _skbuild
from scikit_build_core.build import *  # noqa: F401,F403 - every hook this version has

# What CMake needs from Python packages to build the CUDA module (CMakeLists.txt): the pinned
# NVSHMEM, and the XLA FFI headers of the oldest jaxlib supported (newer ones load the module).
CUDA_BUILD_REQUIRES = ["nvidia-nvshmem-cu13==3.4.5", "jax>=0.10.0,<0.11"]


def find_nvcc() -> str | None:
    """The CUDA compiler CMake will use: CUDACXX, nvcc on PATH, $CUDA_HOME or /usr/local/cuda."""
    if os.environ.get("CUDACXX"):
        return os.environ["CUDACXX"]
    found = shutil.which("nvcc")
    if found:
        return found
    for root in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if root and os.access(os.path.join(root, "bin", "nvcc"), os.X_OK):
            return os.path.join(root, "bin", "nvcc")
    return None


def cuda_mode(config_settings: dict | None) -> str:
    """AUTO, ON or OFF, as CMake will see it (a -C setting wins over the environment)."""
    settings = config_settings or {}
    value = settings.get("cmake.define.JMC_CUDA") or os.environ.get("JMC_CUDA") or "AUTO"
    return str(value).upper()


def builds_cuda(config_settings: dict | None) -> bool:
    mode = cuda_mode(config_settings)
    return mode == "ON" or (mode == "AUTO" and find_nvcc() is not None)


def _with_cuda(requires: list[str], config_settings) -> list[str]:
    return requires + (CUDA_BUILD_REQUIRES if builds_cuda(config_settings) else [])


def get_requires_for_build_wheel(config_settings=None):
    return _with_cuda(_skbuild.get_requires_for_build_wheel(config_settings), config_settings)


if hasattr(_skbuild, "get_requires_for_build_editable"):
    def get_requires_for_build_editable(config_settings=None):
        return _with_cuda(_skbuild.get_requires_for_build_editable(config_settings),
                          config_settings)


def _export_nvcc() -> None:
    """CMake finds nvcc on PATH or through CUDACXX: point it at the one found here."""
    nvcc = find_nvcc()
    if nvcc and not os.environ.get("CUDACXX") and not shutil.which("nvcc"):
        os.environ["CUDACXX"] = nvcc


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    _export_nvcc()
    return _skbuild.build_wheel(wheel_directory, config_settings, metadata_directory)


if hasattr(_skbuild, "build_editable"):
    def build_editable(wheel_directory, config_settings=None, metadata_directory=None):
        _export_nvcc()
        return _skbuild.build_editable(wheel_directory, config_settings, metadata_directory)
