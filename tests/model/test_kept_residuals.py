"""What the backward keeps of a layer's forward (issue 49's memory): each change keeps less and
computes the same values and gradients. ``jax.ad_checkpoint.print_saved_residuals`` lists what a
``jax.vjp`` keeps; the values are compared against the plain computation."""

from __future__ import annotations

import contextlib
import io
import re
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.ad_checkpoint import print_saved_residuals

from mlir_train.model import attention, layers
from mlir_train.model.kernels import blocks
from mlir_train.model.moe import router
from mlir_train.model.moe.dispatch import block_grouping
from mlir_train.model.moe.experts import grouped_experts, placed_grouped_experts


def _kept(f, *args):
    """``(shape, dtype name: "bf16", "f32", ...)`` of each residual ``jax.vjp(f, *args)`` keeps (the public printout's)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        print_saved_residuals(f, *args)
    kept = []
    for line in out.getvalue().splitlines():
        m = re.match(r"(\w+)\[([\d,]*)\]", line)
        if m:
            kept.append((tuple(int(n) for n in m.group(2).split(",") if n), m.group(1)))
    return kept


def _same(got, want):
    """Equal up to rounding in the last bits: the rerun forms compile as one computation where the
    plain forms run op by op, and XLA 0.12 may sum a float32 matmul in another order (1e-6 seen;
    bit-equal on jax 0.10). A bfloat16 result may then round one unit apart."""
    tol = 1e-5 if jnp.result_type(got) == jnp.float32 and jnp.result_type(want) == jnp.float32 else 2 ** -7
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol * (float(np.max(np.abs(want))) or 1.0))


def _rng(*shape, seed=0, dtype=jnp.bfloat16):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), dtype)


def test_rms_norm_keeps_its_input_not_a_float32_copy():
    """The norm reruns in the backward from its bf16 input: no float32 [T, D] (the upcast) and no
    unscaled normalised rows are kept. Values and gradients are the plain formula's."""
    x, scale = _rng(4, 16, 64), _rng(64, seed=1, dtype=jnp.float32)
    graph, state = nnx.split(layers.RMSNorm(64, 1e-6))
    state["scale"].value = scale
    call = lambda x, st: nnx.merge(graph, st)(x)
    kept = _kept(call, x, state)
    assert (x.shape, "f32") not in kept, kept
    assert [k for k in kept if k[0] == x.shape] == [(x.shape, "bf16")], kept

    def plain(x, st):
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + 1e-6)
        return st["scale"].value.astype(x.dtype) * x32.astype(x.dtype)

    ct = _rng(4, 16, 64, seed=2)
    (y, pull), (y_ref, pull_ref) = jax.vjp(call, x, state), jax.vjp(plain, x, state)
    _same(y, y_ref)
    for g, w in zip(jax.tree.leaves(pull(ct)), jax.tree.leaves(pull_ref(ct))):
        _same(g, w)


def test_router_keeps_the_tokens_not_a_float32_copy():
    """The gating matmul in float32 reruns its upcast in the backward: the bf16 tokens are kept,
    not an [S, D] float32 copy; the same logits and gradients (both forms: one weight, and the
    trainer's per-token-rank rows)."""
    x, w = _rng(32, 64), _rng(64, 8, seed=1, dtype=jnp.float32)
    kept = _kept(router.router_logits, x, w)
    assert (x.shape, "f32") not in kept and (x.shape, "bf16") in kept, kept
    plain = lambda x, w: jnp.einsum("sd,de->se", x.astype(jnp.float32), w, precision=jax.lax.Precision.HIGHEST)
    ct = _rng(32, 8, seed=2, dtype=jnp.float32)
    got = jax.vjp(router.router_logits, x, w)
    want = jax.vjp(plain, x, w)
    _same(got[0], want[0])
    for g, v in zip(got[1](ct), want[1](ct)):
        _same(g, v)


@pytest.mark.skipif(attention.pallas_mha_missing() is not None, reason="this jax ships no Pallas-Triton FlashAttention")
def test_flash_attention_keeps_the_kv_heads_not_their_repeat():
    """``--attention-kernel pallas-mha`` repeats each k/v head over its query heads for the
    kernel; the repeat reruns in the backward, so the kept k and v have the K heads. The kernel's
    output and row sums are kept (no forward rerun); the gradients equal the uncheckpointed ones."""
    q, k, v = _rng(1, 128, 4, 64), _rng(1, 128, 2, 64, seed=1), _rng(1, 128, 2, 64, seed=2)
    seg = jnp.ones((1, 128), jnp.int32)
    f = lambda q, k, v: attention.flash_attention(q, k, v, seg, interpret=True, compute_capability="9.0")
    kept = _kept(f, q, k, v)
    assert sorted(s for s, _ in kept if len(s) == 4) == [(1, 128, 2, 64)] * 2 + [(1, 128, 4, 64)] * 2, kept
    from jax.experimental.pallas.ops.gpu import attention as pallas_attention

    def plain(q, k, v):
        k, v = (jnp.repeat(a, 2, axis=2) for a in (k, v))
        return pallas_attention.mha(q, k, v, seg, sm_scale=1 / 8, causal=True, interpret=True,
                                    block_sizes=pallas_attention.BlockSizes(
                                        **attention.flash_block_sizes(128, "9.0", head_dim=64)._asdict()),
                                    num_warps=attention.flash_num_warps(attention.flash_block_sizes(128, "9.0", head_dim=64), 64))
    ct = _rng(1, 128, 4, 64, seed=3)
    got, want = jax.vjp(f, q, k, v)[1](ct), jax.vjp(plain, q, k, v)[1](ct)
    for g, w in zip(got, want):
        _same(g, w)


def test_placed_experts_keep_the_gathered_rows_not_the_block_layout():
    """The gathered exchange's experts on rows placed into the block layout keep the gathered
    rows (``[G, D]``), not the placed ``[rows, D]`` with its per-expert padding, and equal
    :func:`grouped_experts` on the placed rows, values and every gradient."""
    b, d, f, e = 8, 32, 16, 4
    count = jnp.asarray([5, 0, 9, 3], jnp.int32)
    g = int(count.sum())
    n_blocks = -(-g // b) + e
    rows = n_blocks * b
    grouping = block_grouping(count, b, n_blocks)
    starts = grouping[2] * b
    pos = jnp.concatenate([starts[i] + jnp.arange(int(count[i])) for i in range(e)]).astype(jnp.int32)
    x = _rng(g, d)
    wg, wu, wd = _rng(e, d, f, seed=1), _rng(e, d, f, seed=2), _rng(e, f, d, seed=3)
    kernels = blocks.xla_block_kernels(b)
    placed = lambda x, wg, wu, wd: placed_grouped_experts(kernels, x, pos, rows, wg, wu, wd, *grouping)

    def plain(x, wg, wu, wd):
        x_RD = jnp.zeros((rows, d), x.dtype).at[pos].set(x)
        return grouped_experts(kernels, x_RD, jnp.ones((rows,), x.dtype), wg, wu, wd, *grouping)

    kept = _kept(placed, x, wg, wu, wd)
    assert (x.shape, "bf16") in kept and ((rows, d), "bf16") not in kept, kept
    assert ((rows, d), "bf16") in _kept(plain, x, wg, wu, wd)  # the control
    ct = _rng(rows, d, seed=4)
    (y, pull), (y_ref, pull_ref) = jax.vjp(placed, x, wg, wu, wd), jax.vjp(plain, x, wg, wu, wd)
    _same(y, y_ref)
    for got, want in zip(pull(ct), pull_ref(ct)):
        _same(got, want)


def test_attention_projections_regather_only_under_sequence_parallelism():
    """Without a sequence split the projections' normed input is kept for their weight gradients
    as before (the norm's own checkpoint keeps its input besides)."""
    cfg = types.SimpleNamespace(hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=32, init_std=0.02,
                                rms_norm_eps=1e-6)
    att = layers.Attention(cfg, nnx.Rngs(0), 0.02, dtype=jnp.bfloat16)
    graph, state = nnx.split(att)
    x, seg = _rng(1, 16, 64), jnp.ones((1, 16), jnp.int32)
    cos, sin = jnp.ones((1, 16, 32)), jnp.zeros((1, 16, 32))
    norm = layers.RMSNorm(64, 1e-6, dtype=jnp.bfloat16)
    mask = jnp.tril(jnp.ones((1, 16, 16), bool))
    kept = _kept(lambda st, x: nnx.merge(graph, st)(x, cos, sin, mask, norm=norm), state, x)
    assert [s for s, dt in kept if s == x.shape and dt == "bf16"] == [x.shape, x.shape], kept  # input, normed
