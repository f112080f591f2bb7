"""LoRA against references nobody here wrote: HF transformers + peft (PyPI) for the forward and
the adapter gradients, on a tiny dense Qwen3 and a tiny Qwen3-MoE; our adapters go to peft through
our PEFT export, so the export's names and layouts are checked by the same numbers: the per-expert
layout (which peft on transformers 5 turns into fused gate/up adapters of rank 2r itself) for the
forward, the fused layout (peft's ``target_parameters``, its parameters one for one with ours) for
the forward and the gradients. (Every layer
of the MoE model is MoE, as in Qwen3-30B-A3B: peft 0.21 rewrites a Qwen3-MoE model's gate/up/down
targets into the fused expert parameters, so it cannot hold a dense MLP layer's adapters there.) Plus the
policy's flags and patterns. (Reading exports back, both layouts: tests/checkpoint/test_serving_names.py.)"""

from __future__ import annotations

import copy

import jax
import jax.numpy as jnp
import numpy as np
import pytest
torch = pytest.importorskip("torch", reason="needs torch (HF reference models); the default lane has it")
from flax import nnx
from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

from mlir_train.checkpoint.hf import load_pretrained
from mlir_train.checkpoint.peft import save_adapters, to_peft
from mlir_train.config.policies import LoRAPolicy
from mlir_train.families.qwen3 import Qwen3
from mlir_train.families.qwen3.params import TABLE
from mlir_train.model import ModelOptions, losses
from mlir_train.model.lora import LoRAParam
from mlir_train.runtime.errors import ConfigError
from tests.helpers import perturb_torch

peft = pytest.importorskip("peft")  # the test extra installs it: LoRA's reference

VOCAB = 128
TOL = 1e-4


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory):
    torch.manual_seed(0)
    dense = Qwen3ForCausalLM(Qwen3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, tie_word_embeddings=True, rope_theta=1e6,
        max_position_embeddings=256)).eval()
    moe = Qwen3MoeForCausalLM(Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2,
        norm_topk_prob=True, rope_theta=1e6, tie_word_embeddings=False, max_position_embeddings=256)).eval()
    out = {}
    for name, model, seed in (("dense", dense, 1), ("moe", moe, 2)):
        perturb_torch(model, seed)
        path = str(tmp_path_factory.mktemp(name))
        model.save_pretrained(path)
        out[name] = (model, path)
    return out


def _lora_model(path: str, policy: LoRAPolicy, seed: int):
    """Our model of the HF directory with random adapters (B too, so the update is not zero)."""
    base = load_pretrained(path, dtype=jnp.float32)
    model = Qwen3(base.cfg, rngs=nnx.Rngs(0), options=ModelOptions(lora=policy))
    nnx.update(model, nnx.state(base, nnx.Param))
    adapters = nnx.state(model, LoRAParam)
    leaves, tree = jax.tree.flatten(adapters)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    leaves = [0.2 * jax.random.normal(k, x.shape, x.dtype) for k, x in zip(keys, leaves)]
    nnx.update(model, jax.tree.unflatten(tree, leaves))
    return model


def _adapters(model) -> dict:
    return jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(model, LoRAParam)))


def _weights(model) -> dict:
    return nnx.to_pure_dict(nnx.state(model, nnx.Param))


def _peft_model(hf_model, model, policy, tmp_path, layout):
    out = str(tmp_path / layout)
    save_adapters(out, _adapters(model), policy=policy, table=TABLE, stack_kinds=model.stack_kinds,
                  num_experts=model.cfg.num_experts, layout=layout, weights=_weights(model))
    # peft wraps the model's layers in place: give it a copy of the module-scoped fixture's.
    return peft.PeftModel.from_pretrained(copy.deepcopy(hf_model), out, is_trainable=True).eval(), out


def _loss(logits, ids):
    labels = jnp.concatenate([ids[:, 1:], jnp.zeros_like(ids[:, :1])], axis=1)
    mask = jnp.ones(ids.shape, jnp.float32).at[:, -1].set(0)
    total, count = losses.cross_entropy_sum(logits, labels, mask)
    return total / count


CASES = [
    ("dense", LoRAPolicy(dim=4, alpha=8)),
    ("moe", LoRAPolicy(dim=4, alpha=8)),
    ("moe", LoRAPolicy(dim=2, alpha=4, targets=("linear_qkv", "*experts.linear_fc2"))),
    ("moe", LoRAPolicy(dim=2, alpha=4, targets=("linear_proj", "mlp.linear_fc1", "*experts*"),
                       expert_adapters="shared")),
]


# The MoE case (every module adapted) by default; the others slow (40-60 s each; the default lanes' time).
@pytest.mark.parametrize("name,policy", [c if i == 1 else pytest.param(*c, marks=pytest.mark.slow) for i, c in enumerate(CASES)],
                         ids=["dense", "moe", "moe-qkv-fc2", "moe-shared"])
def test_forward_and_adapter_grads_match_peft(hf_models, name, policy, tmp_path):
    hf_model, path = hf_models[name]
    ours = _lora_model(path, policy, seed=3)
    ids = np.random.default_rng(0).integers(0, VOCAB, (2, 20)).astype(np.int32)
    got_logits = np.asarray(ours(jnp.asarray(ids)))
    # The per-expert layout (peft on transformers 5 fuses its gate/up adapters into one of rank 2r itself)
    per_expert, _ = _peft_model(hf_model, ours, policy, tmp_path, "per-expert")
    with torch.no_grad():
        np.testing.assert_allclose(got_logits, per_expert(torch.from_numpy(ids).long()).logits.numpy(), atol=TOL,
                                   rtol=0)
    # and the fused one, whose adapters are peft's trained parameters one for one: logits and gradients.
    pm, _ = _peft_model(hf_model, ours, policy, tmp_path, "fused")
    ref_logits = pm(torch.from_numpy(ids).long()).logits
    np.testing.assert_allclose(got_logits, ref_logits.detach().numpy(), atol=TOL, rtol=0)
    with torch.no_grad():  # the adapters change the model: the test is not vacuous
        with pm.disable_adapter():
            base_logits = pm(torch.from_numpy(ids).long()).logits.numpy()
    assert np.abs(got_logits - base_logits).max() > 100 * TOL

    # Gradients of the mean token loss: ours for the adapters, peft's for its lora_A / lora_B.
    labels = torch.from_numpy(ids).long()
    pm(labels, labels=labels).loss.backward()
    ref_grads = {k.replace(".default", ""): p.grad.numpy() for k, p in pm.named_parameters()
                 if p.requires_grad and p.grad is not None}
    graphdef, adapters, rest = nnx.split(ours, LoRAParam, ...)
    grads = jax.grad(lambda a: _loss(nnx.merge(graphdef, a, rest)(jnp.asarray(ids)), jnp.asarray(ids)))(adapters)
    grads = jax.tree.map(np.asarray, nnx.to_pure_dict(grads))
    if policy.expert_adapters == "shared":
        # peft holds one adapter per expert; a shared one's gradient is their sum.
        expert_sum = {}
        for k, g in ref_grads.items():
            if ".experts." in k:
                e = ours.cfg.num_experts
                g = g.reshape(e, -1, g.shape[-1]).sum(0) if "lora_A" in k else g.reshape(g.shape[0], -1, e).sum(-1)
                expert_sum[k] = g
        ref_grads.update(expert_sum)
        # the shared adapter's gradient as one "expert"
        got = to_peft(grads, TABLE, ours.stack_kinds, 1, shared=True, layout="fused")
    else:
        got = to_peft(grads, TABLE, ours.stack_kinds, ours.cfg.num_experts, layout="fused")
    assert set(got) == set(ref_grads), sorted(set(got) ^ set(ref_grads))[:4]
    for k, g in got.items():
        ref = ref_grads[k]
        assert np.abs(ref).max() > 0, k
        np.testing.assert_allclose(g, ref, atol=2e-5 * max(1.0, np.abs(ref).max()), rtol=1e-4, err_msg=k)


def test_policy_patterns_and_refusals():
    """The patterns select the family's modules (its parameter table's Megatron names); a pattern
    that selects none is refused naming the flag where the model is known (train.build.resolve)."""
    modules = TABLE.lora_modules()
    assert LoRAPolicy(4).modules(modules) == ("self_attention.linear_qkv", "self_attention.linear_proj",
                                              "mlp.linear_fc1", "mlp.linear_fc2", "mlp.experts.linear_fc1",
                                              "mlp.experts.linear_fc2")
    assert LoRAPolicy(4, targets=("*experts*",)).modules(modules) == ("mlp.experts.linear_fc1", "mlp.experts.linear_fc2")
    assert LoRAPolicy(4, targets=("mlp.linear_fc?",)).modules(modules) == ("mlp.linear_fc1", "mlp.linear_fc2")
    assert LoRAPolicy.from_flags(8, 16, 0.0, ["all-linear"], "shared").scaling == 2.0
    assert LoRAPolicy.from_flags(None, 16, 0.0, None, "shared") is None
    for args, flag in (((0, 32, 0.0, None, "per-expert"), "--lora-dim 0"),
                       ((4, 32, 0.1, None, "per-expert"), "--lora-dropout 0.1")):
        with pytest.raises(ConfigError, match=flag):
            LoRAPolicy.from_flags(*args)
    assert TABLE.check_lora_targets(["router"]).startswith("router: the MoE router takes no adapter")
    assert TABLE.check_lora_targets(["linear_fc3"]).startswith("linear_fc3: matches none of")
    assert TABLE.check_lora_targets(LoRAPolicy(4, targets=("linear_qkv", "*experts*", "all-linear")).patterns()) is None
