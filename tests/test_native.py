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
            "jmc_dispatch", "jmc_combine", "jmc_barrier",
            "jmc_order_after"} == set(mod.ffi_targets)
    # the instruments' handlers are apart, registered by jax_moe_comm._bench only
    assert {"jmc_floor_kernels", "jmc_dense_all_to_all",
            "jmc_record_event"} == set(mod.bench.ffi_targets)
    assert not mod.initialized()


def test_cuda_path_reports_why_not_here():
    if native.available():
        pytest.skip("a usable GPU is present")
    reason = native.unavailable_reason()
    assert reason
    if native.built():
        # No NVIDIA driver here (CI's machines): said plainly, not as CUDA's "driver version is
        # insufficient"; with a driver loaded, CUDA's own error is the reason.
        expected = ("no usable CUDA device" if native._driver_present()
                    else "no NVIDIA GPU here (no NVIDIA driver is loaded)")
        assert expected in reason, reason
        assert native._driver_present() or "insufficient" not in reason, reason


def test_the_no_device_reason_keeps_cudas_error_only_with_a_driver(monkeypatch):
    cuda = "cudaErrorInsufficientDriver: CUDA driver version is insufficient for CUDA runtime"
    monkeypatch.setattr(native, "_driver_present", lambda: False)
    assert native.no_device_reason(cuda).startswith("no NVIDIA GPU here")
    assert "insufficient" not in native.no_device_reason(cuda)
    monkeypatch.setattr(native, "_driver_present", lambda: True)
    assert native.no_device_reason(cuda) == f"no usable CUDA device: {cuda}"
    from jax_moe_comm import NativeUnavailableError

    with pytest.raises(NativeUnavailableError):
        native.module()


def test_timeout_names_where_the_late_rank_stands():
    """A PeerTimeout record carries the waited-for rank's started marks (read when the wait gave
    up): the message tells a rank that has not started the cycle from one that is between ops
    and from one that started the kernel the wait needed and stalled inside it."""
    if not native.built():
        pytest.skip(f"built without a CUDA toolkit: {native._import_error}")
    describe = native._native._describe_timeout
    recv_phase, count_what, send_kernel = 2, 2, 1  # dispatch_recv waits for a dispatch_send
    # Rank 3 still in cycle 6 (combine_recv) while rank 0 waits for its cycle-7 count.
    not_waited, alive, silent = 0, 1, 2  # PeerView::late
    late = describe(0, recv_phase, 3, 7 * 9, count_what, send_kernel, 7, [6, 6, 6, 6],
                    not_waited)
    assert late.startswith("PeerTimeout: rank 0 in dispatch_recv")
    assert "rank 3 has not started cycle 7" in late and "combine_recv of cycle 6" in late
    # The wait for its start went on while its heartbeat did, then ran out of start_timeout_s;
    # or its heartbeat stopped: a dead process, not a late one.
    beyond = describe(0, recv_phase, 3, 7 * 9, count_what, send_kernel, 7, [6, 6, 6, 6], alive)
    assert "rank 3 has not started cycle 7" in beyond and "within start_timeout_s" in beyond
    gone = describe(0, recv_phase, 3, 7 * 9, count_what, send_kernel, 7, [6, 6, 6, 6], silent)
    assert "rank 3 has not started cycle 7" in gone and "stopped its heartbeat" in gone
    # Its dispatch of cycle 7 ran; rank 0's combine_recv waits for its combine_send's rows.
    between = describe(0, 4, 3, 7, 4, 3, 7, [7, 7, 6, 6], not_waited)
    assert "rank 3 is mid-cycle: it has not started its combine_send of cycle 7" in between
    assert "dispatch_recv of cycle 7" in between
    # It started the kernel whose count we wait for, and the count never came.
    stalled = describe(0, recv_phase, 3, 7 * 9, count_what, send_kernel, 7, [7, 6, 6, 6],
                       not_waited)
    assert "rank 3 had started its dispatch_send of cycle 7" in stalled
    assert "stalled inside it" in stalled
    fresh = describe(1, recv_phase, 0, 9, count_what, send_kernel, 1, [0, 0, 0, 0], not_waited)
    assert "started no kernel on this handle since its creation or recover()" in fresh
    # The barrier's waits carry no view: the message is the bare timeout.
    assert "cycle" not in describe(0, 5, 1, 3, 0, 0, 0, [0, 0, 0, 0],
                                   not_waited).split("timeout passed")[1]
