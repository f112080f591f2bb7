"""JAX's Pallas FlashAttention (``attention_impl="flash"``, ``--attention-kernel pallas-mha``: the kernel with
packed-document segment ids) equals the XLA reference, values and gradients. On CPU the
kernel runs in Pallas' interpreter; its deviceless XLA:GPU compile is in test_gpu_compile.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mlir_train.model.attention import attention_mask, flash_attention, masked_attention, pallas_mha_missing

# --attention-kernel pallas-mha: JAX's kernel, on the jax versions that ship it (not 0.12; the GPU
# default, docs-flash, is tested in test_docs_flash.py on every version).
pytestmark = pytest.mark.skipif(pallas_mha_missing() is not None, reason=str(pallas_mha_missing()))


def test_flash_attention_equals_masked_attention():
    b, t, kv, g, h = 2, 32, 2, 2, 16
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((b, t, kv * g, h)), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((b, t, kv, h)), jnp.float32) for _ in range(2))
    seg = jnp.asarray(np.array([[1] * 12 + [2] * 14 + [0] * 6, [1] * 32]), jnp.int32)
    w = jnp.asarray(rng.standard_normal((b, t, kv * g, h)), jnp.float32)

    def ref(q, k, v):
        o = masked_attention(q.reshape(b, t, kv, g, h), k, v, attention_mask(seg)).reshape(b, t, kv * g, h)
        return jnp.sum(o * w)

    def got(q, k, v):
        return jnp.sum(flash_attention(q, k, v, seg, interpret=True) * w)

    ref_v, ref_g = jax.value_and_grad(ref, argnums=(0, 1, 2))(q, k, v)
    got_v, got_g = jax.value_and_grad(got, argnums=(0, 1, 2))(q, k, v)
    np.testing.assert_allclose(float(got_v), float(ref_v), rtol=1e-4)
    for a, r in zip(got_g, ref_g):
        np.testing.assert_allclose(np.asarray(a), np.asarray(r), atol=1e-4, rtol=1e-3)


def test_flash_attention_under_data_and_tensor_parallelism():
    """The kernel runs per (batch, head) shard in a manual region: same values as unsharded."""
    import sharding
    from sharding import Layout

    b, t, kv, g, h = 4, 16, 2, 2, 16
    rng = np.random.default_rng(1)
    q = jnp.asarray(rng.standard_normal((b, t, kv * g, h)), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((b, t, kv, h)), jnp.float32) for _ in range(2))
    seg = jnp.asarray(np.repeat(np.array([[1] * 10 + [2] * 6]), b, axis=0), jnp.int32)
    ref = masked_attention(q.reshape(b, t, kv, g, h), k, v, attention_mask(seg)).reshape(b, t, kv * g, h)
    cfg = Layout(tensor=2, num_devices=8)  # DP4 x TP2: batch over 4, heads over 2
    with jax.set_mesh(sharding.make_mesh(cfg)), sharding.use_rules(sharding.rules_for(cfg)):
        got = jax.jit(lambda q, k, v, s: flash_attention(q, k, v, s, interpret=True))(q, k, v, seg)
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("t", [128, 96])  # Hopper's 64-row tiles (dK/dV steps 16 query rows); 32-row where 64 does not divide t
def test_flash_attention_with_256_wide_heads_equals_masked_attention(t):
    """Qwen3.5 / Qwen3-Next's 256-wide heads with the tiles an H200 gets (flash_block_sizes for
    compute capability 9.0: non-square dK/dV tiles), interpreted: values and gradients equal the
    XLA reference on packed documents with padding."""
    from mlir_train.model.attention import flash_block_sizes

    b, kv, g, h = 1, 1, 2, 256
    block = flash_block_sizes(t, "9.0", head_dim=h)
    assert block.block_q_dkv == 16 and block.block_kv_dkv == (64 if t % 64 == 0 else 32), block
    rng = np.random.default_rng(2)
    q = jnp.asarray(rng.standard_normal((b, t, kv * g, h)), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((b, t, kv, h)), jnp.float32) for _ in range(2))
    seg = jnp.asarray(np.array([[1] * 37 + [2] * (t - 37 - 11) + [0] * 11]), jnp.int32)
    w = jnp.asarray(rng.standard_normal((b, t, kv * g, h)), jnp.float32)

    def ref(q, k, v):
        o = masked_attention(q.reshape(b, t, kv, g, h), k, v, attention_mask(seg)).reshape(b, t, kv * g, h)
        return jnp.sum(o * w)

    def got(q, k, v):
        return jnp.sum(flash_attention(q, k, v, seg, interpret=True, compute_capability="9.0") * w)

    ref_v, ref_g = jax.value_and_grad(ref, argnums=(0, 1, 2))(q, k, v)
    got_v, got_g = jax.value_and_grad(got, argnums=(0, 1, 2))(q, k, v)
    np.testing.assert_allclose(float(got_v), float(ref_v), rtol=1e-4)
    for a, r in zip(got_g, ref_g):
        np.testing.assert_allclose(np.asarray(a), np.asarray(r), atol=1e-4, rtol=1e-3)
