"""Loads the CUDA/NVSHMEM module, checks its NVSHMEM version, registers its FFI targets."""

from __future__ import annotations

import functools

REQUIRED_NVSHMEM = (3, 4, 5)

_import_error: str | None = None
try:
    from . import _native  # type: ignore[attr-defined]
except ImportError as e:  # not built (no CUDA toolkit at install time) or libs missing
    _native = None
    _import_error = f"the native module did not load: {e}"


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
        return (f"{_import_error}. Reinstall with a CUDA toolkit and "
                "nvidia-nvshmem-cu13==3.4.5 present (pip install '.[cuda]').")
    built = tuple(_native.built_nvshmem_version())
    loaded = tuple(_native.runtime_nvshmem_version())
    if built != loaded or loaded != REQUIRED_NVSHMEM:
        v = ".".join
        return (f"NVSHMEM mismatch: module built against {v(map(str, built))}, loaded "
                f"libnvshmem_host {v(map(str, loaded))}; jax_moe_comm needs "
                f"{v(map(str, REQUIRED_NVSHMEM))} for both (the device state layout changes "
                "between versions). pip install nvidia-nvshmem-cu13==3.4.5 and rebuild.")
    if _native.cuda_device_count() == 0:
        return f"no usable CUDA device: {_native.cuda_driver_error()}"
    return ""


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
