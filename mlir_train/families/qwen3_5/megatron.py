"""Qwen3.5 / Qwen3.6 and Qwen3-Next in megatron-core: each parameter's tensor in a torch_dist
(dist-checkpointing) checkpoint, and the model's shape from Megatron-LM's ``args``.

The model is megatron-core's ``GPTModel`` as Megatron-Bridge's ``Qwen3NextBridge`` / Qwen3.5
bridges and Megatron-LM configure it: ``--experimental-attention-variant gated_delta_net`` with
``--linear-attention-freq`` (``GatedDeltaNet`` layers, softmax attention every N-th),
``--attention-output-gate``, ``--apply-layernorm-1p`` (zero-centred RMSNorms), a gated shared
expert (``--moe-shared-expert-gate``), Transformer Engine's fused norm + linear modules. Its
torch_dist names (checked against megatron-core 0.16.1 on CPU in
``tests/checkpoint/test_megatron_qwen3_5.py``):

* gated DeltaNet: ``self_attention.in_proj.weight.{query,key,value,z,beta,alpha}`` (megatron-core's
  ``GatedDeltaNet.sharded_state_dict`` stores the fused input projection as six global tensors, so
  the checkpoint reads the same whatever TP wrote it), ``self_attention.conv1d.weight.{query,key,value}``
  ``[rows, 1, W]``, ``dt_bias``, ``A_log``, ``out_norm.weight`` (a plain RMSNorm weight in HF,
  zero-centred in Megatron: Megatron-Bridge's ``RMSNorm2ZeroCenteredRMSNormMapping`` stores
  ``w - 1``), ``out_proj.weight``; its input norm is ``in_proj.layer_norm_weight``;
* gated attention: ``linear_qkv.weight`` per query group its query heads, then their output-gate
  heads, then the key and value head (:class:`GatedQueryGroups`; HF's ``q_proj`` holds per head
  its query then its gate);
* MoE: ``mlp.router.weight``, the experts as Qwen3's, ``mlp.shared_experts.linear_fc1`` (gate and
  up) / ``linear_fc2`` / ``gate_weight`` ``[1, D]``.

LoongForge builds these models with its own ``GatedDeltaNet`` (``in_proj_qkvz`` / ``in_proj_ba`` in
HF Qwen3-Next's fused layout, the DeltaNet replicated over TP, a plain ``out_norm``, a separate
``input_layernorm``; Qwen3.5 under ``language_model.decoder.layers``): a tensor of that layout is
refused by name (``megatron_refused`` of the table). The legacy ``torch`` format is not read for this family: its files hold each TP rank's fused
``in_proj.weight`` (that rank's q, k, v, z, b, a one after another), a layout no reader here
splits; such a checkpoint fails naming the tensor it lacks.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from mlir_train.families.qwen3.megatron import moe_kinds
from mlir_train.families.qwen3.params import EXPERT_FC1, EXPERT_FC2, FC1, FC2
from mlir_train.families.table import COLUMN, GLU, ROW, VOCAB, GateUp, Linear, Megatron, Param
from mlir_train.runtime.errors import CheckpointError


@dataclasses.dataclass(frozen=True)
class GatedQueryGroups:
    """megatron-core's ``linear_qkv`` with ``attention_output_gate``: ``[K*(2G+2)*H, D]``, per
    query group its G query heads, its G gate heads, its key head, its value head; ours q
    ``[D, N, 2H]`` (per head its query, then its gate), k and v ``[D, K, H]``."""

    parts = 3

    def split(self, ext, shapes):
        (d, n, h2), (_, k, h) = shapes[0], shapes[1]
        g = n // k
        w = ext.reshape(k, 2 * g + 2, h, d)
        q = np.concatenate([w[:, :g], w[:, g:2 * g]], axis=2).reshape(n, h2, d).transpose(2, 0, 1)
        return q, w[:, 2 * g].transpose(2, 0, 1), w[:, 2 * g + 1].transpose(2, 0, 1)

    def join(self, parts):
        q, k, v = parts
        d, n, h2 = q.shape
        groups, h = k.shape[1], k.shape[2]
        q = q.transpose(1, 2, 0).reshape(groups, n // groups, h2, d)
        return np.concatenate([q[:, :, :h], q[:, :, h:], k.transpose(1, 2, 0)[:, None], v.transpose(1, 2, 0)[:, None]],
                              axis=1).reshape(-1, d)


@dataclasses.dataclass(frozen=True)
class PlusOne:
    """A plain RMSNorm weight stored zero-centred (``w - 1``), as Megatron keeps the DeltaNet's
    output norm under ``--apply-layernorm-1p``."""

    parts = 1

    def split(self, ext, shapes):
        return (ext + 1.0,)

    def join(self, parts):
        return parts[0] - 1.0


GDN = "self_attention."
_QKV = GatedQueryGroups()
_CONV = dict(conv_q_WGK="query", conv_k_WGK="key", conv_v_WHV="value")
_IN_PROJ = dict(wq_DGK="query", wk_DGK="key", wv_DHV="value", wz_DHV="z", wb_DH="beta", wa_DH="alpha")


def _conv_codec():
    from mlir_train.families.qwen3_5.params import Sections  # the HF conv codec, one part

    return Sections(1, conv=True)


def entries() -> dict[tuple[str, ...], Megatron]:
    """Each parameter path's Megatron tensor (module docstring); expert rows by path too."""
    lin = lambda name, split=COLUMN, codec=Linear(), **kw: Megatron((name,), codec, split=split, linear=True, **kw)
    out = {
        ("embed",): Megatron(("embedding.word_embeddings.weight",), split=VOCAB, stage="first"),
        ("final_norm", "scale"): Megatron(("decoder.final_layernorm.weight",), stage="last"),
        ("lm_head",): Megatron(("output_layer.weight",), Linear(), split=VOCAB, linear=True, stage="last"),
        ("input_norm", "scale"): Megatron(("input_layernorm.weight", "self_attention.linear_qkv.layer_norm_weight",
                                           "self_attention.in_proj.layer_norm_weight")),
        ("post_attn_norm", "scale"): Megatron(("pre_mlp_layernorm.weight", "mlp.linear_fc1.layer_norm_weight")),
        ("attn", "o_proj"): lin("self_attention.linear_proj.weight", ROW, Linear(2)),
        ("attn", "q_norm", "scale"): Megatron(("self_attention.q_layernorm.weight",)),
        ("attn", "k_norm", "scale"): Megatron(("self_attention.k_layernorm.weight",)),
        ("linear_attn", "dt_bias_H"): Megatron((GDN + "dt_bias",), split=COLUMN),
        ("linear_attn", "a_log_H"): Megatron((GDN + "A_log",), split=COLUMN),
        ("linear_attn", "norm_V"): Megatron((GDN + "out_norm.weight",), PlusOne()),
        ("linear_attn", "wout_HVD"): lin(GDN + "out_proj.weight", ROW, Linear(2)),
        ("mlp", "down_proj", "dense"): lin("mlp.linear_fc2.weight", ROW),
        ("mlp", "router"): Megatron(("mlp.router.weight",), Linear()),
        ("mlp", "shared_expert", "down_proj"): lin("mlp.shared_experts.linear_fc2.weight", ROW),
        ("mlp", "shared_expert_gate"): Megatron(("mlp.shared_experts.gate_weight",), Linear()),
        ("mlp", "down_proj", "expert"): Megatron(EXPERT_FC2, Linear(), split=ROW, linear=True, experts=FC2),
    }
    for i, name in enumerate(("q", "k", "v")):
        out[("attn", f"{name}_proj")] = Megatron(("self_attention.linear_qkv.weight",), _QKV, i, split=COLUMN, linear=True)
    for w, part in _IN_PROJ.items():
        out[("linear_attn", w)] = lin(f"{GDN}in_proj.weight.{part}")
    for w, part in _CONV.items():
        out[("linear_attn", w)] = Megatron((f"{GDN}conv1d.weight.{part}",), _conv_codec(), split=COLUMN)
    for i, name in enumerate(("gate", "up")):
        out[("mlp", f"{name}_proj", "dense")] = Megatron(("mlp.linear_fc1.weight",), GateUp(), i, split=GLU, linear=True)
        out[("mlp", "shared_expert", f"{name}_proj")] = Megatron(("mlp.shared_experts.linear_fc1.weight",), GateUp(), i,
                                                                 split=GLU, linear=True)
        out[("mlp", f"{name}_proj", "expert")] = Megatron(EXPERT_FC1, GateUp(), i, split=GLU, linear=True, experts=FC1)
    return out


def with_megatron(rows: tuple[Param, ...]) -> tuple[Param, ...]:
    """``rows`` with their Megatron tensors (:func:`entries`); the state row (expert bias) keeps none."""
    table = entries()

    def key(r: Param) -> tuple[str, ...]:
        if r.path in (("mlp", "gate_proj"), ("mlp", "up_proj"), ("mlp", "down_proj")):
            return (*r.path, "expert" if r.moe else "dense")
        return r.path

    return tuple(dataclasses.replace(r, megatron=table[key(r)]) if key(r) in table else r for r in rows)


# ----- the model's shape from Megatron-LM's args ----------------------------------------------
def _check(a: dict[str, Any]) -> None:
    """Refuse args of another architecture, naming what differs."""
    def need(cond: bool, what: str) -> None:
        if not cond:
            raise CheckpointError(f"{what}; a Qwen3.5 / Qwen3-Next model needs it")

    need(a.get("experimental_attention_variant") == "gated_delta_net",
         f"experimental_attention_variant={a.get('experimental_attention_variant')!r} (not gated_delta_net)")
    need(bool(a.get("attention_output_gate")), "attention_output_gate is off")
    need(bool(a.get("apply_layernorm_1p", a.get("layernorm_zero_centered_gamma"))),
         "apply_layernorm_1p (zero-centred RMSNorm) is off")
    need(a.get("normalization", "RMSNorm") == "RMSNorm", f"normalization={a.get('normalization')!r}")
    need(bool(a.get("swiglu", True)) and bool(a.get("qk_layernorm", True)), "swiglu or qk_layernorm is off")
    need(not a.get("add_bias_linear", False) and not a.get("add_qkv_bias", False), "linear biases are on")
    need(not a.get("rotary_interleaved", False), "rotary_interleaved is on")
    need(a.get("moe_router_score_function", "softmax") == "softmax",
         f"moe_router_score_function={a.get('moe_router_score_function')!r}")
    need(not a.get("moe_shared_expert_intermediate_size") or bool(a.get("moe_shared_expert_gate")),
         "the shared expert has no gate (moe_shared_expert_gate is off)")
    if a.get("mtp_num_layers"):
        raise CheckpointError(f"it has {a['mtp_num_layers']} multi-token-prediction layer(s) (mtp_num_layers), which "
                              "are not read from a Megatron checkpoint; convert it to HF (its mtp.* tensors are carried "
                              "there) or save it without MTP")
    freq = a.get("linear_attention_freq")
    need(isinstance(freq, int) or isinstance(freq, (list, tuple)) and len(freq) == int(a["num_layers"]),
         f"linear_attention_freq={freq!r} (an int or one 0/1 per layer)")


def _layer_types(freq, layers: int) -> tuple[str, ...]:
    from mlir_train.families.qwen3_5.config import FULL, LINEAR

    linear = [(i + 1) % freq != 0 for i in range(layers)] if isinstance(freq, int) else [bool(x) for x in freq]
    return tuple(LINEAR if x else FULL for x in linear)


def _hf_model_type(name: str, a: dict[str, Any], experts: int) -> str:
    """The HF class the model is written back as: the named release's, else Qwen3.5's for its
    248320-token vocabulary and Qwen3-Next's otherwise (the args do not say)."""
    from mlir_train.families.qwen3_5.config import MODELS

    if name in MODELS:
        return MODELS[name].hf_model_type
    if int(a.get("padded_vocab_size") or 0) >= 248320:
        return "qwen3_5_moe_text" if experts else "qwen3_5_text"
    return "qwen3_next"


def from_megatron(a: dict[str, Any], *, name: str, vocab_size: int, has_tensor):
    """Our config of Megatron-LM's ``args`` for a Qwen3.5 / Qwen3-Next model; a
    :class:`CheckpointError` naming what is not one."""
    from mlir_train.families.qwen3_5.config import Qwen35Config

    _check(a)
    heads, hidden, layers = int(a["num_attention_heads"]), int(a["hidden_size"]), int(a["num_layers"])
    groups = int(a["num_query_groups"]) if a.get("group_query_attention") and a.get("num_query_groups") else heads
    experts = int(a.get("num_experts") or 0)
    kinds = moe_kinds(a, layers, experts)
    untied = a["untie_embeddings_and_output_weights"] if "untie_embeddings_and_output_weights" in a \
        else has_tensor("output_layer.weight")
    head_dim = int(a.get("kv_channels") or hidden // heads)
    return Qwen35Config(
        name=name, vocab_size=int(vocab_size), hidden_size=hidden, num_layers=layers, num_heads=heads,
        num_kv_heads=groups, head_dim=head_dim, intermediate_size=int(a.get("ffn_hidden_size") or 0),
        num_experts=experts, moe_intermediate_size=int(a.get("moe_ffn_hidden_size") or 0) if experts else 0,
        top_k=int(a.get("moe_router_topk") or 0) if experts else 0,
        norm_topk_prob=bool(experts) and not a.get("moe_router_pre_softmax", False),
        mlp_only_layers=tuple(i for i, k in enumerate(kinds) if not k) if experts else (),
        rope_theta=float(a.get("rotary_base") or 10000), rms_norm_eps=float(a.get("norm_epsilon") or 1e-6),
        tie_word_embeddings=not untied, max_position_embeddings=int(a.get("max_position_embeddings") or 4096),
        init_std=float(a.get("init_method_std") or 0.02),
        layer_types=_layer_types(a["linear_attention_freq"], layers),
        linear_num_key_heads=int(a["linear_num_key_heads"]), linear_num_value_heads=int(a["linear_num_value_heads"]),
        linear_key_head_dim=int(a["linear_key_head_dim"]), linear_value_head_dim=int(a["linear_value_head_dim"]),
        linear_conv_kernel_dim=int(a.get("linear_conv_kernel_dim") or 4),
        partial_rotary_factor=float(a.get("rotary_percent") or 1.0),
        shared_expert_intermediate_size=int(a.get("moe_shared_expert_intermediate_size") or 0) if experts else 0,
        hf_model_type=_hf_model_type(name, a, experts),
    )
