"""The plain-jit entry (sharded.moe_layer, issue 49): on global arrays under jax.jit it gives
exactly what the hand-written shard_map of moe_forward gives, values and gradients; it compiles
to the same program (the same multiset of HLO operations: no reshard, gather or copy added);
it refuses at trace time what cannot be laid out; the snippet of docs/plain_jit.md runs."""

import collections
import functools
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jax_moe_comm import AllToAll
from jax_moe_comm.moe import MoELayerConfig, init_params, moe_forward
from jax_moe_comm.sharded import moe_layer, param_specs

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
H, M = 64, 8  # hidden, tokens per rank

# (mesh shape, mesh axes, expert axes, data axes)
MESHES = {"ep8": ((8,), ("ep",), ("ep",), ()),
          "data2xexpert4": ((2, 4), ("data", "expert"), ("expert",), ("data",))}
AXIS_TYPES = [t for t in ("Explicit", "Auto") if hasattr(jax.sharding.AxisType, t)]


class Rig:
    """A mesh, a layer config, its handle, placed parameters and inputs, and the two ways of
    calling the layer: the entry under plain jit, and the hand-written shard_map."""

    def __init__(self, mesh_name, axis_type, shared=1):
        shape, names, self.expert, self.data = MESHES[mesh_name]
        kind = getattr(jax.sharding.AxisType, axis_type)
        self.mesh = jax.make_mesh(shape, names, axis_types=(kind,) * len(names))
        ep = int(np.prod([self.mesh.shape[a] for a in self.expert]))
        self.shards = int(np.prod(shape))
        self.cfg = MoELayerConfig(num_experts=2 * ep, experts_per_token=2, hidden=H, ffn=64,
                                  max_num_tokens=M, num_shared_experts=shared)
        axis = self.expert[0] if len(self.expert) == 1 else self.expert
        self.a2a = AllToAll(self.cfg.comm_config(ep), axis_name=axis, backend="reference",
                            differentiable=True)
        full = init_params(self.cfg, seed=1)
        self.specs = param_specs(full, self.expert)
        self.params = {k: jax.device_put(v, NamedSharding(self.mesh, self.specs[k]))
                       for k, v in full.items()}
        tokens = self.data + self.expert
        self.rows = P(tokens[0] if len(tokens) == 1 else tokens)
        rng = np.random.default_rng(2)
        T = self.shards * M
        self.x = self.put(rng.standard_normal((T, H)).astype(jnp.bfloat16))
        self.nt = self.put(rng.integers(M // 2, M + 1, self.shards).astype(np.int32))
        self.G = self.put(rng.standard_normal((T, H)).astype(np.float32))
        self.entry = functools.partial(moe_layer, a2a=self.a2a, layer_config=self.cfg,
                                       mesh=self.mesh, expert_axis=axis,
                                       data_axes=self.data)

    def put(self, a, spec=None):
        return jax.device_put(a, NamedSharding(self.mesh, self.rows if spec is None else spec))

    def hand_written(self, params, x, nt):
        def per_rank(p, x, n):
            return moe_forward(self.a2a, self.cfg, p, x, n.reshape(()))

        return jax.shard_map(per_rank, mesh=self.mesh, in_specs=(self.specs, self.rows,
                                                                 self.rows),
                             out_specs=self.rows)(params, x, nt)

    def close(self):
        self.a2a.close()


# Module scope: the tests of one mesh share its rig, so the programs one test jitted are not
# compiled again by the next (the comparisons read the rig, never change it).
@pytest.fixture(scope="module", params=[(m, t) for m in MESHES for t in AXIS_TYPES],
                ids=lambda p: f"{p[0]}-{p[1]}")
def rig(request):
    r = Rig(*request.param)
    yield r
    r.close()


def test_the_entry_equals_the_hand_written_shard_map(rig):
    y = jax.jit(rig.entry)(rig.params, rig.x, rig.nt)
    want = jax.jit(rig.hand_written)(rig.params, rig.x, rig.nt)
    assert y.shape == (rig.shards * M, H) and y.dtype == jnp.bfloat16
    assert y.sharding.is_equivalent_to(want.sharding, 2), (y.sharding, want.sharding)
    got, want = np.asarray(y, np.float32), np.asarray(want, np.float32)
    assert np.abs(got).max() > 0  # a layer that returned zeros would match nothing real
    np.testing.assert_array_equal(got, want)
    # rows past each shard's count are zero, the rows before it are not all zero
    live = np.arange(M)[None, :] < np.asarray(rig.nt)[:, None]
    blocks = got.reshape(rig.shards, M, H)
    assert not blocks[~live].any() and np.abs(blocks[live]).sum(-1).min() > 0


def test_gradients_through_the_entry_equal_the_hand_written_ones(rig):
    def loss(layer):
        return lambda p, x: jnp.sum(rig.G * layer(p, x, rig.nt).astype(jnp.float32))

    got = jax.jit(jax.grad(loss(rig.entry), argnums=(0, 1)))(rig.params, rig.x)
    want = jax.jit(jax.grad(loss(rig.hand_written), argnums=(0, 1)))(rig.params, rig.x)
    (gp, gx), (wp, wx) = got, want
    assert set(gp) == set(rig.params) and np.abs(np.asarray(gx, np.float32)).max() > 0
    for name in rig.params:
        assert gp[name].shape == rig.params[name].shape
        assert np.abs(np.asarray(wp[name], np.float32)).max() > 0, name
        np.testing.assert_array_equal(np.asarray(gp[name], np.float32),
                                      np.asarray(wp[name], np.float32), err_msg=name)
    np.testing.assert_array_equal(np.asarray(gx, np.float32), np.asarray(wx, np.float32))


# -- the compiled programs ----------------------------------------------------------------------
# An HLO instruction: `[ROOT] %name = <type> <opcode>(...`; the type may be a tuple with spaces
# and /*index=N*/ comments but never a lowercase word directly before "(".
INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(.*)$")
OPCODE = re.compile(r"(?:^|(?<=[\s)\]}]))([a-z][a-z0-9\-]*)\(")
TARGET = re.compile(r'custom_call_target="([^"]+)"')
COLLECTIVES = ("all-to-all", "all-gather", "all-reduce", "collective-permute", "reduce-scatter",
               "all-gather-start", "all-reduce-start", "collective-permute-start")


def op_kinds(hlo: str) -> collections.Counter:
    """The multiset of operations of a compiled module, every computation (fused ones too):
    opcodes, custom calls by target."""
    kinds = collections.Counter()
    for line in hlo.splitlines():
        m = INSTRUCTION.match(line)
        if not m:
            continue
        op = OPCODE.search(m.group(1))
        assert op, f"no opcode in: {line[:200]}"
        kind = op.group(1)
        if kind == "custom-call":
            target = TARGET.search(line)
            kind = f"custom-call:{target.group(1) if target else '?'}"
        kinds[kind] += 1
    return kinds


def compiled(fn, *args) -> str:
    return jax.jit(fn).lower(*args).compile().as_text()


def test_the_entry_compiles_to_the_hand_written_program(rig):
    """Same ops, same counts: collectives, copies, custom calls and all the rest. The reference
    backend's all-to-alls are there in both (so the collectives are counted, not absent)."""
    entry = op_kinds(compiled(rig.entry, rig.params, rig.x, rig.nt))
    hand = op_kinds(compiled(rig.hand_written, rig.params, rig.x, rig.nt))
    assert hand["all-to-all"] > 0 and sum(hand.values()) > 100, hand
    assert entry == hand, {k: (entry[k], hand[k]) for k in entry.keys() | hand.keys()
                           if entry[k] != hand[k]}


def test_the_comparison_sees_a_reshard():
    """The same comparison on x laid out over the hidden dimension: the entry must move it
    (it does, and the comparison says so): the check above can fail."""
    rig = Rig("ep8", AXIS_TYPES[0])
    try:
        wrong = rig.put(np.asarray(rig.x), P(None, "ep"))
        entry = op_kinds(compiled(rig.entry, rig.params, wrong, rig.nt))
        hand = op_kinds(compiled(rig.hand_written, rig.params, rig.x, rig.nt))
        moved = sum(entry[k] for k in COLLECTIVES) - sum(hand[k] for k in COLLECTIVES)
        assert entry != hand and moved > 0, {k: (entry[k], hand[k]) for k in COLLECTIVES}
        np.testing.assert_array_equal(  # and the values are still the layer's
            np.asarray(jax.jit(rig.entry)(rig.params, wrong, rig.nt), np.float32),
            np.asarray(jax.jit(rig.hand_written)(rig.params, rig.x, rig.nt), np.float32))
    finally:
        rig.close()


def test_fewer_rows_than_the_budget_are_padded_inside():
    """4 rows per shard on a budget of 8: the rows of the hand-written layer on each block
    padded to 8 with zeros, counts as given; no num_tokens: every row of the block live."""
    rig = Rig("ep8", AXIS_TYPES[0], shared=0)
    try:
        m = M // 2
        xs = np.asarray(rig.x, np.float32).reshape(rig.shards, M, H)[:, :m]
        x = rig.put(xs.reshape(-1, H).astype(jnp.bfloat16))
        padded = rig.put(np.pad(xs, ((0, 0), (0, M - m), (0, 0))).reshape(-1, H)
                         .astype(jnp.bfloat16))
        nt = np.array([m, 3, 0, 1, m, 2, m, 4], np.int32)
        for counts, live in ((rig.put(nt), nt), (None, np.full(rig.shards, m, np.int32))):
            y = jax.jit(rig.entry)(rig.params, x, counts)
            want = jax.jit(rig.hand_written)(rig.params, padded, rig.put(live))
            want = np.asarray(want, np.float32).reshape(rig.shards, M, H)[:, :m]
            assert y.shape == (rig.shards * m, H) and np.abs(want).max() > 0
            np.testing.assert_array_equal(np.asarray(y, np.float32).reshape(want.shape), want)
    finally:
        rig.close()


# -- refusals, at trace time ----------------------------------------------------------------------
def test_tokens_that_do_not_divide_over_the_token_shards_are_refused():
    rig = Rig("data2xexpert4", AXIS_TYPES[0])
    try:
        x = jax.ShapeDtypeStruct((60, H), jnp.bfloat16)
        with pytest.raises(ValueError, match=r"x has 60 tokens, not a multiple of the 8 token "
                                             r"shards \(data=2 x expert=4\): pad x"):
            jax.eval_shape(rig.entry, rig.params, x)
        with pytest.raises(ValueError, match=r"x has 128 tokens, 16 per token shard, more than "
                                             r"max_num_tokens=8"):
            jax.eval_shape(rig.entry, rig.params, jax.ShapeDtypeStruct((128, H), jnp.bfloat16))
        with pytest.raises(ValueError, match=r"num_tokens has shape \[4\]; expected None or "
                                             r"\[8\] int32"):
            jax.eval_shape(rig.entry, rig.params, rig.x, jnp.zeros(4, jnp.int32))
    finally:
        rig.close()


def test_an_expert_dimension_that_does_not_divide_over_the_expert_axis_is_refused():
    rig = Rig("ep8", AXIS_TYPES[0])
    try:
        params = dict(rig.params)
        for name in ("w_in", "w_out"):
            shape = params[name].shape
            params[name] = jax.ShapeDtypeStruct((12,) + shape[1:], params[name].dtype)
        with pytest.raises(ValueError, match=r"params\['w_in'\] has 12 experts on its first "
                                             r"dimension, not a multiple of the 8 devices of the "
                                             r"expert axis \(ep=8\)"):
            jax.eval_shape(rig.entry, params, rig.x)
        params["w_in"] = params["w_out"] = jax.ShapeDtypeStruct((8, H, 64), jnp.bfloat16)
        with pytest.raises(ValueError, match=r"params\['w_in'\] has shape \[8, 64, 64\]; "
                                             r"expected \[16, 64, 64\]"):
            jax.eval_shape(rig.entry, params, rig.x)
    finally:
        rig.close()


def test_a_handle_of_another_axis_or_size_is_refused():
    rig = Rig("data2xexpert4", AXIS_TYPES[0])
    try:
        with pytest.raises(ValueError, match=r"the handle runs over axis_name='expert' but "
                                             r"expert_axis is 'data'"):
            jax.eval_shape(functools.partial(rig.entry, expert_axis="data", data_axes=()),
                           rig.params, rig.x)
        with pytest.raises(ValueError, match=r"expert_axis names 'ep', not an axis of the mesh"):
            jax.eval_shape(functools.partial(rig.entry, expert_axis="ep"), rig.params, rig.x)
    finally:
        rig.close()


# -- the page -------------------------------------------------------------------------------------
def test_the_docs_snippet_runs_as_written(tmp_path):
    """The page's one snippet, copied out and run as a script on 8 CPU devices."""
    with open(os.path.join(ROOT, "docs", "plain_jit.md")) as f:
        blocks = re.findall(r"^```python\n(.*?)^```$", f.read(), re.MULTILINE | re.DOTALL)
    assert len(blocks) == 1, "docs/plain_jit.md has one runnable snippet"
    script = tmp_path / "plain_jit.py"
    script.write_text(blocks[0])
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS="--xla_force_host_platform_device_count=8")
    r = subprocess.run([sys.executable, str(script)], check=False, capture_output=True,
                       text=True, timeout=300, env=env, cwd=str(tmp_path))
    assert r.returncode == 0, r.stdout + r.stderr
    out = r.stdout.splitlines()
    assert out[0].startswith("(128, 64) bfloat16 ") and "'ep'" in out[0], out
    assert "'w_in': (16, 64, 128)" in out[1] and "'router': (64, 16)" in out[1], out
