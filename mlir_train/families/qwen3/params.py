"""Qwen3 / Qwen3-MoE's parameter table: every parameter's HF, Megatron and LoRA names.

HF: the release checkpoints' names (``model.layers.{l}.self_attn.q_proj.weight``, experts
``mlp.experts.{e}.gate_proj.weight``, written); transformers 5's fused experts
(``mlp.experts.gate_up_proj`` ``[E, 2F, D]``, ``mlp.experts.down_proj`` ``[E, D, F]``) read too.
Megatron: megatron-core's GPTModel with Qwen3's spec (q/k layernorm, SwiGLU, no biases), local
spec names first, TE's after; the layouts are checked against megatron-core in
``tests/checkpoint/test_megatron_checkpoint.py``. LoRA: Megatron-Bridge's module names
(``self_attention.linear_qkv`` ...); PEFT adapters sit on HF's q/k/v and the MLP's gate/up as
separate ``nn.Linear`` modules, on each routed expert's ``gate_proj`` / ``up_proj`` / ``down_proj``
(the release's per-expert modules, which vLLM's and SGLang's Qwen3-MoE LoRA read: the fixture
``tests/checkpoint/fixtures/serving_lora_names.json``), or on the fused expert parameters through
peft's ``target_parameters`` (``--lora-export-format fused``). Our experts' fc1 adapter (one A,
B for gate and up) is the gate and up modules' adapters sharing that A.
"""

from mlir_train.families.table import (
    COLUMN, EXPERT, GLOBAL, GLU, ROW, VOCAB, Ext, GateUp, Linear, LocalExperts, LoRATarget, Megatron, Param,
    QueryGroups, Table)

QKV = QueryGroups()
FC1 = LocalExperts(sequential="mlp.experts.local_experts.{j}.linear_fc1.weight", te="mlp.experts.linear_fc1.weight{j}",
                   grouped="mlp.experts.weight1")
FC2 = LocalExperts(sequential="mlp.experts.local_experts.{j}.linear_fc2.weight", te="mlp.experts.linear_fc2.weight{j}",
                   grouped="mlp.experts.weight2")
EXPERT_FC1 = ("mlp.experts.experts.linear_fc1.weight", "mlp.experts.linear_fc1.weight")  # torch_dist: Sequential, TE
EXPERT_FC2 = ("mlp.experts.experts.linear_fc2.weight", "mlp.experts.linear_fc2.weight")


def _qkv(name: str, part: int) -> Param:
    return Param(("attn", f"{name}_proj"), hf=(Ext(f"self_attn.{name}_proj.weight", Linear()),),
                 megatron=Megatron(("self_attention.linear_qkv.weight",), QKV, part, split=COLUMN, linear=True),
                 lora=LoRATarget("self_attention.linear_qkv", f"self_attn.{name}_proj", f"{name}_lora"))


def _dense_fc1(name: str, part: int) -> Param:
    return Param(("mlp", f"{name}_proj"), moe=False, hf=(Ext(f"mlp.{name}_proj.weight", Linear()),),
                 megatron=Megatron(("mlp.linear_fc1.weight",), GateUp(), part, split=GLU, linear=True),
                 lora=LoRATarget("mlp.linear_fc1", f"mlp.{name}_proj", f"{name}_lora"))


def _expert_fc1(name: str, part: int) -> Param:
    return Param(("mlp", f"{name}_proj"), EXPERT, moe=True,
                 hf=(Ext(f"mlp.experts.{{e}}.{name}_proj.weight", Linear()), Ext("mlp.experts.gate_up_proj", GateUp(), part)),
                 megatron=Megatron(EXPERT_FC1, GateUp(), part, split=GLU, linear=True, experts=FC1),
                 lora=LoRATarget("mlp.experts.linear_fc1", f"mlp.experts.{{e}}.{name}_proj", "fc1_lora", part,
                                 fused="mlp.experts.gate_up_proj"))


ROWS = (
    Param(("embed",), GLOBAL, hf=(Ext("model.embed_tokens.weight"),),
          megatron=Megatron(("embedding.word_embeddings.weight",), split=VOCAB, stage="first")),
    Param(("final_norm", "scale"), GLOBAL, hf=(Ext("model.norm.weight"),),
          megatron=Megatron(("decoder.final_layernorm.weight",), stage="last")),
    Param(("lm_head",), GLOBAL, hf=(Ext("lm_head.weight", Linear()),), tied_to=("embed",),
          megatron=Megatron(("output_layer.weight",), Linear(), split=VOCAB, linear=True, stage="last")),
    # every layer: attention
    Param(("input_norm", "scale"), hf=(Ext("input_layernorm.weight"),),
          megatron=Megatron(("input_layernorm.weight", "self_attention.linear_qkv.layer_norm_weight"))),
    _qkv("q", 0), _qkv("k", 1), _qkv("v", 2),
    Param(("attn", "o_proj"), hf=(Ext("self_attn.o_proj.weight", Linear(2)),),
          megatron=Megatron(("self_attention.linear_proj.weight",), Linear(2), split=ROW, linear=True),
          lora=LoRATarget("self_attention.linear_proj", "self_attn.o_proj", "o_lora")),
    Param(("attn", "q_norm", "scale"), hf=(Ext("self_attn.q_norm.weight"),),
          megatron=Megatron(("self_attention.q_layernorm.weight",))),
    Param(("attn", "k_norm", "scale"), hf=(Ext("self_attn.k_norm.weight"),),
          megatron=Megatron(("self_attention.k_layernorm.weight",))),
    Param(("post_attn_norm", "scale"), hf=(Ext("post_attention_layernorm.weight"),),
          megatron=Megatron(("pre_mlp_layernorm.weight", "mlp.linear_fc1.layer_norm_weight"))),
    # dense layers: the SwiGLU MLP (Megatron's linear_fc1 is gate and up)
    _dense_fc1("gate", 0), _dense_fc1("up", 1),
    Param(("mlp", "down_proj"), moe=False, hf=(Ext("mlp.down_proj.weight", Linear()),),
          megatron=Megatron(("mlp.linear_fc2.weight",), Linear(), split=ROW, linear=True),
          lora=LoRATarget("mlp.linear_fc2", "mlp.down_proj", "down_lora")),
    # MoE layers: the router (never adapted) and the routed experts
    Param(("mlp", "router"), moe=True, hf=(Ext("mlp.gate.weight", Linear()),),
          megatron=Megatron(("mlp.router.weight",), Linear())),
    Param(("mlp", "expert_bias"), moe=True, state=True),  # --moe-router-enable-expert-bias; no HF tensor
    _expert_fc1("gate", 0), _expert_fc1("up", 1),
    Param(("mlp", "down_proj"), EXPERT, moe=True,
          hf=(Ext("mlp.experts.{e}.down_proj.weight", Linear()), Ext("mlp.experts.down_proj", Linear())),
          megatron=Megatron(EXPERT_FC2, Linear(), split=ROW, linear=True, experts=FC2),
          lora=LoRATarget("mlp.experts.linear_fc2", "mlp.experts.{e}.down_proj", "fc2_lora",
                          fused="mlp.experts.down_proj")),
)

TABLE = Table(
    family="qwen3", rows=ROWS, hf_layers="model.layers.{l}.", megatron_layers="decoder.layers.",
    # neither Megatron-Bridge nor peft adapts it: its output picks the experts
    lora_refused={"mlp.router": "the MoE router takes no adapter (it picks the experts)"},
)
