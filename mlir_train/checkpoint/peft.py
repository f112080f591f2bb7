"""LoRA adapters in HF PEFT's format: ``adapter_config.json`` + ``adapter_model.safetensors``,
loadable with ``peft.PeftModel.from_pretrained`` on the HF model, and read back to continue
training.

Names and layouts are peft's (0.17+): a ``nn.Linear`` adapter is ``<module>.lora_A.weight [R, in]``
and ``<module>.lora_B.weight [out, R]``; the routed experts' fused parameters (transformers 5's
``mlp.experts.gate_up_proj [E, 2I, H]`` and ``down_proj [E, H, I]``) take peft's
``target_parameters`` adapters, ``lora_A.weight [E*R, in]`` (row ``e*R + k``) and
``lora_B.weight [out, R*E]`` (column ``k*E + e``). When both expert parameters are adapted, peft
wraps ``gate_up_proj`` first, so its tensors sit under ``mlp.experts.base_layer.`` and
``down_proj``'s under ``mlp.experts.``. Our layouts (:mod:`mlir_train.model.lora`): q/k/v/o and
the dense MLP's gate/up/down carry their own adapters as peft's modules do; the experts' fc1
has one A for gate and up (HF's fused ``gate_up_proj``) and a ``[R, 2, F]`` B. A shared expert
adapter is written per expert (the same A and B for each), which peft's format requires.

Shape suffixes: L layers of a stack, E experts, D hidden, F widths, R rank, N/K heads, H head dim.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

import numpy as np

from mlir_train.runtime.errors import CheckpointError

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
PREFIX = "base_model.model.model.layers"


def _linear_entries(stack: dict, moe: bool) -> list[tuple[str, tuple[str, ...]]]:
    """(peft module under ``model.layers.{l}.``, our path in a stack) of the plain linear adapters present."""
    out = []
    attn = stack.get("attn", {})
    for ours, hf in (("q_lora", "q_proj"), ("k_lora", "k_proj"), ("v_lora", "v_proj"), ("o_lora", "o_proj")):
        if ours in attn:
            out.append((f"self_attn.{hf}", ("attn", ours)))
    if not moe:
        mlp = stack.get("mlp", {})
        for ours, hf in (("gate_lora", "gate_proj"), ("up_lora", "up_proj"), ("down_lora", "down_proj")):
            if ours in mlp:
                out.append((f"mlp.{hf}", ("mlp", ours)))
    return out


def _expert_names(mlp: dict) -> dict[str, str]:
    """Our expert adapter -> its peft module (module docstring: peft's nesting)."""
    both = "fc1_lora" in mlp and "fc2_lora" in mlp
    names = {}
    if "fc1_lora" in mlp:
        names["fc1_lora"] = "mlp.experts.base_layer" if both else "mlp.experts"
    if "fc2_lora" in mlp:
        names["fc2_lora"] = "mlp.experts"
    return names


def _get(tree, path):
    for k in path:
        tree = tree[k]
    return tree


def to_peft(adapters: dict, stack_kinds, num_experts: int) -> dict[str, np.ndarray]:
    """Our adapters (the trainer's params under LoRA, host arrays) -> peft's tensors by name."""
    out: dict[str, np.ndarray] = {}
    for i, (first, n, kind) in enumerate(stack_kinds):
        moe = kind.moe
        stack = adapters["layers"][i]
        for l in range(n):
            pre = f"{PREFIX}.{first + l}"
            for hf, path in _linear_entries(stack, moe):
                lora = _get(stack, path)
                a, b = np.asarray(lora["a"][l]), np.asarray(lora["b"][l])
                r = b.shape[0]
                out[f"{pre}.{hf}.lora_A.weight"] = a.reshape(-1, r).T
                out[f"{pre}.{hf}.lora_B.weight"] = b.reshape(r, -1).T
            if not moe:
                continue
            for ours, hf in _expert_names(stack.get("mlp", {})).items():
                lora = stack["mlp"][ours]
                a, b = np.asarray(lora["a"][l]), np.asarray(lora["b"][l])
                if a.ndim == 2:  # shared: the same adapter for every expert
                    a, b = np.broadcast_to(a, (num_experts, *a.shape)), np.broadcast_to(b, (num_experts, *b.shape))
                e, d, r = a.shape
                b_ERO = b.reshape(e, r, -1)
                out[f"{pre}.{hf}.lora_A.weight"] = np.ascontiguousarray(a.transpose(0, 2, 1).reshape(e * r, d))
                out[f"{pre}.{hf}.lora_B.weight"] = np.ascontiguousarray(b_ERO.transpose(2, 1, 0).reshape(-1, r * e))
    return out


def from_peft(tensors: dict[str, np.ndarray], like: dict, stack_kinds, num_experts: int, where: str) -> dict:
    """peft's tensors -> our adapters shaped like ``like`` (the trainer's adapter shapes); every
    adapter ``like`` has must be there with its shape, and nothing else may be."""
    used = set()
    out: dict = {"layers": {}}

    def take(name, shape):
        if name not in tensors:
            raise CheckpointError(f"{where}: no tensor {name}; the adapter does not match --lora-target-modules "
                                  "(or the model)")
        t = np.asarray(tensors[name])
        if t.shape != tuple(shape):
            raise CheckpointError(f"{where}: tensor {name} has shape {t.shape}, expected {tuple(shape)} "
                                  "(check --lora-dim and the model)")
        used.add(name)
        return t

    for i, (first, n, kind) in enumerate(stack_kinds):
        moe = kind.moe
        stack_like = like["layers"][i]
        stack: dict = {}
        for hf, path in _linear_entries(stack_like, moe):
            lora = _get(stack_like, path)
            a_shape, b_shape = lora["a"].shape[1:], lora["b"].shape[1:]
            r = b_shape[0]
            a_in = int(np.prod(a_shape[:-1]))
            b_out = int(np.prod(b_shape[1:]))
            a = np.stack([take(f"{PREFIX}.{first + l}.{hf}.lora_A.weight", (r, a_in)).T.reshape(a_shape)
                          for l in range(n)])
            b = np.stack([take(f"{PREFIX}.{first + l}.{hf}.lora_B.weight", (b_out, r)).T.reshape(b_shape)
                          for l in range(n)])
            stack.setdefault(path[0], {})[path[1]] = {"a": a, "b": b}
        if moe:
            for ours, hf in _expert_names(stack_like.get("mlp", {})).items():
                lora = stack_like["mlp"][ours]
                a_shape, b_shape = lora["a"].shape[1:], lora["b"].shape[1:]
                shared = len(a_shape) == 2
                e = num_experts
                d, r = a_shape[-2], a_shape[-1]
                o = int(np.prod(b_shape[-len(b_shape) + (1 if shared else 2):]))
                a_l, b_l = [], []
                for l in range(n):
                    name = f"{PREFIX}.{first + l}.{hf}"
                    a = take(f"{name}.lora_A.weight", (e * r, d)).reshape(e, r, d).transpose(0, 2, 1)
                    b = take(f"{name}.lora_B.weight", (o, r * e)).reshape(o, r, e).transpose(2, 1, 0)
                    if shared:
                        if not (np.all(a == a[:1]) and np.all(b == b[:1])):
                            raise CheckpointError(f"{where}: {name} holds a different adapter per expert; load it "
                                                  "with --lora-expert-adapters per-expert")
                        a, b = a[0], b[0]
                    a_l.append(a)
                    b_l.append(b.reshape(b_shape))
                stack.setdefault("mlp", {})[ours] = {"a": np.stack(a_l), "b": np.stack(b_l)}
        out["layers"][i] = stack
    extra = sorted(set(tensors) - used)
    if extra:
        raise CheckpointError(f"{where}: {len(extra)} adapter tensors this run's --lora-target-modules do not "
                              f"adapt, e.g. {extra[0]}; give the targets the adapter was trained with")
    return out


def peft_config(policy, linear: list[str], expert_params: list[str], base: str | None) -> dict[str, Any]:
    """peft's ``LoraConfig`` fields for ``policy``: the HF modules (``self_attn.q_proj``, ...) and
    expert parameters adapted. ``target_modules`` is a full-match regex, so peft adapts exactly
    these ``nn.Linear`` layers (its MoE conversion of gate/up/down names into fused expert targets
    does not apply); the expert parameters are listed in peft's wrapping order (gate_up first)."""
    alternatives = "|".join(re.escape(m) for m in sorted(linear))
    return {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": policy.dim, "lora_alpha": policy.alpha,
        "lora_dropout": policy.dropout, "bias": "none", "fan_in_fan_out": False, "use_rslora": False,
        "use_dora": False, "init_lora_weights": True, "inference_mode": True, "base_model_name_or_path": base,
        "target_modules": rf".*\.layers\.\d+\.({alternatives})" if linear else None,
        "target_parameters": list(expert_params) or None,
        "rank_pattern": {}, "alpha_pattern": {}, "modules_to_save": None, "layers_to_transform": None,
        "layers_pattern": None, "exclude_modules": None,
    }


def save_adapters(path: str, adapters: dict, *, policy, stack_kinds, num_experts: int, base: str | None = None,
                  dtype=None) -> None:
    """Write ``adapters`` (host arrays, the trainer's params) as a PEFT adapter directory."""
    from safetensors.numpy import save_file

    os.makedirs(path, exist_ok=True)
    tensors = to_peft(adapters, stack_kinds, num_experts)
    if dtype is not None:
        tensors = {k: v.astype(dtype) for k, v in tensors.items()}
    linear, experts = set(), set()
    for i, s in enumerate(stack_kinds):
        stack = adapters["layers"][i]
        linear |= {hf for hf, _ in _linear_entries(stack, s.moe)}
        if s.moe:
            experts |= set(stack.get("mlp", {})) & {"fc1_lora", "fc2_lora"}
    params = [p for p, ours in (("gate_up_proj", "fc1_lora"), ("down_proj", "fc2_lora")) if ours in experts]
    save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, os.path.join(path, WEIGHTS_NAME))
    with open(os.path.join(path, CONFIG_NAME), "w") as f:
        json.dump(peft_config(policy, sorted(linear), params, base), f, indent=2)


def is_adapter_dir(path: str) -> bool:
    return os.path.isfile(os.path.join(path, CONFIG_NAME)) and os.path.isfile(os.path.join(path, WEIGHTS_NAME))


def read_adapter_config(path: str) -> dict[str, Any]:
    with open(os.path.join(path, CONFIG_NAME)) as f:
        return json.load(f)


def load_adapters(path: str, like: dict, stack_kinds, num_experts: int) -> dict:
    """A PEFT adapter directory -> our adapters shaped like ``like`` (host arrays)."""
    from safetensors.numpy import load_file

    where = os.path.join(path, WEIGHTS_NAME)
    if not is_adapter_dir(path):
        raise CheckpointError(f"{path}: not a PEFT adapter directory ({CONFIG_NAME} + {WEIGHTS_NAME})")
    cfg = read_adapter_config(path)
    if cfg.get("peft_type", "LORA") != "LORA" or cfg.get("use_dora") or cfg.get("lora_bias") or cfg.get("bias", "none") != "none":
        raise CheckpointError(f"{path}: only plain LoRA adapters are read (no DoRA, no bias)")
    if cfg.get("rank_pattern") or cfg.get("alpha_pattern"):
        raise CheckpointError(f"{path}: per-module ranks or alphas (rank_pattern / alpha_pattern) are not read")
    tensors = {re.sub(r"\.lora_([AB])\.[^.]+\.weight$", r".lora_\1.weight", k): v for k, v in load_file(where).items()}
    return from_peft(tensors, like, stack_kinds, num_experts, where)
