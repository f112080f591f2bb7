"""Qwen3-MoE sparse block: float32 top-k router, SwiGLU experts, dropless by default.

Shape suffixes: S flat tokens (batch*seq), D hidden, E experts, K top-k slots, F expert
width, C per-expert capacity (token slots in the padded dispatch buffer), A = S*K assignments,
L local experts (E / EP), M rows of a ragged receive buffer.

Three ways to run the experts, all computing the same function (tests compare them):

* ``"dense"``   reference: every expert on every token, combined by the routing weights.
                Plain and obviously right; costs E/K times the routed work.
* ``"padded"``  sort assignments by expert into statically shaped buffers, one batched
                matmul per weight; the fast path on CPU. Dropless on one rank it is a
                block-grouped matmul (MegaBlocks' layout, :func:`moe_dispatch.blocked`): each
                expert's rows start on a block boundary, each block runs with its expert's
                weights, and the block count is bounded for any routing, so nothing is
                dropped and no branch is taken. With a capacity (or under EP) it scatters
                into a ``[E, C, D]`` buffer; see below.
* ``"ragged"``  sort assignments by expert and run ``jax.lax.ragged_dot`` on the groups:
                dropless by construction; the fast path on TPU. (XLA:GPU lowers ragged_dot to
                a dense padded dot over every expert: E/K times the routed work.)
* ``"grouped"`` dropless block-grouped experts on block kernels (``kernels.blocks.BlockKernels``):
                the blocked layout with 64-row blocks, run by Pallas Mosaic-GPU kernels
                (``kernels.mosaic_moe``, Hopper) that compute only the used blocks: the routed rows plus
                each expert's round-up to a block. The fast path on GPU. Under EP the rows move
                with ``ragged_all_to_all`` straight into that layout. Off GPU the same wrapper
                runs ``ragged_dot`` (the reference the CPU tests use). With a capacity it runs
                the padded path (an ``[E, C, D]`` batched matmul, ``capacity_factor`` x routed).

``DEFAULT_MOE_IMPL`` maps the platform a run compiles for to the implementation it takes.

With ``capacity_factor`` set (Megatron's ``--moe-expert-capacity-factor``) the padded buffer
has C = ceil(capacity_factor * S*K/E) and overflowing assignments are dropped, by position
(later tokens first) or by probability (``--moe-token-drop-policy probs``); drops are counted.

The code is split by concern: routing in :mod:`mlir_train.model.moe.router` (called by :meth:`MoE.route`); the expert
kernels in :mod:`mlir_train.model.moe.experts`; sorting, block layout and padded/ragged
dispatch on one rank in :mod:`mlir_train.model.moe.dispatch`; the data- and
expert-parallel manual regions in :mod:`mlir_train.model.moe.parallel`. How a block runs its
experts (:class:`~mlir_train.model.moe.dispatch.ExpertsPlan`) is fixed when it is built.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from mlir_train.model.kernels.blocks import BlockKernels, xla_block_kernels
from mlir_train.model.kernels.mosaic_moe import BLOCK_ROWS as GPU_BLOCK_ROWS, interpret_params, mosaic_block_kernels
from mlir_train.model.kernels.tokamax_ops import tokamax_block_kernels
from mlir_train.model.layers import MLP, param
from mlir_train.model.lora import LoRA, expert_delta, maybe
from mlir_train.model.moe.dispatch import (
    COUNTS, DEFAULT_EP_BUFFER_FACTOR, DEFAULT_MOE_IMPL, MOE_IMPLS, ExpertsPlan, block_layout, block_rows, ragged_all_to_all_dense, ragged_collective_for,
)
from mlir_train.model.moe.experts import swiglu_down
from mlir_train.model.moe.parallel import run_experts
from mlir_train.model.recompute import checkpointed
from mlir_train.model.moe.router import route, route_in, router_logits
from mlir_train.config.policies import RouterConfig
from mlir_train.runtime.platform_setup import platform_name
from sharding import constrain

ROUTER_SCOPE = "moe_router"

__all__ = ["DEFAULT_EP_BUFFER_FACTOR", "DEFAULT_MOE_IMPL", "MOE_IMPLS", "MoE", "ExpertsPlan", "BlockKernels", "block_layout", "block_rows",
           "ragged_all_to_all_dense"]


class MoE(nnx.Module):
    """The sparse block. ``impl`` picks the experts' implementation (module docstring);
    ``platform`` is the one the program is compiled for (the mesh's devices: "cpu", "gpu",
    "tpu", :func:`~mlir_train.runtime.platform_setup.platform_name`; None: the default devices'), which decides whether the expert-parallel
    ``"ragged"`` path can use ``jax.lax.ragged_all_to_all``; ``ragged_all_to_all`` overrides
    that collective (tests pass :func:`ragged_all_to_all_dense` to run the ragged dispatcher on
    CPU). ``block_loop`` forces the dropless blocked experts' loop (True) or batched form
    (False); None picks by size. ``block_kernels`` are ``impl="grouped"``'s matmuls: by default
    (or "mosaic") our Mosaic-GPU kernels when ``platform`` is "gpu", else the ``ragged_dot``
    reference; "tokamax" tokamax's kernels (:mod:`mlir_train.model.kernels.tokamax_ops`);
    "mosaic-interpret" ours in the Mosaic-GPU interpreter (``--code-paths gpu`` on CPU).

    ``shared_expert_size``: a shared expert of that width beside the routed ones (a SwiGLU
    :class:`~mlir_train.model.layers.MLP` every token goes through, split over the tensor ranks
    like a dense MLP), added to their output; ``shared_expert_gate``: scaled first by
    ``sigmoid(x w)`` per token (HF Qwen3-Next / Qwen3.5's ``shared_expert_gate``, megatron-core's
    ``--moe-shared-expert-gate``). 0: none (Qwen3-MoE)."""

    def __init__(
        self, cfg, rngs: nnx.Rngs, out_std: float, *,
        impl: str = "padded",
        capacity_factor: float | None = None,
        drop_policy: str = "probs",
        dtype=jnp.float32,
        block_loop: bool | None = None,
        platform: str | None = None,
        ragged_all_to_all: Callable | None = None,
        block_kernels: BlockKernels | str | None = None,
        router: RouterConfig | None = None,
        recompute_act: bool = False,
        lora=None,
        ep_buffer_factor: float = DEFAULT_EP_BUFFER_FACTOR,
        shared_expert_size: int = 0,
        shared_expert_gate: bool = False,
    ):
        platform = platform or platform_name()
        if ragged_all_to_all is None and impl in ("ragged", "grouped") and capacity_factor is None:
            ragged_all_to_all = ragged_collective_for(platform)
        if impl == "grouped" and block_kernels == "tokamax":  # --moe-gemm-backend tokamax
            block_kernels = tokamax_block_kernels(GPU_BLOCK_ROWS)
        elif impl == "grouped" and block_kernels == "mosaic-interpret":  # --code-paths gpu on CPU
            block_kernels = mosaic_block_kernels(interpret_params())
        elif impl == "grouped" and block_kernels in (None, "mosaic"):
            block_kernels = mosaic_block_kernels() if platform == "gpu" else xla_block_kernels(GPU_BLOCK_ROWS)
        self.plan = ExpertsPlan(
            impl=impl, num_experts=cfg.num_experts, capacity_factor=capacity_factor, drop_policy=drop_policy,
            block_loop=block_loop, ragged_all_to_all=ragged_all_to_all, block_kernels=block_kernels,
            recompute_act=recompute_act, ep_buffer_factor=ep_buffer_factor,
        )
        d, e, f = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
        self.router = param(rngs, (d, e), ("embed", "router_exp"), cfg.init_std, dtype)
        self.gate_proj = param(rngs, (e, d, f), ("exp", "embed", "moe_mlp"), cfg.init_std, dtype)
        self.up_proj = param(rngs, (e, d, f), ("exp", "embed", "moe_mlp"), cfg.init_std, dtype)
        self.down_proj = param(rngs, (e, f, d), ("exp", "moe_mlp", "embed"), out_std, dtype)
        # LoRA on the routed experts (mlir_train.model.lora): gate and up share one adapter, one A
        # and a B each (peft's on HF's fused gate and up parameter), the adapter of gate_proj;
        # per-expert adapters carry the experts' "exp" axis (split with them under EP), a shared
        # one has none.
        experts = (e, "exp") if lora is not None and lora.expert_adapters == "per-expert" else None
        self.fc1_lora = maybe(lora, "gate_proj", lambda: LoRA(
            rngs, (d,), ("embed",), (2, f), (None, "moe_mlp"), lora.dim, lora.scaling, experts=experts, dtype=dtype))
        self.fc2_lora = maybe(lora, "down_proj", lambda: LoRA(
            rngs, (f,), ("moe_mlp",), (d,), ("embed",), lora.dim, lora.scaling, experts=experts, dtype=dtype))
        self.shared_expert, self.shared_expert_gate = _shared_expert(cfg, shared_expert_size, shared_expert_gate,
                                                                     out_std, rngs, dtype, lora)
        self.num_experts, self.top_k, self.norm_topk_prob = e, cfg.top_k, cfg.norm_topk_prob
        self.impl = impl
        self.capacity_factor = capacity_factor
        self.drop_policy = drop_policy
        self.router_cfg = router or RouterConfig()
        self.router_cfg.check(e, cfg.top_k, cfg.norm_topk_prob)
        if self.router_cfg.enable_expert_bias:
            # Aux-loss-free balancing state: float32, no gradient (the router stops it), moved by
            # the trainer from each step's load (``mlir_train.model.moe.router.updated_expert_bias``).
            self.expert_bias = nnx.Param(jnp.zeros((e,), jnp.float32), logical_axes=("router_exp",))

    # ----- routing (mlir_train.model.moe.router) ------------------------------------------------
    def route(self, x_SD: jax.Array, valid_S: jax.Array, segment_ids_BT: jax.Array | None = None,
              logits_SE: jax.Array | None = None, rows: int = 1):
        """Router in float32 (Megatron and HF both softmax in fp32; we also matmul in fp32), or
        float64 with ``--moe-router-dtype fp64`` (its own gating matmul, in float64);
        ``logits_SE``: the float32 router logits of ``x_SD``, already computed; ``rows``: how
        many rows the tokens are (the balancing groups are runs of rows)."""
        bias = self.expert_bias[...] if self.router_cfg.enable_expert_bias else None
        groups = self.router_cfg.balancing_groups(rows)
        if self.router_cfg.dtype != "fp32":
            return route_in(self.router_cfg, x_SD, self.router[...], valid_S, top_k=self.top_k,
                            norm_topk_prob=self.norm_topk_prob, expert_bias_E=bias, segment_ids_BT=segment_ids_BT,
                            balancing_groups=groups)
        if logits_SE is None:
            logits_SE = router_logits(x_SD, self.router[...])
        return route(logits_SE, valid_S, top_k=self.top_k, norm_topk_prob=self.norm_topk_prob, cfg=self.router_cfg,
                     expert_bias_E=bias, segment_ids_BT=segment_ids_BT, balancing_groups=groups)

    # ----- experts -------------------------------------------------------------------------
    def __call__(self, x_BTD: jax.Array, valid_BT: jax.Array, segment_ids_BT: jax.Array | None = None,
                 norm=None, recompute_norm: bool = False):
        """``norm`` (the pre-MLP norm) runs first when given; ``recompute_norm`` makes it
        megatron-core's output-discarding "layernorm" recompute: norm and router matmul are
        one checkpoint whose backward reruns only the norm. (The dropless blocked / ragged /
        grouped experts still keep the normed tokens for their weight gradients.)"""
        b, t, d = x_BTD.shape
        valid_S = valid_BT.reshape(-1)

        def pre(x_BTD):
            if norm is not None:
                x_BTD = norm(x_BTD)
            x_SD = constrain(x_BTD.reshape(b * t, d), ("act_tokens", "act_embed"))
            if self.router_cfg.dtype != "fp32":
                return x_SD, None  # the fp64 router does its own gating matmul
            with jax.named_scope(ROUTER_SCOPE):  # names the router's matmuls in the HLO (FLOP audits)
                return x_SD, router_logits(x_SD, self.router[...])

        x_SD, logits_SE = checkpointed(pre, recompute_norm)(x_BTD)
        # Routing stays outside any manual region: XLA reduces the stats over each balancing
        # group's rows, so they are the single-device arrays under every layout.
        with jax.named_scope(ROUTER_SCOPE):
            weights_SK, experts_SK, stats = self.route(x_SD, valid_S, segment_ids_BT, logits_SE, rows=b)
        weights_SK = weights_SK.astype(x_SD.dtype)
        if self.impl == "dense":
            # The reference stays plain under every layout; XLA partitions it as it likes.
            y_SD, counts = self._dense(x_SD, weights_SK, experts_SK), jnp.zeros((len(COUNTS),), jnp.float32)
        else:
            y_SD, counts = run_experts(self.plan, x_SD, weights_SK, experts_SK, valid_S, self._weights(x_SD.dtype))
        # Assignments dropped by a capacity, and dropless rows that overflowed the expert-parallel
        # exchange buffer into further rounds (computed exactly, but counted: --moe-ep-buffer-factor).
        stats.update({name: counts[i] for i, name in enumerate(COUNTS)})
        y_BTD = y_SD.reshape(b, t, d)
        if self.shared_expert is not None:
            y_BTD = y_BTD + self._shared(x_SD.reshape(b, t, d))
        return y_BTD, stats

    def _shared(self, x_BTD: jax.Array) -> jax.Array:
        """The shared expert's output on the normed tokens, scaled by its gate."""
        y_BTD = self.shared_expert(x_BTD)
        if self.shared_expert_gate is None:
            return y_BTD
        g_BT = jnp.einsum("btd,d->bt", x_BTD, self.shared_expert_gate[...].astype(x_BTD.dtype))
        return y_BTD * jax.nn.sigmoid(g_BT)[..., None]

    def _weights(self, dt):
        """The experts' weights in ``dt``, with their LoRA updates folded in."""
        wg, wu, wd = self.gate_proj[...].astype(dt), self.up_proj[...].astype(dt), self.down_proj[...].astype(dt)
        if self.fc1_lora is not None:
            d_gu = self.fc1_lora.delta(dt)  # [(E,) D, 2, F]: gate and up
            wg, wu = wg + d_gu[..., 0, :], wu + d_gu[..., 1, :]
        return wg, wu, expert_delta(wd, self.fc2_lora)

    def _dense(self, x_SD, weights_SK, experts_SK):
        wg, wu, wd = self._weights(x_SD.dtype)
        combine_SE = jnp.sum(jax.nn.one_hot(experts_SK, self.num_experts, dtype=x_SD.dtype) * weights_SK[..., None], axis=1)
        g_SEF = jnp.einsum("sd,edf->sef", x_SD, wg)
        u_SEF = jnp.einsum("sd,edf->sef", x_SD, wu)
        y_SED = swiglu_down(g_SEF, u_SEF, lambda h_SEF: jnp.einsum("sef,efd->sed", h_SEF, wd), self.plan.recompute_act)
        return jnp.einsum("sed,se->sd", y_SED, combine_SE)


def _shared_expert(cfg, size: int, gated: bool, out_std: float, rngs: nnx.Rngs, dtype, lora):
    """:class:`MoE`'s shared expert of width ``size`` and its gate (None, None: none)."""
    if not size:
        return None, None
    mlp = MLP(cfg.hidden_size, size, cfg.init_std, out_std, rngs, dtype,
              lora=None if lora is None else lora.under("shared_expert"))
    return mlp, param(rngs, (cfg.hidden_size,), ("embed",), cfg.init_std, dtype) if gated else None
