"""recover()'s agreement on the cycles every rank completed (jax_moe_comm.recovery), and what
recover() returns on the reference backend. The GPU side (each rank's count from its kernels'
error record) runs in tests/gpu_server_worker.py."""

import pytest

from jax_moe_comm import recovery
from jax_moe_comm.errors import MoECommError, RecoveryError


@pytest.mark.parametrize("counts,agreed", [([5], 5), ([3, 3, 3, 3], 3), ([7, 6, 7, 7], 6),
                                           ([0, 1], 0), ([2**48, 2**48 + 1], 2**48)])
def test_the_agreed_point_is_the_fewest_cycles_within_one(counts, agreed):
    assert recovery.agreed_point(counts) == agreed


def test_counts_two_apart_are_refused_naming_every_rank():
    with pytest.raises(RecoveryError) as e:
        recovery.agreed_point([9, 7, 9, 8])
    text = str(e.value)
    assert "2 apart" in text and all(f"rank {r}: {n}" in text
                                     for r, n in enumerate([9, 7, 9, 8]))
    assert isinstance(e.value, MoECommError)  # a server's `except MoECommError` sees it


def test_no_counts_is_a_caller_error():
    with pytest.raises(ValueError):
        recovery.agreed_point([])


def test_agree_in_one_process_returns_its_own_count():
    assert recovery.agree("recover", 12) == 12
