"""Creation requests compared across ranks before anything collective (issue 28, item 5): a
rank with another setting is named on every rank instead of leaving the others in the
collective allocation."""

from jax_moe_comm.backends.nvshmem import PROTOCOL_ENV, creation_mismatch


def request(shape=(8, 2, 128, 4, 2, 1, "bfloat16", "bfloat16"), **settings):
    base = dict({k: "" for k in PROTOCOL_ENV}, num_blocks=0, warps_per_block=16, start_epoch=0)
    return {"shape": list(shape), "settings": dict(base, **settings)}


def test_agreeing_ranks_pass():
    assert creation_mismatch(1, [request(), request(), request()]) == ""


def test_a_differing_env_setting_names_the_rank_on_every_rank():
    everyone = [request(JMC_FUSED="bogus"), request(), request()]
    for rank in range(3):
        msg = creation_mismatch(rank, everyone)
        assert "JMC_FUSED differs between ranks" in msg and "'bogus' on rank 0" in msg, msg
    assert "'' on rank 1" in creation_mismatch(0, everyone)


def test_a_differing_shape_is_reported_before_settings():
    everyone = [request(), request(shape=(16, 2, 128, 4, 2, 1, "bfloat16", "bfloat16"),
                                   JMC_PDL="0")]
    msg = creation_mismatch(0, everyone)
    assert msg.startswith("rank(s) [1] asked for another layer shape"), msg


def test_a_test_only_start_epoch_must_agree_too():
    msg = creation_mismatch(0, [request(start_epoch=2**32), request()])
    assert "start_epoch differs" in msg


def test_a_staged_transport_on_one_rank_only_is_named():
    """The staged transport changes the symmetric layout and who is sent to how (issue 25):
    a rank asking for it alone is named, whether it came from the environment or the code."""
    msg = creation_mismatch(1, [request(transport="auto", JMC_TRANSPORT="staged"),
                                request(transport="auto")])
    assert "differs between ranks" in msg and "on rank 0" in msg, msg
    assert "JMC_TRANSPORT" in PROTOCOL_ENV


def test_the_protocol_options_must_agree():
    """JMC_ACKS decides how a receiver tells a sender it may overwrite: a rank asking for
    release acknowledgements alone is named at creation."""
    for key, value in (("JMC_ACKS", "release"),):
        assert key in PROTOCOL_ENV
        msg = creation_mismatch(0, [request(), request(**{key: value})])
        assert f"{key} differs between ranks" in msg and f"'{value}' on rank 1" in msg, msg


def test_a_refusal_on_one_rank_is_named_on_every_rank():
    """A rank that cannot create the handle (no usable GPU, a process layout the backend
    refuses) still takes the creation's tag and publishes why (issue 48, item 4): every rank
    raises naming it, and nobody is left in the collective allocation."""
    from jax_moe_comm.backends.nvshmem import creation_refusal

    everyone = [dict(request(), refused=""), dict(request(), refused="no usable CUDA device"),
                dict(request(), refused="")]
    for rank in range(3):
        msg = creation_refusal(rank, everyone)
        assert msg.startswith("rank(s) [1] cannot create it") and "no usable CUDA device" in msg
    assert "(this rank)" in creation_refusal(1, everyone)
    assert "(this rank)" not in creation_refusal(0, everyone)
    assert creation_refusal(0, [dict(request(), refused="")] * 3) == ""


def test_a_refused_creation_still_takes_its_tag():
    """Here (no GPU) the nvshmem backend refuses: after its creation tag, so that the tag
    counters of the ranks stay in step whichever of them refused."""
    import pytest

    from jax_moe_comm import KernelTuning, MoEConfig, NativeUnavailableError, bootstrap
    from jax_moe_comm.backends import nvshmem

    cfg = MoEConfig(num_experts=8, experts_per_token=2, hidden=128, max_num_tokens=4,
                    world_size=1)
    from jax_moe_comm.api import _gpu_problem

    if not _gpu_problem(cfg):
        pytest.skip("the nvshmem backend can run here: nothing refuses")
    first = int(bootstrap.next_collective_tag("probe").removeprefix("probe"))
    with pytest.raises(NativeUnavailableError):
        nvshmem.NvshmemBackend(cfg, "ep", KernelTuning())
    after = int(bootstrap.next_collective_tag("probe").removeprefix("probe"))
    assert after == first + 2, "the refused creation took no tag"
