"""The gated DeltaNet under context parallelism (:mod:`mlir_train.model.gdn_context`) equals one
device: the layer's output and its gradients (every weight, the input), on packed rows whose
documents cross the 2 x CP piece cuts, start exactly at a cut, and end in padding; CP 4 x DP 2
and CP 2 x TP 2 (heads split) x DP 2 on 8 fake devices. A piece shorter than the conv window
is refused naming the flags.

In float32 the layout's sums run in another order than one device's, so the two agree to float32
noise (1e-5 of each gradient's largest element here). In float64 (:func:`tests.helpers.float64`)
the same comparison must hold to 1e-10: a missing reset, a wrongly ordered fold or heads mixed
across tensor ranks would show there at full size, not hidden under a float32 tolerance."""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mlir_train.model.gdn_context import check_pieces
from mlir_train.model.linear_attention import GatedDeltaNet
from sharding import use_rules
from sharding.context import from_zigzag, to_zigzag
from sharding.layout import Layout
from sharding.mesh import make_mesh
from sharding.rules import rules_for
from tests.helpers import COMPILER_OPTIONS, float64

T = 32
# Row 0: a document over the cuts at 4 and 8, one from the cut at 12 to the cut at 16, one over
# the cuts 16..24, then padding; row 1: a 3-token document, one across nearly every cut, padding.
SEGMENTS = np.array([[1] * 12 + [2] * 4 + [3] * 9 + [0] * 7,
                     [1] * 3 + [2] * 27 + [0] * 2], np.int32)


def _layer():
    return GatedDeltaNet(16, 2, 4, 8, 8, rngs=nnx.Rngs(3), chunk_size=4, dtype=jnp.float32)


def _loss_and_grads(layer, x, seg, order):
    def loss(layer, x):
        y, _ = layer(x, seg)
        y = from_zigzag_jnp(y, order)
        return jnp.sum(y * jnp.cos(jnp.arange(y.size).reshape(y.shape)))

    return nnx.value_and_grad(loss, argnums=(0, 1))(layer, x)


def from_zigzag_jnp(y, order):
    return jnp.take(y, jnp.argsort(order), axis=1)


# float32: 14 s (compile cache warm) to ~40 s cold at -O0 on 2 shared cores (load 8); float64: 80 s cold at
# load 7, over the ~30 s budget, but the default suite's only test of CP with TP (a whole step takes longer).
@pytest.mark.parametrize("layout, bits", [
    pytest.param(Layout(context=4), 32, marks=pytest.mark.slow),
    pytest.param(Layout(context=2, tensor=2), 32, marks=pytest.mark.slow),
    (Layout(context=2, tensor=2), 64),
], ids=["CP4xDP2", "CP2xTP2xDP2", "CP2xTP2xDP2-float64"])
def test_context_parallel_layer_matches_one_device(layout, bits):
    if bits == 64:
        with float64():
            _compare_with_one_device(layout, tol=1e-10)
    else:
        _compare_with_one_device(layout, tol=1e-5)


def _compare_with_one_device(layout, tol):
    start = time.perf_counter()
    x = jax.random.normal(jax.random.key(0), (2, T, 16), jnp.float32)
    seg = jnp.asarray(SEGMENTS)
    ref_fn = jax.jit(lambda l, x: _loss_and_grads(l, x, seg, jnp.arange(T)))
    ref_loss, (ref_g, ref_gx) = ref_fn.lower(_layer(), x).compile(COMPILER_OPTIONS)(_layer(), x)
    cp = layout.context
    order = to_zigzag(np.arange(T), cp)
    mesh = make_mesh(layout)
    with use_rules(rules_for(layout)), jax.set_mesh(mesh):
        fn = jax.jit(lambda l, x, s: _loss_and_grads(l, x, s, jnp.asarray(order)))
        args = (_layer(), jnp.asarray(to_zigzag(np.asarray(x), cp, axis=1)), jnp.asarray(to_zigzag(SEGMENTS, cp, axis=1)))
        compiled = fn.lower(*args).compile(COMPILER_OPTIONS)
        loss, (g, gx) = compiled(*args)
        hlo = compiled.as_text()
    assert "all-gather" in hlo
    assert all(a.dtype == x.dtype for a in jax.tree.leaves(nnx.state(g))), "the layer ran in another precision"
    np.testing.assert_allclose(loss, ref_loss, rtol=tol)
    np.testing.assert_allclose(from_zigzag(np.asarray(gx), cp, axis=1), ref_gx, atol=tol * np.abs(ref_gx).max())
    worst = 0.0
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(nnx.state(g)), jax.tree.leaves(nnx.state(ref_g))):
        a, b = np.asarray(a), np.asarray(b)
        worst = max(worst, np.abs(a - b).max() / np.abs(b).max())
        np.testing.assert_allclose(a, b, atol=tol * np.abs(b).max(), err_msg=jax.tree_util.keystr(path))
    print(f"{layout} {x.dtype}: loss rel {abs(loss / ref_loss - 1):.1e}, worst grad max|diff|/max|ref| {worst:.1e}, "
          f"{time.perf_counter() - start:.0f} s")


def test_pieces_shorter_than_the_conv_window_are_refused():
    """Before anything is built (sharding.mesh.validate with the family's layout dims), and
    again where the layer is traced."""
    from mlir_train.families import get_model_config
    from sharding.layout import LayoutError
    from sharding.mesh import validate

    dims = get_model_config("qwen3.5-moe-tiny").layout_dims()
    validate(Layout(context=4), dims, seq_length=24)
    with pytest.raises(LayoutError, match=r"--context-parallel-size \(4\) with --seq-length \(16\)"):
        validate(Layout(context=4), dims, seq_length=16)
    check_pieces(32, 4, 4)
    with pytest.raises(ValueError, match="--context-parallel-size 8 with --seq-length 32"):
        check_pieces(32, 8, 4)
