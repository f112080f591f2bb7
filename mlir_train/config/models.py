"""What a model is: the architecture fields every family shares (:class:`ModelConfig`) and the
kind of each decoder layer (:class:`LayerKind`).

A family (:mod:`mlir_train.families`, one folder each) subclasses :class:`ModelConfig` where its
architecture needs more fields, names its released sizes, and maps its configs to and from HF's
``config.json`` and Megatron's args. Precision, parallelism and training knobs live with the code
that reads them; how a model is built to run is :class:`mlir_train.model.options.ModelOptions`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar


@dataclasses.dataclass(frozen=True)
class LayerKind:
    """What one decoder layer holds: its token mixer (``"attention"``: softmax attention; a
    family adds its own) and whether its MLP is a routed MoE block. Layers of one kind are stacked
    and scanned together. No truth value: ask ``kind.moe``."""

    moe: bool = False
    mixer: str = "attention"

    def __bool__(self) -> bool:  # an old ``if is_moe:`` on a kind would always be true
        raise TypeError("a LayerKind has no truth value; use kind.moe")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """A decoder-only LM's architecture. ``family`` names its folder in :mod:`mlir_train.families`,
    which builds it and reads and writes its checkpoints."""

    name: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int            # dense SwiGLU width (dense models, and the dense layers of MoE ones)
    num_experts: int = 0              # 0 -> dense model
    moe_intermediate_size: int = 0
    top_k: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    rope_theta: float = 1_000_000.0
    # Megatron's --rotary-seq-len-interpolation-factor: positions are divided by it (linear
    # position interpolation, HF rope_type "linear" with the same factor).
    rope_scaling_factor: float = 1.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 40960
    init_std: float = 0.02
    router_aux_loss_coef: float = 0.001  # carried only for HF export of MoE configs
    # Megatron's --mtp-num-layers: multi-token-prediction depths trained after the decoder (0: none;
    # a checkpoint's MTP head is then carried untouched). Not part of structure(): a run chooses it.
    mtp_num_layers: int = 0
    family: ClassVar[str] = "qwen3"

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def rotary_dim(self) -> int:
        """How many of a head's dimensions RoPE rotates (all of them here; a family with partial
        RoPE rotates fewer)."""
        return self.head_dim

    def structure(self) -> dict[str, Any]:
        """What makes two configs the same network, whatever their name, vocabulary padding,
        context length or init: a model named with ``--model-name`` must agree with the
        checkpoint ``--load`` reads on every entry. Sizes no layer uses are left out."""
        kinds = self.layer_kinds()
        found = dict(family=self.family, hidden_size=self.hidden_size, num_layers=self.num_layers,
                     num_heads=self.num_heads, num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
                     tie_word_embeddings=self.tie_word_embeddings, layer_kinds=kinds)
        if any(not k.moe for k in kinds):
            found["intermediate_size"] = self.intermediate_size
        if self.is_moe:
            found.update(num_experts=self.num_experts, moe_intermediate_size=self.moe_intermediate_size,
                         top_k=self.top_k, norm_topk_prob=self.norm_topk_prob)
        return found

    def layout_dims(self) -> dict[str, int]:
        """The sizes a parallel layout must divide, by the names :func:`sharding.mesh.validate`
        and :func:`sharding.rules.rules_for` read (a family adds its own)."""
        return dict(
            num_heads=self.num_heads, num_kv_heads=self.num_kv_heads, num_experts=self.num_experts,
            intermediate_size=self.intermediate_size, moe_intermediate_size=self.moe_intermediate_size,
            num_layers=self.num_layers, vocab_size=self.vocab_size, hidden_size=self.hidden_size,
        )

    def layer_flops(self, layer: int, seq_length: int, *, causal: bool = True) -> float:
        """Decoder layer ``layer``'s per-token matmul terms of Megatron-LM's
        ``num_floating_point_operations`` (before its ``3 * 2``; :mod:`mlir_train.model.flops`):
        the MLP (dense SwiGLU, or the routed experts), the QKV and output projections and core
        attention (halved for the causal mask unless ``causal=False``). A family whose layers
        differ counts its own."""
        h, s = self.hidden_size, seq_length
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        ffn = 3 * self.moe_intermediate_size * self.top_k if self.layer_is_moe(layer) else 3 * self.intermediate_size
        core_attn = q * s / 2 * 2 if causal else q * s * 2
        return h * ffn + h * (q + 2 * kv) + core_attn + q * h

    def layer_is_moe(self, layer: int) -> bool:
        """HF Qwen3-MoE's rule for which decoder layers get a sparse MoE block."""
        return (
            self.is_moe
            and layer not in self.mlp_only_layers
            and (layer + 1) % self.decoder_sparse_step == 0
        )

    def mtp_kinds(self) -> tuple[LayerKind, ...]:
        """The layer kind of each multi-token-prediction depth (a family with an MTP head says)."""
        if self.mtp_num_layers:
            raise ValueError(f"{self.name}: --mtp-num-layers {self.mtp_num_layers}: the {self.family} family has no "
                             "multi-token-prediction head (Qwen3.5, Qwen3.6 and Qwen3-Next have one)")
        return ()

    def router_layers(self) -> int:
        """How many MoE routers a forward runs: the decoder's MoE layers, then the MTP depths' (the
        leading axis of the router stats and of the aux losses, as megatron-core counts them)."""
        return sum(self.moe_layers()) + sum(k.moe for k in self.mtp_kinds())

    def moe_layers(self) -> tuple[bool, ...]:
        """Whether each decoder layer is MoE, in order."""
        return tuple(self.layer_is_moe(i) for i in range(self.num_layers))

    def layer_kinds(self) -> tuple[LayerKind, ...]:
        """Each decoder layer's :class:`LayerKind`, in order."""
        return tuple(LayerKind(moe=moe) for moe in self.moe_layers())

    def with_moe_layers(self, pattern: tuple[bool, ...]) -> "ModelConfig":
        """This config with MoE exactly at ``pattern``'s layers (``--moe-layer-freq``)."""
        return self.replace(decoder_sparse_step=1, mlp_only_layers=tuple(i for i, moe in enumerate(pattern) if not moe))

    def with_layer_kinds(self, kinds: tuple[LayerKind, ...]) -> "ModelConfig":
        """This config of ``len(kinds)`` layers, each of its kind."""
        small = self.replace(num_layers=len(kinds), **self.mixer_fields(tuple(k.mixer for k in kinds)))
        return small.with_moe_layers(tuple(k.moe for k in kinds)) if self.is_moe else small

    def mixer_fields(self, mixers: tuple[str, ...]) -> dict[str, Any]:
        """The fields that give the layers these token mixers (a family with other mixers than
        attention names its own)."""
        others = set(mixers) - {"attention"}
        if others:
            raise ValueError(f"{self.name}: this family's layers have attention only, not {sorted(others)}")
        return {}

    def replace(self, **changes: Any) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    def as_dict(self) -> dict[str, Any]:
        """Every field and the family: what our checkpoints record (:func:`mlir_train.families.from_saved` reads it)."""
        return dataclasses.asdict(self) | {"family": self.family}

    def num_params(self) -> int:
        """Total parameter count (all experts), as HF would report it."""
        h, d = self.hidden_size, self.head_dim
        attn = h * d * (self.num_heads + 2 * self.num_kv_heads) + self.num_heads * d * h + 2 * d
        total = 0
        for moe in self.moe_layers():
            mlp = (
                self.num_experts * 3 * h * self.moe_intermediate_size + h * self.num_experts
                if moe
                else 3 * h * self.intermediate_size
            )
            total += attn + mlp + 2 * h
        total += self.vocab_size * h * (1 if self.tie_word_embeddings else 2) + h
        return total


def moe_layer_pattern(freq: str, num_layers: int) -> tuple[bool, ...]:
    """Megatron's ``--moe-layer-freq``: an int ``N`` (layer ``i`` is MoE when ``i % N == 0``) or
    a Python list expression of 0/1 per layer such as ``([0]*3+[1]*45)``. Raises ValueError
    naming the flag."""
    import ast

    def value(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, (ast.List, ast.Tuple)):
            return [value(e) for e in node.elts]
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
            a, b = value(node.left), value(node.right)
            return a + b if isinstance(node.op, ast.Add) else a * b
        raise ValueError
    try:
        parsed = value(ast.parse(freq.strip(), mode="eval").body)
    except (SyntaxError, ValueError, TypeError):
        raise ValueError(f"--moe-layer-freq {freq!r}: give an int or a list of 0/1 per layer, e.g. ([0]*3+[1]*45)") from None
    if isinstance(parsed, int):
        if parsed < 1:
            raise ValueError(f"--moe-layer-freq {freq}: must be >= 1")
        return tuple(i % parsed == 0 for i in range(num_layers))
    if len(parsed) != num_layers or any(x not in (0, 1) for x in parsed):
        raise ValueError(f"--moe-layer-freq {freq!r}: needs one 0/1 entry per layer ({num_layers}), got {parsed}")
    return tuple(bool(x) for x in parsed)
