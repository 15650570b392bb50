"""Loads the CUDA/NVSHMEM module, checks its NVSHMEM version, registers its FFI targets."""

from __future__ import annotations

import functools
import importlib
import os

REQUIRED_NVSHMEM = (3, 4, 5)

# How to get the CUDA module, for every message that says it is missing.
BUILD_HINT = ("Build it from a source checkout on a machine with nvcc (CUDA 12 or 13): "
              "`pip install '.[cuda13]'` or `'.[cuda12]'` (with nvcc present the build includes "
              "the CUDA module or fails saying why; JMC_CUDA=ON makes a missing nvcc an error "
              "too), or run `bash scripts/setup.sh`")

try:  # written by CMake beside _native: the GPU architectures and CUDA it was compiled for
    _native_build = importlib.import_module(f"{__package__}._native_build")
except ImportError:
    _native_build = None


def nvshmem_requirement(cuda_version: str | None = None) -> str:
    """The NVSHMEM wheel the CUDA module needs at run time, e.g. 'nvidia-nvshmem-cu13==3.4.5'
    (cu12 for a module built by CUDA 12; what the wheel's metadata requires)."""
    if cuda_version is None:
        cuda_version = getattr(_native_build, "CUDA_VERSION", "") or "13"
    major = cuda_version.split(".")[0]
    return f"nvidia-nvshmem-cu{major}=={'.'.join(map(str, REQUIRED_NVSHMEM))}"


def import_failure(error: ImportError) -> str:
    """Why the CUDA module did not import, and the command that fixes it."""
    if isinstance(error, ModuleNotFoundError) and error.name == f"{__package__}._native":
        return ("jax_moe_comm was installed without its CUDA module (no nvcc when it was "
                f"built, or JMC_CUDA=OFF). {BUILD_HINT}.")
    if "libnvshmem_host" in str(error):
        return (f"jax_moe_comm's CUDA module did not load: {error}. Its NVSHMEM runtime is "
                f"missing: `pip install {nvshmem_requirement()}` (the wheel requires it; an "
                "install with --no-deps skips it).")
    return (f"jax_moe_comm's CUDA module did not load: {error} (its NVSHMEM runtime comes with "
            f"`pip install {nvshmem_requirement()}`). {BUILD_HINT}.")


_import_error: str | None = None
try:
    _native = importlib.import_module(f"{__package__}._native")
except ImportError as e:  # not built (no CUDA toolkit at install time) or libs missing
    _native = None
    _import_error = import_failure(e)


def module():
    """The loaded _native module; raises NativeUnavailableError when it cannot run."""
    from .errors import NativeUnavailableError

    reason = unavailable_reason()
    if reason:
        raise NativeUnavailableError(reason)
    return _native


@functools.lru_cache(maxsize=None)
def unavailable_reason() -> str:
    """'' when the nvshmem backend can run here, else why not (and what to do)."""
    if _native is None:
        return _import_error
    built = tuple(_native.built_nvshmem_version())
    loaded = tuple(_native.runtime_nvshmem_version())
    if built != loaded or loaded != REQUIRED_NVSHMEM:
        v = ".".join
        return (f"NVSHMEM mismatch: module built against {v(map(str, built))}, loaded "
                f"libnvshmem_host {v(map(str, loaded))}; jax_moe_comm needs "
                f"{v(map(str, REQUIRED_NVSHMEM))} for both (the device state layout changes "
                f"between versions). `pip install {nvshmem_requirement()}` and rebuild.")
    if _native.cuda_device_count() == 0:
        return no_device_reason(_native.cuda_driver_error())
    return ""


def _driver_present() -> bool:
    """Whether an NVIDIA kernel driver is loaded here (its /proc entry, or a device node)."""
    return os.path.exists("/proc/driver/nvidia/version") or os.path.exists("/dev/nvidiactl")


def no_device_reason(cuda_error: str) -> str:
    """What to say when CUDA sees no device. With no NVIDIA driver at all the CUDA runtime
    reports cudaErrorInsufficientDriver ("driver version is insufficient"), which reads as a
    version mismatch on a machine that simply has no GPU: say that instead. With a driver
    loaded the CUDA error is the real reason (a driver older than the runtime, no visible
    device, ...)."""
    if not _driver_present():
        return ("no NVIDIA GPU here (no NVIDIA driver is loaded); the reference backend runs "
                "on CPUs")
    return f"no usable CUDA device: {cuda_error}"


def built_archs() -> tuple[tuple[int, ...], int | None]:
    """(SASS architectures, PTX architecture) the CUDA module was compiled for, e.g.
    ((80, 90, 100), 100); ((), None) when unknown."""
    if _native_build is None:
        return (), None
    return tuple(_native_build.CUDA_ARCHS), _native_build.PTX_ARCH


def arch_supported(sm: int, sass: tuple[int, ...], ptx: int | None) -> bool:
    """Machine code for sm_XY runs on sm_XZ, Z >= Y (same major); PTX is JIT-compiled for any
    later architecture."""
    return any(a // 10 == sm // 10 and a <= sm for a in sass) or (ptx is not None and ptx <= sm)


def device_problem(device) -> str:
    """'' when the CUDA module has code for `device` (a jax Device), else what to do."""
    cc = getattr(device, "compute_capability", None)
    sass, ptx = built_archs()
    if cc is None or not sass:
        return ""
    major, minor = (int(v) for v in str(cc).split(".")[:2])
    sm = 10 * major + minor
    if arch_supported(sm, sass, ptx):
        return ""
    kind = getattr(device, "device_kind", "this GPU")
    built = ", ".join(f"sm_{a}" for a in sass)
    ptx_note = f" + PTX for compute_{ptx}, which later GPUs JIT-compile" if ptx else ""
    cuda = (getattr(_native_build, "CUDA_VERSION", "") or "13").split(".")[0]
    return (f"{kind} is sm_{sm}, but jax_moe_comm's CUDA module was built for {built}"
            f"{ptx_note}. Rebuild it for this GPU: `pip install '.[cuda{cuda}]' -C "
            f"cmake.define.JMC_CUDA_ARCHS={sm}` (NVSHMEM needs sm_70 or newer), or pass "
            "backend='reference'.")


def available() -> bool:
    return not unavailable_reason()


def built() -> bool:
    """The native module was compiled and imports (true on CI, which has no GPU)."""
    return _native is not None


@functools.lru_cache(maxsize=None)
def register_targets() -> None:
    """Register the FFI handlers with XLA for CUDA, once per process."""
    import jax

    mod = module()
    for name, capsule in mod.ffi_targets.items():
        jax.ffi.register_ffi_target(name, capsule, platform="CUDA")
