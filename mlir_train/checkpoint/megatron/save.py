"""Writing our weights as a Megatron legacy ``torch`` checkpoint, in any TP / PP / EP / ETP layout.

One ``mp_rank_TT[_PPP][_EEE]/model_optim_rng.pt`` per model-parallel rank, named and laid out
as Megatron-LM writes them (see :mod:`~mlir_train.checkpoint.megatron.read`), with
Megatron's local-spec names (``local_experts.<j>``) and the vocabulary padded back to
``--make-vocab-size-divisible-by`` x TP. The layout is :class:`sharding.layout.Layout`, the
project's one layout type (its tensor, pipeline, expert and expert-tensor sizes).
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from mlir_train.checkpoint import integrity
from mlir_train.checkpoint.megatron.find import TRACKER
from mlir_train.checkpoint.megatron.read import MegatronCheckpointError, import_torch
from mlir_train.config.sections import padded_vocab_size
from mlir_train.config.models import ModelConfig

if TYPE_CHECKING:
    from sharding.layout import Layout


def megatron_args(cfg: ModelConfig, layout: Layout, padded: int, *,
                  make_vocab_size_divisible_by: int = 128) -> dict[str, Any]:
    """The Megatron arguments a loader of the written checkpoint reads (names as Megatron-LM's)."""
    kinds = cfg.moe_layers()
    return dict(
        num_layers=cfg.num_layers, hidden_size=cfg.hidden_size, ffn_hidden_size=cfg.intermediate_size or None,
        num_attention_heads=cfg.num_heads, group_query_attention=cfg.num_kv_heads != cfg.num_heads,
        num_query_groups=cfg.num_kv_heads, kv_channels=cfg.head_dim,
        num_experts=cfg.num_experts or None, moe_ffn_hidden_size=cfg.moe_intermediate_size or None,
        moe_router_topk=cfg.top_k or 2, moe_router_pre_softmax=not cfg.norm_topk_prob,
        moe_layer_freq=[int(k) for k in kinds] if cfg.is_moe and not all(kinds) else 1,
        moe_router_score_function="softmax", moe_shared_expert_intermediate_size=None,
        normalization="RMSNorm", norm_epsilon=cfg.rms_norm_eps, qk_layernorm=True, swiglu=True,
        add_bias_linear=False, add_qkv_bias=False, position_embedding_type="rope", add_position_embedding=False,
        rotary_base=int(cfg.rope_theta),
        rotary_percent=1.0, rotary_interleaved=False,
        rotary_seq_len_interpolation_factor=None if cfg.rope_scaling_factor == 1.0 else cfg.rope_scaling_factor,
        max_position_embeddings=cfg.max_position_embeddings, padded_vocab_size=padded, vocab_size=cfg.vocab_size,
        make_vocab_size_divisible_by=make_vocab_size_divisible_by,
        untie_embeddings_and_output_weights=not cfg.tie_word_embeddings, init_method_std=cfg.init_std,
        tensor_model_parallel_size=layout.tensor, pipeline_model_parallel_size=layout.pipeline,
        expert_model_parallel_size=layout.expert, expert_tensor_parallel_size=layout.etp,
        virtual_pipeline_model_parallel_size=None, context_parallel_size=1, ckpt_format="torch",
        transformer_impl="local", moe_grouped_gemm=False, bf16=False, fp16=False,
    )


def save_legacy(layer_array, global_array, cfg: ModelConfig, dst: str, layout: Layout, *,
                make_vocab_size_divisible_by: int = 128, iteration: int | None = None, dtype=None) -> list[str]:
    """Write ``cfg``'s weights as a Megatron legacy ``torch`` checkpoint in ``layout`` under ``dst``
    (``release`` unless ``iteration``). ``layer_array(leaf, l, e)`` / ``global_array(leaf)`` give
    our arrays (e.g. ``"attn/q_proj"`` ``[D, N, H]``) for one layer (expert) / global parameter on
    the host. Files are written one at a time, each from only the layers and experts it holds,
    with Megatron's local-spec names (``local_experts.<j>``). Returns the files written."""
    import argparse

    torch = import_torch()
    _check_layout(cfg, layout)
    padded = padded_vocab_size(cfg.vocab_size, make_vocab_size_divisible_by, layout.tensor)
    torch_dtype = dtype or torch.float32
    ranks = _RankWriter(layer_array, global_array, cfg, layout, padded,
                        lambda a: torch.from_numpy(np.array(a, dtype=np.float32)).to(torch_dtype))
    sub = "release" if iteration is None else f"iter_{iteration:07d}"
    args = megatron_args(cfg, layout, padded, make_vocab_size_divisible_by=make_vocab_size_divisible_by)
    ns = argparse.Namespace(**args, iteration=iteration or 0)
    written = []
    for p in range(layout.pipeline):
        for t in range(layout.tensor):
            for e_rank in range(layout.expert):
                sd = ranks.state_dict(p, t, e_rank)
                path = os.path.join(dst, sub, _rank_dir(layout, t, p, e_rank), "model_optim_rng.pt")
                os.makedirs(os.path.dirname(path), exist_ok=True)
                torch.save({"args": ns, "checkpoint_version": 3.0, "iteration": iteration or 0, "model": sd}, path)
                written.append(path)
                del sd  # one file's tensors in memory at a time
    # Megatron records no checksums; ours beside the rank directories (Megatron ignores the file)
    # let our reader tell a flipped bit from a good export.
    integrity.write_manifest(os.path.join(dst, sub))
    with open(os.path.join(dst, TRACKER), "w") as f:
        f.write("release" if iteration is None else str(iteration))
    return written


def _check_layout(cfg: ModelConfig, layout: Layout) -> None:
    """Refuse a layout the model's sizes or the legacy format cannot take, naming the flag."""
    tp, pp, ep, etp = layout.tensor, layout.pipeline, layout.expert, layout.etp
    e_all, l_all = cfg.num_experts, cfg.num_layers
    if cfg.num_kv_heads % tp or cfg.num_heads % tp:
        raise MegatronCheckpointError(f"--tensor-model-parallel-size {tp} does not divide the {cfg.num_kv_heads} "
                                      f"query groups / {cfg.num_heads} heads")
    if l_all % pp:
        raise MegatronCheckpointError(f"--pipeline-model-parallel-size {pp} does not divide {l_all} layers")
    if cfg.is_moe and (e_all % ep or cfg.moe_intermediate_size % etp):
        raise MegatronCheckpointError(f"--expert-model-parallel-size {ep} / --expert-tensor-parallel-size {etp} do "
                                      f"not divide {e_all} experts of width {cfg.moe_intermediate_size}")
    if not cfg.is_moe and ep > 1:
        raise MegatronCheckpointError("--expert-model-parallel-size > 1 for a dense model")
    if etp > tp or tp % etp:
        raise MegatronCheckpointError(f"--expert-tensor-parallel-size {etp} must divide "
                                      f"--tensor-model-parallel-size {tp} in the legacy format (files are named by "
                                      "the dense TP rank)")
    if cfg.tie_word_embeddings and pp > 1:
        raise MegatronCheckpointError("tied embeddings with --pipeline-model-parallel-size > 1 are not written "
                                      "(Megatron keeps a second copy on the last stage); use PP 1")


def _rank_dir(layout: Layout, t: int, p: int, e_rank: int) -> str:
    """``mp_rank_TT[_PPP][_EEE]``, as Megatron-LM's ``get_checkpoint_name``."""
    return (f"mp_rank_{t:02d}" + (f"_{p:03d}" if layout.pipeline > 1 else "")
            + (f"_{e_rank:03d}" if layout.expert > 1 else ""))


def _part(w: np.ndarray, i: int, n: int, axis: int = 0) -> np.ndarray:
    """Rank ``i``'s part of ``w`` split ``n`` ways along ``axis``."""
    return np.split(w, n, axis=axis)[i]


def _qkv_rows(q: np.ndarray, k: np.ndarray, v: np.ndarray, cfg: ModelConfig) -> np.ndarray:
    """Megatron's ``linear_qkv`` ``[(K*(G+2))*H, D]`` from our ``[D, N, H]`` / ``[D, K, H]``: per query
    group, its G query heads, then its key head, then its value head."""
    d, n, h = q.shape
    g = n // cfg.num_kv_heads
    return np.concatenate([q.transpose(1, 2, 0).reshape(cfg.num_kv_heads, g, h, d),
                           k.transpose(1, 2, 0)[:, None], v.transpose(1, 2, 0)[:, None]], axis=1).reshape(-1, d)


@dataclasses.dataclass(frozen=True)
class _RankWriter:
    """The ``model`` state dict of one legacy rank file, built from our host arrays."""

    layer_array: Callable[[str, int, int | None], np.ndarray]
    global_array: Callable[[str], np.ndarray]
    cfg: ModelConfig
    layout: Layout
    padded: int                                # the padded vocabulary
    to_torch: Callable[[np.ndarray], Any]      # to a torch tensor of the export dtype

    def state_dict(self, p: int, t: int, e_rank: int) -> dict[str, Any]:
        """Pipeline rank ``p``, tensor rank ``t``, expert rank ``e_rank``'s tensors, local names."""
        tp, t_ = self.layout.tensor, self.to_torch
        sd: dict[str, Any] = {}
        if p == 0:
            sd["embedding.word_embeddings.weight"] = t_(_part(self._pad_rows(self.global_array("embed")), t, tp))
        per_stage = self.cfg.num_layers // self.layout.pipeline
        for i in range(per_stage):
            l, pre = p * per_stage + i, f"decoder.layers.{i}."
            sd.update(self._attention(pre, l, t))
            sd.update(self._mlp(pre, l, t, e_rank))
        if p == self.layout.pipeline - 1:
            sd["decoder.final_layernorm.weight"] = t_(self.global_array("final_norm/scale"))
            if not self.cfg.tie_word_embeddings:
                sd["output_layer.weight"] = t_(_part(self._pad_rows(self.global_array("lm_head").T), t, tp))
        # Megatron's linear layers keep an (empty) extra state; strict loads expect the keys.
        sd.update({k[: -len("weight")] + "_extra_state": None for k in list(sd)
                   if re.search(r"(linear_\w+|output_layer)\.weight$", k)})
        return sd

    def _pad_rows(self, w: np.ndarray) -> np.ndarray:
        """Megatron pads the vocabulary with zero rows (never looked up, never predicted)."""
        padded = self.padded
        return np.concatenate([w, np.zeros((padded - w.shape[0], w.shape[1]), w.dtype)]) if padded > w.shape[0] else w

    def _attention(self, pre: str, l: int, t: int) -> dict[str, Any]:
        a, t_, tp = self.layer_array, self.to_torch, self.layout.tensor
        q, k, v = (a(f"attn/{w}_proj", l, None) for w in "qkv")
        d, n, h = q.shape
        return {
            pre + "input_layernorm.weight": t_(a("input_norm/scale", l, None)),
            pre + "self_attention.linear_qkv.weight": t_(_part(_qkv_rows(q, k, v, self.cfg), t, tp)),
            pre + "self_attention.linear_proj.weight": t_(_part(a("attn/o_proj", l, None).reshape(n * h, d).T, t, tp,
                                                                axis=1)),
            pre + "self_attention.q_layernorm.weight": t_(a("attn/q_norm/scale", l, None)),
            pre + "self_attention.k_layernorm.weight": t_(a("attn/k_norm/scale", l, None)),
        }

    def _mlp(self, pre: str, l: int, t: int, e_rank: int) -> dict[str, Any]:
        a, t_, tp = self.layer_array, self.to_torch, self.layout.tensor
        sd = {pre + "pre_mlp_layernorm.weight": t_(a("post_attn_norm/scale", l, None))}
        if not self.cfg.layer_is_moe(l):
            gate, up, down = (a(f"mlp/{w}", l, None) for w in ("gate_proj", "up_proj", "down_proj"))
            # [gate_t; up_t]: the rank's part of each half
            sd[pre + "mlp.linear_fc1.weight"] = t_(np.concatenate([_part(gate.T, t, tp), _part(up.T, t, tp)]))
            sd[pre + "mlp.linear_fc2.weight"] = t_(_part(down.T, t, tp, axis=1))
            return sd
        sd[pre + "mlp.router.weight"] = t_(a("mlp/router", l, None).T)
        etp = self.layout.etp
        x = t % etp  # the file of dense TP rank t holds expert-tensor rank t % ETP
        local_e = self.cfg.num_experts // self.layout.expert
        for j in range(local_e):
            gate, up, down = (a(f"mlp/{w}", l, e_rank * local_e + j) for w in ("gate_proj", "up_proj", "down_proj"))
            sd[pre + f"mlp.experts.local_experts.{j}.linear_fc1.weight"] = t_(np.concatenate(
                [_part(gate.T, x, etp), _part(up.T, x, etp)]))
            sd[pre + f"mlp.experts.local_experts.{j}.linear_fc2.weight"] = t_(_part(down.T, x, etp, axis=1))
        return sd
