"""The native module: compiled with nvcc (CI requires it), imports with no GPU, says why the
CUDA path cannot run here."""

import os

import pytest

from jax_moe_comm import native

REQUIRE = os.environ.get("JMC_REQUIRE_NATIVE") == "1"  # set by .ci/run and the README command


def test_native_module_built():
    if not native.built():
        if REQUIRE:
            pytest.fail(f"native module required but not importable: {native._import_error}")
        pytest.skip(f"built without a CUDA toolkit: {native._import_error}")
    mod = native._native
    assert tuple(mod.built_nvshmem_version()) == native.REQUIRED_NVSHMEM
    assert tuple(mod.runtime_nvshmem_version()) == native.REQUIRED_NVSHMEM
    assert {"jmc_dispatch_send", "jmc_dispatch_recv", "jmc_combine_send", "jmc_combine_recv",
            "jmc_barrier", "jmc_dense_all_to_all", "jmc_record_event"} <= set(mod.ffi_targets)
    assert not mod.initialized()


def test_cuda_path_reports_why_not_here():
    if native.available():
        pytest.skip("a usable GPU is present")
    reason = native.unavailable_reason()
    assert reason
    if native.built():
        assert "no usable CUDA device" in reason
    from jax_moe_comm import NativeUnavailableError

    with pytest.raises(NativeUnavailableError):
        native.module()
