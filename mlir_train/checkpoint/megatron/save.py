"""Writing our weights as a Megatron legacy ``torch`` checkpoint, in any TP / PP / EP / ETP layout."""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Any

import numpy as np

from mlir_train.checkpoint import integrity
from mlir_train.checkpoint.megatron.find import TRACKER
from mlir_train.checkpoint.megatron.read import MegatronCheckpointError, import_torch
from mlir_train.config.models import ModelConfig


# ----- writing the legacy format -------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class MegatronLayout:
    tensor: int = 1
    pipeline: int = 1
    expert: int = 1
    expert_tensor: int | None = None  # None: = tensor
    make_vocab_size_divisible_by: int = 128

    @property
    def etp(self) -> int:
        return self.expert_tensor or self.tensor


def megatron_args(cfg: ModelConfig, layout: MegatronLayout, padded: int) -> dict[str, Any]:
    """The Megatron arguments a loader of the written checkpoint reads (names as Megatron-LM's)."""
    kinds = cfg.layer_kinds()
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
        make_vocab_size_divisible_by=layout.make_vocab_size_divisible_by,
        untie_embeddings_and_output_weights=not cfg.tie_word_embeddings, init_method_std=cfg.init_std,
        tensor_model_parallel_size=layout.tensor, pipeline_model_parallel_size=layout.pipeline,
        expert_model_parallel_size=layout.expert, expert_tensor_parallel_size=layout.etp,
        virtual_pipeline_model_parallel_size=None, context_parallel_size=1, ckpt_format="torch",
        transformer_impl="local", moe_grouped_gemm=False, bf16=False, fp16=False,
    )


def save_legacy(layer_array, global_array, cfg: ModelConfig, dst: str, layout: MegatronLayout, *,
                iteration: int | None = None, dtype=None) -> list[str]:
    """Write ``cfg``'s weights as a Megatron legacy ``torch`` checkpoint in ``layout`` under ``dst``
    (``release`` unless ``iteration``). ``layer_array(leaf, l, e)`` / ``global_array(leaf)`` give
    our arrays (e.g. ``"attn/q_proj"`` ``[D, N, H]``) for one layer (expert) / global parameter on
    the host. Files are written one at a time, each from only the layers and experts it holds,
    with Megatron's local-spec names (``local_experts.<j>``). Returns the files written."""
    import argparse

    torch = import_torch()
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
    multiple = layout.make_vocab_size_divisible_by * tp
    padded = -(-cfg.vocab_size // multiple) * multiple
    per_stage = l_all // pp
    local_e = e_all // ep if cfg.is_moe else 0
    torch_dtype = dtype or torch.float32

    def t_(a: np.ndarray):
        return torch.from_numpy(np.array(a, dtype=np.float32)).to(torch_dtype)

    def pad_rows(w):  # Megatron pads the vocabulary with zero rows (never looked up, never predicted)
        return np.concatenate([w, np.zeros((padded - w.shape[0], w.shape[1]), w.dtype)]) if padded > w.shape[0] else w

    def tp_rows(w, t, n):  # [gate_t; up_t] style splits take the rank's part of each half separately
        return np.split(w, n)[t]

    sub = "release" if iteration is None else f"iter_{iteration:07d}"
    ns = argparse.Namespace(**megatron_args(cfg, layout, padded), iteration=iteration or 0)
    written = []
    for p in range(pp):
        for t in range(tp):
            for e_rank in range(ep):
                sd: dict[str, Any] = {}
                if p == 0:
                    sd["embedding.word_embeddings.weight"] = t_(tp_rows(pad_rows(global_array("embed")), t, tp))
                for i in range(per_stage):
                    l, pre = p * per_stage + i, f"decoder.layers.{i}."
                    q, k, v = (layer_array(f"attn/{w}_proj", l, None) for w in "qkv")
                    d, n, h = q.shape
                    g = n // cfg.num_kv_heads
                    # per query group: its G query heads, then its key head, then its value head
                    qkv = np.concatenate([q.transpose(1, 2, 0).reshape(cfg.num_kv_heads, g, h, d),
                                          k.transpose(1, 2, 0)[:, None], v.transpose(1, 2, 0)[:, None]],
                                         axis=1).reshape(-1, d)
                    sd[pre + "input_layernorm.weight"] = t_(layer_array("input_norm/scale", l, None))
                    sd[pre + "self_attention.linear_qkv.weight"] = t_(tp_rows(qkv, t, tp))
                    sd[pre + "self_attention.linear_proj.weight"] = t_(np.split(
                        layer_array("attn/o_proj", l, None).reshape(n * h, d).T, tp, axis=1)[t])
                    sd[pre + "self_attention.q_layernorm.weight"] = t_(layer_array("attn/q_norm/scale", l, None))
                    sd[pre + "self_attention.k_layernorm.weight"] = t_(layer_array("attn/k_norm/scale", l, None))
                    sd[pre + "pre_mlp_layernorm.weight"] = t_(layer_array("post_attn_norm/scale", l, None))
                    if cfg.layer_is_moe(l):
                        sd[pre + "mlp.router.weight"] = t_(layer_array("mlp/router", l, None).T)
                        x = t % etp  # the file of dense TP rank t holds expert-tensor rank t % ETP
                        for j in range(local_e):
                            e = e_rank * local_e + j
                            gate, up, down = (layer_array(f"mlp/{w}", l, e) for w in ("gate_proj", "up_proj", "down_proj"))
                            sd[pre + f"mlp.experts.local_experts.{j}.linear_fc1.weight"] = t_(np.concatenate(
                                [tp_rows(gate.T, x, etp), tp_rows(up.T, x, etp)]))
                            sd[pre + f"mlp.experts.local_experts.{j}.linear_fc2.weight"] = t_(
                                np.split(down.T, etp, axis=1)[x])
                    else:
                        gate, up, down = (layer_array(f"mlp/{w}", l, None) for w in ("gate_proj", "up_proj", "down_proj"))
                        sd[pre + "mlp.linear_fc1.weight"] = t_(np.concatenate([tp_rows(gate.T, t, tp), tp_rows(up.T, t, tp)]))
                        sd[pre + "mlp.linear_fc2.weight"] = t_(np.split(down.T, tp, axis=1)[t])
                if p == pp - 1:
                    sd["decoder.final_layernorm.weight"] = t_(global_array("final_norm/scale"))
                    if not cfg.tie_word_embeddings:
                        sd["output_layer.weight"] = t_(tp_rows(pad_rows(global_array("lm_head").T), t, tp))
                # Megatron's linear layers keep an (empty) extra state; strict loads expect the keys.
                sd.update({k[: -len("weight")] + "_extra_state": None for k in list(sd)
                           if re.search(r"(linear_\w+|output_layer)\.weight$", k)})
                name = f"mp_rank_{t:02d}" + (f"_{p:03d}" if pp > 1 else "") + (f"_{e_rank:03d}" if ep > 1 else "")
                path = os.path.join(dst, sub, name, "model_optim_rng.pt")
                os.makedirs(os.path.dirname(path), exist_ok=True)
                torch.save({"args": ns, "checkpoint_version": 3.0, "iteration": iteration or 0, "model": sd}, path)
                written.append(path)
                del sd
    # Megatron records no checksums; ours beside the rank directories (Megatron ignores the file)
    # let our reader tell a flipped bit from a good export.
    integrity.write_manifest(os.path.join(dst, sub))
    with open(os.path.join(dst, TRACKER), "w") as f:
        f.write("release" if iteration is None else str(iteration))
    return written
