"""A family's parameter table: one row per parameter, saying where it lives in every format.

A row (:class:`Param`) names our parameter (its path in a decoder layer, or from the model's
root, and how it is stacked), the HF tensor(s) it is read from and written to, Megatron's tensor
with its tensor-parallel split, and the LoRA target it is (Megatron's module name for
``--lora-target-modules``, HF's module or expert parameter for PEFT, our adapter beside it). The
readers and writers in :mod:`mlir_train.checkpoint` spell no family's names: they walk the
family's :class:`Table`. A second family is a second table (and, where its tensors fuse our
parameters differently, a new :class:`Codec` in its own folder), not new checkpoint code.

An external tensor may hold several of our parameters (Megatron's ``linear_qkv`` is q, k and v;
HF's fused ``gate_up_proj`` gate and up): each row names the tensor with a :class:`Codec` that
splits it into its parts and joins them back, and its ``part``. A reader splits, a writer joins
the rows that share the tensor (:meth:`Table.parts`).

Shapes: our arrays are ``[in..., out...]`` per layer (per expert); torch's linear weights
``[out, in]``. Stacking (:data:`GLOBAL`, :data:`LAYER`, :data:`EXPERT`): one array, ``[L, ...]``
per stack of layers, ``[L, E, ...]``.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import functools
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Protocol

import numpy as np

from mlir_train.config.models import LayerKind
from mlir_train.config.policies import matches
from mlir_train.runtime.errors import CheckpointError

GLOBAL, LAYER, EXPERT = "global", "layer", "expert"
# How Megatron's tensor-parallel ranks (the experts': expert-tensor-parallel ranks) hold a tensor.
REPLICATED = "replicated"  # every rank the whole tensor (norms, the router)
COLUMN = "column"          # rows split in contiguous blocks (linear_qkv: whole query groups per rank)
ROW = "row"                # columns split (linear_proj, linear_fc2)
GLU = "glu"                # [gate; up] rows, each rank its block of each half, gate block first
VOCAB = "vocab"            # rows split, the vocabulary padded (--make-vocab-size-divisible-by x TP)
SPLITS = (REPLICATED, COLUMN, ROW, GLU, VOCAB)
Shape = tuple[int, ...]


# ----- transforms: our parameter(s) <-> one external tensor ---------------------------------------------
class Codec(Protocol):
    parts: int

    def split(self, ext: np.ndarray, shapes: Sequence[Shape]) -> tuple[np.ndarray, ...]:
        """The external tensor (one layer, one expert) as our parts of ``shapes``."""

    def join(self, parts: Sequence[np.ndarray]) -> np.ndarray:
        """Our parts as the external tensor."""


@dataclasses.dataclass(frozen=True)
class Same:
    """Stored as we hold it (norm scales, the embedding)."""

    parts = 1

    def split(self, ext, shapes):
        return (ext,)

    def join(self, parts):
        return parts[0]


@dataclasses.dataclass(frozen=True)
class Linear:
    """A torch linear weight ``[out, in]``; ours ``[in..., out...]`` with ``n_in`` input axes."""

    n_in: int = 1
    parts = 1

    def split(self, ext, shapes):
        return (np.ascontiguousarray(ext.T).reshape(shapes[0]),)

    def join(self, parts):
        w = parts[0]
        return np.ascontiguousarray(w.reshape(math.prod(w.shape[:self.n_in]), -1).T)


@dataclasses.dataclass(frozen=True)
class GateUp:
    """Gate and up projections as one ``[2F, D]`` tensor: all gate rows, then all up rows."""

    parts = 2

    def split(self, ext, shapes):
        f = shapes[0][-1]
        if ext.shape[0] != 2 * f:
            raise ValueError(f"{ext.shape[0]} rows, expected 2 x {f} (gate and up)")
        return np.ascontiguousarray(ext[:f].T), np.ascontiguousarray(ext[f:].T)

    def join(self, parts):
        return np.concatenate([p.T for p in parts])


@dataclasses.dataclass(frozen=True)
class QueryGroups:
    """Megatron's ``linear_qkv`` ``[K*(G+2)*H, D]`` from q ``[D, N, H]``, k and v ``[D, K, H]``:
    per query group, its G query heads, then its key head, then its value head."""

    parts = 3

    def split(self, ext, shapes):
        (d, n, h), (_, k, _) = shapes[0], shapes[1]
        g = n // k
        w = ext.reshape(k, g + 2, h, d)
        q = w[:, :g].reshape(k * g, h, d).transpose(2, 0, 1)
        return q, w[:, g].transpose(2, 0, 1), w[:, g + 1].transpose(2, 0, 1)

    def join(self, parts):
        q, k, v = parts
        d, n, h = q.shape
        groups = k.shape[1]
        return np.concatenate([q.transpose(1, 2, 0).reshape(groups, n // groups, h, d),
                               k.transpose(1, 2, 0)[:, None], v.transpose(1, 2, 0)[:, None]], axis=1).reshape(-1, d)


# ----- where a parameter lives in each format -------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Ext:
    """An HF tensor holding a row's parameter, or its ``part`` of a fused one. ``name``: under
    the table's HF layer prefix for layer rows; ``{e}`` an expert (no ``{e}`` in an expert row's
    name: the tensor holds every expert on a leading axis)."""

    name: str
    codec: Codec = Same()
    part: int = 0


@dataclasses.dataclass(frozen=True)
class LocalExperts:
    """An expert weight in Megatron's legacy files, by how the layer stores its local experts
    (``{j}``: the local expert): SequentialMLP, TE's grouped GEMM, the legacy GroupedMLP (all
    local experts in one tensor, input-major)."""

    sequential: str
    te: str
    grouped: str


@dataclasses.dataclass(frozen=True)
class Megatron:
    """A row's tensor in Megatron checkpoints. ``names``: the spellings (local spec first, which
    is what we write; TE's after), under ``decoder.layers.{i}.`` (legacy, local layer ``i``) or
    ``decoder.layers.`` (torch_dist, layers stacked) for layer rows; expert rows give torch_dist's
    names here and the legacy ones in ``experts``. ``split``: how the tensor-parallel ranks hold it
    (:data:`SPLITS`); ``linear``: a linear layer's weight, beside which Megatron keeps an
    ``_extra_state``; ``stage``: the pipeline stage holding a global tensor ("first" / "last")."""

    names: tuple[str, ...]
    codec: Codec = Same()
    part: int = 0
    split: str = REPLICATED
    linear: bool = False
    stage: str = ""
    experts: LocalExperts | None = None

    @property
    def name(self) -> str:
        return self.names[0]


@dataclasses.dataclass(frozen=True)
class LoRATarget:
    """The adapter of a row's weight. ``module``: Megatron's name (what ``--lora-target-modules``
    matches, short name its last component); ``adapter``: our adapter's name beside the weight;
    ``peft``: the HF module a PEFT adapter of the weight sits on, under the HF layer prefix, one per
    expert for a routed expert's weight (``{e}``): the layout serving engines read (vLLM's
    Qwen3-MoE LoRA takes routed experts only as ``mlp.experts.<e>.<proj>``). ``part``: the
    weight's slice of the adapter's B when one adapter updates several weights (the experts' fc1:
    gate 0, up 1, sharing one A). ``fused``: an expert weight's fused HF parameter, which PEFT's
    ``target_parameters`` adapts (the layout of transformers 5 + peft, ``--lora-export-format
    fused``)."""

    module: str
    peft: str
    adapter: str
    part: int = 0
    fused: str | None = None

    @property
    def expert(self) -> bool:
        """A routed expert's weight: one PEFT module per expert."""
        return "{e}" in self.peft

    @property
    def short(self) -> str:
        """PEFT's short name of the module (``target_modules``): its last component."""
        return self.peft.rsplit(".", 1)[-1]


@dataclasses.dataclass(frozen=True)
class Param:
    """One parameter of a family's model (module docstring). ``moe`` / ``mixer``: the layers it
    exists in (None: all). ``state``: training state, not a weight (the router's expert bias): a
    format with no place for it starts it at zero and leaves it out on save, saying so when it is
    not zero. ``tied_to``: the parameter it is absent for when the embeddings are tied (a file
    may still carry the copy)."""

    path: tuple[str, ...]
    stacked: str = LAYER
    hf: tuple[Ext, ...] = ()
    megatron: Megatron | None = None
    lora: LoRATarget | None = None
    moe: bool | None = None
    mixer: str | None = None
    state: bool = False
    tied_to: tuple[str, ...] | None = None

    def applies(self, kind: LayerKind | None) -> bool:
        """Whether the row is a parameter of a layer of ``kind`` (None: the model's root)."""
        if kind is None:
            return self.stacked == GLOBAL
        return self.stacked != GLOBAL and self.moe in (None, kind.moe) and self.mixer in (None, kind.mixer)


@dataclasses.dataclass(frozen=True)
class Bound:
    """A row bound to one parameter of a model: its full path (``("layers", i, ...)`` for a
    stack's), and the stack's layers (row ``i`` is layer ``layers[i]``) and kind (None for a
    global row)."""

    row: Param
    path: tuple
    layers: tuple[int, ...] | None = None
    kind: LayerKind | None = None
    root: tuple = ()              # the path of the module the row's path is under (a stack's, an MTP depth's)
    hf_layers: str | None = None  # the HF layer prefix when not the table's (an MTP depth's layer)

    @property
    def first(self) -> int | None:
        """The stack's first layer (None for a global row: what ``is None`` tests ask)."""
        return None if self.layers is None else self.layers[0]

    @property
    def count(self) -> int:
        return 0 if self.layers is None else len(self.layers)

    @property
    def name(self) -> str:
        return "/".join(map(str, self.path))


@dataclasses.dataclass(frozen=True)
class Table:
    """A family's parameters (:class:`Param` rows) and the prefixes their names sit under:
    ``hf_layers`` an HF layer's (``{l}`` the layer), ``megatron_layers`` Megatron's decoder
    layers'. ``lora_refused``: Megatron modules that take no adapter, and why. ``carried``: HF
    tensors the family's checkpoints hold but its model does not use (``fnmatch`` patterns of their
    names, e.g. an MTP head ``mtp.*`` or a vision tower ``model.visual.*``): read past on load and
    copied untouched into HF exports (:mod:`mlir_train.checkpoint.carry`). ``megatron_formats``:
    the Megatron checkpoint formats its rows describe (``torch`` legacy, ``torch_dist``);
    ``megatron_refused``: fragments of tensor names of another Megatron layout of the family that
    is not read, and what to do instead."""

    family: str
    rows: tuple[Param, ...]
    hf_layers: str
    megatron_layers: str
    lora_refused: Mapping[str, str] = dataclasses.field(default_factory=dict)
    carried: tuple[str, ...] = ()
    megatron_formats: tuple[str, ...] = ("torch", "torch_dist")
    megatron_refused: Mapping[str, str] = dataclasses.field(default_factory=dict)
    mtp_rows: tuple[Param, ...] = ()  # an MTP depth's own parameters (GLOBAL rows under ("mtp", d))
    mtp_layers: str = ""              # the HF prefix of an MTP depth's layer ({l}: the depth); "": no MTP head

    def with_hf_prefix(self, old: str, new: str) -> "Table":
        """This table with every HF name (the layer prefix and the global tensors) that starts
        with ``old`` starting with ``new`` instead: another class layout of the same model."""
        swap = lambda name: new + name[len(old):] if name.startswith(old) else name
        rows = tuple(dataclasses.replace(r, hf=tuple(dataclasses.replace(x, name=swap(x.name)) if r.stacked == GLOBAL
                                                     else x for x in r.hf)) for r in self.rows)
        return dataclasses.replace(self, rows=rows, hf_layers=swap(self.hf_layers))

    def layer_rows(self, kind: LayerKind | None) -> tuple[Param, ...]:
        return tuple(r for r in self.rows if r.applies(kind))

    def row(self, path: tuple, kind: LayerKind | None) -> Param | None:
        return next((r for r in self.layer_rows(kind) if r.path == tuple(path)), None)

    def bind(self, paths: Iterable[tuple], stack_kinds: Sequence[Any], what: str = "",
             mtp_kinds: Sequence[LayerKind] = ()) -> list[Bound]:
        """Each parameter path (nnx's flat paths, ``("layers", i, ...)`` in a stack, ``("mtp", d,
        ...)`` in multi-token-prediction depth ``d``, whose layers are ``mtp_kinds``) bound to its
        row; a parameter without one is an error naming it (every parameter has a row)."""
        out = []
        for path in paths:
            path = tuple(path)
            if path[0] == "mtp":
                bound = self._bind_mtp(path, mtp_kinds)
            else:
                stack = stack_kinds[int(path[1])] if path[0] == "layers" else None
                rest = path[2:] if stack is not None else path
                row = self.row(tuple(map(str, rest)), stack.kind if stack is not None else None)
                bound = row and Bound(row, path, *((stack.layers, stack.kind, path[:2]) if stack is not None else ()))
            if bound is None:
                raise CheckpointError(f"{what}parameter {'/'.join(map(str, path))} of the model has no row in the "
                                      f"{self.family} parameter table")
            out.append(bound)
        return out

    def _bind_mtp(self, path: tuple, kinds: Sequence[LayerKind]) -> Bound | None:
        """An MTP depth's parameter: its layer's (the decoder's rows, layer ``d`` under
        :attr:`mtp_layers`) or its own (:attr:`mtp_rows`)."""
        d = int(path[1])
        if d >= len(kinds) or not self.mtp_layers:
            return None
        if path[2] == "layer":
            row = self.row(tuple(map(str, path[3:])), kinds[d])
            return row and Bound(row, path, (d,), kinds[d], path[:3], self.mtp_layers)
        row = next((r for r in self.mtp_rows if r.path == tuple(map(str, path[2:]))), None)
        return row and Bound(row, path, root=path[:2])

    def parts(self, row: Param, ext: Ext | Megatron, kind: LayerKind | None, fmt: str) -> tuple[Param, ...]:
        """The rows whose parameters are the parts of ``ext`` (``fmt``: "hf" or "megatron"), in
        part order: ``row`` alone for a tensor of one part."""
        if ext.codec.parts == 1:
            return (row,)
        found: dict[int, Param] = {}
        for r in self.layer_rows(kind):
            for x in (r.hf if fmt == "hf" else (r.megatron,) if r.megatron else ()):
                if x.name == ext.name and x.codec == ext.codec and r.stacked == row.stacked:
                    found[x.part] = r
        if sorted(found) != list(range(ext.codec.parts)):
            raise ValueError(f"{self.family} table: {ext.name} has parts {sorted(found)} of {ext.codec.parts}")
        return tuple(found[i] for i in range(ext.codec.parts))

    # ----- HF tensors the model does not use -------------------------------------------------------------
    @functools.cached_property
    def _hf_spellings(self) -> re.Pattern:
        names = [x.name if r.stacked == GLOBAL else self.hf_layers + x.name for r in self.rows for x in r.hf]
        if self.mtp_layers:  # a table of a model that trains its MTP head reads those tensors too
            names += [x.name for r in self.mtp_rows for x in r.hf]
            names += [self.mtp_layers + x.name for r in self.rows if r.stacked != GLOBAL for x in r.hf]
        return re.compile("|".join(re.escape(n).replace(r"\{l\}", r"\d+").replace(r"\{e\}", r"\d+") for n in names))

    def spells(self, name: str) -> bool:
        """Whether ``name`` is spelled as one of the rows' HF tensors (of any layer, any expert):
        a tensor a model of this family reads when it has that layer and expert."""
        return self._hf_spellings.fullmatch(name) is not None

    def carried_pattern(self, name: str) -> str | None:
        """The pattern of :attr:`carried` that ``name`` matches (None: none does)."""
        return next((p for p in self.carried if fnmatch.fnmatchcase(name, p)), None)

    # ----- LoRA -------------------------------------------------------------------------------------------
    def lora_modules(self) -> tuple[str, ...]:
        """Megatron's names of the modules an adapter can wrap, in table order."""
        return tuple(dict.fromkeys(r.lora.module for r in self.rows if r.lora is not None))

    def lora_weights(self, policy, kind: LayerKind) -> frozenset[tuple[str, ...]]:
        """The weights of a layer of ``kind`` whose module ``policy`` (a LoRAPolicy) selects."""
        chosen = set(policy.modules(self.lora_modules()))
        return frozenset(r.path for r in self.layer_rows(kind) if r.lora is not None and r.lora.module in chosen)

    def check_lora_targets(self, patterns: Sequence[str]) -> str | None:
        """What is wrong with the first of ``--lora-target-modules``' patterns that selects no
        module of this family (None: they all select one)."""
        modules = self.lora_modules()
        short = sorted({m.rsplit(".", 1)[-1] for m in modules}, key=[m.rsplit(".", 1)[-1] for m in modules].index)
        for pattern in patterns:
            if any(matches(m, pattern) for m in modules):
                continue
            refused = [why for m, why in self.lora_refused.items()
                       if matches(m, pattern) or m.rsplit(".", 1)[-1] in pattern]
            if refused:
                return f"{pattern}: {refused[0]}; adapt {', '.join(short[:-1])} or {short[-1]}"
            return (f"{pattern}: matches none of {', '.join(modules)} (short names {', '.join(short)}; wildcards "
                    "allowed; 'all-linear' for all of them)")
        return None

