"""Model architecture configs: a registry keyed by Megatron/AIAK ``--model-name`` strings.

Values are those of the public Qwen3 releases' ``config.json`` files. ``ModelConfig`` is
architecture only; precision, parallelism and training knobs live with the code that reads them.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

from mlir_train.runtime.errors import CheckpointError, ConfigError


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    name: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int            # dense SwiGLU width (dense models, and mlp_only_layers of MoE ones)
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

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def layer_is_moe(self, layer: int) -> bool:
        """HF Qwen3-MoE's rule for which decoder layers get a sparse MoE block."""
        return (
            self.is_moe
            and layer not in self.mlp_only_layers
            and (layer + 1) % self.decoder_sparse_step == 0
        )

    def layer_kinds(self) -> tuple[bool, ...]:
        return tuple(self.layer_is_moe(i) for i in range(self.num_layers))

    def replace(self, **changes: Any) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    def num_params(self) -> int:
        """Total parameter count (all experts), as HF would report it."""
        h, d = self.hidden_size, self.head_dim
        attn = h * d * (self.num_heads + 2 * self.num_kv_heads) + self.num_heads * d * h + 2 * d
        total = 0
        for moe in self.layer_kinds():
            mlp = (
                self.num_experts * 3 * h * self.moe_intermediate_size + h * self.num_experts
                if moe
                else 3 * h * self.intermediate_size
            )
            total += attn + mlp + 2 * h
        total += self.vocab_size * h * (1 if self.tie_word_embeddings else 2) + h
        return total

    # ----- HF interop -------------------------------------------------------------------
    @classmethod
    def from_hf_dict(cls, hf: dict[str, Any], name: str | None = None) -> "ModelConfig":
        model_type = hf.get("model_type", "")
        if model_type not in ("qwen3", "qwen3_moe"):
            raise CheckpointError(f"HF model_type {model_type!r} is not a Qwen3 model: mlir-train trains model_type "
                                  "'qwen3' or 'qwen3_moe'; give a Qwen3 / Qwen3-MoE model directory")
        rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
        theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", "linear"):
            raise CheckpointError(f"rope_type {rope_type!r} is not supported (supported: default, linear)")
        factor = float(rope.get("factor", 1.0)) if rope_type == "linear" else 1.0
        moe = model_type == "qwen3_moe"
        heads = hf["num_attention_heads"]
        return cls(
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

    @classmethod
    def from_hf_json(cls, path: str) -> "ModelConfig":
        """The config of an HF directory (or its ``config.json``); anything that is not a Qwen3 /
        Qwen3-MoE config there is a :class:`CheckpointError` naming the file."""
        file = os.path.join(path, "config.json") if os.path.isdir(path) else path
        try:
            with open(file) as f:
                hf = json.load(f)
        except FileNotFoundError:
            raise CheckpointError(f"{file}: no HF config.json there") from None
        except json.JSONDecodeError as e:
            raise CheckpointError(f"{file}:{e.lineno}: not valid JSON ({e.msg})") from None
        except (OSError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{file}: cannot read it ({e})") from None
        if not isinstance(hf, dict):
            raise CheckpointError(f"{file}: not an HF config (expected a JSON object)")
        try:
            return cls.from_hf_dict(hf, name=os.path.basename(os.path.dirname(os.path.abspath(file))))
        except CheckpointError as e:
            raise CheckpointError(f"{file}: {e}") from None
        except KeyError as e:
            raise CheckpointError(f"{file}: HF config without {e.args[0]!r}; is it a Qwen3 config.json?") from None
        except (TypeError, ValueError) as e:
            raise CheckpointError(f"{file}: not a usable Qwen3 config ({e})") from None

    def to_hf_dict(self) -> dict[str, Any]:
        rope: dict[str, Any] = {"rope_theta": self.rope_theta, "rope_type": "default"}
        if self.rope_scaling_factor != 1.0:
            rope = {"rope_theta": self.rope_theta, "rope_type": "linear", "factor": self.rope_scaling_factor}
        d: dict[str, Any] = {
            "architectures": ["Qwen3MoeForCausalLM" if self.is_moe else "Qwen3ForCausalLM"],
            "model_type": "qwen3_moe" if self.is_moe else "qwen3",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size,
            "hidden_act": "silu",
            "attention_bias": False,
            "attention_dropout": 0.0,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_parameters": rope,
            "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
            "initializer_range": self.init_std,
            "use_sliding_window": False,
            "sliding_window": None,
        }
        if self.is_moe:
            d.update(
                num_experts=self.num_experts,
                moe_intermediate_size=self.moe_intermediate_size,
                num_experts_per_tok=self.top_k,
                norm_topk_prob=self.norm_topk_prob,
                decoder_sparse_step=self.decoder_sparse_step,
                mlp_only_layers=list(self.mlp_only_layers),
                router_aux_loss_coef=self.router_aux_loss_coef,
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


def layer_pattern_overrides(pattern: tuple[bool, ...]) -> dict[str, Any]:
    """The HF fields (``decoder_sparse_step=1`` + ``mlp_only_layers``) that give ``pattern``."""
    return dict(decoder_sparse_step=1, mlp_only_layers=tuple(i for i, moe in enumerate(pattern) if not moe))


def get_model_config(name_or_path: "str | ModelConfig", **overrides: Any) -> ModelConfig:
    """A registry config by ``--model-name``, or one read from an HF directory / config.json (or
    a given config), with per-run overrides (``num_layers=..., top_k=..., vocab_size=...``) applied on top."""
    if isinstance(name_or_path, ModelConfig):
        cfg = name_or_path
    elif name_or_path in MODELS:
        cfg = MODELS[name_or_path]
    elif os.path.exists(name_or_path):
        try:
            cfg = ModelConfig.from_hf_json(name_or_path)
        except CheckpointError as e:
            raise ConfigError(f"--model-name {name_or_path}: {e}") from None
    else:
        import difflib

        close = difflib.get_close_matches(name_or_path, MODELS, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ConfigError(
            f"--model-name {name_or_path!r} is neither a known model ({', '.join(MODELS)}) "
            f"nor a path to an HF config.json.{hint}"
        )
    unknown = set(overrides) - {f.name for f in dataclasses.fields(ModelConfig)}
    if unknown:
        raise TypeError(f"unknown ModelConfig override(s): {sorted(unknown)}")
    return cfg.replace(**{k: v for k, v in overrides.items() if v is not None})
