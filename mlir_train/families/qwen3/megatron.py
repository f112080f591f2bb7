"""Qwen3 / Qwen3-MoE configs and Megatron-LM's arguments, both ways (the names as Megatron-LM's
argparse spells them): what a Megatron checkpoint's ``args`` say the model is, and what a
checkpoint we write must say for Megatron to build it again."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from mlir_train.config.models import ModelConfig
from mlir_train.families.qwen3.params import TABLE
from mlir_train.runtime.errors import CheckpointError


def _check(a: dict[str, Any]) -> None:
    """Refuse args of another architecture, naming what differs."""
    def need(cond: bool, what: str) -> None:
        if not cond:
            raise CheckpointError(f"{what}; only Qwen3 / Qwen3-MoE models are supported")

    need(a.get("normalization", "RMSNorm") == "RMSNorm", f"normalization={a.get('normalization')!r}")
    need(bool(a.get("swiglu", True)), "swiglu is off")
    need(not a.get("add_bias_linear", False) and not a.get("add_qkv_bias", False), "linear biases are on")
    need(a.get("position_embedding_type", "rope") == "rope", f"position_embedding_type={a.get('position_embedding_type')!r}")
    need(float(a.get("rotary_percent", 1.0) or 1.0) == 1.0, f"rotary_percent={a.get('rotary_percent')}")
    need(not a.get("rotary_interleaved", False), "rotary_interleaved is on")
    need(bool(a.get("qk_layernorm", True)), "qk_layernorm is off")
    need(not a.get("moe_shared_expert_intermediate_size"), "it has shared experts")
    need(a.get("moe_router_score_function", "softmax") == "softmax",
         f"moe_router_score_function={a.get('moe_router_score_function')!r}")
    need(not a.get("mtp_num_layers"), "it has multi-token-prediction layers")
    need(not a.get("experimental_attention_variant"),
         f"experimental_attention_variant={a.get('experimental_attention_variant')!r} (gated DeltaNet layers)")
    need(not a.get("attention_output_gate"), "attention_output_gate is on")


def moe_kinds(a: dict[str, Any], layers: int, experts: int) -> list[int]:
    freq = a.get("moe_layer_freq", 1)
    if not experts:
        return [0] * layers
    if isinstance(freq, int):
        return [1 if i % freq == 0 else 0 for i in range(layers)]
    return [int(x) for x in freq]


def from_megatron(a: dict[str, Any], *, name: str, vocab_size: int,
                  has_tensor: Callable[[str], bool]) -> ModelConfig:
    """Our config of Megatron's ``args`` (a dict), with the vocabulary ``vocab_size``;
    ``has_tensor(name)``: whether the checkpoint holds a global tensor (an LM head, for args
    that do not say whether the embeddings are tied). Raises :class:`CheckpointError` naming what
    is not Qwen3."""
    _check(a)
    heads = int(a["num_attention_heads"])
    groups = int(a["num_query_groups"]) if a.get("group_query_attention") and a.get("num_query_groups") else heads
    hidden, layers, experts = int(a["hidden_size"]), int(a["num_layers"]), int(a.get("num_experts") or 0)
    kinds = moe_kinds(a, layers, experts)
    head = next(r for r in TABLE.rows if r.tied_to)  # Megatron's default ties them: look for the LM head
    untied = a["untie_embeddings_and_output_weights"] if "untie_embeddings_and_output_weights" in a \
        else has_tensor(head.megatron.name)
    return ModelConfig(
        name=name, vocab_size=int(vocab_size), hidden_size=hidden, num_layers=layers, num_heads=heads,
        num_kv_heads=groups, head_dim=int(a.get("kv_channels") or hidden // heads),
        intermediate_size=int(a.get("ffn_hidden_size") or 0), num_experts=experts,
        moe_intermediate_size=int(a.get("moe_ffn_hidden_size") or a.get("ffn_hidden_size") or 0) if experts else 0,
        top_k=int(a.get("moe_router_topk") or 0) if experts else 0,
        # top-k of the logits then softmax over the k (pre_softmax off) = HF's renormalised top-k
        norm_topk_prob=bool(experts) and not a.get("moe_router_pre_softmax", False),
        mlp_only_layers=tuple(i for i, k in enumerate(kinds) if not k) if experts else (),
        rope_theta=float(a.get("rotary_base") or 10000),
        rope_scaling_factor=float(a.get("rotary_seq_len_interpolation_factor") or 1.0),
        rms_norm_eps=float(a.get("norm_epsilon") or 1e-5),
        tie_word_embeddings=not untied,
        max_position_embeddings=int(a.get("max_position_embeddings") or a.get("seq_length") or 4096),
        init_std=float(a.get("init_method_std") or 0.02),
    )


def to_megatron(cfg: ModelConfig) -> dict[str, Any]:
    """The arguments Megatron builds ``cfg``'s model from (its shape; the layout and vocabulary
    padding are the checkpoint's, :func:`mlir_train.checkpoint.megatron.save.megatron_args`)."""
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
        rotary_base=int(cfg.rope_theta), rotary_percent=1.0, rotary_interleaved=False,
        rotary_seq_len_interpolation_factor=None if cfg.rope_scaling_factor == 1.0 else cfg.rope_scaling_factor,
        max_position_embeddings=cfg.max_position_embeddings,
        untie_embeddings_and_output_weights=not cfg.tie_word_embeddings, init_method_std=cfg.init_std,
    )
