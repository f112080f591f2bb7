"""Megatron's tensors laid into our parameters, for any layout it was saved in.

:func:`load_params` binds every parameter of the model to its row of the family's parameter
table (:mod:`mlir_train.families.table`), checks that the checkpoint holds every row's tensor
and that every tensor of its files is one a row reads (:mod:`mlir_train.checkpoint.complete`),
then builds each parameter with ``jax.make_array_from_callback`` in the run's own shardings
(:mod:`mlir_train.checkpoint.shards`): the callback reads only the layers (and experts) of the
shard asked for, from memory-mapped legacy files (only the TP pieces of that layer) or as DCP
reads of that layer's region (:mod:`~mlir_train.checkpoint.megatron.source`). No host holds the
whole model. A row's codec splits Megatron's tensor into our parameters (the fused attention input
projection by query groups, the fused first MLP layer into gate and up); the vocabulary padding Megatron adds
(``--make-vocab-size-divisible-by`` x TP) is stripped to the model's vocabulary;
:func:`~mlir_train.checkpoint.megatron.save.save_legacy` adds it back. The layouts are matched
numerically against megatron-core in ``tests/checkpoint/test_megatron_checkpoint.py`` (Qwen3) and
``tests/checkpoint/test_megatron_qwen3_5.py`` (Qwen3.5 / Qwen3-Next, torch_dist).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from mlir_train import families
from mlir_train.checkpoint import complete, shards
from mlir_train.checkpoint.megatron.read import MegatronCheckpoint, MegatronCheckpointError
from mlir_train.checkpoint.megatron.source import EXPERT_STYLES, Source, expert_pattern, open_source
from mlir_train.config.models import ModelConfig
from mlir_train.families.table import EXPERT, VOCAB, Bound, Table
from mlir_train.model.periods import layer_stacks


# ----- what the checkpoint must hold, and nothing more --------------------------------------------------
def _names(table: Table, kind) -> set[str]:
    """The tensor names rows of ``kind`` (None: global) read: their spellings, legacy expert names as patterns."""
    out = set()
    for r in table.layer_rows(kind):
        if r.megatron is not None:
            out |= set(r.megatron.names)
            if r.megatron.experts is not None:
                out |= {getattr(r.megatron.experts, s) for s in EXPERT_STYLES}
    return out


def _read_by(names: set[str], name: str) -> bool:
    return name in names or any("{j}" in n and expert_pattern(n).match(name) for n in names)


def check_complete(source: Source, table: Table, cfg: ModelConfig) -> None:
    """Every tensor of the checkpoint is read by a parameter of ``cfg``'s model (a row of its
    layer's kind, or a global row; a tied model's file may carry the LM head's copy), else an
    error naming it."""
    kinds = cfg.layer_kinds()
    per_kind = {k: _names(table, k) for k in set(kinds)}
    every_kind = set().union(*per_kind.values())
    unread = {}
    for where, layer, name, shape in source.tensors():
        known = (_names(table, None) if layer is None else every_kind if layer == "stacked"
                 else per_kind[kinds[layer]] if layer < len(kinds) else set())
        if not _read_by(known, name):
            full = (name if layer is None else table.megatron_layers + name if layer == "stacked"
                    else f"{table.megatron_layers}{layer}.{name}")
            why = next((why for part, why in table.megatron_refused.items() if part in name), None)
            if why:
                raise MegatronCheckpointError(f"{source.ckpt.describe()}: tensor {full}: {why}")
            unread[full] = f"{shape} (in {where})"
    complete.check(source.ckpt.describe(), unread=unread, error=MegatronCheckpointError,
                   hint=f"; the {table.family} model of its args has no such parameter (biases, MTP layers and "
                        "other architectures' tensors are not read)")


# ----- our parameters from Megatron's tensors -------------------------------------------------------
def _ours_from(source: Source, bound: Bound, part_shapes, l: int | None, e: int | None, vocab: int) -> np.ndarray:
    """Our array of ``bound`` for global layer ``l`` (expert ``e``; None: a global parameter)."""
    mt = bound.row.megatron
    w = source.whole(mt) if l is None else source.layer(mt, l, e)
    if mt.split == VOCAB:
        if w.shape[0] < vocab:
            raise MegatronCheckpointError(f"{mt.name} has {w.shape[0]} rows (padded vocabulary), fewer than the "
                                          f"model's vocabulary {vocab}")
        w = w[:vocab]
    return mt.codec.split(w, part_shapes)[mt.part]


def leaves(params_shapes: dict, prefix=()) -> list[tuple[tuple, Any]]:
    out = []
    for k, v in params_shapes.items():
        if isinstance(v, dict):
            out += leaves(v, prefix + (k,))
        else:
            out.append((prefix + (k,), v))
    return out


def load_params(ckpt: MegatronCheckpoint, cfg: ModelConfig, param_shapes: dict, shardings: dict,
                *, dtype=np.float32) -> dict:
    """Our parameter tree (nested dicts like ``nnx.to_pure_dict`` of the model) read from
    ``ckpt``: each leaf a ``jax.Array`` in ``shardings`` (same tree), built shard by shard."""
    import jax

    table = families.family_of(cfg).params
    if cfg.mtp_num_layers:
        raise MegatronCheckpointError(
            f"{ckpt.describe()}: --mtp-num-layers {cfg.mtp_num_layers}: a Megatron checkpoint's MTP layers are not read "
            "here; convert it to HF (the head is mtp.* there) and --load that")
    if ckpt.format not in table.megatron_formats:
        raise MegatronCheckpointError(
            f"{ckpt.describe()}: the {ckpt.format} format is not read for {table.family} models ({cfg.name}), only "
            f"{' / '.join(table.megatron_formats)}; re-save it with --ckpt-format {table.megatron_formats[0]}")
    source = open_source(ckpt, table)
    check_complete(source, table, cfg)
    if getattr(source, "layer_at", None) is not None and len(source.layer_at) != cfg.num_layers:
        raise MegatronCheckpointError(f"{ckpt.describe()}: holds {len(source.layer_at)} layers, the model has "
                                      f"{cfg.num_layers}")
    shapes = {path: tuple(s.shape) for path, s in leaves(param_shapes)}
    flat_shardings = dict(leaves(shardings))
    out: dict = {}
    for bound in table.bind(shapes, layer_stacks(cfg), f"{ckpt.describe()}: "):
        if bound.row.megatron is None:
            callback = _missing(bound, ckpt, shapes[bound.path], dtype)
        else:
            callback = _callback(source, table, bound, shapes, cfg.vocab_size, dtype)
        arr = jax.make_array_from_callback(shapes[bound.path], flat_shardings[bound.path], callback)
        node = out
        for p in bound.path[:-1]:
            node = node.setdefault(p, {})
        node[bound.path[-1]] = arr
    return out


def _missing(bound: Bound, ckpt: MegatronCheckpoint, shape, dtype) -> shards.Callback:
    """Training state the format has no place for starts at zero; a weight without one is an error."""
    if not bound.row.state:
        complete.check(ckpt.describe(), unwritten=[bound.name], error=MegatronCheckpointError,
                       hint=" (its table row names no Megatron tensor)")
    return shards.whole_callback(lambda: np.zeros(shape, dtype), dtype)


def _check(arr: np.ndarray, want: tuple[int, ...], what: str, ckpt_dir: str) -> np.ndarray:
    if tuple(arr.shape) != tuple(want):
        raise MegatronCheckpointError(f"{ckpt_dir}: {what} has shape {tuple(arr.shape)} in our layout, the model "
                                      f"expects {tuple(want)}; does --model-name / its overrides match the checkpoint?")
    return arr


def _callback(source: Source, table: Table, bound: Bound, shapes: dict, vocab: int, dtype) -> shards.Callback:
    mt = bound.row.megatron
    lead = 0 if bound.first is None else 2 if bound.row.stacked == EXPERT else 1
    root = bound.root
    part_shapes = tuple(shapes[root + r.path][lead:] for r in table.parts(bound.row, mt, bound.kind, "megatron"))
    per = shapes[bound.path][lead:]
    directory = source.ckpt.directory
    if bound.first is None:
        read = lambda: _check(_ours_from(source, bound, part_shapes, None, None, vocab), per,
                              f"{bound.name} (from {mt.name})", directory)
        return shards.whole_callback(read, dtype)

    def one(l: int, e: int | None) -> np.ndarray:
        what = (f"layer {bound.layers[l]}" + (f" expert {e}" if e is not None else "")
                + f" {bound.name} (from {table.megatron_layers}{bound.layers[l]}.{mt.name})")
        try:
            arr = _ours_from(source, bound, part_shapes, bound.layers[l], e, vocab)
        except ValueError as err:  # e.g. a reshape of a tensor of another shape than the config's
            if isinstance(err, MegatronCheckpointError):
                raise
            raise MegatronCheckpointError(f"{directory}: {what}: {err}; does the model config (--model-name / "
                                          "overrides / the checkpoint's args) match its tensors?") from err
        return _check(arr, per, what, directory)

    return shards.stacked_callback(shapes[bound.path], one, dtype, experts=lead == 2, cache=16)
