"""A small named layer shape for the CPU tests (test_reference.py, test_grad.py)."""

import dataclasses

import jax.numpy as jnp

from jax_moe_comm import MoEConfig

bf16 = jnp.bfloat16


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    E: int
    k: int
    H: int
    m: int
    ep: int
    dp: int = 1
    dtype: object = bf16
    out: object = bf16

    def cfg(self):
        return MoEConfig(num_experts=self.E, experts_per_token=self.k, hidden=self.H,
                         max_num_tokens=self.m, world_size=self.ep, token_replicas=self.dp,
                         dispatch_dtype=self.dtype, combine_dtype=self.out)
