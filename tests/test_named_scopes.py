"""Every op and the layer's stages carry a jax.named_scope, so a profile (XProf, Perfetto) and
the HLO's op metadata name them instead of anonymous custom calls."""

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

from jax_moe_comm import AllToAll, testing as T
from jax_moe_comm.moe import MoELayerConfig, init_params, moe_forward


def _lowered_text(fn, *args) -> str:
    return jax.jit(fn).lower(*args).as_text(debug_info=True)


def test_the_layer_names_its_stages_and_ops_in_the_hlo_metadata():
    world = 8
    cfg = MoELayerConfig(num_experts=16, experts_per_token=2, hidden=64, ffn=32,
                         max_num_tokens=4, num_shared_experts=1)
    mesh = T.make_mesh(world)
    with AllToAll(cfg.comm_config(world), backend="reference") as a2a:
        params = init_params(cfg)
        x = jax.numpy.asarray(np.random.default_rng(0).standard_normal(
            (world * cfg.max_num_tokens, cfg.hidden)), jax.numpy.bfloat16)
        nt = jax.numpy.full((world,), cfg.max_num_tokens, jax.numpy.int32)

        def body(p, x, nt):
            return moe_forward(a2a, cfg, p, x, nt.reshape(()))

        specs = T.layer_shardings(mesh, [params])[0]
        fn = jax.shard_map(body, mesh=mesh, in_specs=(specs, P("ep"), P("ep")),
                           out_specs=P("ep"))
        text = _lowered_text(fn, params, x, nt)
    for scope in ("jax_moe_comm.router", "jax_moe_comm.dispatch_send",
                  "jax_moe_comm.dispatch_recv", "jax_moe_comm.experts",
                  "jax_moe_comm.shared_experts_in", "jax_moe_comm.shared_experts_out",
                  "jax_moe_comm.combine_send", "jax_moe_comm.combine_recv"):
        assert scope in text, f"{scope} is not in the lowered program's metadata"
