"""Qwen3.5 / Qwen3.6 (MoE and dense) and Qwen3-Next configs: their released sizes
(``--model-name``), HF ``config.json`` both ways, and their FLOP and parameter counts.

One structure: every layer is pre-norm, its token mixer gated DeltaNet (``linear_attention``) or
gated full attention (``full_attention``, every 4th layer in the releases: HF's ``layer_types``),
then a routed MoE block with a gated shared expert, or a dense SwiGLU MLP. What tells the members
apart is :attr:`Qwen35Config.hf_model_type`: Qwen3-Next (``qwen3_next``) stores the DeltaNet input
projections fused per key head (``in_proj_qkvz``, ``in_proj_ba``) and may mix dense layers in
(``mlp_only_layers``, ``decoder_sparse_step``); Qwen3.5 stores them split, as a text model
(``qwen3_5_moe_text`` / ``qwen3_5_text``: ``model.layers.*``) or inside the vision-language model
(``qwen3_5_moe`` / ``qwen3_5``: ``model.language_model.*`` beside a vision tower), whose other
fields (the vision config, the image token ids) are kept in :attr:`Qwen35Config.hf_extra` and
written back as they came.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, ClassVar

from mlir_train.config.models import LayerKind, ModelConfig
from mlir_train.model.gated_deltanet import megatron_flops_per_token
from mlir_train.runtime.errors import CheckpointError

ATTENTION, GATED_DELTANET = "attention", "gated_deltanet"  # the LayerKind mixers
FULL, LINEAR = "full_attention", "linear_attention"         # HF's layer_types
TEXT_TYPES = {"qwen3_5_moe": "qwen3_5_moe_text", "qwen3_5": "qwen3_5_text"}  # vision-language -> its text model
HF_MODEL_TYPES = ("qwen3_next", "qwen3_5_moe_text", "qwen3_5_text", *TEXT_TYPES)
ARCHITECTURES = {"qwen3_next": "Qwen3NextForCausalLM", "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM",
                 "qwen3_5_text": "Qwen3_5ForCausalLM", "qwen3_5_moe": "Qwen3_5MoeForConditionalGeneration",
                 "qwen3_5": "Qwen3_5ForConditionalGeneration"}


@dataclasses.dataclass(frozen=True)
class Qwen35Config(ModelConfig):
    """The shared fields plus the family's: the layer pattern (``layer_types``, HF's spelling;
    empty: every 4th layer full attention), the DeltaNet's heads and conv, partial RoPE, the
    shared expert's width (0: none), the HF class (:data:`ARCHITECTURES`) and the HF fields kept
    to be written back (``hf_extra``, JSON)."""

    layer_types: tuple[str, ...] = ()
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_conv_kernel_dim: int = 4
    partial_rotary_factor: float = 0.25
    shared_expert_intermediate_size: int = 0
    hf_model_type: str = "qwen3_5_moe_text"
    hf_extra: str = ""
    family: ClassVar[str] = "qwen3_5"

    def __post_init__(self):
        if self.hf_model_type not in HF_MODEL_TYPES:
            raise ValueError(f"{self.name}: hf_model_type {self.hf_model_type!r} is not one of {HF_MODEL_TYPES}")
        if self.layer_types and len(self.layer_types) != self.num_layers:
            raise ValueError(f"{self.name}: {len(self.layer_types)} layer_types for {self.num_layers} layers")
        if set(self.layer_types) - {FULL, LINEAR}:
            raise ValueError(f"{self.name}: layer_types may be {FULL!r} or {LINEAR!r}, got {sorted(set(self.layer_types))}")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ValueError(f"{self.name}: linear_num_value_heads ({self.linear_num_value_heads}) must be a multiple "
                             f"of linear_num_key_heads ({self.linear_num_key_heads})")

    @property
    def fused_projections(self) -> bool:
        """Qwen3-Next's checkpoint layout of the DeltaNet input projections."""
        return self.hf_model_type == "qwen3_next"

    @property
    def hf_root(self) -> str:
        """Where the text model sits in the checkpoint's tensor names."""
        return "model.language_model." if self.hf_model_type in TEXT_TYPES else "model."

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    def mixers(self) -> tuple[str, ...]:
        """Each layer's HF layer type (every 4th layer full attention when none are given)."""
        return self.layer_types or tuple(FULL if (i + 1) % 4 == 0 else LINEAR for i in range(self.num_layers))

    def layer_kinds(self) -> tuple[LayerKind, ...]:
        return tuple(LayerKind(moe=moe, mixer=ATTENTION if t == FULL else GATED_DELTANET)
                     for moe, t in zip(self.moe_layers(), self.mixers()))

    def mtp_kinds(self) -> tuple[LayerKind, ...]:
        """Each MTP depth's layer: gated full attention, MoE as vLLM decides for ``mtp.layers.{d}``
        (the decoder's rule at index ``d``: every depth of the MoE releases)."""
        return tuple(LayerKind(moe=self.layer_is_moe(d), mixer=ATTENTION) for d in range(self.mtp_num_layers))

    def mixer_fields(self, mixers: tuple[str, ...]) -> dict[str, Any]:
        return {"layer_types": tuple(FULL if m == ATTENTION else LINEAR for m in mixers)}

    def structure(self) -> dict[str, Any]:
        found = super().structure() | dict(partial_rotary_factor=self.partial_rotary_factor,
                                           hf_text_type=TEXT_TYPES.get(self.hf_model_type, self.hf_model_type))
        if LINEAR in self.mixers():
            found.update(linear_num_key_heads=self.linear_num_key_heads, linear_num_value_heads=self.linear_num_value_heads,
                         linear_key_head_dim=self.linear_key_head_dim, linear_value_head_dim=self.linear_value_head_dim,
                         linear_conv_kernel_dim=self.linear_conv_kernel_dim)
        if self.is_moe:
            found["shared_expert_intermediate_size"] = self.shared_expert_intermediate_size
        return found

    def layout_dims(self) -> dict[str, int]:
        return super().layout_dims() | dict(shared_expert_intermediate_size=self.shared_expert_intermediate_size,
                                            gdn_key_heads=self.linear_num_key_heads,
                                            gdn_heads=self.linear_num_value_heads,
                                            gdn_conv_width=self.linear_conv_kernel_dim)

    def layer_flops(self, layer: int, seq_length: int, *, causal: bool = True) -> float:
        """Megatron-LM's terms (``num_floating_point_operations``, before its ``3 * 2``): a
        gated attention layer's projections count the gate (``attention_output_gate``), a
        gated-DeltaNet layer counts its ``experimental_attention_variant == "gated_delta_net"``
        term (:func:`~mlir_train.model.gated_deltanet.megatron_flops_per_token`), and an MoE
        layer its shared expert (``moe_shared_expert_intermediate_size``)."""
        h, q, kv, s = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim, seq_length
        attention = h * (q + 2 * kv) + (q * s if causal else 2 * q * s) + q * h
        mlp = super().layer_flops(layer, seq_length, causal=causal) - attention  # the base formula's MLP term
        if self.mixers()[layer] == FULL:
            mixer = attention + h * q
        else:
            mixer = megatron_flops_per_token(h, self.linear_num_key_heads, self.linear_num_value_heads,
                                             self.linear_key_head_dim, self.linear_value_head_dim,
                                             self.linear_conv_kernel_dim) / 2
        shared = 3 * h * self.shared_expert_intermediate_size if self.layer_is_moe(layer) else 0
        return mixer + mlp + shared

    def num_params(self) -> int:
        """Total parameter count (all experts), as HF would report it (the text model alone)."""
        h, n, kv, hd = self.hidden_size, self.num_heads, self.num_kv_heads, self.head_dim
        g, hv, k, v, w = (self.linear_num_key_heads, self.linear_num_value_heads, self.linear_key_head_dim,
                          self.linear_value_head_dim, self.linear_conv_kernel_dim)
        attn = h * hd * (2 * n + 2 * kv) + n * hd * h + 2 * hd
        gdn = h * (2 * g * k + 2 * hv * v + 2 * hv) + w * (2 * g * k + hv * v) + 2 * hv + v + hv * v * h
        total = 0
        for kind in self.layer_kinds():
            mlp = (self.num_experts * 3 * h * self.moe_intermediate_size + h * self.num_experts
                   + 3 * h * self.shared_expert_intermediate_size + h) if kind.moe else 3 * h * self.intermediate_size
            total += (attn if kind.mixer == ATTENTION else gdn) + mlp + 2 * h
        return total + self.vocab_size * h * (1 if self.tie_word_embeddings else 2) + h


# ----- HF config.json both ways ----------------------------------------------------------------
# The text config's fields this config models (written back from it); every other field of the
# file is kept in hf_extra as it came.
_MODELED = ("model_type", "architectures", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim", "intermediate_size", "num_experts", "moe_intermediate_size",
            "num_experts_per_tok", "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers", "rms_norm_eps",
            "tie_word_embeddings", "max_position_embeddings", "initializer_range", "router_aux_loss_coef",
            "layer_types", "full_attention_interval", "linear_num_key_heads", "linear_num_value_heads",
            "linear_key_head_dim", "linear_value_head_dim", "linear_conv_kernel_dim", "shared_expert_intermediate_size",
            "partial_rotary_factor", "rope_theta")


def _check(text: dict[str, Any]) -> None:
    """Refuse what this family's model does not compute, naming the field."""
    if text.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"hidden_act {text['hidden_act']!r}: only silu is supported")
    if text.get("attention_bias"):
        raise CheckpointError("attention_bias is true: the attention projections here have no biases")
    rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        raise CheckpointError(f"rope_type {rope.get('rope_type', rope.get('type'))!r} is not supported (supported: default)")


def from_hf(hf: dict[str, Any], name: str | None = None) -> Qwen35Config:
    """Our config of a Qwen3-Next / Qwen3.5 ``config.json`` (as a dict): a text model's, or a
    vision-language model's (its ``text_config``)."""
    model_type = hf.get("model_type", "")
    outer = {k: v for k, v in hf.items() if k != "text_config"} if model_type in TEXT_TYPES else None
    text = dict(hf["text_config"]) if outer is not None else dict(hf)
    _check(text)
    rope = dict(text.get("rope_parameters") or text.get("rope_scaling") or {})
    moe = int(text.get("num_experts") or 0) > 0
    heads = text["num_attention_heads"]
    extra = {"text": {k: v for k, v in text.items() if k not in _MODELED}, "outer": outer}
    return Qwen35Config(
        name=name or hf.get("_name_or_path") or model_type, vocab_size=text["vocab_size"],
        hidden_size=text["hidden_size"], num_layers=text["num_hidden_layers"], num_heads=heads,
        num_kv_heads=text.get("num_key_value_heads", heads), head_dim=text.get("head_dim") or text["hidden_size"] // heads,
        intermediate_size=text.get("intermediate_size") or 0,
        num_experts=int(text.get("num_experts") or 0) if moe else 0,
        moe_intermediate_size=text.get("moe_intermediate_size", 0) if moe else 0,
        top_k=text.get("num_experts_per_tok", 0) if moe else 0,
        # Qwen3.5-MoE's router always renormalises its top k; Qwen3-Next's as norm_topk_prob says.
        norm_topk_prob=moe and bool(text.get("norm_topk_prob", True) if model_type == "qwen3_next" else True),
        decoder_sparse_step=text.get("decoder_sparse_step", 1) if moe else 1,
        mlp_only_layers=tuple(text.get("mlp_only_layers") or ()) if moe else (),
        rope_theta=float(rope.get("rope_theta", text.get("rope_theta", 10000.0))),
        rms_norm_eps=text.get("rms_norm_eps", 1e-6),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", text.get("tie_word_embeddings", False))),
        max_position_embeddings=text.get("max_position_embeddings", 32768),
        init_std=text.get("initializer_range", 0.02), router_aux_loss_coef=text.get("router_aux_loss_coef", 0.001),
        layer_types=tuple(text.get("layer_types") or ()),
        linear_num_key_heads=text.get("linear_num_key_heads", 16), linear_num_value_heads=text.get("linear_num_value_heads", 32),
        linear_key_head_dim=text.get("linear_key_head_dim", 128), linear_value_head_dim=text.get("linear_value_head_dim", 128),
        linear_conv_kernel_dim=text.get("linear_conv_kernel_dim", 4),
        partial_rotary_factor=float(rope.get("partial_rotary_factor", text.get("partial_rotary_factor", 0.25))),
        shared_expert_intermediate_size=text.get("shared_expert_intermediate_size", 0) if moe else 0,
        hf_model_type=model_type, hf_extra=json.dumps(extra, sort_keys=True),
    )


def to_hf(cfg: Qwen35Config) -> dict[str, Any]:
    """The ``config.json`` of ``cfg`` as transformers spells it for its class: every field the
    config models, over the fields it came with (``hf_extra``); a vision-language model's text
    config inside its own, whose other fields are written back unchanged."""
    extra = json.loads(cfg.hf_extra) if cfg.hf_extra else {"text": {}, "outer": None}
    text_type = TEXT_TYPES.get(cfg.hf_model_type, cfg.hf_model_type)
    rope = dict(extra["text"].get("rope_parameters") or {})
    rope.update(rope_type=rope.get("rope_type", "default"), rope_theta=cfg.rope_theta,
                partial_rotary_factor=cfg.partial_rotary_factor)
    text = dict(extra["text"]) | {
        "model_type": text_type, "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
        "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim, "hidden_act": "silu",
        "attention_bias": False, "rms_norm_eps": cfg.rms_norm_eps, "rope_parameters": rope,
        "tie_word_embeddings": cfg.tie_word_embeddings, "max_position_embeddings": cfg.max_position_embeddings,
        "initializer_range": cfg.init_std, "layer_types": list(cfg.mixers()),
        "linear_num_key_heads": cfg.linear_num_key_heads, "linear_num_value_heads": cfg.linear_num_value_heads,
        "linear_key_head_dim": cfg.linear_key_head_dim, "linear_value_head_dim": cfg.linear_value_head_dim,
        "linear_conv_kernel_dim": cfg.linear_conv_kernel_dim,
    }
    if cfg.intermediate_size:
        text["intermediate_size"] = cfg.intermediate_size
    if cfg.mtp_num_layers:  # the trained head is written (a carried one keeps the field it came with)
        text["mtp_num_hidden_layers"] = cfg.mtp_num_layers
    if cfg.is_moe:
        text.update(num_experts=cfg.num_experts, moe_intermediate_size=cfg.moe_intermediate_size,
                    num_experts_per_tok=cfg.top_k, shared_expert_intermediate_size=cfg.shared_expert_intermediate_size,
                    router_aux_loss_coef=cfg.router_aux_loss_coef)
        if cfg.hf_model_type == "qwen3_next":
            text.update(norm_topk_prob=cfg.norm_topk_prob, decoder_sparse_step=cfg.decoder_sparse_step,
                        mlp_only_layers=list(cfg.mlp_only_layers))
    if extra["outer"] is None:
        return text | {"architectures": [ARCHITECTURES[cfg.hf_model_type]]}
    return dict(extra["outer"]) | {"model_type": cfg.hf_model_type, "architectures": [ARCHITECTURES[cfg.hf_model_type]],
                                   "tie_word_embeddings": cfg.tie_word_embeddings, "text_config": text}


def to_megatron(cfg: Qwen35Config) -> dict[str, Any]:
    raise CheckpointError(f"{cfg.name}: writing a Qwen3.5 / Qwen3-Next model as a Megatron checkpoint is not "
                          "supported (their torch_dist checkpoints are read only); write it with --save-hf "
                          "(convert --to hf)")


# ----- the released sizes (their config.json) and tiny ones for tests ---------------------------
def _release(name: str, **kw) -> Qwen35Config:
    base = dict(num_heads=16, num_kv_heads=2, head_dim=256, rope_theta=10_000_000.0, max_position_embeddings=262144,
                tie_word_embeddings=False)
    return Qwen35Config(name=name, **(base | kw))


_QWEN35_MOE = dict(vocab_size=248320, hidden_size=2048, num_layers=40, intermediate_size=0, num_experts=256,
                   moe_intermediate_size=512, top_k=8, norm_topk_prob=True, shared_expert_intermediate_size=512,
                   hf_model_type="qwen3_5_moe_text")
_QWEN35_27B = dict(vocab_size=248320, hidden_size=5120, num_layers=64, num_heads=24, num_kv_heads=4,
                   intermediate_size=17408, linear_num_value_heads=48, hf_model_type="qwen3_5_text")
# Tiny: heads, key heads and experts divide by 2 and 4 so every test layout (TP2, EP4) splits them;
# one full-attention layer in four as in the releases; the vocab is a placeholder the trainer replaces.
_TINY = dict(vocab_size=2048, hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=32,
             linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=32,
             rope_theta=10_000_000.0, max_position_embeddings=4096)

MODELS: dict[str, Qwen35Config] = {
    # Qwen/Qwen3.5-35B-A3B and Qwen/Qwen3.6-35B-A3B (one structure; the releases are the
    # vision-language class, whose config.json --load reads), Qwen/Qwen3-Next-80B-A3B-Instruct.
    "qwen3.5-35b-a3b": _release("qwen3.5-35b-a3b", **_QWEN35_MOE),
    "qwen3.6-35b-a3b": _release("qwen3.6-35b-a3b", **_QWEN35_MOE),
    "qwen3-next-80b-a3b": _release(
        "qwen3-next-80b-a3b", vocab_size=151936, hidden_size=2048, num_layers=48, intermediate_size=5120,
        num_experts=512, moe_intermediate_size=512, top_k=10, norm_topk_prob=True,
        shared_expert_intermediate_size=512, hf_model_type="qwen3_next"),
    # Dense: Qwen/Qwen3.5-27B (and Qwen3.6-27B, the same structure).
    "qwen3.5-27b": _release("qwen3.5-27b", **_QWEN35_27B),
    "qwen3.6-27b": _release("qwen3.6-27b", **_QWEN35_27B),
    "qwen3.5-moe-tiny": Qwen35Config(name="qwen3.5-moe-tiny", **_TINY, intermediate_size=0, num_experts=8,
                                     moe_intermediate_size=64, top_k=2, norm_topk_prob=True,
                                     shared_expert_intermediate_size=64, hf_model_type="qwen3_5_moe_text"),
    "qwen3.5-tiny": Qwen35Config(name="qwen3.5-tiny", **_TINY, intermediate_size=384, tie_word_embeddings=True,
                                 hf_model_type="qwen3_5_text"),
    "qwen3-next-tiny": Qwen35Config(name="qwen3-next-tiny", **_TINY, intermediate_size=256, num_experts=8,
                                    moe_intermediate_size=64, top_k=2, norm_topk_prob=True, mlp_only_layers=(0,),
                                    shared_expert_intermediate_size=64, hf_model_type="qwen3_next"),
}
