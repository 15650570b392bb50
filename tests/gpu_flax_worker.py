"""Flax module suite (issue 26), run on every rank by the launcher:

    python -m jax_moe_comm.launch -n 8 --oversubscribe -- python tests/gpu_flax_worker.py
    python -m jax_moe_comm.launch -n 2 --platform cpu -- \
        python tests/gpu_flax_worker.py --backend reference         # this file itself, on CPU

A ("data", "expert") mesh of every process's one device, the expert axis over both (the
nvshmem backend's all-to-all spans every process), sigmoid grouped top-k with a shared
expert, budgets (16, 2):
  abstract    nnx.eval_shape builds the model: no handle, partition specs on every parameter
  init        sharded init (nnx.jit of the constructor, each process computes its shards),
              then create_handles: one handle per budget
  forward     [B, S, H] and a 1-token-per-rank decode call against the dense layer on this
              process's own device (parameters gathered through the key-value store)
  train       --steps Adam steps of the expert weights through dispatch/combine's backward
              all-to-alls; the loss goes down
  checkpoint  Orbax save, restore into the abstract model's shardings, the same outputs
No XLA collective runs on the nvshmem backend (NCCL refuses several ranks on one GPU): the
loss is reduced on the host, the training step's cotangent is elementwise, the replicated
parameters are not trained (they would need an all-reduce), Orbax's barriers go through the
key-value store; each jitted program's HLO is checked for collectives.
Prints `PASS name` / `FAIL name: why` per case on rank 0, then `GPU FLAX SUITE PASSED`.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
import types

import jax_moe_comm.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
RANK, WORLD = dist.initialize()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

from gpu_harness import Suite, gather_global  # noqa: E402
from jax_moe_comm import bootstrap  # noqa: E402
import jax_moe_comm.flax as jf  # noqa: E402
from jax_moe_comm.router import RouterConfig  # noqa: E402

suite = Suite(RANK)
log, case = suite.log, suite.case
E, K, H, F = 4 * WORLD, 4, 256, 256
BUDGETS = (16, 2)
COLLECTIVES = re.compile(r"\b(all-reduce|all-gather|reduce-scatter|collective-permute|"
                         r"all-to-all)(-start)?\(")


def mesh_of_processes():
    data = 2 if WORLD % 2 == 0 else 1
    return jax.sharding.Mesh(np.array(jax.devices()).reshape(data, WORLD // data),
                             ("data", "expert"))


def build(mesh, backend, seed=0, **kw):
    return jf.MoE(num_experts=E, experts_per_token=K, hidden=H, ffn=F, shared_ffn=128,
                  max_num_tokens=BUDGETS, mesh=mesh, expert_axis=("data", "expert"),
                  router=RouterConfig(score="sigmoid", num_groups=4,
                                      topk_groups=2 if E // 2 >= K else None, scale=2.5),
                  backend=backend, eager_handles=False, rngs=nnx.Rngs(seed), **kw)


def collectives(jitted, *args) -> list[str] | None:
    if not hasattr(jitted, "lower"):  # an nnx.jit without .lower (another flax version)
        return None
    return sorted({m.group(1) for m in COLLECTIVES.finditer(
        jitted.lower(*args).compile().as_text())})


def no_collectives(found: list[str] | None, backend: str, what: str) -> str:
    if found is None:
        return "XLA collectives: not checked"
    allowed = {"all-to-all"} if backend == "reference" else set()  # the reference's own
    extra = sorted(set(found) - allowed)
    assert not extra, f"{what} runs XLA collectives {extra} (NCCL refuses several ranks/GPU)"
    return f"XLA collectives: {found or 'none'}"


def mine(arr) -> np.ndarray:
    """This process's rows of a global array sharded over every device on its first axis."""
    return np.asarray(arr.addressable_shards[0].data)


def full_params(model, tag: str) -> dict:
    return {name: gather_global(f"flax:{tag}:{name}", v)  # sharded or replicated
            for name, v in model._params().items()}


def kv_barriers_for_orbax() -> None:
    """Orbax's default barrier is an XLA all-reduce over every device; NCCL refuses several
    ranks on one GPU, so its barriers go through the key-value store here."""
    try:  # orbax's own switch to the distributed client's barrier, where it has one
        from absl import flags

        if not flags.FLAGS.is_parsed():
            flags.FLAGS.mark_as_parsed()
        flags.FLAGS.experimental_orbax_use_distributed_barrier = True
    except Exception:  # noqa: BLE001 - an orbax without the flag: the patch below does it
        pass
    from orbax.checkpoint._src.multihost import multihost as omh

    def sync(name, *_, **__):
        bootstrap.all_gather(f"orbax:{name}", "1")

    def refuse(*_, **__):
        raise RuntimeError("orbax asked for an XLA collective the worker does not allow")

    omh.multihost_utils = types.SimpleNamespace(sync_global_devices=sync,
                                                broadcast_one_to_all=refuse,
                                                reached_preemption_sync_point=refuse)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", default="nvshmem", choices=("nvshmem", "reference"))
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--quick", action="store_true", help="accepted (gpu_check.sh)")
    args = parser.parse_args()
    backend = args.backend
    mesh = mesh_of_processes()
    log(f"world={WORLD} platform={jax.default_backend()} backend={backend} "
        f"jax={jax.__version__} mesh={dict(mesh.shape)}")
    state = {}
    local = jax.local_devices()[0]
    m = BUDGETS[0]
    rng = np.random.default_rng(5)
    x_all = rng.standard_normal((WORLD * 2, m // 2, H)).astype(jnp.bfloat16)  # [B, S, H]
    xs = jax.make_array_from_callback(x_all.shape, NamedSharding(mesh, P(("data", "expert"))),
                                      lambda idx: x_all[idx])
    step = nnx.jit(lambda model, x: model(x))

    @case(f"EP{WORLD}-abstract-model-no-handle")
    def abstract():
        made = []
        real = jf.AllToAll
        jf.AllToAll = lambda *a, **k: made.append(1) or real(*a, **k)
        try:
            model = nnx.eval_shape(lambda: build(mesh, backend))
        finally:
            jf.AllToAll = real
        assert not made and not model.handles.by_budget, "eval_shape made a handle"
        specs = nnx.get_partition_spec(nnx.state(model, nnx.Param))
        got = {k: str(getattr(specs[k], "get_value", lambda v=specs[k]: v.value)())
               for k in ("w_in", "router")}
        assert "('data', 'expert')" in got["w_in"], got
        state["abstract"] = model
        return f"partition specs {got}"

    @case(f"EP{WORLD}-sharded-init-then-handles")
    def init():
        model = nnx.jit(lambda: build(mesh, backend))()
        shard = model.w_in[...].addressable_shards[0].data
        assert shard.shape == (E // WORLD, H, F), shard.shape
        assert not model.handles.by_budget
        n = jf.create_handles(model)
        assert n == len(BUDGETS), n
        state["model"] = model
        return f"w_in shard {tuple(shard.shape)} per process, {n} handles"

    @case(f"EP{WORLD}-forward-bsh-and-decode-vs-dense")
    def forward():
        model = state["model"]
        hlo = no_collectives(collectives(step, model, xs), backend, "the forward")
        p = {k: jax.device_put(v, local) for k, v in full_params(model, "fwd").items()}
        dense = jax.jit(lambda x, p: model.dense(x, params=p))
        worst = 0.0
        x1 = rng.standard_normal((WORLD, H)).astype(jnp.bfloat16)  # 1 token per rank
        x1s = jax.make_array_from_callback(x1.shape, NamedSharding(mesh, P(("data", "expert"))),
                                           lambda idx: x1[idx])
        for x, x_local in ((xs, x_all[2 * RANK:2 * RANK + 2]), (x1s, x1[RANK:RANK + 1])):
            y = mine(step(model, x)).astype(np.float32)
            ref = np.asarray(dense(jax.device_put(x_local, local), p), np.float32)
            assert y.shape == ref.shape and np.abs(ref).max() > 0.1, (y.shape, ref.shape)
            worst = max(worst, float(np.abs(y - ref).max()))
        jf.check_handles(model)
        assert worst <= 0.05, worst
        return f"max|y - dense| = {worst:.3g} ([B,S,H] budget 16, 1 token/rank budget 2); {hlo}"

    @case(f"EP{WORLD}-train-{args.steps}-steps")
    def train():
        import optax

        model = state["model"]
        experts = nnx.Any(nnx.PathContains("w_in"), nnx.PathContains("w_out"))
        graphdef, params, rest = nnx.split(model, experts, ...)
        target_w = jnp.asarray(np.random.default_rng(9).standard_normal((H, H)) / np.sqrt(H),
                               jnp.float32)
        tx = optax.adam(3e-3)
        opt = tx.init(params)

        @jax.jit
        def train_step(params, opt, x):
            def f(p):
                return nnx.merge(graphdef, p, rest)(x).astype(jnp.float32)

            target = jnp.tanh(x.astype(jnp.float32) @ target_w)
            y, vjp = jax.vjp(f, params)
            n = x.shape[0] * x.shape[1]
            (g,) = vjp(2.0 * (y - target) / (n * H))  # elementwise: no reduction over ranks
            updates, opt = tx.update(g, opt, params)
            sq = jnp.sum((y - target) ** 2, axis=-1)  # per token, reduced on the host
            return optax.apply_updates(params, updates), opt, sq

        hlo = no_collectives(collectives(train_step, params, opt, xs), backend,
                             "the training step")
        losses = []
        for _ in range(args.steps):
            params, opt, sq = train_step(params, opt, xs)
            parts = bootstrap.all_gather(f"loss{len(losses)}", repr(float(mine(sq).sum())))
            losses.append(sum(float(v) for v in parts) / (x_all.shape[0] * m // 2 * H))
        nnx.update(model, params)
        jf.check_handles(model)
        assert losses[-1] < 0.9 * losses[0], losses
        return f"loss {losses[0]:.4f} -> {losses[-1]:.4f}; {hlo}"

    @case(f"EP{WORLD}-orbax-save-restore")
    def checkpoint():
        import orbax.checkpoint as ocp

        kv_barriers_for_orbax()
        model = state["model"]
        root = bootstrap.all_gather("flax:ckpt", tempfile.mkdtemp() if RANK == 0 else "")[0]
        path = os.path.join(root, "moe")
        with ocp.StandardCheckpointer() as ckpt:
            ckpt.save(path, nnx.state(model, nnx.Param))
        graphdef, abs_state, rest = nnx.split(nnx.eval_shape(lambda: build(mesh, backend, 7)),
                                              nnx.Param, ...)
        target = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                              abs_state, nnx.get_named_sharding(abs_state, mesh))
        with ocp.StandardCheckpointer() as ckpt:
            restored = ckpt.restore(path, target)
        back = nnx.merge(graphdef, restored, rest)
        jf.create_handles(back)
        same = np.array_equal(mine(step(back, xs)).astype(np.float32),
                              mine(step(model, xs)).astype(np.float32))
        jf.check_handles(back)
        jf.close_handles(back)
        assert same, "the restored model's output differs"
        return f"restored into {len(jax.tree.leaves(target))} sharded arrays, same output"

    if "model" in state:
        jf.close_handles(state["model"])
    return suite.finish("GPU FLAX SUITE")


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.exit(code)
