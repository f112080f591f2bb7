"""LoRA adapters in HF PEFT's format: ``adapter_config.json`` + ``adapter_model.safetensors``,
loadable with ``peft.PeftModel.from_pretrained`` on the HF model, and read back to continue
training.

Which adapter is which PEFT module is the family's parameter table's LoRA column
(:class:`~mlir_train.families.table.LoRATarget`). Names and layouts are peft's (0.17+): an
``nn.Linear`` adapter is ``<module>.lora_A.weight [R, in]`` and ``<module>.lora_B.weight
[out, R]``; a fused expert parameter (``target=parameter``) takes peft's ``target_parameters``
adapter, ``lora_A.weight [E*R, in]`` (row ``e*R + k``) and ``lora_B.weight [out, R*E]``
(column ``k*E + e``). peft wraps a module's adapted parameters one inside the other in the order
``target_parameters`` lists them (the table's order), so the first one's tensors sit under
``<module>.base_layer.`` when a second is adapted too. A shared expert adapter is written per
expert (the same A and B for each), which peft's format requires. Our layouts are
:mod:`mlir_train.model.lora`'s (in-axes then rank for A, rank then out-axes for B).

Shape suffixes: L layers of a stack, E experts, D hidden, F widths, R rank.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from typing import Any

import numpy as np

from mlir_train.checkpoint import complete
from mlir_train.checkpoint.hf_files import usual_mode
from mlir_train.families.table import LoRATarget, Table
from mlir_train.runtime.errors import CheckpointError

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
PREFIX = "base_model.model."  # peft's wrapper around the HF model


@dataclasses.dataclass(frozen=True)
class _Adapter:
    """One adapter of a stack: where it is in our tree, and its PEFT module under the layer prefix."""

    path: tuple[str, ...]   # under the stack: (parent, adapter)
    target: LoRATarget
    module: str             # peft's module holding lora_A / lora_B (nesting included)


def _adapters(table: Table, stack: dict, kind) -> list[_Adapter]:
    """The adapters ``stack`` (our tree of one stack) holds, each with its PEFT module."""
    out: dict[tuple, LoRATarget] = {}
    for row in table.layer_rows(kind):
        if row.lora is not None:
            path = row.path[:-1] + (row.lora.adapter,)
            if _has(stack, path):
                out.setdefault(path, row.lora)
    adapters = []
    for path, t in out.items():
        module = t.peft
        if t.parameter:  # nested under the ones wrapped after it (module docstring)
            module, _ = t.peft.rsplit(".", 1)
            after = [u for u in out.values() if u.parameter and u.peft.rsplit(".", 1)[0] == module]
            module += ".base_layer" * (len(after) - 1 - after.index(t))
        adapters.append(_Adapter(path, t, module))
    return adapters


def _has(tree, path) -> bool:
    for k in path:
        if not isinstance(tree, dict) or k not in tree:
            return False
        tree = tree[k]
    return True


def _get(tree, path):
    for k in path:
        tree = tree[k]
    return tree


def _name(table: Table, layer: int, adapter: _Adapter, which: str) -> str:
    return f"{PREFIX}{table.hf_layers.format(l=layer)}{adapter.module}.lora_{which}.weight"


def to_peft(adapters: dict, table: Table, stack_kinds, num_experts: int) -> dict[str, np.ndarray]:
    """Our adapters (the trainer's params under LoRA, host arrays) -> peft's tensors by name."""
    out: dict[str, np.ndarray] = {}
    for i, (first, n, kind) in enumerate(stack_kinds):
        stack = adapters["layers"][i]
        for ad in _adapters(table, stack, kind):
            lora = _get(stack, ad.path)
            for l in range(n):
                a, b = np.asarray(lora["a"][l]), np.asarray(lora["b"][l])
                out[_name(table, first + l, ad, "A")], out[_name(table, first + l, ad, "B")] = (
                    _expert_to_peft(a, b, num_experts) if ad.target.parameter else _linear_to_peft(a, b))
    return out


def _linear_to_peft(a, b) -> tuple[np.ndarray, np.ndarray]:
    r = b.shape[0]
    return a.reshape(-1, r).T, b.reshape(r, -1).T


def _expert_to_peft(a, b, num_experts: int) -> tuple[np.ndarray, np.ndarray]:
    if a.ndim == 2:  # shared: the same adapter for every expert
        a, b = np.broadcast_to(a, (num_experts, *a.shape)), np.broadcast_to(b, (num_experts, *b.shape))
    e, d, r = a.shape
    b_ERO = b.reshape(e, r, -1)
    return (np.ascontiguousarray(a.transpose(0, 2, 1).reshape(e * r, d)),
            np.ascontiguousarray(b_ERO.transpose(2, 1, 0).reshape(-1, r * e)))


class _Taker:
    """Reads peft's tensors by name, each checked for shape; what it never took is unread."""

    def __init__(self, tensors: dict[str, np.ndarray], where: str):
        self.tensors, self.where, self.used = tensors, where, set()

    def __call__(self, name: str, shape) -> np.ndarray:
        if name not in self.tensors:
            complete.check(self.where, missing=[name], hint="; the adapter does not match --lora-target-modules (or "
                                                            "the model)")
        t = np.asarray(self.tensors[name])
        if t.shape != tuple(shape):
            raise CheckpointError(f"{self.where}: tensor {name} has shape {t.shape}, expected {tuple(shape)} "
                                  "(check --lora-dim and the model)")
        self.used.add(name)
        return t

    def check_all_read(self) -> None:
        complete.check(self.where, unread=set(self.tensors) - self.used,
                       hint="; this run's --lora-target-modules do not adapt it: give the targets the adapter was "
                            "trained with")


def from_peft(tensors: dict[str, np.ndarray], like: dict, table: Table, stack_kinds, num_experts: int,
              where: str) -> dict:
    """peft's tensors -> our adapters shaped like ``like`` (the trainer's adapter shapes); every
    adapter ``like`` has must be there with its shape, and nothing else may be."""
    take = _Taker(tensors, where)
    out: dict = {"layers": {}}
    for i, (first, n, kind) in enumerate(stack_kinds):
        stack_like, stack = like["layers"][i], {}
        for ad in _adapters(table, stack_like, kind):
            lora = _get(stack_like, ad.path)
            a_shape, b_shape = tuple(lora["a"].shape[1:]), tuple(lora["b"].shape[1:])
            read = _expert_from_peft if ad.target.parameter else _linear_from_peft
            pairs = [read(lambda which, shape: take(_name(table, first + l, ad, which), shape), a_shape, b_shape,
                          num_experts, f"{where}: {_name(table, first + l, ad, 'A')}") for l in range(n)]
            stack.setdefault(ad.path[0], {})[ad.path[1]] = {"a": np.stack([p[0] for p in pairs]),
                                                            "b": np.stack([p[1] for p in pairs])}
        out["layers"][i] = stack
    take.check_all_read()
    return out


def _linear_from_peft(take, a_shape, b_shape, num_experts: int, what: str):
    r = b_shape[0]
    a_in, b_out = int(np.prod(a_shape[:-1])), int(np.prod(b_shape[1:]))
    return take("A", (r, a_in)).T.reshape(a_shape), take("B", (b_out, r)).T.reshape(b_shape)


def _expert_from_peft(take, a_shape, b_shape, num_experts: int, what: str):
    shared = len(a_shape) == 2
    e, (d, r) = num_experts, a_shape[-2:]
    o = int(np.prod(b_shape[-len(b_shape) + (1 if shared else 2):]))
    a = take("A", (e * r, d)).reshape(e, r, d).transpose(0, 2, 1)
    b = take("B", (o, r * e)).reshape(o, r, e).transpose(2, 1, 0)
    if shared:
        if not (np.all(a == a[:1]) and np.all(b == b[:1])):
            raise CheckpointError(f"{what} holds a different adapter per expert; load it with --lora-expert-adapters "
                                  "per-expert")
        a, b = a[0], b[0]
    return a, b.reshape(b_shape)


def peft_config(policy, table: Table, linear: list[str], expert_params: list[str], base: str | None) -> dict[str, Any]:
    """peft's ``LoraConfig`` fields for ``policy``: the HF modules (``linear``) and fused
    parameters (``expert_params``, in peft's wrapping order) adapted. ``target_modules`` is a
    full-match regex over the layers' modules, so peft adapts exactly these ``nn.Linear`` layers
    (its MoE conversion of names into fused expert targets does not apply)."""
    alternatives = "|".join(re.escape(m) for m in sorted(linear))
    layers = table.hf_layers.split("{l}")[0].rstrip(".").rsplit(".", 1)[-1]  # the layer list's own name
    return {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": policy.dim, "lora_alpha": policy.alpha,
        "lora_dropout": policy.dropout, "bias": "none", "fan_in_fan_out": False, "use_rslora": False,
        "use_dora": False, "init_lora_weights": True, "inference_mode": True, "base_model_name_or_path": base,
        "target_modules": rf".*\.{re.escape(layers)}\.\d+\.({alternatives})" if linear else None,
        "target_parameters": list(expert_params) or None,
        "rank_pattern": {}, "alpha_pattern": {}, "modules_to_save": None, "layers_to_transform": None,
        "layers_pattern": None, "exclude_modules": None,
    }


def save_adapters(path: str, adapters: dict, *, policy, table: Table, stack_kinds, num_experts: int,
                  base: str | None = None, dtype=None) -> None:
    """Write ``adapters`` (host arrays, the trainer's params) as a PEFT adapter directory."""
    from safetensors.numpy import save_file

    os.makedirs(path, exist_ok=True)
    tensors = to_peft(adapters, table, stack_kinds, num_experts)
    if dtype is not None:
        tensors = {k: v.astype(dtype) for k, v in tensors.items()}
    targets = {ad.target: None for i, s in enumerate(stack_kinds) for ad in _adapters(table, adapters["layers"][i], s.kind)}
    linear = sorted({t.peft for t in targets if not t.parameter})
    params = [r.lora.peft.rsplit(".", 1)[1] for r in table.rows if r.lora in targets and r.lora.parameter]
    save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, os.path.join(path, WEIGHTS_NAME))
    usual_mode(os.path.join(path, WEIGHTS_NAME))
    with open(os.path.join(path, CONFIG_NAME), "w") as f:
        json.dump(peft_config(policy, table, linear, list(dict.fromkeys(params)), base), f, indent=2)


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


def check_adapter_config(path: str, policy) -> None:
    """The adapters' ``adapter_config.json`` agrees with the run's LoRA flags: the rank and the
    alpha (their scale ``alpha / r``, which would be applied silently otherwise) and no scale
    rule of peft's we do not apply. The targets are checked tensor by tensor when read."""
    cfg, where = read_adapter_config(path), os.path.join(path, CONFIG_NAME)
    for key, flag, mine in (("r", "--lora-dim", policy.dim), ("lora_alpha", "--lora-alpha", policy.alpha)):
        if key in cfg and float(cfg[key]) != float(mine):
            raise CheckpointError(f"{where}: {key} {cfg[key]} but {flag} {mine:g}: give {flag} {cfg[key]} (the "
                                  "adapters were trained with it)")
    if cfg.get("use_rslora"):
        raise CheckpointError(f"{where}: use_rslora scales the adapters by alpha / sqrt(r), which is not "
                              "implemented here (alpha / r)")


def load_adapters(path: str, like: dict, table: Table, stack_kinds, num_experts: int) -> dict:
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
    try:
        stored = load_file(where)
    except Exception as e:  # noqa: BLE001 - safetensors' errors: a truncated or damaged file
        raise CheckpointError(f"{where}: cannot read the adapter weights ({e}): the file is truncated or damaged; "
                              "write it again (--save-peft)") from None
    tensors = {re.sub(r"\.lora_([AB])\.[^.]+\.weight$", r".lora_\1.weight", k): v for k, v in stored.items()}
    return from_peft(tensors, like, table, stack_kinds, num_experts, where)
