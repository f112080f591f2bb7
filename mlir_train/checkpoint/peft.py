"""LoRA adapters as an HF PEFT adapter directory (``adapter_config.json`` +
``adapter_model.safetensors``): written for serving engines and peft, read back to continue
training.

The layout (:mod:`mlir_train.checkpoint.peft_tensors`) is ``per-expert`` by default: every
routed expert's gate_proj / up_proj / down_proj its own module, ``target_modules`` a list of short
names and no ``target_parameters``. That is what vLLM's Qwen3-MoE LoRA loader binds (it drops a
``target_parameters`` adapter's experts or refuses it, and serves the base model: vllm#41384) and
what SGLang reads (it refuses a regex ``target_modules``). The names, shapes and rules are the
fixture ``tests/checkpoint/fixtures/serving_lora_names.json``, read from vLLM 0.33.0 (commit
4ba787ec9) and SGLang 0.5.23 with file and line. ``fused`` (``--lora-export-format fused``) is
peft's ``target_parameters`` form on transformers 5's fused experts.

What the engines require and we meet: LoRA tensors only, ``modules_to_save`` null; one rank
everywhere; all three projections of every expert in a MoE layer with any expert adapter (exact
zeros where the run adapts none: said in the log); scaling ``lora_alpha / r`` (``use_rslora``
false: vLLM before 0.33 and SGLang scale expert adapters by alpha/r whatever the config says, and
so do we). Reading back takes either layout and checks ``r``, ``lora_alpha`` and the targets
against the run's flags.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

import numpy as np

from mlir_train.checkpoint.hf_files import usual_mode
from mlir_train.checkpoint.peft_tensors import PREFIX, adapters_of, from_peft, layout_of, to_peft, zero_targets
from mlir_train.families.table import Table
from mlir_train.runtime import log
from mlir_train.runtime.errors import CheckpointError

__all__ = ["PREFIX", "CONFIG_NAME", "WEIGHTS_NAME", "save_adapters", "load_adapters", "is_adapter_dir",
           "read_adapter_config", "peft_config", "to_peft", "from_peft"]

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
# vllm/config/lora.py l.27 (vLLM 0.33.0, commit 4ba787ec9): the values --max-lora-rank takes.
VLLM_MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def peft_config(policy, table: Table, targets: list, layout: str, base: str | None) -> dict[str, Any]:
    """peft's ``LoraConfig`` fields for ``policy`` adapting ``targets`` (the table's LoRA
    targets written, zero ones included). Per-expert: ``target_modules`` the list of their short
    names. Fused: a full-match regex over the layers' ``nn.Linear`` modules (so peft adapts exactly
    those) and the fused expert parameters as ``target_parameters``, in peft's wrapping order."""
    fields = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": policy.dim, "lora_alpha": policy.alpha,
        "lora_dropout": policy.dropout, "bias": "none", "fan_in_fan_out": False, "use_rslora": False,
        "use_dora": False, "init_lora_weights": True, "inference_mode": True, "base_model_name_or_path": base,
        "target_modules": list(dict.fromkeys(t.short for t in targets)),
        "rank_pattern": {}, "alpha_pattern": {}, "modules_to_save": None, "layers_to_transform": None,
        "layers_pattern": None, "exclude_modules": None,
    }
    if layout == "fused":
        linear = sorted({t.peft for t in targets if not t.expert})
        layers = table.hf_layers.split("{l}")[0].rstrip(".").rsplit(".", 1)[-1]  # the layer list's own name
        alternatives = "|".join(re.escape(m) for m in linear)
        fields["target_modules"] = rf".*\.{re.escape(layers)}\.\d+\.({alternatives})" if linear else None
        fields["target_parameters"] = list(dict.fromkeys(t.fused.rsplit(".", 1)[1] for t in targets if t.expert)) \
            or None
    return fields


def save_adapters(path: str, adapters: dict, *, policy, table: Table, stack_kinds, num_experts: int,
                  base: str | None = None, dtype=None, layout: str = "per-expert", weights: dict | None = None,
                  mlp_only_layers: tuple[int, ...] = ()) -> None:
    """Write ``adapters`` (host arrays, the trainer's params) as a PEFT adapter directory in
    ``layout``; ``weights``: the base's (their shapes give zero adapters theirs);
    ``mlp_only_layers``: the dense layers the model's config.json lists as such."""
    from safetensors.numpy import save_file

    os.makedirs(path, exist_ok=True)
    shared = policy.expert_adapters == "shared"
    tensors = to_peft(adapters, table, stack_kinds, num_experts, shared=shared, layout=layout, weights=weights)
    if dtype is not None:
        tensors = {k: v.astype(dtype) for k, v in tensors.items()}
    found = {t: None for i, s in enumerate(stack_kinds) for ad in adapters_of(table, adapters["layers"].get(i, {}), s.kind)
             for t in ad.targets}
    zeros = {r.lora: None for i, s in enumerate(stack_kinds) if layout == "per-expert"
             for r in zero_targets(table, adapters["layers"].get(i, {}), s.kind)}
    targets = [r.lora for r in table.rows if r.lora in found or r.lora in zeros]
    save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, os.path.join(path, WEIGHTS_NAME))
    usual_mode(os.path.join(path, WEIGHTS_NAME))
    with open(os.path.join(path, CONFIG_NAME), "w") as f:
        json.dump(peft_config(policy, table, list(dict.fromkeys(targets)), layout, base), f, indent=2)
    _say_what_serves(path, policy, table, stack_kinds, found, zeros, layout, len(tensors), mlp_only_layers)


def _say_what_serves(path, policy, table: Table, stack_kinds, found, zeros, layout: str, count: int,
                     mlp_only_layers) -> None:
    """The log of an export: what it holds, its zero fill, and how vLLM serves it."""
    log.info(f"{path}: {count} LoRA tensors, {layout} layout, rank {policy.dim}, alpha {policy.alpha:g} "
             f"(scaling alpha/r = {policy.scaling:g})")
    if zeros:
        names = ", ".join(dict.fromkeys(t.short for t in zeros))
        log.info(f"{path}: every expert's {names} carries an exact zero adapter (not in --lora-target-modules): vLLM "
                 "needs all three projections of every expert in a MoE layer with expert adapters")
    if layout == "fused" and any(t.expert for t in found):
        log.info(f"{path}: fused expert adapters (target_parameters) are for transformers 5 + peft; vLLM's Qwen3-MoE "
                 "drops or refuses them: export with --lora-export-format per-expert to serve them")
    fit = next((r for r in VLLM_MAX_LORA_RANKS if r >= policy.dim), None)
    if fit is None:
        log.warning(f"{path}: rank {policy.dim} is above {VLLM_MAX_LORA_RANKS[-1]}, the largest --max-lora-rank vLLM "
                    "takes: vLLM cannot serve this adapter")
    else:
        log.info(f"{path}: serve with vllm serve BASE --enable-lora --lora-modules NAME={path} --max-lora-rank {fit}")
    dense_only = [r.lora for r in table.rows if r.moe is False and r.lora in found]
    dense_layers = {l for s in stack_kinds if not s.kind.moe for l in s.layers}
    if dense_only and any(s.kind.moe for s in stack_kinds) and not dense_layers <= set(mlp_only_layers):
        log.warning(f"{path}: adapters on the dense layers' {', '.join(dict.fromkeys(t.short for t in dense_only))} "
                    "of a model with MoE layers: vLLM 0.33 binds them only when the served config.json lists those "
                    "layers in mlp_only_layers")


def is_adapter_dir(path: str) -> bool:
    return os.path.isfile(os.path.join(path, CONFIG_NAME)) and os.path.isfile(os.path.join(path, WEIGHTS_NAME))


def read_adapter_config(path: str) -> dict[str, Any]:
    where = os.path.join(path, CONFIG_NAME)
    try:
        with open(where) as f:
            cfg = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{where}: cannot read it ({e}): the adapter directory is damaged or not PEFT's; "
                              "write it again (--save-peft)") from None
    if not isinstance(cfg, dict):
        raise CheckpointError(f"{where}: a JSON {type(cfg).__name__}, expected PEFT's LoraConfig object")
    return cfg


def check_config(cfg: dict[str, Any], policy, where: str) -> None:
    """What an adapter directory's config must be for this run to continue it: plain LoRA at
    the run's rank and alpha, scaled as we scale (alpha/r), nothing but adapters."""
    if cfg.get("peft_type", "LORA") != "LORA" or cfg.get("use_dora") or cfg.get("lora_bias") or \
            cfg.get("bias", "none") != "none":
        raise CheckpointError(f"{where}: only plain LoRA adapters are read (no DoRA, no bias)")
    if cfg.get("rank_pattern") or cfg.get("alpha_pattern"):
        raise CheckpointError(f"{where}: per-module ranks or alphas (rank_pattern / alpha_pattern) are not read")
    if cfg.get("use_rslora"):
        raise CheckpointError(f"{where}: use_rslora (scaling alpha/sqrt(r)) is not how this trainer scales adapters "
                              "(alpha/r); re-export it without rsLoRA")
    if cfg.get("modules_to_save"):
        raise CheckpointError(f"{where}: modules_to_save {cfg['modules_to_save']}: full modules beside the adapters "
                              "are not read")
    for key, flag, mine in (("r", "--lora-dim", policy.dim), ("lora_alpha", "--lora-alpha", policy.alpha)):
        if not isinstance(cfg.get(key), (int, float)) or isinstance(cfg.get(key), bool):
            raise CheckpointError(f"{where}: {key} {cfg.get(key)!r} is not a number")
        if float(cfg[key]) != float(mine):
            raise CheckpointError(f"{where}: {key} {cfg[key]:g} differs from {flag} {mine:g}: give {flag} "
                                  f"{cfg[key]:g} to continue these adapters")


def check_continue(path: str, policy) -> None:
    """``--load`` of a PEFT directory: a LoRA run whose flags agree with its adapter_config.json
    (:func:`check_config`), or one error saying which flags continue it."""
    from mlir_train.runtime.errors import ConfigError

    cfg = read_adapter_config(path)
    if policy is None:
        raise ConfigError(f"--load {path} holds PEFT adapters (r {cfg.get('r')}, lora_alpha {cfg.get('lora_alpha')}): "
                          f"add --lora-dim {cfg.get('r')} --lora-alpha {cfg.get('lora_alpha')} to continue them, with "
                          "their base as --pretrained-checkpoint")
    check_config(cfg, policy, os.path.join(path, CONFIG_NAME))


def load_adapters(path: str, like: dict, table: Table, stack_kinds, num_experts: int, policy) -> dict:
    """A PEFT adapter directory, either layout -> our adapters shaped like ``like`` (host
    arrays), its config checked against ``policy`` (the run's LoRA flags)."""
    where = os.path.join(path, WEIGHTS_NAME)
    if not is_adapter_dir(path):
        raise CheckpointError(f"{path}: not a PEFT adapter directory ({CONFIG_NAME} + {WEIGHTS_NAME})")
    cfg = read_adapter_config(path)
    check_config(cfg, policy, os.path.join(path, CONFIG_NAME))
    tensors = {re.sub(r"\.lora_([AB])\.[^.]+\.weight$", r".lora_\1.weight", k): v for k, v in _read_weights(where).items()}
    layout = layout_of(cfg, tensors, table, where)
    shared = policy is not None and policy.expert_adapters == "shared"
    return from_peft(tensors, like, table, stack_kinds, num_experts, where, shared=shared, layout=layout)


def _read_weights(where: str) -> dict:
    """``adapter_model.safetensors``, or one error saying it is truncated or damaged."""
    from safetensors.numpy import load_file

    try:
        return load_file(where)
    except Exception as e:  # noqa: BLE001 - safetensors' errors: a truncated or damaged file
        raise CheckpointError(f"{where}: cannot read the adapter weights ({e}): the file is truncated or damaged; "
                              "write it again (--save-peft)") from None
