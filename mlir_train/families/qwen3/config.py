"""Qwen3 and Qwen3-MoE configs: the released sizes (``--model-name``) and HF ``config.json``
both ways. Values are those of the public Qwen3 releases' ``config.json`` files."""

from __future__ import annotations

from typing import Any

from mlir_train.config.models import ModelConfig
from mlir_train.runtime.errors import CheckpointError

HF_MODEL_TYPES = ("qwen3", "qwen3_moe")


def from_hf(hf: dict[str, Any], name: str | None = None) -> ModelConfig:
    """Our config of a Qwen3 / Qwen3-MoE ``config.json`` (as a dict)."""
    model_type = hf.get("model_type", "")
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "linear"):
        raise CheckpointError(f"rope_type {rope_type!r} is not supported (supported: default, linear)")
    factor = float(rope.get("factor", 1.0)) if rope_type == "linear" else 1.0
    moe = model_type == "qwen3_moe"
    heads = hf["num_attention_heads"]
    return ModelConfig(
        name=name or hf.get("_name_or_path") or model_type,
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads", heads),
        head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
        intermediate_size=hf.get("intermediate_size", 0),
        num_experts=(hf.get("num_experts") or hf.get("num_local_experts") or 0) if moe else 0,
        moe_intermediate_size=hf.get("moe_intermediate_size", 0) if moe else 0,
        top_k=hf.get("num_experts_per_tok", 0) if moe else 0,
        norm_topk_prob=bool(hf.get("norm_topk_prob", False)) if moe else False,
        decoder_sparse_step=hf.get("decoder_sparse_step", 1) if moe else 1,
        mlp_only_layers=tuple(hf.get("mlp_only_layers", ()) or ()) if moe else (),
        rope_theta=float(theta),
        rope_scaling_factor=factor,
        rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        max_position_embeddings=hf.get("max_position_embeddings", 40960),
        init_std=hf.get("initializer_range", 0.02),
        router_aux_loss_coef=hf.get("router_aux_loss_coef", 0.001),
    )


def to_hf(cfg: ModelConfig) -> dict[str, Any]:
    """The ``config.json`` fields of ``cfg``, as transformers' Qwen3 / Qwen3-MoE configs spell them."""
    rope: dict[str, Any] = {"rope_theta": cfg.rope_theta, "rope_type": "default"}
    if cfg.rope_scaling_factor != 1.0:
        rope = {"rope_theta": cfg.rope_theta, "rope_type": "linear", "factor": cfg.rope_scaling_factor}
    d: dict[str, Any] = {
        "architectures": ["Qwen3MoeForCausalLM" if cfg.is_moe else "Qwen3ForCausalLM"],
        "model_type": "qwen3_moe" if cfg.is_moe else "qwen3",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "intermediate_size": cfg.intermediate_size,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_parameters": rope,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "max_position_embeddings": cfg.max_position_embeddings,
        "initializer_range": cfg.init_std,
        "use_sliding_window": False,
        "sliding_window": None,
    }
    if cfg.is_moe:
        d.update(
            num_experts=cfg.num_experts,
            moe_intermediate_size=cfg.moe_intermediate_size,
            num_experts_per_tok=cfg.top_k,
            norm_topk_prob=cfg.norm_topk_prob,
            decoder_sparse_step=cfg.decoder_sparse_step,
            mlp_only_layers=list(cfg.mlp_only_layers),
            router_aux_loss_coef=cfg.router_aux_loss_coef,
        )
    return d


_VOCAB = 151936


def _dense(name: str, hidden: int, layers: int, heads: int, inter: int, tie: bool) -> ModelConfig:
    return ModelConfig(
        name=name, vocab_size=_VOCAB, hidden_size=hidden, num_layers=layers, num_heads=heads,
        num_kv_heads=8, head_dim=128, intermediate_size=inter, tie_word_embeddings=tie,
    )


MODELS: dict[str, ModelConfig] = {
    # Dense Qwen3 releases (Qwen/Qwen3-*/config.json).
    "qwen3-0.6b": _dense("qwen3-0.6b", 1024, 28, 16, 3072, tie=True),
    "qwen3-1.7b": _dense("qwen3-1.7b", 2048, 28, 16, 6144, tie=True),
    "qwen3-4b": _dense("qwen3-4b", 2560, 36, 32, 9728, tie=True),
    "qwen3-8b": _dense("qwen3-8b", 4096, 36, 32, 12288, tie=False),
    "qwen3-14b": _dense("qwen3-14b", 5120, 40, 40, 17408, tie=False),
    "qwen3-32b": _dense("qwen3-32b", 5120, 64, 64, 25600, tie=False),
    # MoE releases.
    "qwen3-30b-a3b": ModelConfig(
        name="qwen3-30b-a3b", vocab_size=_VOCAB, hidden_size=2048, num_layers=48, num_heads=32,
        num_kv_heads=4, head_dim=128, intermediate_size=6144, num_experts=128,
        moe_intermediate_size=768, top_k=8, norm_topk_prob=True,
    ),
    "qwen3-235b-a22b": ModelConfig(
        name="qwen3-235b-a22b", vocab_size=_VOCAB, hidden_size=4096, num_layers=94, num_heads=64,
        num_kv_heads=4, head_dim=128, intermediate_size=12288, num_experts=128,
        moe_intermediate_size=1536, top_k=8, norm_topk_prob=True,
    ),
    # Tiny configs that train on a laptop CPU in seconds. Their vocab is a placeholder: the
    # trainer replaces it with the (padded) tokenizer size. Head/expert counts divide by 2 and
    # 4 so every test layout (TP2, EP4, PP4) splits them.
    "qwen3-moe-tiny": ModelConfig(
        name="qwen3-moe-tiny", vocab_size=2048, hidden_size=128, num_layers=4, num_heads=4,
        num_kv_heads=2, head_dim=32, intermediate_size=256, num_experts=8,
        moe_intermediate_size=64, top_k=2, norm_topk_prob=True, max_position_embeddings=4096,
    ),
    "qwen3-tiny": ModelConfig(
        name="qwen3-tiny", vocab_size=2048, hidden_size=128, num_layers=4, num_heads=4,
        num_kv_heads=2, head_dim=32, intermediate_size=384, tie_word_embeddings=True,
        max_position_embeddings=4096,
    ),
}
