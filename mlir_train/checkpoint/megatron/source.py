"""A Megatron checkpoint as Megatron's *global* per-layer tensors, whatever layout wrote it.

The legacy format's per-rank shards (layer indices local to the stage and chunk, experts local
to the EP rank, each tensor split over TP as the family's table says) are assembled
(:mod:`~mlir_train.checkpoint.megatron.ranks`); torch_dist's global tensors (layers stacked on a
leading axis, experts on a second) are read by region. Which tensor is asked for is a row's
:class:`~mlir_train.families.table.Megatron` entry: its spellings (local spec, TE), its split,
its legacy expert names (SequentialMLP, TE grouped GEMM, legacy GroupedMLP). Global expert ``e``
is local expert ``e % L`` of EP rank ``e // L``.
"""

from __future__ import annotations

import functools
import os
import re

import numpy as np

from mlir_train.checkpoint.megatron import ranks
from mlir_train.checkpoint.megatron.read import (
    RANK_DIR, DistReader, MegatronCheckpoint, MegatronCheckpointError, import_torch, listing, torch_load)
from mlir_train.families.table import ROW, Megatron, Table

# Never weights: TE's extra state, RoPE's cached frequencies.
IGNORED = re.compile(r"(^|\.)_extra_state(/.*)?$|\.inv_freq$")
EXPERT_STYLES = ("sequential", "te", "grouped")


def expert_pattern(name: str) -> re.Pattern:
    """A legacy expert name (``{j}`` the local expert) as a regex capturing ``j``."""
    return re.compile("^" + re.escape(name).replace(re.escape("{j}"), r"(\d+)") + "$")


class Source:
    """Global per-layer tensors by a row's Megatron entry (see the module docstring)."""

    ckpt: MegatronCheckpoint
    table: Table

    def layer(self, mt: Megatron, l: int, e: int | None = None) -> np.ndarray:  # pragma: no cover - interface
        raise NotImplementedError

    def whole(self, mt: Megatron) -> np.ndarray:  # pragma: no cover - interface
        raise NotImplementedError

    def has(self, name: str) -> bool:  # pragma: no cover - interface
        """Whether the checkpoint holds the global tensor ``name``."""
        raise NotImplementedError


class LegacySource(Source):
    """Per-rank ``model_optim_rng.pt`` files, memory-mapped, assembled into global per-layer tensors."""

    def __init__(self, ckpt: MegatronCheckpoint, table: Table):
        self.ckpt, self.table = ckpt, table
        self.layer_key = re.compile("^" + re.escape(table.megatron_layers) + r"(\d+)\.(.+)$")
        self.files = self._files(ckpt)
        self.tp, self.pp, self.ep = (1 + max(k[i] for k in self.files) for i in range(3))
        self._check_ranks(ckpt.args)
        self._open = functools.lru_cache(maxsize=None)(lambda key: torch_load(self.files[key]))
        self._experts_in = functools.lru_cache(maxsize=None)(self._scan_experts)  # one key scan per layer
        sd = self._open(next(iter(sorted(self.files))))
        self.chunk_keys = sorted((k for k in sd if re.fullmatch(r"model\d*", k)), key=lambda k: int(k[5:] or 0))
        if not self.chunk_keys:
            raise MegatronCheckpointError(f"{self.files[min(self.files)]}: no 'model' state dict in it "
                                          f"(keys: {listing(list(sd))})")
        # Global layer order: chunk-major, then stage (Megatron's layer offsets, even or not).
        self.layer_at: list[tuple[int, int, int]] = []  # global layer -> (pp, chunk, local index)
        for c in range(len(self.chunk_keys)):
            for p in range(self.pp):
                model = self.model(self.any_file(p), c)
                local = sorted({int(m.group(1)) for k in model if (m := self.layer_key.match(k))})
                if local != list(range(len(local))):
                    raise MegatronCheckpointError(f"{self.files[self.any_file(p)]}: local layer indices {local}")
                self.layer_at += [(p, c, i) for i in local]

    @staticmethod
    def _files(ckpt: MegatronCheckpoint) -> dict[tuple[int, int, int], str]:
        """(TP, PP, EP rank) -> file; ``mp_rank_TT_XXX`` is TT + PP rank with PP > 1, else TT + EP
        rank (Megatron-LM's get_checkpoint_name)."""
        files = {}
        for n in os.listdir(ckpt.directory):
            m = RANK_DIR.match(n)
            if not m:
                continue
            f = os.path.join(ckpt.directory, n, "model_optim_rng.pt")
            if not os.path.exists(f):
                raise MegatronCheckpointError(f"{ckpt.directory}/{n}: no model_optim_rng.pt in it")
            tp, a, b = int(m.group(1)), m.group(2), m.group(3)
            pp_size_hint = int(ckpt.args.get("pipeline_model_parallel_size") or (2 if b is not None else 1))
            if b is not None:
                files[(tp, int(a), int(b))] = f
            elif a is not None:
                files[(tp, int(a), 0) if pp_size_hint > 1 else (tp, 0, int(a))] = f
            else:
                files[(tp, 0, 0)] = f
        return files

    def _check_ranks(self, a: dict) -> None:
        directory = self.ckpt.directory
        for name, have in (("tensor_model_parallel_size", self.tp), ("pipeline_model_parallel_size", self.pp),
                           ("expert_model_parallel_size", self.ep)):
            if a.get(name) and int(a[name]) != have:
                raise MegatronCheckpointError(f"{directory}: args say {name}={a[name]} but the mp_rank_* "
                                              f"directories there span {have}; incomplete copy?")
        self.etp = int(a.get("expert_tensor_parallel_size") or self.tp)
        if self.etp > self.tp or self.tp % self.etp:
            raise MegatronCheckpointError(
                f"{directory}: expert_tensor_parallel_size {self.etp} with TP {self.tp} "
                "(--expert-tensor-parallel-size must divide --tensor-model-parallel-size here): the legacy format "
                "names files by the dense TP rank (Megatron's get_checkpoint_name), so expert-tensor ranks beyond it "
                "would share one file; a torch_dist checkpoint (--ckpt-format torch_dist) holds any layout")
        for t in range(self.tp):
            for p in range(self.pp):
                if not any((t, p, e) in self.files for e in range(self.ep)):
                    raise MegatronCheckpointError(f"{directory}: no file for tensor rank {t}, pipeline rank {p}")

    def any_file(self, p: int, t: int = 0, e: int | None = None) -> tuple[int, int, int]:
        for ee in ([e] if e is not None else range(self.ep)):
            if (t, p, ee) in self.files:
                return (t, p, ee)
        raise MegatronCheckpointError(f"{self.ckpt.directory}: no file for tensor rank {t}, pipeline rank {p}"
                                      + (f", expert rank {e}" if e is not None else ""))

    def model(self, key: tuple[int, int, int], c: int) -> dict:
        sd = self._open(key)
        ck = self.chunk_keys[c]
        if ck not in sd:
            raise MegatronCheckpointError(f"{self.files[key]}: no '{ck}' in it")
        return sd[ck]

    def _tensor(self, key: tuple[int, int, int], c: int, name: str, what: str) -> np.ndarray:
        model = self.model(key, c)
        if name not in model:
            raise MegatronCheckpointError(f"{self.files[key]}: missing {name} ({what})")
        t = model[name]
        torch = import_torch()
        return t.detach().float().numpy() if t.dtype.is_floating_point and t.dtype not in (
            torch.float32, torch.float64) else t.detach().numpy()

    def _layer_name(self, key, c, i: int, mt: Megatron) -> str:
        model = self.model(key, c)
        for suffix in mt.names:
            if f"{self.table.megatron_layers}{i}.{suffix}" in model:
                return f"{self.table.megatron_layers}{i}.{suffix}"
        raise MegatronCheckpointError(f"{self.files[key]}: missing {self.table.megatron_layers}{i}.{mt.name}")

    def layer(self, mt: Megatron, l: int, e: int | None = None) -> np.ndarray:
        if l >= len(self.layer_at):
            raise MegatronCheckpointError(f"{self.ckpt.directory}: has {len(self.layer_at)} layers, layer {l} asked for")
        p, c, i = self.layer_at[l]
        if mt.experts is not None:
            return self._expert(mt, p, c, i, e)
        key = lambda t: self.any_file(p, t)
        return ranks.assemble([self._tensor(key(t), c, self._layer_name(key(t), c, i, mt), mt.name)
                               for t in ranks.pieces_of(mt.split, self.tp)], mt.split)

    def _scan_experts(self, key, c: int, i: int) -> tuple[str, int]:
        """How layer ``i`` stores its local experts (:data:`EXPERT_STYLES`) and how many it holds."""
        prefix = f"{self.table.megatron_layers}{i}."
        rest = [k[len(prefix):] for k in self.model(key, c) if k.startswith(prefix)]
        for row in self.table.rows:
            names = row.megatron.experts if row.megatron is not None else None
            if names is None:
                continue
            for style in EXPERT_STYLES:
                pattern = expert_pattern(getattr(names, style))
                ids = {m.group(1) if pattern.groups else "" for k in rest if (m := pattern.match(k))}
                if ids and style == "grouped":
                    num = self.ckpt.args.get("num_experts")
                    if not num:
                        raise MegatronCheckpointError(f"{self.files[key]}: GroupedMLP weights need num_experts in args")
                    return style, int(num) // self.ep
                if ids:
                    return style, len(ids)
        raise MegatronCheckpointError(f"{self.files[key]}: layer {i} has no expert weights")

    def _expert(self, mt: Megatron, p: int, c: int, i: int, e: int) -> np.ndarray:
        style, local = self._experts_in(self.any_file(p), c, i)
        ep_rank, j = divmod(e, local)
        name = f"{self.table.megatron_layers}{i}.{getattr(mt.experts, style).format(j=j)}"
        pieces = []
        for x in range(self.etp):
            t = next((t for t in range(x, self.tp, self.etp) if (t, p, ep_rank) in self.files), None)
            if t is None:
                raise MegatronCheckpointError(f"{self.ckpt.directory}: no file holds expert rank {ep_rank}'s "
                                              f"expert-tensor rank {x} (pipeline rank {p})")
            w = self._tensor((t, p, ep_rank), c, name, mt.name)
            if style == "grouped":  # all local experts, input-major: [D, L*out] (fc1) or [L*in, D] (fc2)
                d = int(self.ckpt.args["hidden_size"])
                w = w.reshape(local, -1, d)[j].T if mt.split == ROW else w.reshape(local, d, -1)[j].T
            pieces.append(w)
        return ranks.assemble(pieces, mt.split)

    def whole(self, mt: Megatron) -> np.ndarray:
        p, c = (0, 0) if mt.stage == "first" else (self.pp - 1, len(self.chunk_keys) - 1)
        return ranks.assemble([self._tensor(self.any_file(p, t), c, mt.name, mt.name)
                               for t in ranks.pieces_of(mt.split, self.tp)], mt.split)

    def has(self, name: str) -> bool:
        return name in self.model(self.any_file(self.pp - 1), len(self.chunk_keys) - 1)

    def tensors(self):
        """(file, global layer or None, name under the layer or the whole name, shape) of every
        tensor of every file; a nested state dict (pre-megatron-core models) is refused."""
        index = {(p, c, i): l for l, (p, c, i) in enumerate(self.layer_at)}
        for key in sorted(self.files):
            for c in range(len(self.chunk_keys)):
                for k, v in self.model(key, c).items():
                    if isinstance(v, dict):
                        raise MegatronCheckpointError(
                            f"{self.files[key]}: '{k}' is a nested state dict, as the pre-megatron-core (legacy "
                            "GPT model) format writes it; only megatron-core GPTModel checkpoints are read (convert "
                            "it with Megatron-LM's tools/checkpoint first)")
                    if IGNORED.search(k) or not hasattr(v, "shape"):
                        continue
                    m = self.layer_key.match(k)
                    layer = index.get((key[1], c, int(m.group(1)))) if m else None
                    yield self.files[key], layer, m.group(2) if m else k, tuple(v.shape)


class DistSource(Source):
    """Global tensors of a torch_dist checkpoint: layers stacked (``decoder.layers.<name>``
    ``[L, ...]``) or, when dense and MoE layers are mixed, one per layer
    (``decoder.layers.<i>.<name>``, as megatron-core writes heterogeneous blocks)."""

    def __init__(self, ckpt: MegatronCheckpoint, table: Table):
        self.ckpt, self.table = ckpt, table
        self.r = DistReader(ckpt.directory)
        self.keys = set(self.r.keys())
        self.prefix = "model." if any(k.startswith("model." + table.megatron_layers) for k in self.keys) else ""
        self._names: dict = {}

    def _has(self, name: str) -> bool:
        return name in self.keys or name + "_w" in self.keys

    def _name(self, mt: Megatron, l: int | None) -> tuple[str, bool]:
        """(checkpoint key, stacked over layers) of ``mt`` in layer ``l`` (None: global)."""
        if (mt, l) not in self._names:
            layers = self.table.megatron_layers
            found = None
            for c in mt.names:
                name = c if l is None else layers + c
                if self._has(self.prefix + name):
                    found = (self.prefix + name, l is not None)
                    break
                if l is not None and self._has(f"{self.prefix}{layers}{l}.{c}"):
                    found = (f"{self.prefix}{layers}{l}.{c}", False)
                    break
            if found is None:
                where = "" if l is None else f" (layer {l})"
                raise MegatronCheckpointError(f"{self.ckpt.directory}: no tensor "
                                              f"{mt.name if l is None else layers + mt.name}{where} in it")
            self._names[(mt, l)] = found
        return self._names[(mt, l)]

    def _read(self, name: str, index: tuple) -> np.ndarray:
        if name not in self.keys:  # gate and up stored apart (_w, _v)
            return np.concatenate([self.r.read(name + "_w", index), self.r.read(name + "_v", index)], axis=-2)
        return self.r.read(name, index)

    def layer(self, mt: Megatron, l: int, e: int | None = None) -> np.ndarray:
        name, stacked = self._name(mt, l)
        index = ((slice(l, l + 1),) if stacked else ()) + ((slice(e, e + 1),) if e is not None else ())
        out = self._read(name, index)
        return out.reshape(out.shape[len(index):])

    def whole(self, mt: Megatron) -> np.ndarray:
        return self._read(self._name(mt, None)[0], ())

    def has(self, name: str) -> bool:
        return self._has(self.prefix + name)

    def tensors(self):
        """(directory, layer or None, name under the layer or the whole name, shape) of every model
        tensor (stacked ones under layer None, their name under the layers)."""
        per_layer = re.compile("^" + re.escape(self.table.megatron_layers) + r"(\d+)\.(.+)$")
        for k in sorted(self.keys):
            if k.startswith(("optimizer", "rng_state", "rerun_state", "opt_param")) or IGNORED.search(k) \
                    or self.r.shape(k) is None:
                continue
            name = re.sub(r"_[wv]$", "", k[len(self.prefix):] if k.startswith(self.prefix) else k)
            m = per_layer.match(name)
            if m:
                yield self.ckpt.directory, int(m.group(1)), m.group(2), self.r.shape(k)
            elif name.startswith(self.table.megatron_layers):
                yield self.ckpt.directory, "stacked", name[len(self.table.megatron_layers):], self.r.shape(k)
            else:
                yield self.ckpt.directory, None, name, self.r.shape(k)


def open_source(ckpt: MegatronCheckpoint, table: Table) -> Source:
    return LegacySource(ckpt, table) if ckpt.format == "torch" else DistSource(ckpt, table)
