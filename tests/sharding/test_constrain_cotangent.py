"""``sharding.constrain_cotangent``: the identity, whose backward constrains the cotangent.

The model marks a row-parallel linear's output with it (``layers.row_parallel_out``) so that
under --sequence-parallel the backward gathers the output gradient once for both of the
linear's gradients; the compiled effect (one all-gather where XLA:GPU made two) is checked on
the deviceless GPU compile in ``tests/planner/test_comm_audit.py``.
"""

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import jaxprs_in_params

from sharding import Layout, constrain, constrain_cotangent, logical_to_spec, make_mesh, rules_for, use_rules

GATHERED = ("act_batch", "act_seq", "act_embed")
SPLIT = ("act_batch", "act_res_seq", "act_embed")


def _loss(x_BTD, w_DD):
    y_BTD = constrain_cotangent(jnp.einsum("btd,de->bte", x_BTD, w_DD), GATHERED)
    return jnp.sum(constrain(y_BTD, SPLIT) ** 2)


def _constraint_specs(jaxpr) -> list:
    out = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "sharding_constraint":
            out.append(eqn.params["sharding"].spec)
        for sub in jaxprs_in_params(eqn.params):
            out += _constraint_specs(sub)
    return out


def test_identity_forward_and_gradients():
    x = jnp.arange(2 * 8 * 4, dtype=jnp.float32).reshape(2, 8, 4) / 10
    w = jnp.eye(4) + 0.1
    plain = lambda x, w: jnp.sum(jnp.einsum("btd,de->bte", x, w) ** 2)  # noqa: E731
    np.testing.assert_allclose(_loss(x, w), plain(x, w), rtol=1e-6)
    for got, want in zip(jax.grad(_loss, argnums=(0, 1))(x, w), jax.grad(plain, argnums=(0, 1))(x, w)):
        np.testing.assert_allclose(got, want, rtol=1e-6)
    # Without rules (one device, notebooks) nothing is constrained, forward or backward.
    assert not _constraint_specs(jax.make_jaxpr(jax.grad(_loss))(x, w).jaxpr)


def test_backward_constrains_the_cotangent_to_the_gathered_layout():
    lay = Layout(tensor=2, sequence_parallel=True, num_devices=2)
    mesh, rules = make_mesh(lay), rules_for(lay)
    x = jnp.ones((1, 8, 4))
    w = jnp.eye(4)
    with jax.set_mesh(mesh), use_rules(rules):
        forward = _constraint_specs(jax.make_jaxpr(_loss)(x, w).jaxpr)
        backward = _constraint_specs(jax.make_jaxpr(jax.grad(_loss))(x, w).jaxpr)
        grads = jax.jit(jax.grad(_loss, argnums=(0, 1)))(x, w)
    split, gathered = (logical_to_spec(n, rules, mesh.axis_names) for n in (SPLIT, GATHERED))
    assert "tensor" in str(split) and "tensor" not in str(gathered)
    assert forward == [split]                   # only the residual stream's own constraint
    assert backward.count(gathered) == 1        # the cotangent, whole along the sequence
    np.testing.assert_allclose(grads[0], jax.grad(_loss)(x, w), rtol=1e-6)
