"""Writing our weights as a Megatron legacy ``torch`` checkpoint, in any TP / PP / EP / ETP layout.

One ``mp_rank_TT[_PPP][_EEE]/model_optim_rng.pt`` per model-parallel rank, named and laid out
as Megatron-LM writes them (see :mod:`~mlir_train.checkpoint.megatron.read`), with
Megatron's local-spec names (``local_experts.<j>``) and the vocabulary padded back to
``--make-vocab-size-divisible-by`` x TP. The layout is :class:`sharding.layout.Layout`, the
project's one layout type (its tensor, pipeline, expert and expert-tensor sizes).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from mlir_train import families
from mlir_train.checkpoint import complete, integrity
from mlir_train.checkpoint.megatron import ranks
from mlir_train.checkpoint.megatron.load import leaves
from mlir_train.checkpoint.megatron.find import TRACKER
from mlir_train.checkpoint.megatron.read import MegatronCheckpointError, import_torch
from mlir_train.config.sections import padded_vocab_size
from mlir_train.config.models import ModelConfig
from mlir_train.families.table import VOCAB, Param, Table
from mlir_train.model.periods import layer_stacks

if TYPE_CHECKING:
    from sharding.layout import Layout


def save_params(params: dict, cfg: ModelConfig, dst: str, layout: Layout, *, make_vocab_size_divisible_by: int = 128,
                iteration: int | None = None, dtype: str | None = None) -> list[str]:
    """Our parameters (a tree like ``nnx.to_pure_dict`` of the model, any sharding) as a Megatron
    legacy checkpoint in ``layout`` (:func:`save_legacy`), read to the host one layer (one
    expert) at a time; ``dtype``: torch's name of the files' dtype (default float32)."""
    import jax

    stacks = layer_stacks(cfg)  # each kind's layers, as the model builds them
    flat = dict(leaves(params))
    for bound in families.family_of(cfg).params.bind(flat, stacks, f"{dst}: "):
        if bound.row.megatron is None:
            complete.drop(dst, bound.name, bound.row.state, jax.device_get(flat[bound.path]), "Megatron",
                          MegatronCheckpointError)

    def leaf_of(tree, path):
        for part in path:
            tree = tree[part]
        return tree

    def layer_array(path, l: int, e: int | None):
        si = next(i for i, s in enumerate(stacks) if l in s.layers)
        x = leaf_of(params["layers"][si], path)[stacks[si].layers.index(l)]
        return np.asarray(jax.device_get(x if e is None else x[e]), np.float32)

    def global_array(path):
        return np.asarray(jax.device_get(leaf_of(params, path)), np.float32)

    return save_legacy(layer_array, global_array, cfg, dst, layout, iteration=iteration,
                       dtype=None if dtype is None else getattr(import_torch(), dtype),
                       make_vocab_size_divisible_by=make_vocab_size_divisible_by)


def megatron_args(cfg: ModelConfig, layout: Layout, padded: int, *,
                  make_vocab_size_divisible_by: int = 128) -> dict[str, Any]:
    """The Megatron arguments a loader of the written checkpoint reads (names as Megatron-LM's):
    the model's (its family's mapping), then the vocabulary padding and the layout."""
    return families.family_of(cfg).to_megatron(cfg) | dict(
        padded_vocab_size=padded, vocab_size=cfg.vocab_size, make_vocab_size_divisible_by=make_vocab_size_divisible_by,
        tensor_model_parallel_size=layout.tensor, pipeline_model_parallel_size=layout.pipeline,
        expert_model_parallel_size=layout.expert, expert_tensor_parallel_size=layout.etp,
        virtual_pipeline_model_parallel_size=None, context_parallel_size=1, ckpt_format="torch",
        transformer_impl="local", moe_grouped_gemm=False, bf16=False, fp16=False,
    )


def save_legacy(layer_array, global_array, cfg: ModelConfig, dst: str, layout: Layout, *,
                make_vocab_size_divisible_by: int = 128, iteration: int | None = None, dtype=None) -> list[str]:
    """Write ``cfg``'s weights as a Megatron legacy ``torch`` checkpoint in ``layout`` under ``dst``
    (``release`` unless ``iteration``). ``layer_array(path, l, e)`` / ``global_array(path)`` give
    our arrays (by a table row's path) for one layer (expert) / global parameter on the host. Files are written one at a time, each from only the layers and experts it holds,
    with Megatron's local-spec names (``local_experts.<j>``). Returns the files written."""
    import argparse

    torch = import_torch()
    _check_layout(cfg, layout)
    padded = padded_vocab_size(cfg.vocab_size, make_vocab_size_divisible_by, layout.tensor)
    torch_dtype = dtype or torch.float32
    writer = _RankWriter(layer_array, global_array, families.family_of(cfg).params, cfg, layout, padded,
                         lambda a: torch.from_numpy(np.array(a, dtype=np.float32)).to(torch_dtype))
    sub = "release" if iteration is None else f"iter_{iteration:07d}"
    args = megatron_args(cfg, layout, padded, make_vocab_size_divisible_by=make_vocab_size_divisible_by)
    ns = argparse.Namespace(**args, iteration=iteration or 0)
    written = []
    for p in range(layout.pipeline):
        for t in range(layout.tensor):
            for e_rank in range(layout.expert):
                sd = writer.state_dict(p, t, e_rank)
                path = os.path.join(dst, sub, _rank_dir(layout, t, p, e_rank), "model_optim_rng.pt")
                os.makedirs(os.path.dirname(path), exist_ok=True)
                torch.save({"args": ns, "checkpoint_version": 3.0, "iteration": iteration or 0, "model": sd}, path)
                written.append(path)
                del sd  # one file's tensors in memory at a time
    # Megatron records no checksums; ours beside the rank directories (Megatron ignores the file)
    # let our reader tell a flipped bit from a good export.
    integrity.write_manifest(os.path.join(dst, sub))
    with open(os.path.join(dst, TRACKER), "w") as f:
        f.write("release" if iteration is None else str(iteration))
    return written


def _check_layout(cfg: ModelConfig, layout: Layout) -> None:
    """Refuse a layout the model's sizes or the legacy format cannot take, naming the flag."""
    tp, pp, ep, etp = layout.tensor, layout.pipeline, layout.expert, layout.etp
    e_all, l_all = cfg.num_experts, cfg.num_layers
    if cfg.num_kv_heads % tp or cfg.num_heads % tp:
        raise MegatronCheckpointError(f"--tensor-model-parallel-size {tp} does not divide the {cfg.num_kv_heads} "
                                      f"query groups / {cfg.num_heads} heads")
    if l_all % pp:
        raise MegatronCheckpointError(f"--pipeline-model-parallel-size {pp} does not divide {l_all} layers")
    if cfg.is_moe and (e_all % ep or cfg.moe_intermediate_size % etp):
        raise MegatronCheckpointError(f"--expert-model-parallel-size {ep} / --expert-tensor-parallel-size {etp} do "
                                      f"not divide {e_all} experts of width {cfg.moe_intermediate_size}")
    if not cfg.is_moe and ep > 1:
        raise MegatronCheckpointError("--expert-model-parallel-size > 1 for a dense model")
    if etp > tp or tp % etp:
        raise MegatronCheckpointError(f"--expert-tensor-parallel-size {etp} must divide "
                                      f"--tensor-model-parallel-size {tp} in the legacy format (files are named by "
                                      "the dense TP rank)")
    if cfg.tie_word_embeddings and pp > 1:
        raise MegatronCheckpointError("tied embeddings with --pipeline-model-parallel-size > 1 are not written "
                                      "(Megatron keeps a second copy on the last stage); use PP 1")


def _rank_dir(layout: Layout, t: int, p: int, e_rank: int) -> str:
    """``mp_rank_TT[_PPP][_EEE]``, as Megatron-LM's ``get_checkpoint_name``."""
    return (f"mp_rank_{t:02d}" + (f"_{p:03d}" if layout.pipeline > 1 else "")
            + (f"_{e_rank:03d}" if layout.expert > 1 else ""))


@dataclasses.dataclass(frozen=True)
class _RankWriter:
    """The ``model`` state dict of one legacy rank file, built from our host arrays by the
    family's parameter table: each Megatron tensor joined from the parameters it holds, the
    rank's piece of it (:mod:`~mlir_train.checkpoint.megatron.ranks`) under its first (local
    spec) spelling, routed experts under SequentialMLP's ``local_experts.<j>``."""

    layer_array: Callable[[tuple[str, ...], int, int | None], np.ndarray]  # (path in a layer, layer, expert)
    global_array: Callable[[tuple[str, ...]], np.ndarray]
    table: Table
    cfg: ModelConfig
    layout: Layout
    padded: int                                # the padded vocabulary
    to_torch: Callable[[np.ndarray], Any]      # to a torch tensor of the export dtype

    def _groups(self, kind) -> list[Param]:
        """One row per Megatron tensor of a layer of ``kind`` (None: global): its first part's."""
        rows = [r for r in self.table.layer_rows(kind) if r.megatron is not None and r.megatron.part == 0]
        return [r for r in rows if kind is not None or not (self.cfg.tie_word_embeddings and r.tied_to)]

    def _tensor(self, row: Param, kind, l: int | None, e: int | None) -> np.ndarray:
        mt = row.megatron
        ours = (lambda path: self.global_array(path)) if l is None else (lambda path: self.layer_array(path, l, e))
        w = mt.codec.join([ours(r.path) for r in self.table.parts(row, mt, kind, "megatron")])
        if mt.split == VOCAB and self.padded > w.shape[0]:  # Megatron pads with zero rows, never used
            w = np.concatenate([w, np.zeros((self.padded - w.shape[0], *w.shape[1:]), w.dtype)])
        return w

    def state_dict(self, p: int, t: int, e_rank: int) -> dict[str, Any]:
        """Pipeline rank ``p``, tensor rank ``t``, expert rank ``e_rank``'s tensors, local names."""
        tp, last = self.layout.tensor, self.layout.pipeline - 1
        sd: dict[str, Any] = {}
        for row in self._groups(None):
            if p == (0 if row.megatron.stage == "first" else last):
                _put(sd, row.megatron.name, row.megatron,
                     self.to_torch(ranks.piece(self._tensor(row, None, None, None), row.megatron.split, t, tp)))
        per_stage = self.cfg.num_layers // self.layout.pipeline
        kinds = self.cfg.layer_kinds()
        for i in range(per_stage):
            l = p * per_stage + i
            for row in self._groups(kinds[l]):
                sd.update(self._layer(row, kinds[l], l, f"{self.table.megatron_layers}{i}.", t, e_rank))
        return sd

    def _layer(self, row: Param, kind, l: int, pre: str, t: int, e_rank: int) -> dict[str, Any]:
        mt, sd = row.megatron, {}
        if mt.experts is None:
            _put(sd, pre + mt.name, mt, self.to_torch(ranks.piece(self._tensor(row, kind, l, None), mt.split, t,
                                                                  self.layout.tensor)))
            return sd
        etp = self.layout.etp
        x = t % etp  # the file of dense TP rank t holds expert-tensor rank t % ETP
        local_e = self.cfg.num_experts // self.layout.expert
        for j in range(local_e):
            w = ranks.piece(self._tensor(row, kind, l, e_rank * local_e + j), mt.split, x, etp)
            _put(sd, pre + mt.experts.sequential.format(j=j), mt, self.to_torch(w))
        return sd


def _put(sd: dict[str, Any], name: str, mt, value) -> None:
    sd[name] = value
    if mt.linear:  # Megatron's linear layers keep an (empty) extra state; strict loads expect the keys
        sd[name[: -len("weight")] + "_extra_state"] = None
