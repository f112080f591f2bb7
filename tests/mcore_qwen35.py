"""Real megatron-core on CPU building Qwen3-Next / Qwen3.5 as Megatron-Bridge configures them
(megatron-core's own ``GatedDeltaNet``), as an oracle for their ``--load`` checkpoints (torch_dist).
LoongForge builds these models with its own GatedDeltaNet module instead (another layout).

Megatron-Bridge's ``Qwen3NextBridge`` (and its Qwen3.5 bridges) build megatron-core's
``GPTModel`` with ``get_transformer_block_with_experimental_attention_variant_spec``:
``experimental_attention_variant="gated_delta_net"``, ``linear_attention_freq`` (every 4th
layer softmax attention), ``attention_output_gate=True``, ``layernorm_zero_centered_gamma=True``,
``moe_shared_expert_gate=True``, ``hetereogenous_dist_checkpoint=True``, Transformer Engine
modules. That spec function asserts TE; without TE on this CPU the same block is assembled here
from megatron-core's own classes (``GatedDeltaNet``, ``SelfAttention``, ``MoELayer`` with
``SharedExpertMLP``, ``MLP``) with two CPU stand-ins for TE's modules that keep TE's parameter
names and semantics: :class:`ZeroCentredRMSNorm` (TENorm: ``weight``, ``x_norm * (1 + w)``
under zero-centred gamma) and :class:`LayerNormColumnLinear` (TELayerNormColumnParallelLinear:
``layer_norm_weight`` + ``weight``, the norm fused in front of a column-parallel linear).
So the checkpoint's tensor names are TE's (``self_attention.in_proj.layer_norm_weight``,
``self_attention.linear_qkv.layer_norm_weight``, ``mlp.linear_fc1.layer_norm_weight``) and
each tensor's layout is megatron-core's own (``GatedDeltaNet.sharded_state_dict`` splits
``in_proj.weight`` into ``.query/.key/.value/.z/.beta/.alpha`` and ``conv1d.weight`` into
``.query/.key/.value``). Experts are SequentialMLP (the local spec's; TE's grouped GEMM stores
the same weights under ``mlp.experts.linear_fc1.weight``, which the loader also reads).

CPU shims besides :func:`tests.mcore_cpu.apply_shims`: the gated delta rule runs megatron-core's
own torch implementation (``deterministic_mode=True`` selects ``torch_chunk_gated_delta_rule``
instead of FLA's Triton kernel), FLA's ``l2norm`` is replaced by its formula
(``x * rsqrt(sum x^2 + 1e-6)``), and ``TORCHDYNAMO_DISABLE=1`` keeps the ``jit_fuser``
(``torch.compile``) of the gated norm eager.

Job: ``save`` only (``python tests/mcore_qwen35.py JOB.json`` in ``world`` gloo processes):
build for the layout, give every parameter shard deterministic random values, save
``<out>/torch_dist`` with ``dist_checkpointing.save`` (no Megatron-LM ``args`` unless
``"args": true``: Megatron-Bridge's checkpoints carry its provider config, not argparse args),
run megatron-core's forward on fixed tokens and store ``logits.npy`` / ``tokens.npy``.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tests import mcore_cpu  # noqa: E402
from tests.mcore_cpu import Layout  # noqa: E402

# qwen3-next-tiny's shape (mlir_train/families/qwen3_5/config.py), so --model-name names it
SPEC_FIELDS = dict(
    hidden=128, layers=4, heads=4, groups=2, head_dim=32, experts=8, moe_ffn=64, topk=2, ffn=256,
    shared=64, gdn_key_heads=2, gdn_value_heads=4, gdn_key_dim=32, gdn_value_dim=32, conv=4,
    rotary_percent=0.25, vocab=250, divisible_by=64, seq=24, batch=2, rope_theta=10_000_000.0, eps=1e-6,
    moe_layer_freq=[0, 1, 1, 1], linear_attention_freq=4,
)


def _pattern(freq, layers: int, *, moe: bool = False) -> list[int]:
    """megatron-core's per-layer 0/1 pattern of an int or list ``linear_attention_freq`` (an int N:
    every N-th layer 0) or ``moe_layer_freq`` (``moe``; an int N: every N-th layer from 0 is MoE)."""
    if not isinstance(freq, int):
        return list(freq)
    return [int(i % freq == 0) for i in range(layers)] if moe else [0 if (i + 1) % freq == 0 else 1 for i in range(layers)]


def _stand_ins():
    """The CPU stand-ins for TE's norm and fused norm + column-parallel linear (module docstring)."""
    import torch
    from megatron.core.tensor_parallel import ColumnParallelLinear

    def rms(x, w, eps, zero_centred):
        y = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
        return (y * ((1.0 + w.float()) if zero_centred else w.float())).to(x.dtype)

    class ZeroCentredRMSNorm(torch.nn.Module):
        def __init__(self, config, hidden_size, eps=1e-5, **_):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.zeros(hidden_size))
            self.eps, self.zero_centred = eps, config.layernorm_zero_centered_gamma

        def forward(self, x):
            return rms(x, self.weight, self.eps, self.zero_centred)

    class LayerNormColumnLinear(ColumnParallelLinear):
        def __init__(self, input_size, output_size, *, config, **kw):
            super().__init__(input_size, output_size, config=config, **kw)
            self.layer_norm_weight = torch.nn.Parameter(torch.zeros(input_size))
            self.eps, self.zero_centred = config.layernorm_epsilon, config.layernorm_zero_centered_gamma

        def forward(self, x, *a, **k):
            return super().forward(rms(x, self.layer_norm_weight, self.eps, self.zero_centred), *a, **k)

    return ZeroCentredRMSNorm, LayerNormColumnLinear


def _shim_fla():
    import torch
    from megatron.core.ssm import gated_delta_net

    gated_delta_net.HAVE_FLA = True
    gated_delta_net.l2norm = lambda x, dim=-1, eps=1e-6: x * torch.rsqrt((x * x).sum(dim, keepdim=True) + eps)


def _config(spec: dict, layout: Layout):
    import torch
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=spec["layers"], hidden_size=spec["hidden"], num_attention_heads=spec["heads"],
        num_query_groups=spec["groups"], kv_channels=spec["head_dim"], ffn_hidden_size=spec["ffn"],
        normalization="RMSNorm", layernorm_epsilon=spec["eps"], gated_linear_unit=True, activation_func=F.silu,
        add_bias_linear=False, add_qkv_bias=False, qk_layernorm=True, hidden_dropout=0.0, attention_dropout=0.0,
        layernorm_zero_centered_gamma=True, attention_output_gate=True,
        experimental_attention_variant="gated_delta_net", linear_attention_freq=spec["linear_attention_freq"],
        linear_conv_kernel_dim=spec["conv"], linear_key_head_dim=spec["gdn_key_dim"],
        linear_value_head_dim=spec["gdn_value_dim"], linear_num_key_heads=spec["gdn_key_heads"],
        linear_num_value_heads=spec["gdn_value_heads"], deterministic_mode=True, hetereogenous_dist_checkpoint=True,
        num_moe_experts=spec["experts"], moe_ffn_hidden_size=spec["moe_ffn"], moe_router_topk=spec["topk"],
        moe_router_pre_softmax=False, moe_shared_expert_intermediate_size=spec["shared"],
        moe_shared_expert_gate=True, moe_token_dispatcher_type="allgather", moe_aux_loss_coeff=0.0,
        moe_grouped_gemm=False, moe_router_load_balancing_type="none", moe_layer_freq=spec["moe_layer_freq"],
        use_cpu_initialization=True, params_dtype=torch.float32, pipeline_dtype=torch.float32,
        tensor_model_parallel_size=layout.tp, pipeline_model_parallel_size=layout.pp,
        expert_model_parallel_size=layout.ep, expert_tensor_parallel_size=layout.etp or layout.tp,
        sequence_parallel=False, attention_softmax_in_fp32=True, apply_rope_fusion=False,
        bias_activation_fusion=False, gradient_accumulation_fusion=False, masked_softmax_fusion=False,
        persist_layer_norm=False,
    )


def _block_spec(spec: dict, config):
    """The per-layer specs of ``get_transformer_block_with_experimental_attention_variant_spec``
    with the CPU stand-ins for TE's modules."""
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet, GatedDeltaNetSubmodules
    from megatron.core.tensor_parallel import RowParallelLinear
    from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.mlp import MLP, MLPSubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
    from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

    Norm, LNLinear = _stand_ins()
    gdn = ModuleSpec(module=GatedDeltaNet, submodules=GatedDeltaNetSubmodules(
        in_proj=LNLinear, out_norm=Norm, out_proj=RowParallelLinear))
    attention = ModuleSpec(module=SelfAttention, params={"attn_mask_type": AttnMaskType.causal},
                           submodules=SelfAttentionSubmodules(
                               linear_qkv=LNLinear, core_attention=DotProductAttention, linear_proj=RowParallelLinear,
                               q_layernorm=Norm, k_layernorm=Norm))
    dense = ModuleSpec(module=MLP, submodules=MLPSubmodules(linear_fc1=LNLinear, linear_fc2=RowParallelLinear))
    moe = get_moe_module_spec(use_te=False, num_experts=spec["experts"], moe_grouped_gemm=False)
    layers = []
    for linear, is_moe in zip(_pattern(spec["linear_attention_freq"], spec["layers"]),
                              _pattern(spec["moe_layer_freq"], spec["layers"], moe=True)):
        layers.append(ModuleSpec(module=TransformerLayer, submodules=TransformerLayerSubmodules(
            input_layernorm=IdentityOp, self_attention=gdn if linear else attention, self_attn_bda=get_bias_dropout_add,
            pre_mlp_layernorm=Norm if is_moe else IdentityOp, mlp=moe if is_moe else dense,
            mlp_bda=get_bias_dropout_add)))
    return TransformerBlockSubmodules(layer_specs=layers, layer_norm=Norm)


def _build(spec: dict, layout: Layout):
    from megatron.core.models.gpt import GPTModel

    config = _config(spec, layout)
    return [GPTModel(
        config=config, transformer_layer_spec=_block_spec(spec, config),
        vocab_size=layout.padded_vocab(spec["vocab"], spec["divisible_by"]), max_sequence_length=4096,
        pre_process=True, post_process=True, parallel_output=False, share_embeddings_and_output_weights=False,
        position_embedding_type="rope", rotary_percent=spec["rotary_percent"], rotary_base=int(spec["rope_theta"]),
    )]


def megatron_args(spec: dict, layout: Layout, world: int):
    """The argparse Namespace a Megatron-LM run of this model pickles as ``args``: the flags of
    Megatron-LM's Qwen3-Next scripts (``--attention-output-gate``,
    ``--experimental-attention-variant gated_delta_net``, ``--linear-*``, ``--apply-layernorm-1p``,
    ``--moe-shared-expert-gate``...)."""
    return argparse.Namespace(
        num_layers=spec["layers"], hidden_size=spec["hidden"], ffn_hidden_size=spec["ffn"],
        num_attention_heads=spec["heads"], num_query_groups=spec["groups"], group_query_attention=True,
        kv_channels=spec["head_dim"], num_experts=spec["experts"], moe_ffn_hidden_size=spec["moe_ffn"],
        moe_router_topk=spec["topk"], moe_router_pre_softmax=False, moe_router_score_function="softmax",
        moe_layer_freq=spec["moe_layer_freq"], moe_shared_expert_intermediate_size=spec["shared"],
        moe_shared_expert_gate=True, moe_grouped_gemm=False, normalization="RMSNorm", norm_epsilon=spec["eps"],
        apply_layernorm_1p=True, qk_layernorm=True, swiglu=True, add_bias_linear=False, add_qkv_bias=False,
        attention_output_gate=True, experimental_attention_variant="gated_delta_net",
        linear_attention_freq=spec["linear_attention_freq"], linear_conv_kernel_dim=spec["conv"],
        linear_key_head_dim=spec["gdn_key_dim"], linear_value_head_dim=spec["gdn_value_dim"],
        linear_num_key_heads=spec["gdn_key_heads"], linear_num_value_heads=spec["gdn_value_heads"],
        position_embedding_type="rope", rotary_base=int(spec["rope_theta"]), rotary_percent=spec["rotary_percent"],
        rotary_interleaved=False, rotary_seq_len_interpolation_factor=None, max_position_embeddings=4096,
        seq_length=spec["seq"], padded_vocab_size=layout.padded_vocab(spec["vocab"], spec["divisible_by"]),
        make_vocab_size_divisible_by=spec["divisible_by"], vocab_size=None,
        untie_embeddings_and_output_weights=True, tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp, expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=layout.etp or layout.tp, context_parallel_size=1, world_size=world,
        ckpt_format="torch_dist", transformer_impl="transformer_engine", sequence_parallel=False, bf16=False,
        fp16=False, iteration=10,
    )


def worker(job_path: str) -> None:
    import torch
    import torch.distributed as dist

    job, spec, layout = mcore_cpu.start_worker(job_path, SPEC_FIELDS)
    _shim_fla()
    chunks = _build(spec, layout)
    mcore_cpu._randomise(chunks, layout)
    for chunk in chunks:  # A_log: log of a decay rate in (1, 16) as megatron-core initialises it
        for name, p in chunk.named_parameters():
            if name.endswith("A_log"):
                with torch.no_grad():
                    p.copy_(torch.log(1.0 + (p - 1.0).abs() * 10))
    sharded = {"checkpoint_version": 3.0, "iteration": 10, "model": chunks[0].sharded_state_dict()}
    if job.get("args"):
        sharded["args"] = megatron_args(spec, layout, dist.get_world_size())
    mcore_cpu.save_dist(sharded, os.path.join(job["out"], "torch_dist"), 10)
    mcore_cpu.finish_worker(chunks, job, spec, layout)


def run_job(job: dict, out_dir: str, *, timeout: float = 900.0) -> None:
    os.environ["TORCHDYNAMO_DISABLE"] = "1"
    mcore_cpu.run_workers(os.path.abspath(__file__), job, out_dir, Layout(**job["layout"]).world, timeout=timeout)


if __name__ == "__main__":
    worker(sys.argv[1])
