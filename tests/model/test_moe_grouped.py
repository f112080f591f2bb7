"""The block-grouped MoE experts (``moe_impl="grouped"``, the GPU path) against the dense
reference, values and gradients, on one device, under data parallelism and under expert
parallelism (the ragged_all_to_all dispatcher, through its dense emulation on CPU).

On CPU the grouped path runs its custom VJP on ``jax.lax.ragged_dot`` kernels
(``kernels.blocks.xla_block_kernels``); the Mosaic-GPU kernels themselves run here in the
Mosaic-GPU interpreter on small shapes, and compile for an H200 in test_moe_gpu_compile.py.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import sharding
from mlir_train.model import ModelOptions
from mlir_train.families import get_model_config
from mlir_train.model.moe import block as moe_lib
from mlir_train.model.moe import dispatch as moe_dispatch
from mlir_train.model.kernels import blocks, mosaic_moe
from sharding import Layout

TINY = get_model_config("qwen3-moe-tiny", vocab_size=512, num_layers=2)
B, T = 8, 16
FAST_COMPILE = {"xla_backend_optimization_level": 0}


def _block(**kwargs):
    return moe_lib.MoE(TINY, nnx.Rngs(1), TINY.init_std, **kwargs)


def _inputs():
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((B, T, TINY.hidden_size)), jnp.float32)
    valid = np.ones((B, T), bool)
    valid[2, 5:] = False
    return x, jnp.asarray(valid)


def _run(block, x, valid, cfg=None):
    graphdef, state = nnx.split(block)

    def f(state, x):
        y, stats = nnx.merge(graphdef, state)(x, valid)
        return jnp.sum(jnp.sin(y)), y

    f = jax.value_and_grad(f, argnums=(0, 1), has_aux=True)
    if cfg is None:
        return jax.jit(f).lower(state, x).compile(FAST_COMPILE)(state, x), ""
    mesh, rules = sharding.make_mesh(cfg), sharding.rules_for(cfg)
    with jax.set_mesh(mesh), sharding.use_rules(rules):
        compiled = jax.jit(f).lower(state, x).compile(FAST_COMPILE)
        return compiled(state, x), compiled.as_text()


def _assert_same(got, ref):
    ((_, y), grads), ((_, ref_y), ref_grads) = got, ref
    np.testing.assert_allclose(np.asarray(y), np.asarray(ref_y), atol=1e-5, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-6, rtol=1e-4)


LAYOUTS = {
    None: None,
    "DP8": Layout(num_devices=8),
    "TP2xDP4": Layout(tensor=2, num_devices=8),
    "EP4xTP2": Layout(expert=4, tensor=2, num_devices=8),
    # ETP = TP under SP (the seed's): each tensor rank dispatches its own tokens and the tensor
    # ranks gather what they received (exchange.ep_grouped_gathered).
    "TP2xEP2+SP": Layout(expert=2, tensor=2, sequence_parallel=True, num_devices=8),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_grouped_equals_dense_reference(layout):
    """Under tensor parallelism the kernels run in a region manual over the F split too."""
    cfg = LAYOUTS[layout]
    x, valid = _inputs()
    ref, _ = _run(_block(impl="dense"), x, valid)
    block = _block(impl="grouped", platform="cpu", ragged_all_to_all=moe_lib.ragged_all_to_all_dense)
    assert block.plan.block_kernels.name == "xla"
    got, hlo = _run(block, x, valid, cfg)
    _assert_same(got, ref)
    if layout == "EP4xTP2":
        assert "all-to-all" in hlo
    if layout and "TP2" in layout:
        assert "all-reduce" in hlo  # the down projection's partial sums over the tensor ranks


def test_grouped_with_skewed_routing_equals_reference():
    """Every token to experts 0 and 1 (router ties): one rank receives every row, the block
    bound and the worst-case receive buffer are reached."""
    x, valid = _inputs()
    skewed = _block(impl="grouped", platform="cpu", ragged_all_to_all=moe_lib.ragged_all_to_all_dense)
    skewed.router[...] = jnp.zeros_like(skewed.router[...])
    ref = _block(impl="dense")
    ref.router[...] = skewed.router[...]
    _assert_same(_run(skewed, x, valid, Layout(expert=8, num_devices=8))[0], _run(ref, x, valid)[0])


def test_gathered_dispatch_with_skewed_routing_equals_reference():
    """The seed's ETP = TP fold (TP2xEP2+SP) with every token to experts 0 and 1: one rank
    receives every row, so the gathered exchange (exchange.ep_grouped_gathered, rounds of the
    balanced rows) takes its further rounds."""
    x, valid = _inputs()
    skewed = _block(impl="grouped", platform="cpu", ragged_all_to_all=moe_lib.ragged_all_to_all_dense)
    skewed.router[...] = jnp.zeros_like(skewed.router[...])
    ref = _block(impl="dense")
    ref.router[...] = skewed.router[...]
    _assert_same(_run(skewed, x, valid, LAYOUTS["TP2xEP2+SP"])[0], _run(ref, x, valid)[0])


def test_grouped_platform_choice():
    assert _block(impl="grouped", platform="gpu").plan.block_kernels.name == "mosaic"
    assert _block(impl="grouped", platform="gpu").plan.ragged_all_to_all is jax.lax.ragged_all_to_all
    assert _block(impl="grouped", platform="cpu").plan.ragged_all_to_all is None
    assert moe_lib.DEFAULT_MOE_IMPL["gpu"] == "grouped"
    from mlir_train.model import kernel_options

    assert kernel_options("gpu", is_moe=True) == ModelOptions(attention_impl="docs-flash", moe_impl="grouped", moe_platform="gpu")
    assert kernel_options("cpu", is_moe=True) == ModelOptions(attention_impl="xla", moe_impl="padded", moe_platform="cpu")
    assert kernel_options("cpu", is_moe=False) == ModelOptions(attention_impl="xla")


def _interpret():
    from mlir_train.model.kernels.mosaic_moe import interpret_params

    try:
        return interpret_params()
    except ImportError:  # pragma: no cover - depends on the jax build
        pytest.skip("this jax has no Mosaic-GPU interpreter")


ROUTINGS = {  # rows per expert, in 6 blocks of 64
    "an expert without rows": [100, 0, 150],  # 2 + 0 + 3 blocks, one spare
    "one hot expert": [0, 384, 0],  # every block one expert's: no spare, two experts without rows
    "skewed": [1, 250, 10],  # 1 + 4 + 1 blocks: single-block experts beside a long one
}


@pytest.mark.parametrize("routing, k", [(r, 128) for r in ROUTINGS] + [("skewed", 64)])
def test_mosaic_kernels_in_interpreter_equal_reference(routing, k):
    """The two Mosaic-GPU kernels, run by the Mosaic-GPU interpreter on CPU, equal their
    ``ragged_dot`` reference (``kernels.blocks.xla_block_kernels``): spare blocks zero, an expert
    without rows a zero weight gradient. ``k`` 128: a 2-step pipelined K loop, 64: one step
    (no delayed release). Output width 256: two tiles."""
    b, n, e, n_blocks = mosaic_moe.BLOCK_ROWS, 256, 3, 6
    rng = np.random.default_rng(0)
    sizes_E = jnp.asarray(ROUTINGS[routing], jnp.int32)
    layout = moe_dispatch.block_grouping(sizes_E, b, n_blocks)
    used = int(layout[1])
    x = jnp.asarray(rng.standard_normal((n_blocks * b, k)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((e, k, n)), jnp.bfloat16)
    dy = jnp.asarray(rng.standard_normal((n_blocks * b, n)), jnp.bfloat16)
    mosaic, ref = mosaic_moe.mosaic_block_kernels(_interpret()), blocks.xla_block_kernels(b)
    got, want = mosaic.matmul(x, w, *layout), ref.matmul(x, w, *layout)
    assert not np.any(np.asarray(got[used * b:], np.float32))
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=2e-2, atol=0.25)
    got_t, want_t = mosaic.matmul_t(x.T, dy, *layout), ref.matmul_t(x.T, dy, *layout)
    np.testing.assert_allclose(np.asarray(got_t), np.asarray(want_t), rtol=1e-4, atol=1e-3)
    for expert in np.flatnonzero(np.asarray(sizes_E) == 0):
        assert not np.any(np.asarray(got_t[expert]))


@pytest.mark.slow  # 190 s on 2 shared cores (load 9): the interpreter, device by device
def test_mosaic_kernels_interpreted_under_expert_parallelism_equal_reference():
    """The Mosaic-GPU kernels interpreted under EP4 (``--code-paths gpu``'s experts): each device's
    kernel call runs on the host in turn (``mosaic_moe._on_host``); forward and gradients equal the
    dense block. Before, JAX's interpreter simulated every device of the region at once and its
    callbacks starved XLA:CPU's pool (EP4 x TP2 hung on the 8 test devices)."""
    x, valid = _inputs()
    ref, _ = _run(_block(impl="dense"), x, valid)
    block = _block(impl="grouped", platform="cpu", ragged_all_to_all=moe_lib.ragged_all_to_all_dense,
                   block_kernels="mosaic-interpret")
    assert block.plan.block_kernels.name == "mosaic-interpret"
    got, hlo = _run(block, x, valid, Layout(expert=4, num_devices=4))
    _assert_same(got, ref)
    assert "all-to-all" in hlo and "custom-call" in hlo  # the exchange, and the kernels' host callbacks


def test_gathered_positions_put_each_experts_rows_together():
    """Two ranks' chunks of 5 rows (rows per expert [1, 0, 2] and [2, 1, 0], blocks of 2 rows):
    expert 0's rows first from a block boundary (rank 0's, then rank 1's two), expert 1's,
    expert 2's, then the unused rows in the spare rows at the end, every position once."""
    from mlir_train.model.moe.exchange import gathered_positions

    count_GL = jnp.asarray([[1, 0, 2], [2, 1, 0]], jnp.int32)
    pos, (expert_N, used, first_E, num_E) = jax.jit(gathered_positions, static_argnums=(1, 2))(count_GL, 5, 2)
    # expert 0: 3 rows in blocks 0-1 (rows 0-2), expert 1: block 2 (row 4), expert 2: block 3 (rows 6-7).
    np.testing.assert_array_equal(pos, [0, 6, 7, 8, 9, 1, 2, 4, 10, 11])
    assert len(set(np.asarray(pos).tolist())) == 10 and int(np.max(pos)) < len(expert_N) * 2
    np.testing.assert_array_equal(num_E, [2, 1, 1])
    np.testing.assert_array_equal(first_E, [0, 2, 3])
    assert int(used) == 4
