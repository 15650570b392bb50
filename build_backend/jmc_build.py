"""PEP 517 backend: scikit-build-core, plus the CUDA module's build requirements when a CUDA
compiler is present.

With nvcc on the machine (and JMC_CUDA not OFF), an isolated build (`pip install .`,
`pip install '.[cuda]'`, `pip wheel .`) also gets NVSHMEM and the XLA FFI headers (jax), so
CMake builds the CUDA module; if anything is still missing CMake stops with the reason. It
never quietly produces a reference-only package on a machine that could build the module.
Without nvcc the package is reference-only (CMake says so). JMC_CUDA=ON/OFF (environment or
-C cmake.define.JMC_CUDA=...) forces either way.

A wheel that contains the CUDA module also requires the NVSHMEM runtime it links against
(`Requires-Dist: nvidia-nvshmem-cu13==3.4.5`, cu12 for a CUDA 12 build), so no install of it can
half-work: the metadata is written from what was built (the module and the CUDA version CMake
recorded beside it), and `prepare_metadata_for_build_wheel` predicts the same from nvcc.
"""

from __future__ import annotations

import base64
import hashlib
import os
import re
import shutil
import subprocess
import zipfile

from scikit_build_core import build as _skbuild
from scikit_build_core.build import *  # noqa: F401,F403 - every hook this version has

# The one NVSHMEM the kernels are built and run with (its device state's layout changes between
# versions; jax_moe_comm/native.py checks it at import). Published for CUDA 12 and 13.
NVSHMEM_VERSION = "3.4.5"
# The XLA FFI headers of the oldest jaxlib supported (newer ones load the module).
JAX_BUILD_REQUIRES = "jax>=0.10.0,<0.11"


def nvshmem_requirement(cuda_major: int) -> str:
    """The NVSHMEM wheel a module built by CUDA `cuda_major` links against and needs at run time."""
    return f"nvidia-nvshmem-cu{cuda_major}=={NVSHMEM_VERSION}"


def nvcc_major(nvcc: str | None) -> int:
    """CUDA major version of `nvcc` ("release 12.9, V12.9.86" -> 12); 13 when unknown."""
    if nvcc:
        try:
            out = subprocess.run([nvcc, "--version"], capture_output=True, text=True,
                                 timeout=60).stdout
        except (OSError, subprocess.SubprocessError):
            out = ""
        m = re.search(r"release (\d+)\.", out)
        if m:
            return int(m.group(1))
    return 13


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


def cuda_build_requires(config_settings: dict | None) -> list[str]:
    """What CMake needs from Python packages to build the CUDA module (CMakeLists.txt)."""
    if not builds_cuda(config_settings):
        return []
    return [nvshmem_requirement(nvcc_major(find_nvcc())), JAX_BUILD_REQUIRES]


def _with_cuda(requires: list[str], config_settings) -> list[str]:
    return requires + cuda_build_requires(config_settings)


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


# -- the NVSHMEM runtime in the metadata ----------------------------------------------------
def add_requirement(metadata: str, requirement: str) -> str:
    """METADATA text with `Requires-Dist: requirement` among the header fields (once)."""
    line = f"Requires-Dist: {requirement}"
    head, sep, body = metadata.partition("\n\n")  # header fields, then the description
    if line in head.splitlines():
        return metadata
    return head.rstrip("\n") + "\n" + line + "\n" + ("\n" + body if sep else "")


def _record_hash(data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
    return f"sha256={digest.decode()}"


def wheel_cuda_major(names: list[str], read) -> int | None:
    """CUDA major of the module in a wheel (from _native_build.py), None without a module."""
    if not any(re.fullmatch(r"[^/]+/_native\.[^/]*\.so", n) for n in names):
        return None
    build = [n for n in names if n.endswith("/_native_build.py")]
    m = re.search(r'CUDA_VERSION = "(\d+)\.', read(build[0]).decode()) if build else None
    return int(m.group(1)) if m else 13


def require_nvshmem_in_wheel(path: str) -> str | None:
    """Rewrite the wheel at `path` so that, if it holds the CUDA module, its METADATA requires
    the matching NVSHMEM wheel (RECORD updated). Returns the requirement added, or None."""
    with zipfile.ZipFile(path) as z:
        names = z.namelist()
        major = wheel_cuda_major(names, z.read)
        if major is None:
            return None
        requirement = nvshmem_requirement(major)
        entries = [(info, z.read(info.filename)) for info in z.infolist()]
    meta_name = next(n for n in names if re.fullmatch(r"[^/]+\.dist-info/METADATA", n))
    record_name = meta_name[: -len("METADATA")] + "RECORD"
    files = dict((info.filename, data) for info, data in entries)
    meta = add_requirement(files[meta_name].decode(), requirement).encode()
    record = "".join(
        f"{meta_name},{_record_hash(meta)},{len(meta)}\n" if line.startswith(meta_name + ",")
        else line + "\n" for line in files[record_name].decode().splitlines())
    files[meta_name], files[record_name] = meta, record.encode()
    tmp = path + ".tmp"
    with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as z:
        for info, _ in entries:
            z.writestr(info, files[info.filename])
    os.replace(tmp, path)
    return requirement


def prepare_metadata_for_build_wheel(metadata_directory, config_settings=None):
    name = _skbuild.prepare_metadata_for_build_wheel(metadata_directory, config_settings)
    _predict_nvshmem(os.path.join(metadata_directory, name, "METADATA"), config_settings)
    return name


def _predict_nvshmem(path: str, config_settings) -> None:
    """pip resolves dependencies from this metadata before building: add what the wheel will
    require (the CUDA module is built exactly when builds_cuda says so, or the build fails)."""
    if not builds_cuda(config_settings):
        return
    with open(path, encoding="utf-8") as f:
        text = f.read()
    with open(path, "w", encoding="utf-8") as f:
        f.write(add_requirement(text, nvshmem_requirement(nvcc_major(find_nvcc()))))


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    _export_nvcc()
    # scikit-build-core writes METADATA itself (metadata_directory is only a hint to reuse).
    name = _skbuild.build_wheel(wheel_directory, config_settings, None)
    require_nvshmem_in_wheel(os.path.join(wheel_directory, name))
    return name


if hasattr(_skbuild, "build_editable"):
    def build_editable(wheel_directory, config_settings=None, metadata_directory=None):
        _export_nvcc()
        name = _skbuild.build_editable(wheel_directory, config_settings, None)
        require_nvshmem_in_wheel(os.path.join(wheel_directory, name))
        return name


if hasattr(_skbuild, "prepare_metadata_for_build_editable"):
    def prepare_metadata_for_build_editable(metadata_directory, config_settings=None):
        name = _skbuild.prepare_metadata_for_build_editable(metadata_directory, config_settings)
        _predict_nvshmem(os.path.join(metadata_directory, name, "METADATA"), config_settings)
        return name
