"""Our PEFT exports against the serving engines' LoRA loaders, as read from their source: the
fixture ``fixtures/serving_lora_names.json`` (vLLM 0.33.0 and SGLang 0.5.23, file and line per
rule). We cannot run vLLM or SGLang here; this check stands in for loading the adapter in them.

Each export (dense Qwen3; a Qwen3-MoE with a dense layer in ``mlp_only_layers`` and MoE layers;
per-expert and shared expert adapters; only some projections targeted) goes through the
fixture's ``test_procedure``, for both engines: every key matches the tensor pattern and exactly
one module pattern, names a module the built model has, with the exact shapes; every module has
A and B; a MoE layer with expert adapters has all of them at one rank; no other key; the key set
is the trainer's adapters' (with the zero fill) and the config is what both engines read. vLLM's
own name check (``check_unexpected_modules``) is replayed too: ours pass it, the fused layout's
keys do not bind on Qwen3-MoE (vLLM's 2D MoE model). Then: both layouts read back exactly, and an
adapter config that disagrees with the flags is refused."""

from __future__ import annotations

import json
import os
import re

import jax
import numpy as np
import pytest
from flax import nnx

from mlir_train import families
from mlir_train.checkpoint.peft import load_adapters, save_adapters
from mlir_train.config.policies import LoRAPolicy
from mlir_train.families.qwen3.params import TABLE
from mlir_train.model import ModelOptions
from mlir_train.model.lora import LoRAParam
from mlir_train.runtime.errors import CheckpointError

FIXTURE = json.load(open(os.path.join(os.path.dirname(__file__), "fixtures", "serving_lora_names.json")))
ENGINES = ("vllm", "sglang")

DENSE = families.get_model_config("qwen3-tiny", num_layers=2, vocab_size=64, hidden_size=64, intermediate_size=96)
MOE = families.get_model_config("qwen3-moe-tiny", num_layers=3, vocab_size=64, hidden_size=64, num_experts=4,
                                intermediate_size=96, moe_intermediate_size=32, mlp_only_layers=(0,))


def _export(tmp_path, cfg, policy, layout="per-expert", seed=0):
    """Our model of ``cfg`` with random adapters, exported; returns (dir, adapters, stack kinds)."""
    model = families.build_model(cfg, ModelOptions(lora=policy), abstract=True)
    weights = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    shapes = nnx.to_pure_dict(nnx.state(model, LoRAParam))
    rng = np.random.default_rng(seed)
    adapters = jax.tree.map(lambda s: rng.normal(size=s.shape).astype(np.float32), shapes)
    out = str(tmp_path / f"{layout}-{seed}")
    save_adapters(out, adapters, policy=policy, table=TABLE, stack_kinds=model.stack_kinds,
                  num_experts=cfg.num_experts, layout=layout, weights=weights, mlp_only_layers=cfg.mlp_only_layers)
    return out, adapters, model.stack_kinds


def _tensors(path):
    from safetensors.numpy import load_file

    return load_file(os.path.join(path, "adapter_model.safetensors"))


def _dims(cfg, r):
    return {"H": cfg.hidden_size, "Dh": cfg.head_dim, "N": cfg.num_heads, "K": cfg.num_kv_heads,
            "I": cfg.intermediate_size, "F": cfg.moe_intermediate_size, "E": cfg.num_experts, "L": cfg.num_layers,
            "r": r}


def _shape(rule: str, dims) -> tuple[int, ...]:
    """A fixture shape ``"[N*Dh, r]"`` with the model's sizes."""
    return tuple(int(np.prod([dims[f] for f in part.strip().split("*")])) for part in rule.strip("[]").split(","))


def served_problems(path: str, cfg, engine: str) -> list[str]:
    """What in the export at ``path`` the ``engine``'s loader would reject or leave unread, by the
    fixture's test procedure (empty: every tensor is accepted and bound)."""
    spec, config = FIXTURE[engine], json.load(open(os.path.join(path, "adapter_config.json")))
    patterns = spec["module_patterns"]["qwen3_moe" if cfg.is_moe else "qwen3"]
    dims, moe_layers = _dims(cfg, config["r"]), cfg.moe_layers()
    problems, modules, ranks = [], {}, {}
    for key, t in _tensors(path).items():
        m = re.fullmatch(spec["tensor_pattern"], key)
        if m is None or "base_layer" in key:
            problems.append(f"{key}: not a LoRA tensor name the loader binds")
            continue
        module, ab = m["module"], m["AB"]
        hits = [(kind, h) for kind, p in patterns.items() if (h := re.fullmatch(p, module))]
        if len(hits) != 1 or hits[0][0] == "router_gate_accepted_not_exported":
            problems.append(f"{key}: matches {[k for k, _ in hits]} of the module patterns")
            continue
        kind, h = hits[0]
        layer = int(h["layer"])
        exists = layer < cfg.num_layers and {"attention": True, "dense_mlp": not moe_layers[layer],
                                             "experts": moe_layers[layer] and int(h.groupdict().get("expert") or 0)
                                             < cfg.num_experts}[kind]
        if not exists:
            problems.append(f"{key}: names no module of the built model (silently unread)")
        rule = spec["shape_rules"]["per_module"][re.sub(r"\.\d+\.", ".<e>.", re.sub(r"^model\.layers\.\d+\.", "", module))]
        if t.shape != _shape(rule[f"lora_{ab}"], dims):
            problems.append(f"{key}: shape {t.shape}, the loader's buffer is {rule[f'lora_{ab}']} = "
                            f"{_shape(rule[f'lora_{ab}'], dims)}")
        modules.setdefault(module, set()).add(ab)
        ranks[module] = t.shape[0] if ab == "A" else t.shape[1]
    problems += [f"{m}: only lora_{''.join(ab)}" for m, ab in modules.items() if ab != {"A", "B"}]
    problems += [f"{m}: rank {r} != r {config['r']}" for m, r in ranks.items() if r != config["r"]]
    for layer in range(cfg.num_layers):
        experts = {m for m in modules if m.startswith(f"model.layers.{layer}.mlp.experts.")}
        want = {f"model.layers.{layer}.mlp.experts.{e}.{p}" for e in range(cfg.num_experts)
                for p in ("gate_proj", "up_proj", "down_proj")}
        if experts and experts != want:
            problems.append(f"layer {layer}: expert modules {len(experts)} of {len(want)} (vLLM's pack_moe asserts all)")
    return problems + _config_problems(config, modules)


def _config_problems(config, modules) -> list[str]:
    want = FIXTURE["export_target"]["adapter_config"]
    bad = [f"adapter_config {k} = {config.get(k)!r}, want {v!r}" for k, v in want.items()
           if not isinstance(v, str) and config.get(k) != v]
    if "target_parameters" in config:
        bad.append("adapter_config has target_parameters")
    if not isinstance(config["target_modules"], list):
        bad.append(f"target_modules {config['target_modules']!r} is not a list (SGLang raises)")
    elif not {m.rsplit(".", 1)[-1] for m in modules} <= set(config["target_modules"]):
        bad.append(f"target_modules {config['target_modules']} misses adapted modules")
    return bad


def vllm_name_check(keys, num_experts: int, dense_names: bool) -> tuple[list[str], list[str]]:
    """vLLM 0.33.0's ``check_unexpected_modules`` (lora/lora_model.py l.246) on Qwen3-MoE, with the
    expected modules of lora/worker_manager.py l.106: (the keys it rejects, the keys it skips
    unread: ``base_layer``)."""
    expected = {m.split()[0].rstrip(",") for m in FIXTURE["vllm"]["expected_lora_modules_qwen3_moe"][:-1]}
    expected = {m.replace("<e>", str(e)) for m in expected for e in range(max(num_experts, 1))}
    if dense_names:
        expected |= {"gate_proj", "up_proj", "down_proj"}
    rejected, skipped = [], []
    for key in keys:
        module = key.removeprefix("base_model.model.").rsplit(".lora_", 1)[0]
        if "base_layer" in key:
            skipped.append(key)
        elif ".experts" in module:
            if module[module.index(".experts") + 1:] not in expected:
                rejected.append(key)
        elif module.rsplit(".", 1)[-1] not in expected:
            rejected.append(key)
    return rejected, skipped


CASES = {
    "dense": (DENSE, LoRAPolicy(dim=4, alpha=8)),
    "moe-per-expert": (MOE, LoRAPolicy(dim=4, alpha=8)),
    "moe-shared": (MOE, LoRAPolicy(dim=4, alpha=8, expert_adapters="shared")),
    "moe-qkv-fc2": (MOE, LoRAPolicy(dim=8, alpha=16, targets=("linear_qkv", "*experts.linear_fc2"))),
}


@pytest.mark.parametrize("case", list(CASES))
def test_every_exported_tensor_is_accepted_and_bound(tmp_path, case):
    cfg, policy = CASES[case]
    path, adapters, stack_kinds = _export(tmp_path, cfg, policy)
    for engine in ENGINES:
        assert served_problems(path, cfg, engine) == [], engine
    keys = set(_tensors(path))
    # (vLLM's dense Qwen3 packs gate/up like mlp_only_layers does: the same names are expected)
    rejected, skipped = vllm_name_check(keys, cfg.num_experts, dense_names=not cfg.is_moe or bool(cfg.mlp_only_layers))
    assert rejected == [] and skipped == []
    # the key set is the trainer's adapters' (plus the zero fill): every tensor lands in one of them
    assert len(keys) == _expected_count(cfg, policy)
    back = load_adapters(path, adapters, TABLE, stack_kinds, cfg.num_experts, policy=policy)
    for (p, a), b in zip(jax.tree_util.tree_flatten_with_path(adapters)[0], jax.tree.leaves(back)):
        np.testing.assert_array_equal(a, b, err_msg=jax.tree_util.keystr(p))


def _expected_count(cfg, policy) -> int:
    """2 tensors per adapted module: attention (and dense MLP) per layer, 3 per expert per MoE layer."""
    modules = TABLE.lora_modules()
    chosen = policy.modules(modules)
    attn = sum({"self_attention.linear_qkv": 3, "self_attention.linear_proj": 1}.get(m, 0) for m in chosen)
    dense = sum({"mlp.linear_fc1": 2, "mlp.linear_fc2": 1}.get(m, 0) for m in chosen)
    experts = any("experts" in m for m in chosen)
    moe = cfg.moe_layers()
    return 2 * sum(attn + (3 * cfg.num_experts * experts if moe[l] else dense) for l in range(cfg.num_layers))


def test_zero_fill_is_exact_zeros_and_logged(tmp_path, capsys):
    cfg, policy = CASES["moe-qkv-fc2"]
    path, _, _ = _export(tmp_path, cfg, policy)
    out = capsys.readouterr().out
    assert "every expert's gate_proj, up_proj carries an exact zero adapter" in out
    assert "--max-lora-rank 8" in out
    tensors = _tensors(path)
    zero = [k for k in tensors if re.search(r"experts\.\d+\.(gate|up)_proj", k)]
    assert len(zero) == 2 * 2 * cfg.num_experts * 2 and all(not tensors[k].any() for k in zero)
    assert all(tensors[k].any() for k in tensors if "down_proj" in k or "self_attn" in k)
    assert json.load(open(os.path.join(path, "adapter_config.json")))["target_modules"] == \
        ["q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "down_proj"]


def test_dense_mlp_adapters_of_sparse_step_dense_layers_are_warned_about(tmp_path, capsys):
    """vLLM's Qwen3-MoE expects dense gate/up adapters only with a non-empty mlp_only_layers."""
    _export(tmp_path, MOE, CASES["moe-per-expert"][1])
    assert "WARNING" not in capsys.readouterr().out  # layer 0 is listed in mlp_only_layers
    _export(tmp_path, MOE.replace(mlp_only_layers=(), decoder_sparse_step=2), CASES["moe-per-expert"][1], seed=1)
    assert "WARNING" in (out := capsys.readouterr().out) and "mlp_only_layers" in out


def test_fused_layout_is_what_vllm_does_not_bind(tmp_path):
    """The fused (target_parameters) layout, ``--lora-export-format fused``: the fixture's check and
    vLLM's own name check catch it on Qwen3-MoE, and it reads back exactly."""
    cfg, policy = CASES["moe-per-expert"]
    path, adapters, stack_kinds = _export(tmp_path, cfg, policy, layout="fused")
    config = json.load(open(os.path.join(path, "adapter_config.json")))
    assert config["target_parameters"] == ["gate_up_proj", "down_proj"] and isinstance(config["target_modules"], str)
    assert any("not a LoRA tensor name the loader binds" in p for p in served_problems(path, cfg, "vllm"))
    rejected, skipped = vllm_name_check(set(_tensors(path)), cfg.num_experts, dense_names=True)
    assert skipped and all(".mlp.experts.base_layer." in k for k in skipped)  # gate_up: silently unread
    back = load_adapters(path, adapters, TABLE, stack_kinds, cfg.num_experts, policy=policy)
    for a, b in zip(jax.tree.leaves(adapters), jax.tree.leaves(back)):
        np.testing.assert_array_equal(a, b)


def _rewrite_config(path, **fields):
    file = os.path.join(path, "adapter_config.json")
    json.dump(json.load(open(file)) | fields, open(file, "w"))


@pytest.mark.parametrize("fields,policy,match", [
    ({"lora_alpha": 32}, None, r"lora_alpha 32 differs from --lora-alpha 8"),
    ({}, LoRAPolicy(dim=8, alpha=8), r"r 4 differs from --lora-dim 8"),
    ({"use_rslora": True}, None, "use_rslora"),
    ({"modules_to_save": ["lm_head"]}, None, "modules_to_save"),
    ({}, LoRAPolicy(dim=4, alpha=8, targets=("linear_qkv",)), "nothing reads it.*--lora-target-modules"),
])
def test_disagreeing_adapter_config_is_refused(tmp_path, fields, policy, match):
    cfg, mine = CASES["moe-per-expert"]
    path, adapters, stack_kinds = _export(tmp_path, cfg, mine)
    _rewrite_config(path, **fields)
    policy = policy or mine
    like = adapters if policy.targets == mine.targets else nnx.to_pure_dict(
        nnx.state(families.build_model(cfg, ModelOptions(lora=policy), abstract=True), LoRAParam))
    with pytest.raises(CheckpointError, match=match):
        load_adapters(path, like, TABLE, stack_kinds, cfg.num_experts, policy=policy)


def test_per_expert_gate_and_up_must_share_their_a(tmp_path):
    """An adapter from elsewhere whose gate and up A differ cannot be held by our one fc1 A: refused by name."""
    from safetensors.numpy import save_file

    cfg, policy = CASES["moe-per-expert"]
    path, adapters, stack_kinds = _export(tmp_path, cfg, policy)
    tensors = _tensors(path)
    key = "base_model.model.model.layers.1.mlp.experts.2.up_proj.lora_A.weight"
    tensors[key] = tensors[key] + 1
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    with pytest.raises(CheckpointError, match="experts.2.gate_proj and .*experts.2.up_proj have different lora_A"):
        load_adapters(path, adapters, TABLE, stack_kinds, cfg.num_experts, policy=policy)


def test_a_fused_hf_module_with_several_adapters_is_refused_naming_the_flag(tmp_path):
    """Qwen3.5's gated DeltaNet: HF's ``in_proj_qkv`` fuses q, k and v, each with its own adapter
    here (its own A), which no PEFT module can hold: refused naming --save-peft and the way out,
    never written as one of them. Without the DeltaNet's input projection the export goes through."""
    cfg = families.get_model_config("qwen3.5-moe-tiny", vocab_size=64, num_layers=2,
                                    layer_types=("linear_attention", "full_attention"))
    table = families.family_of(cfg).hf_params(cfg)

    def export(targets, out):
        policy = LoRAPolicy(dim=4, alpha=8, targets=targets)
        model = families.build_model(cfg, ModelOptions(lora=policy), abstract=True)
        weights = nnx.to_pure_dict(nnx.state(model, nnx.Param))
        shapes = nnx.to_pure_dict(nnx.state(model, LoRAParam))
        adapters = jax.tree.map(lambda s: np.ones(s.shape, np.float32), shapes)
        save_adapters(str(tmp_path / out), adapters, policy=policy, table=table, stack_kinds=model.stack_kinds,
                      num_experts=cfg.num_experts, weights=weights, mlp_only_layers=cfg.mlp_only_layers)

    with pytest.raises(CheckpointError, match=r"--save-peft: .*linear_attn\.in_proj_qkv is one HF module for "
                                              r"several adapted weights.*--save-hf"):
        export(("in_proj",), "fused")
    assert not os.path.exists(tmp_path / "fused" / "adapter_model.safetensors")
    export(("linear_qkv", "linear_proj"), "attention")
    assert any("self_attn.q_proj.lora_A" in k for k in _tensors(str(tmp_path / "attention")))
