"""Building blocks of the Qwen3 decoder: RMSNorm, RoPE, GQA attention, SwiGLU MLP. How the
attention itself runs (masks, XLA and kernel implementations) is :mod:`mlir_train.model.attention`.

Shape suffixes (nanodo style): B batch, T sequence, S key sequence, D hidden (embed),
N query heads, K kv heads, G query heads per kv head, H head dim, F MLP width, V vocab.

Parameters carry their logical axis names in the ``logical_axes`` metadata of ``nnx.Param``;
activations are annotated with :func:`sharding.constrain`. Nothing here names a mesh axis.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from mlir_train.model.attention import (
    ATTENTION_IMPLS, context_parallel_attention, docs_flash_attention, flash_attention, kernel_attention, masked_attention,
)
from mlir_train.model.lora import LoRA, adapted, maybe
from mlir_train.model.recompute import checkpointed
from sharding import constrain, constrain_cotangent, mesh_axes_of
from sharding.context import sequence_order

Axes = tuple[str | None, ...]


def param(rngs: nnx.Rngs, shape: Sequence[int], axes: Axes, std: float, dtype=jnp.float32) -> nnx.Param:
    """A normally initialised weight (Megatron's init_method_normal) tagged with logical axes."""
    assert len(shape) == len(axes), (shape, axes)
    value = std * jax.random.normal(rngs.params(), tuple(shape), jnp.float32)
    return nnx.Param(value.astype(dtype), logical_axes=tuple(axes))


def ones_param(shape: Sequence[int], axes: Axes, dtype=jnp.float32) -> nnx.Param:
    return nnx.Param(jnp.ones(tuple(shape), dtype), logical_axes=tuple(axes))


class RMSNorm(nnx.Module):
    """HF Qwen3RMSNorm: normalise in float32, cast back, then scale. ``zero_centred``: the
    scale is stored as ``w`` and applied as ``1 + w`` (initialised to zero), in float32 before
    the cast back (HF Qwen3-Next / Qwen3.5's norm, Megatron's ``--apply-layernorm-1p``)."""

    def __init__(self, dim: int, eps: float, axis_name: str = "norm", dtype=jnp.float32, zero_centred: bool = False):
        self.scale = nnx.Param(jnp.zeros((dim,), dtype), logical_axes=(axis_name,)) if zero_centred \
            else ones_param((dim,), (axis_name,), dtype)
        self.eps = eps
        self.zero_centred = zero_centred

    def __call__(self, x: jax.Array) -> jax.Array:
        # One checkpoint around the norm: its backward reruns it from the input it keeps (``x``,
        # in its own dtype) instead of keeping the float32 upcast and the unscaled normalised
        # rows (the seed, per layer and micro-batch on a device: 16 MiB for the q norm, 8 for each
        # residual-stream norm). The same values; Megatron's fused RMSNorm keeps its input and the
        # reciprocal alone.
        return checkpointed(functools.partial(_rms_norm, eps=self.eps, zero_centred=self.zero_centred), True)(
            x, self.scale[...])


def _rms_norm(x: jax.Array, scale: jax.Array, *, eps: float, zero_centred: bool) -> jax.Array:
    """:class:`RMSNorm`'s values: normalise in float32, cast back, then scale."""
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    if scale.ndim == 2:  # [R, D]: one row per sequence rank (mlir_train.train.reduction.token_partial)
        return _per_rank(x32, scale, x.dtype, zero_centred)
    if zero_centred:
        return (x32 * (1.0 + scale.astype(jnp.float32))).astype(x.dtype)
    return scale.astype(x.dtype) * x32.astype(x.dtype)


def _per_rank(x32: jax.Array, scale_RD: jax.Array, dtype, zero_centred: bool) -> jax.Array:
    """The scale of a residual-stream norm broadcast over its ``R`` sequence ranks: each rank's
    rows (``x``'s sequence split ``[R, T/R]``, as ``"act_res_seq"`` splits it) meet their own
    row, so the scale's gradient stays per rank, summed once per step by the trainer (the
    router's way, :func:`mlir_train.model.moe.router.router_logits`). The same values."""
    *lead, t, d = x32.shape
    r = scale_RD.shape[0]
    names = ("act_batch",) * min(len(lead), 1) + (None,) * (len(lead) - 1) + ("seq_ranks", None, "act_embed")
    x_R = constrain(x32.reshape(*lead, r, t // r, d), names)
    w_R = constrain(scale_RD, ("seq_ranks", None))[:, None, :]
    if zero_centred:
        return (x_R * (1.0 + w_R.astype(jnp.float32))).astype(dtype).reshape(x32.shape)
    return (w_R.astype(dtype) * x_R.astype(dtype)).reshape(x32.shape)


def rope_tables(positions_BT: jax.Array, head_dim: int, theta: float, scaling_factor: float) -> tuple[jax.Array, jax.Array]:
    """cos/sin tables ``[B, T, H]`` (HF "default" RoPE; linear interpolation divides positions).
    ``head_dim``: the dimensions rotated (a model with partial RoPE passes fewer than a head's)."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    pos = positions_BT.astype(jnp.float32) / scaling_factor
    freqs_BTh = pos[..., None] * inv_freq
    emb_BTH = jnp.concatenate([freqs_BTh, freqs_BTh], axis=-1)
    return jnp.cos(emb_BTH), jnp.sin(emb_BTH)


def apply_rope(x_BTNH: jax.Array, cos_BTH: jax.Array, sin_BTH: jax.Array) -> jax.Array:
    """RoPE (rotate-half) on the first ``cos_BTH.shape[-1]`` dimensions of each head; the rest
    pass through (partial RoPE, HF's ``partial_rotary_factor``)."""
    r = cos_BTH.shape[-1]
    x_rot = x_BTNH[..., :r]
    half = r // 2
    rotated = jnp.concatenate([-x_rot[..., half:], x_rot[..., :half]], axis=-1)
    cos, sin = cos_BTH[:, :, None, :], sin_BTH[:, :, None, :]
    out = (x_rot.astype(jnp.float32) * cos + rotated.astype(jnp.float32) * sin).astype(x_BTNH.dtype)
    return out if r == x_BTNH.shape[-1] else jnp.concatenate([out, x_BTNH[..., r:]], axis=-1)


def row_parallel_out(y_BTD: jax.Array) -> jax.Array:
    """The output of a row-parallel linear (o_proj, down_proj: partial sums over the tensor
    ranks, which the residual add's constraint reduces), with its cotangent gathered over the
    sequence once in the backward, for both of the linear's gradients (Megatron's one
    all-gather of the output gradient under --sequence-parallel; without the constraint XLA
    gathered it once per gradient)."""
    return constrain_cotangent(y_BTD, ("act_batch", "act_seq", "act_embed"))


class Attention(nnx.Module):
    """``impl`` (:data:`~mlir_train.model.attention.ATTENTION_IMPLS`) decides what ``mask`` the
    call takes: the ``[B, T, S]`` boolean mask of :func:`~mlir_train.model.attention.attention_mask`
    for "xla", the ``[B, T]`` segment ids for "flash", "tokamax" and "docs-flash" and, with the
    sequence split over context ranks, for
    :func:`~mlir_train.model.attention.context_parallel_attention` (``Qwen3.layer_context``
    builds the right one).

    ``output_gate``: the query projection emits, per head, the query and then a gate of the
    same width (HF Qwen3-Next / Qwen3.5's ``q_proj``, ``[q_h | gate_h]`` per head), and the
    attention output is multiplied by ``sigmoid(gate)`` before the output projection.
    ``zero_centred_norms``: the q/k norms are :class:`RMSNorm` with ``zero_centred``."""

    def __init__(self, cfg, rngs: nnx.Rngs, out_std: float, dtype=jnp.float32, impl: str = "xla",
                 recompute_core_attn: bool = False, lora=None, output_gate: bool = False,
                 zero_centred_norms: bool = False, interpret: bool = False, compute_capability: str | None = None):
        if impl not in ATTENTION_IMPLS:
            raise ValueError(f"unknown attention implementation {impl!r}; choose one of {ATTENTION_IMPLS}")
        self.impl = impl
        # The flash kernels in Pallas' interpreter (--code-paths gpu on CPU), tiled for this
        # compute capability (None: the devices').
        self.interpret, self.compute_capability = interpret, compute_capability
        # megatron-core's "core_attn" recompute: softmax(q k^T) v from the roped q, k and v.
        # Both implementations already keep only their output and log-sum-exp (FlashAttention's
        # residuals), so this drops those and runs the attention forward once more.
        self.recompute_core_attn = recompute_core_attn
        d, n, k, h = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        std = cfg.init_std
        qw = 2 * h if output_gate else h  # a head's query, then its gate
        self.q_proj = param(rngs, (d, n, qw), ("embed", "q_heads", "head_dim"), std, dtype)
        self.k_proj = param(rngs, (d, k, h), ("embed", "kv_heads", "head_dim"), std, dtype)
        self.v_proj = param(rngs, (d, k, h), ("embed", "kv_heads", "head_dim"), std, dtype)
        self.o_proj = param(rngs, (n, h, d), ("q_heads", "head_dim", "embed"), out_std, dtype)
        self.q_norm = RMSNorm(h, cfg.rms_norm_eps, "head_dim", dtype, zero_centred=zero_centred_norms)
        self.k_norm = RMSNorm(h, cfg.rms_norm_eps, "head_dim", dtype, zero_centred=zero_centred_norms)
        self.output_gate = output_gate
        # LoRA (``lora``: the Adapters of this module): q/k/v each carry their own adapter (peft's
        # on the HF model's separate projections; Megatron's fused projection is the three).
        qkv = lambda heads, axis, width=h: lambda: LoRA(rngs, (d,), ("embed",), (heads, width), (axis, "head_dim"),
                                                        lora.dim, lora.scaling, dtype=dtype)
        self.q_lora = maybe(lora, "q_proj", qkv(n, "q_heads", qw))
        self.k_lora = maybe(lora, "k_proj", qkv(k, "kv_heads"))
        self.v_lora = maybe(lora, "v_proj", qkv(k, "kv_heads"))
        self.o_lora = maybe(lora, "o_proj", lambda: LoRA(
            rngs, (n, h), ("q_heads", "head_dim"), (d,), ("embed",), lora.dim, lora.scaling, dtype=dtype))
        self.num_kv_heads = k
        self.head_dim = h

    def __call__(self, x_BTD, cos_BTH, sin_BTH, mask, norm=None, recompute_norm: bool = False) -> jax.Array:
        """``norm`` (the layer's input norm) runs first when given; ``recompute_norm`` makes it
        megatron-core's output-discarding "layernorm" recompute: norm and q/k/v projections
        are one checkpoint, whose backward reruns only the norm (the projections' outputs are
        not needed to differentiate them), so the normed input is not kept for the projections'
        weight gradients."""
        dt = x_BTD.dtype

        def project(x_BTD):
            if norm is not None:
                x_BTD = norm(x_BTD)
            if mesh_axes_of("act_kv_heads")[0] == mesh_axes_of("act_heads")[0]:
                # One all-gather of the normed input over the sequence (SP) for the three
                # projections, as Megatron's column-parallel linears share it; left to the
                # partitioner, inside the trainer's data-manual region each projection gathered
                # its own copy. (With k/v heads replicated over TP their weight gradients would
                # then contract the whole sequence on every tensor rank: left as it was.)
                x_BTD = constrain(x_BTD, ("act_batch", None, "act_embed"))
            q_BTNH = adapted(x_BTD, jnp.einsum("btd,dnh->btnh", x_BTD, self.q_proj[...].astype(dt)), self.q_lora)
            k_BTKH = adapted(x_BTD, jnp.einsum("btd,dkh->btkh", x_BTD, self.k_proj[...].astype(dt)), self.k_lora)
            v_BTKH = adapted(x_BTD, jnp.einsum("btd,dkh->btkh", x_BTD, self.v_proj[...].astype(dt)), self.v_lora)
            return (constrain(q_BTNH, ("act_batch", "act_seq", "act_heads", "act_head_dim")),
                    constrain(k_BTKH, ("act_batch", "act_seq", "act_kv_heads", "act_head_dim")),
                    constrain(v_BTKH, ("act_batch", "act_seq", "act_kv_heads", "act_head_dim")))

        # Under sequence parallelism the projections read the input gathered over the sequence.
        # As Megatron's column-parallel linears keep their sequence-split input and gather it
        # again in the backward, the gather is recomputed there, and the norm before it with it
        # (a norm costs nothing next to the gather): neither the gathered nor the normed rows are
        # kept (the seed: 12 MiB per layer and micro-batch on a device), for one more all-gather
        # per layer in the backward, which Megatron's volume counts too.
        regather = norm is not None and mesh_axes_of("act_res_seq")[1] > 1
        q_BTNH, k_BTKH, v_BTKH = checkpointed(project, recompute_norm or regather)(x_BTD)
        if self.output_gate:
            q_BTNH, gate_BTNH = q_BTNH[..., :self.head_dim], q_BTNH[..., self.head_dim:]
        q_BTNH = apply_rope(self.q_norm(q_BTNH), cos_BTH, sin_BTH)
        k_BTKH = apply_rope(self.k_norm(k_BTKH), cos_BTH, sin_BTH)

        b, t, n, h = q_BTNH.shape
        if self.impl == "flash":
            o_BTNH = checkpointed(functools.partial(flash_attention, interpret=self.interpret,
                                                    compute_capability=self.compute_capability),
                                  self.recompute_core_attn)(q_BTNH, k_BTKH, v_BTKH, mask)
        elif self.impl == "tokamax":
            o_BTNH = checkpointed(kernel_attention, self.recompute_core_attn)(q_BTNH, k_BTKH, v_BTKH, mask)
        elif self.impl == "docs-flash":
            o_BTNH = checkpointed(functools.partial(docs_flash_attention, interpret=self.interpret),
                                  self.recompute_core_attn)(q_BTNH, k_BTKH, v_BTKH, mask)
        elif mesh_axes_of("act_seq")[1] > 1:  # mask: the segment ids (Qwen3.layer_context)
            o_BTNH = checkpointed(lambda q, k, v, seg: context_parallel_attention(q, k, v, seg, sequence_order(t)),
                                  self.recompute_core_attn)(q_BTNH, k_BTKH, v_BTKH, mask)
        else:
            g = n // self.num_kv_heads
            o_BTKGH = checkpointed(masked_attention, self.recompute_core_attn)(
                q_BTNH.reshape(b, t, self.num_kv_heads, g, h), k_BTKH, v_BTKH, mask)
            o_BTNH = o_BTKGH.reshape(b, t, n, h)
        if self.output_gate:
            o_BTNH = o_BTNH * jax.nn.sigmoid(gate_BTNH)
        o_BTNH = constrain(o_BTNH, ("act_batch", "act_seq", "act_heads", "act_head_dim"))
        return row_parallel_out(adapted(o_BTNH, jnp.einsum("btnh,nhd->btd", o_BTNH, self.o_proj[...].astype(dt)), self.o_lora))


class MLP(nnx.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)); gate/up column-, down row-parallel under TP."""

    def __init__(self, hidden: int, width: int, std: float, out_std: float, rngs: nnx.Rngs, dtype=jnp.float32,
                 lora=None):
        self.gate_proj = param(rngs, (hidden, width), ("embed", "mlp"), std, dtype)
        self.up_proj = param(rngs, (hidden, width), ("embed", "mlp"), std, dtype)
        self.down_proj = param(rngs, (width, hidden), ("mlp", "embed"), out_std, dtype)
        # LoRA: gate and up each carry their own adapter (peft's on the HF model's separate
        # projections; Megatron's fused first layer is the two).
        fc1 = lambda: LoRA(rngs, (hidden,), ("embed",), (width,), ("mlp",), lora.dim, lora.scaling, dtype=dtype)
        self.gate_lora = maybe(lora, "gate_proj", fc1)
        self.up_lora = maybe(lora, "up_proj", fc1)
        self.down_lora = maybe(lora, "down_proj", lambda: LoRA(
            rngs, (width,), ("mlp",), (hidden,), ("embed",), lora.dim, lora.scaling, dtype=dtype))

    def __call__(self, x_BTD: jax.Array, norm=None, recompute_norm: bool = False) -> jax.Array:
        """``norm``, ``recompute_norm``: the pre-MLP norm, as :meth:`Attention.__call__`'s."""
        dt = x_BTD.dtype

        def fc1(x_BTD):
            if norm is not None:
                x_BTD = norm(x_BTD)
            return (adapted(x_BTD, jnp.einsum("btd,df->btf", x_BTD, self.gate_proj[...].astype(dt)), self.gate_lora),
                    adapted(x_BTD, jnp.einsum("btd,df->btf", x_BTD, self.up_proj[...].astype(dt)), self.up_lora))

        g_BTF, u_BTF = checkpointed(fc1, recompute_norm)(x_BTD)
        h_BTF = constrain(jax.nn.silu(g_BTF) * u_BTF, ("act_batch", "act_seq", "act_mlp"))
        return row_parallel_out(adapted(h_BTF, jnp.einsum("btf,fd->btd", h_BTF, self.down_proj[...].astype(dt)), self.down_lora))
