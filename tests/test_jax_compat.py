"""The private JAX pieces (jax_moe_comm/_jax_compat.py) on the installed jax: each is present,
and the one whose calling form changed between versions (DCE rules) behaves. CI runs this
file on the oldest supported jax (the main venv) and on the newest (scripts/test_newest_jax.sh).
"""

import jax
import jax.numpy as jnp
import pytest

from jax_moe_comm import _jax_compat as C


def test_every_private_piece_imports():
    assert C.MISSING == "", C.MISSING


@pytest.mark.parametrize("owner,name", [
    ("core", "ShapedArray"), ("core", "Var"), ("core", "trace_state_clean"),
    ("core", "trace_ctx"), ("core", "get_axis_env"), ("core", "auto_insert_reshard"),
    ("dispatch", "apply_primitive"), ("pe", "dce_rules"), ("pe", "dce_jaxpr"),
    ("pe", "partial_eval_jaxpr_custom_rules"), ("ad", "defjvp_zero"),
    ("effects", "remat_allowed_effects"), ("clusters", "ClusterEnv")])
def test_the_attributes_we_use_exist(owner, name):
    assert hasattr(getattr(C, owner), name), f"jax {jax.__version__}: {owner}.{name} is gone"


def test_cluster_types_and_distributed_state():
    assert isinstance(C.clusters.ClusterEnv._cluster_types, list)
    assert hasattr(C.distributed_state(), "client")


def test_trace_queries_inside_and_outside_jit():
    assert not C.under_trace()
    seen = []

    @jax.jit
    def f(x):
        seen.append((C.under_trace(), C.current_trace()))
        return x + 1

    f(jnp.ones(2))
    assert seen and seen[0][0] is True and seen[0][1] is not None


def test_a_dce_rule_registered_through_the_shim_keeps_an_unused_call():
    """A primitive whose output nobody reads, with a rule that keeps it: DCE must call the rule
    in this jax's form (a wrong arity raises TypeError, as jax 0.12 did against the old form)
    and keep the equation; a second primitive with a rule that drops it must go."""
    from jax.extend.core import Primitive

    kept_calls = []

    def make(name, keep):
        p = Primitive(name)
        p.def_abstract_eval(lambda x: x)

        def rule(used_outputs, eqn):
            kept_calls.append(name)
            if keep or any(used_outputs):
                return [True] * len(eqn.invars), eqn
            return [False] * len(eqn.invars), None

        C.register_dce_rule(p, rule)
        return p

    keep, drop = make("jmc_test_keep", True), make("jmc_test_drop", False)

    def f(x):
        keep.bind(x)
        drop.bind(x)
        return x * 2

    jaxpr = jax.make_jaxpr(f)(jnp.ones(3)).jaxpr
    pruned, _ = C.pe.dce_jaxpr(jaxpr, [True])
    names = [e.primitive.name for e in pruned.eqns]
    assert "jmc_test_keep" in names and "jmc_test_drop" not in names, names
    assert sorted(set(kept_calls)) == ["jmc_test_drop", "jmc_test_keep"]


def test_our_primitives_survive_jit_on_this_jax():
    """The FFI call primitive and the host check build on this jax (they register the DCE and
    remat rules above); None would mean the slower fallback and an unchecked reference run."""
    from jax_moe_comm.backends import ffi_call, host_check

    assert ffi_call._primitive() is not None
    assert host_check._primitive() is not None
