"""Qwen3.5 / Qwen3.6 and Qwen3-Next's parameter table: every parameter's HF and LoRA names.

HF: transformers 5.24's names (``Qwen3_5MoeForCausalLM``, ``Qwen3NextForCausalLM``, the dense
``Qwen3_5ForCausalLM``) under ``model.``; the vision-language classes
(``Qwen3_5MoeForConditionalGeneration``) hold the same under ``model.language_model.``
(:func:`hf_table`). Routed experts as the releases store them (``mlp.experts.{e}.gate_proj``,
written) or fused as transformers 5 holds them (``mlp.experts.gate_up_proj``, read too). A gated
DeltaNet layer's input projections are split in Qwen3.5 (``in_proj_qkv``: all q rows, then k,
then v; ``in_proj_z``, ``in_proj_b``, ``in_proj_a``) and fused per key head in Qwen3-Next
(``in_proj_qkvz``, ``in_proj_ba``: key head g's q, k, its value heads' v and z, then their b
and a); the conv weight ``[2GK + HV, 1, W]`` is q | k | v in both. The multi-token-prediction
head (``mtp.*``) and the vision tower (``model.visual.*``) are not trained: carried through.
Megatron: megatron-core's torch_dist names (:mod:`.megatron`; read, not written). LoRA: megatron-core's module
names (``self_attention.in_proj`` / ``out_proj`` for a gated-DeltaNet layer,
``mlp.shared_experts.linear_fc1`` / ``linear_fc2``), peft's HF modules beside them.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import numpy as np

from mlir_train.families.qwen3_5.config import ATTENTION, GATED_DELTANET, Qwen35Config
from mlir_train.families.qwen3_5.megatron import with_megatron
from mlir_train.families.table import EXPERT, GLOBAL, Ext, GateUp, Linear, LoRATarget, Param, Table
from mlir_train.runtime.errors import CheckpointError


@dataclasses.dataclass(frozen=True)
class Sections:
    """An HF tensor whose rows are our parts' flattened outputs one after another (Qwen3.5's
    ``in_proj_qkv`` ``[q; k; v]``); ``conv``: a depthwise conv weight ``[rows, 1, W]`` (ours
    ``[W, ...]``)."""

    parts: int = 3
    conv: bool = False

    def split(self, ext, shapes):
        rows = ext[:, 0, :] if self.conv else ext
        sizes = [math.prod(s[1:]) for s in shapes]
        if rows.shape[0] != sum(sizes):
            raise ValueError(f"{rows.shape[0]} rows, expected {' + '.join(map(str, sizes))}")
        bounds = np.cumsum([0, *sizes])
        return tuple(np.ascontiguousarray(rows[a:b].T).reshape(s) for a, b, s in zip(bounds[:-1], bounds[1:], shapes))

    def join(self, parts):
        rows = np.concatenate([p.reshape(p.shape[0], -1).T for p in parts])
        return rows[:, None, :] if self.conv else rows


@dataclasses.dataclass(frozen=True)
class KeyHeadGroups:
    """Qwen3-Next's fused projections: the rows grouped by the ``groups`` key heads, each group
    holding its share of every part in part order (``in_proj_qkvz``: q, k, v, z; ``in_proj_ba``:
    b, a), value head ``g R + r`` the ``r``-th of key head ``g``'s
    (:func:`mlir_train.model.gated_deltanet.split_qwen3_next_projections`)."""

    parts: int
    groups: int

    def split(self, ext, shapes):
        sizes = [math.prod(s[1:]) // self.groups for s in shapes]
        grouped = ext.reshape(self.groups, sum(sizes), ext.shape[-1])
        bounds = np.cumsum([0, *sizes])
        return tuple(np.ascontiguousarray(grouped[:, a:b].reshape(-1, ext.shape[-1]).T).reshape(s)
                     for a, b, s in zip(bounds[:-1], bounds[1:], shapes))

    def join(self, parts):
        d = parts[0].shape[0]
        grouped = [p.reshape(d, -1).T.reshape(self.groups, -1, d) for p in parts]
        return np.concatenate(grouped, axis=1).reshape(-1, d)


def _lin(path: tuple[str, ...], hf: str, lora: LoRATarget | None = None, n_in: int = 1, **kw) -> Param:
    return Param(path, hf=(Ext(hf, Linear(n_in)),), lora=lora, **kw)


def _norm(path: tuple[str, ...], hf: str, **kw) -> Param:
    return Param(path, hf=(Ext(hf),), **kw)


def _attention() -> tuple[Param, ...]:
    qkv = lambda name: _lin(("attn", f"{name}_proj"), f"self_attn.{name}_proj.weight", mixer=ATTENTION,
                            lora=LoRATarget("self_attention.linear_qkv", f"self_attn.{name}_proj", f"{name}_lora"))
    return (qkv("q"), qkv("k"), qkv("v"),  # q_proj: per head its query, then its output gate
            _lin(("attn", "o_proj"), "self_attn.o_proj.weight", n_in=2, mixer=ATTENTION,
                 lora=LoRATarget("self_attention.linear_proj", "self_attn.o_proj", "o_lora")),
            _norm(("attn", "q_norm", "scale"), "self_attn.q_norm.weight", mixer=ATTENTION),
            _norm(("attn", "k_norm", "scale"), "self_attn.k_norm.weight", mixer=ATTENTION))


IN_PROJ = ("wq_DGK", "wk_DGK", "wv_DHV", "wz_DHV", "wb_DH", "wa_DH")  # q, k, v, z, b, a


def _deltanet(fused_groups: int | None) -> tuple[Param, ...]:
    """A gated-DeltaNet layer's rows: the input projections split (Qwen3.5) or fused per key
    head over ``fused_groups`` key heads (Qwen3-Next)."""
    if fused_groups is None:
        peft = ("in_proj_qkv",) * 3 + ("in_proj_z", "in_proj_b", "in_proj_a")
        exts = [Ext("linear_attn.in_proj_qkv.weight", Sections(3), i) for i in range(3)] + \
            [Ext(f"linear_attn.{p}.weight", Linear()) for p in peft[3:]]
    else:
        peft = ("in_proj_qkvz",) * 4 + ("in_proj_ba",) * 2
        qkvz, ba = KeyHeadGroups(4, fused_groups), KeyHeadGroups(2, fused_groups)
        exts = [Ext("linear_attn.in_proj_qkvz.weight", qkvz, i) for i in range(4)] + \
            [Ext("linear_attn.in_proj_ba.weight", ba, i) for i in range(2)]
    rows = [Param(("linear_attn", w), hf=(ext,), mixer=GATED_DELTANET,
                  lora=LoRATarget("self_attention.in_proj", f"linear_attn.{p}", f"{w}_lora"))
            for w, ext, p in zip(IN_PROJ, exts, peft)]
    conv = Sections(3, conv=True)
    rows += [Param(("linear_attn", w), hf=(Ext("linear_attn.conv1d.weight", conv, i),), mixer=GATED_DELTANET)
             for i, w in enumerate(("conv_q_WGK", "conv_k_WGK", "conv_v_WHV"))]
    return (*rows,
            _norm(("linear_attn", "dt_bias_H"), "linear_attn.dt_bias", mixer=GATED_DELTANET),
            _norm(("linear_attn", "a_log_H"), "linear_attn.A_log", mixer=GATED_DELTANET),
            _norm(("linear_attn", "norm_V"), "linear_attn.norm.weight", mixer=GATED_DELTANET),
            _lin(("linear_attn", "wout_HVD"), "linear_attn.out_proj.weight", n_in=2, mixer=GATED_DELTANET,
                 lora=LoRATarget("self_attention.out_proj", "linear_attn.out_proj", "wout_HVD_lora")))


def _swiglu(under: tuple[str, ...], hf: str, module: str, **kw) -> tuple[Param, ...]:
    """A SwiGLU MLP's gate, up and down projections (a dense layer's, the shared expert's)."""
    fc1 = lambda name: _lin((*under, f"{name}_proj"), f"{hf}.{name}_proj.weight", **kw,
                            lora=LoRATarget(f"{module}.linear_fc1", f"{hf}.{name}_proj", f"{name}_lora"))
    return (fc1("gate"), fc1("up"), _lin((*under, "down_proj"), f"{hf}.down_proj.weight", **kw,
                                         lora=LoRATarget(f"{module}.linear_fc2", f"{hf}.down_proj", "down_lora")))


def _experts() -> tuple[Param, ...]:
    fc1 = lambda name, part: Param(
        ("mlp", f"{name}_proj"), EXPERT, moe=True,
        hf=(Ext(f"mlp.experts.{{e}}.{name}_proj.weight", Linear()), Ext("mlp.experts.gate_up_proj", GateUp(), part)),
        lora=LoRATarget("mlp.experts.linear_fc1", f"mlp.experts.{{e}}.{name}_proj", "fc1_lora", part,
                        fused="mlp.experts.gate_up_proj"))
    return (Param(("mlp", "router"), moe=True, hf=(Ext("mlp.gate.weight", Linear()),)),
            Param(("mlp", "expert_bias"), moe=True, state=True),  # --moe-router-enable-expert-bias; no HF tensor
            fc1("gate", 0), fc1("up", 1),
            Param(("mlp", "down_proj"), EXPERT, moe=True,
                  hf=(Ext("mlp.experts.{e}.down_proj.weight", Linear()), Ext("mlp.experts.down_proj", Linear())),
                  lora=LoRATarget("mlp.experts.linear_fc2", "mlp.experts.{e}.down_proj", "fc2_lora",
                                 fused="mlp.experts.down_proj")),
            *_swiglu(("mlp", "shared_expert"), "mlp.shared_expert", "mlp.shared_experts", moe=True),
            _lin(("mlp", "shared_expert_gate"), "mlp.shared_expert_gate.weight", moe=True))


def _rows(fused_groups: int | None) -> tuple[Param, ...]:
    return (
        Param(("embed",), GLOBAL, hf=(Ext("model.embed_tokens.weight"),)),
        Param(("final_norm", "scale"), GLOBAL, hf=(Ext("model.norm.weight"),)),
        Param(("lm_head",), GLOBAL, hf=(Ext("lm_head.weight", Linear()),), tied_to=("embed",)),
        _norm(("input_norm", "scale"), "input_layernorm.weight"),
        _norm(("post_attn_norm", "scale"), "post_attention_layernorm.weight"),
        *_attention(), *_deltanet(fused_groups),
        *_swiglu(("mlp",), "mlp", "mlp", moe=False), *_experts(),
    )


LOONGFORGE = ("LoongForge's own GatedDeltaNet layout (in_proj_qkvz / in_proj_ba as HF Qwen3-Next fuses them, the "
              "DeltaNet replicated over TP, a plain out_norm), which is not read; convert it to HF with LoongForge's "
              "tools/convert_checkpoint and --load that")


def _table(rows: tuple[Param, ...]) -> Table:
    return Table(family="qwen3_5", rows=with_megatron(rows), hf_layers="model.layers.{l}.", megatron_layers="decoder.layers.",
                 lora_refused={"mlp.router": "the MoE router takes no adapter (it picks the experts)"},
                 carried=("mtp.*", "model.visual.*"), megatron_formats=("torch_dist",),
                 megatron_refused={"in_proj_qkvz": LOONGFORGE, "in_proj_ba": LOONGFORGE})


TABLE = _table(_rows(None))  # Qwen3.5's split projections, the text model's names

# The multi-token-prediction head as the releases store it and vLLM's Qwen3NextMultiTokenPredictor /
# Qwen3.5's MTP read it (megatron-core's enorm, hnorm, eh_proj, final_layernorm): one depth, its
# decoder layer under mtp.layers.0 with the decoder's own names. fc's input is [embedding; hidden].
MTP_ROWS = (Param(("fc",), GLOBAL, hf=(Ext("mtp.fc.weight", Linear()),)),
            Param(("embed_norm", "scale"), GLOBAL, hf=(Ext("mtp.pre_fc_norm_embedding.weight"),)),
            Param(("hidden_norm", "scale"), GLOBAL, hf=(Ext("mtp.pre_fc_norm_hidden.weight"),)),
            Param(("norm", "scale"), GLOBAL, hf=(Ext("mtp.norm.weight"),)))
MTP_LAYERS = "mtp.layers.{l}."


@functools.cache
def _layout(fused_groups: int | None, root: str, mtp: bool) -> Table:
    table = TABLE if fused_groups is None else _table(_rows(fused_groups))
    table = table if root == "model." else table.with_hf_prefix("model.", root)
    if mtp:  # the head is trained: read and written, no longer carried
        table = dataclasses.replace(table, mtp_rows=MTP_ROWS, mtp_layers=MTP_LAYERS,
                                    carried=tuple(p for p in table.carried if p != "mtp.*"))
    return table


def hf_table(cfg: Qwen35Config) -> Table:
    """The table with the HF names of ``cfg``'s class: Qwen3-Next's fused projections or
    Qwen3.5's split ones, under ``model.`` or a vision-language model's ``model.language_model.``;
    with the MTP head's (``mtp.*``) when ``cfg`` trains it (``--mtp-num-layers 1``: the HF
    layout holds one depth)."""
    if cfg.mtp_num_layers > 1:
        raise CheckpointError(f"--mtp-num-layers {cfg.mtp_num_layers}: an HF checkpoint holds one multi-token-"
                              "prediction depth (mtp.*, which vLLM and SGLang draft with repeatedly); train 1 "
                              "depth to read or write HF")
    return _layout(cfg.linear_num_key_heads if cfg.fused_projections else None, cfg.hf_root, cfg.mtp_num_layers > 0)
