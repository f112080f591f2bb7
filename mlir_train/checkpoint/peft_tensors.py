"""Our LoRA adapters as PEFT's tensors and back, in either layout of the routed experts.

Which adapter is which PEFT module is the family's parameter table's LoRA column
(:class:`~mlir_train.families.table.LoRATarget`). An ``nn.Linear`` adapter is
``<module>.lora_A.weight [R, in]`` and ``<module>.lora_B.weight [out, R]`` (peft's names, under
``base_model.model.`` and the table's HF layer prefix). The layouts differ in the routed experts:

* ``per-expert``: each expert's weight its own module (``LoRATarget.peft`` with ``{e}``), the
  layout vLLM and SGLang read for Qwen3-MoE. An adapter that updates several weights (our experts'
  fc1: one A, B ``[R, 2, F]`` for gate and up) is their modules' adapters sharing that A, B's
  ``part`` each: exact, at the same rank. A shared expert adapter is written for every expert.
  A MoE layer with any expert adapter gets one for every expert weight the table adapts: those
  the run does not adapt are exact zeros (vLLM packs all three projections of every expert, or
  fails), of the base weight's shape.
* ``fused``: peft's ``target_parameters`` adapter on the fused parameter (``LoRATarget.fused``):
  ``lora_A.weight [E*R, in]`` (row ``e*R + k``) and ``lora_B.weight [out, R*E]`` (column
  ``k*E + e``). peft wraps a module's adapted parameters one inside the other in the order the
  table lists them, so the first one's tensors sit under ``<module>.base_layer.`` when a second is
  adapted too.

Our layouts are :mod:`mlir_train.model.lora`'s (in-axes then rank for A, rank then out-axes for B).
Shape suffixes: E experts, R rank.
"""

from __future__ import annotations

import dataclasses
import math
import re

import numpy as np

from mlir_train.checkpoint import complete
from mlir_train.families.table import Linear, LoRATarget, Table
from mlir_train.runtime import log
from mlir_train.runtime.errors import CheckpointError

PREFIX = "base_model.model."  # peft's wrapper around the HF model
LAYOUTS = ("per-expert", "fused")


@dataclasses.dataclass(frozen=True)
class _Adapter:
    """One adapter of a stack: where it is in our tree (``(parent, adapter)`` under the stack)
    and the table's targets of the weights it updates, in part order."""

    path: tuple[str, ...]
    targets: tuple[LoRATarget, ...]

    @property
    def expert(self) -> bool:
        return self.targets[0].expert


def adapters_of(table: Table, stack: dict, kind) -> list[_Adapter]:
    """The adapters ``stack`` (our tree of one stack of layers of ``kind``) holds."""
    found: dict[tuple, dict[int, LoRATarget]] = {}
    for row in table.layer_rows(kind):
        if row.lora is not None and _has(stack, row.path[:-1] + (row.lora.adapter,)):
            found.setdefault(row.path[:-1] + (row.lora.adapter,), {})[row.lora.part] = row.lora
    return [_Adapter(path, tuple(parts[k] for k in sorted(parts))) for path, parts in found.items()]


def zero_targets(table: Table, stack: dict, kind) -> list:
    """The rows of the expert weights a per-expert export fills with zero adapters in a stack
    whose experts carry any adapter: those the table adapts and the run does not."""
    adapters = adapters_of(table, stack, kind)
    if not any(ad.expert for ad in adapters):
        return []
    covered = {t for ad in adapters for t in ad.targets}
    return [r for r in table.layer_rows(kind) if r.lora is not None and r.lora.expert and r.lora not in covered]


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


def _module(table: Table, layer: int, module: str, e: int | None = None) -> str:
    return f"{PREFIX}{table.hf_layers.format(l=layer)}{module.format(e=e)}"


def _fused_module(ad: _Adapter, adapters: list[_Adapter]) -> str:
    """peft's module of a fused expert adapter, nested under the ones wrapped after it."""
    parent = ad.targets[0].fused.rsplit(".", 1)[0]
    siblings = [x for x in adapters if x.expert and x.targets[0].fused.rsplit(".", 1)[0] == parent]
    return parent + ".base_layer" * (len(siblings) - 1 - siblings.index(ad))


# ----- ours -> PEFT ---------------------------------------------------------------------------------------
def to_peft(adapters: dict, table: Table, stack_kinds, num_experts: int, *, shared: bool = False,
            layout: str = "per-expert", weights: dict | None = None) -> dict[str, np.ndarray]:
    """Our adapters (the trainer's params under LoRA, host arrays; ``shared``: one adapter for
    all experts of a layer) -> PEFT's tensors by name. ``weights``: the base's weights (anything
    with ``.shape``, our tree), which give the per-expert layout's zero adapters their shapes."""
    out: dict[str, np.ndarray] = {}
    for i, (kind, layers) in enumerate(stack_kinds):
        stack = adapters["layers"].get(i, {})
        found = adapters_of(table, stack, kind)
        for ad in found:
            lora = _get(stack, ad.path)
            for l, layer in enumerate(layers):
                a, b = np.asarray(lora["a"][l]), np.asarray(lora["b"][l])
                if ad.expert and layout == "fused":
                    module = _module(table, layer, _fused_module(ad, found))
                    out[f"{module}.lora_A.weight"], out[f"{module}.lora_B.weight"] = \
                        _fused_expert(a, b, num_experts, shared)
                    continue
                for e in range(num_experts) if ad.expert else (None,):
                    ae, be = (a, b) if e is None or shared else (a[e], b[e])
                    for t, (pa, pb) in zip(ad.targets, _linear(ae, be, len(ad.targets))):
                        module = _module(table, layer, t.peft, e)
                        _unclaimed(out, module, t)
                        out[f"{module}.lora_A.weight"], out[f"{module}.lora_B.weight"] = pa, pb
        zero = zero_targets(table, stack, kind) if layout == "per-expert" else []
        if zero:
            if weights is None:
                raise ValueError("to_peft: a per-expert export with unadapted expert weights needs the base's weights")
            rank = np.shape(_get(stack, found[0].path)["a"])[-1]
            out |= _zeros(table, zero, layers, num_experts, rank, weights["layers"][i])
    return out


def _unclaimed(out: dict, module: str, target: LoRATarget) -> None:
    """Refuse a second adapter on one PEFT module: an HF projection that fuses weights we adapt
    separately (a gated DeltaNet's ``in_proj_qkv``: q, k and v, each its own A) has no PEFT form,
    and writing both would keep only the last."""
    if f"{module}.lora_A.weight" in out:
        raise CheckpointError(
            f"--save-peft: {module} is one HF module for several adapted weights ({target.module}, adapters "
            f"{target.adapter} and others, each with its own A), which a PEFT adapter cannot hold; write the merged "
            f"model with --save-hf instead, or leave {target.module} out of --lora-target-modules")


def _linear(a, b, parts: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """(A [R, in], B [out, R]) of each part of our ``a [in..., R]``, ``b [R, (parts,) out...]``: one A."""
    r = b.shape[0]
    a_RI = np.ascontiguousarray(a.reshape(-1, r).T)
    if parts == 1:
        return [(a_RI, np.ascontiguousarray(b.reshape(r, -1).T))]
    return [(a_RI, np.ascontiguousarray(b[:, j].reshape(r, -1).T)) for j in range(parts)]


def _fused_expert(a, b, num_experts: int, shared: bool) -> tuple[np.ndarray, np.ndarray]:
    if shared:  # the same adapter for every expert
        a, b = np.broadcast_to(a, (num_experts, *a.shape)), np.broadcast_to(b, (num_experts, *b.shape))
    e, d, r = a.shape
    b_ERO = b.reshape(e, r, -1)
    return (np.ascontiguousarray(a.transpose(0, 2, 1).reshape(e * r, d)),
            np.ascontiguousarray(b_ERO.transpose(2, 1, 0).reshape(-1, r * e)))


def _zeros(table: Table, rows, layers: tuple[int, ...], num_experts: int, rank: int,
           weights: dict) -> dict[str, np.ndarray]:
    """Exact zero adapters at ``rank`` for the expert weights of ``rows`` in a stack (``weights``: its base's)."""
    out = {}
    for row in rows:
        shape = tuple(_get(weights, row.path).shape[2:])  # [L, E, in..., out...]: one expert's
        n_in = row.hf[0].codec.n_in if row.hf and isinstance(row.hf[0].codec, Linear) else 1
        fan_in, fan_out = math.prod(shape[:n_in]), math.prod(shape[n_in:])
        for layer in layers:
            for e in range(num_experts):
                module = _module(table, layer, row.lora.peft, e)
                out[f"{module}.lora_A.weight"] = np.zeros((rank, fan_in), np.float32)
                out[f"{module}.lora_B.weight"] = np.zeros((fan_out, rank), np.float32)
    return out


# ----- PEFT -> ours ---------------------------------------------------------------------------------------
def expert_modules(table: Table) -> re.Pattern:
    """PEFT's per-expert module names of the table's expert weights, in any layer, any expert."""
    names = [PREFIX + table.hf_layers + r.lora.peft for r in table.rows if r.lora is not None and r.lora.expert]
    return re.compile("|".join(re.escape(n).replace(r"\{l\}", r"\d+").replace(r"\{e\}", r"\d+") for n in names)
                      or "(?!)")


def layout_of(config: dict, names, table: Table, where: str) -> str:
    """The layout of an adapter directory's routed experts: ``fused`` when its config lists
    ``target_parameters``, else ``per-expert`` (also what an adapter without expert modules is)."""
    fused = bool(config.get("target_parameters"))
    per_expert = expert_modules(table)
    if fused and any(per_expert.match(n) for n in names):
        raise CheckpointError(f"{where}: holds per-expert adapters (mlp.experts.<e>.*) and its adapter_config.json "
                              "lists target_parameters (the fused layout): one layout per directory")
    return "fused" if fused else "per-expert"


class _Taker:
    """Reads PEFT's tensors by name, each checked for shape; what it never took is unread."""

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

    def check_all_read(self, table: Table) -> None:
        """Every tensor taken, but for the zero adapters a per-expert export gives the expert
        weights the run did not adapt (counted in the log)."""
        unread = set(self.tensors) - self.used
        experts = expert_modules(table)
        zeros = {n for n in unread if experts.match(n) and not np.any(np.asarray(self.tensors[n]))}
        if zeros:
            log.info(f"{self.where}: {len(zeros)} zero tensors of expert weights this run does not adapt (the "
                     "per-expert layout's fill for vLLM) skipped")
        complete.check(self.where, unread=unread - zeros,
                       hint="; this run's --lora-target-modules do not adapt it: give the targets the adapter was "
                            "trained with")


def from_peft(tensors: dict[str, np.ndarray], like: dict, table: Table, stack_kinds, num_experts: int, where: str,
              *, shared: bool = False, layout: str = "per-expert") -> dict:
    """PEFT's tensors -> our adapters shaped like ``like`` (the trainer's adapter shapes): every
    adapter ``like`` has must be there with its shape, and nothing else may be (but zeros)."""
    take = _Taker(tensors, where)
    out: dict = {"layers": {}}
    for i, (kind, layers) in enumerate(stack_kinds):
        stack_like, stack = like["layers"][i], {}
        found = adapters_of(table, stack_like, kind)
        for ad in found:
            lora = _get(stack_like, ad.path)
            a_shape, b_shape = tuple(lora["a"].shape[1:]), tuple(lora["b"].shape[1:])
            pairs = []
            for layer in layers:
                if ad.expert and layout == "fused":
                    module = _module(table, layer, _fused_module(ad, found))
                    pairs.append(_fused_from_peft(take, module, a_shape, b_shape, num_experts, shared))
                elif ad.expert:
                    pairs.append(_experts_from_peft(take, table, layer, ad, a_shape, b_shape, num_experts, shared))
                else:
                    pairs.append(_modules_from_peft(take, [_module(table, layer, t.peft) for t in ad.targets],
                                                    a_shape, b_shape))
            stack.setdefault(ad.path[0], {})[ad.path[1]] = {"a": np.stack([p[0] for p in pairs]),
                                                            "b": np.stack([p[1] for p in pairs])}
        out["layers"][i] = stack
    take.check_all_read(table)
    return out


def _modules_from_peft(take, modules: list[str], a_shape, b_shape):
    """Our (a, b) of one adapter (one layer, one expert) from its modules' tensors, one per part:
    the parts share our one A, so theirs must be equal."""
    r, parts = a_shape[-1], len(modules)
    fan_in, fan_out = math.prod(a_shape[:-1]), math.prod(b_shape[1:]) // parts
    a = [take(f"{m}.lora_A.weight", (r, fan_in)) for m in modules]
    if any(not np.array_equal(a[0], x) for x in a[1:]):
        raise CheckpointError(f"{take.where}: {modules[0]} and {modules[1]} have different lora_A tensors; this "
                              "model's adapter of them shares one A (an export of ours), so it cannot hold them")
    b = [take(f"{m}.lora_B.weight", (fan_out, r)).T for m in modules]
    return a[0].T.reshape(a_shape), (b[0] if parts == 1 else np.stack(b, axis=1)).reshape(b_shape)


def _experts_from_peft(take, table: Table, layer: int, ad: _Adapter, a_shape, b_shape, num_experts: int,
                       shared: bool):
    """Our (a, b) of one layer's expert adapter from every expert's modules; a shared one's must
    be the same for every expert."""
    one = (lambda s: s) if shared else (lambda s: s[1:])
    pairs = [_modules_from_peft(take, [_module(table, layer, t.peft, e) for t in ad.targets],
                                one(a_shape), one(b_shape)) for e in range(num_experts)]
    a, b = np.stack([p[0] for p in pairs]), np.stack([p[1] for p in pairs])
    return _one_for_all(take.where, a, b) if shared else (a, b)


def _fused_from_peft(take, module: str, a_shape, b_shape, num_experts: int, shared: bool):
    e, (d, r) = num_experts, a_shape[-2:]
    o = math.prod(b_shape[1:] if shared else b_shape[2:])
    a = take(f"{module}.lora_A.weight", (e * r, d)).reshape(e, r, d).transpose(0, 2, 1)
    b = take(f"{module}.lora_B.weight", (o, r * e)).reshape(o, r, e).transpose(2, 1, 0)
    if shared:
        a, b = _one_for_all(take.where, a, b)
    return a, b.reshape(b_shape)


def _one_for_all(where: str, a, b):
    """The one adapter of every expert (``a``/``b`` with a leading expert axis), or an error."""
    if not (np.all(a == a[:1]) and np.all(b == b[:1])):
        raise CheckpointError(f"{where} holds a different adapter per expert; load it with --lora-expert-adapters "
                              "per-expert")
    return a[0], b[0]
