"""Hugging Face interop: build our model from an HF directory, and write one back.

``load_pretrained(path, dtype=jnp.bfloat16, mesh=None, rules=None)`` reads ``config.json`` and
the safetensors weights (one file or sharded with ``model.safetensors.index.json``). Which HF
tensor holds which parameter, and how, is the model family's parameter table
(:mod:`mlir_train.families.table`): a row may name several spellings (e.g. experts per expert or
fused on a leading axis) and is read from whichever the file holds, layer by layer. Every
tensor of the file must be read by a parameter and every parameter must find its tensor
(:mod:`mlir_train.checkpoint.complete`).

Nothing is materialised whole: the model is first built abstractly, each parameter gets its
target sharding (from ``mesh`` and the logical-axis ``rules``), and
``jax.make_array_from_callback`` asks for one device shard at a time, which we read straight
from the memory-mapped safetensors (only the layers and experts that shard holds).

The loaded model is called as ``model(input_ids)`` (int32 ``[B, T]``) and returns float
logits ``[B, T, V]``; ``segment_ids=``/``positions=`` and ``return_router_stats=True`` are
documented in :mod:`mlir_train.model.transformer`.

``save_pretrained(model, path)`` writes ``config.json`` and safetensors with each row's first
spelling (the release names), which ``transformers.AutoModelForCausalLM.from_pretrained`` loads.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx

from mlir_train import families
from mlir_train.checkpoint import carry, complete, shards
from mlir_train.checkpoint.hf_files import Files, ShardWriter, to_numpy
from mlir_train.config.models import ModelConfig
from mlir_train.families.table import EXPERT, Bound, Ext, Table
from mlir_train.model import CausalLM, ModelOptions
from mlir_train.runtime import log
from mlir_train.runtime.errors import CheckpointError
from sharding import Rules
from sharding.logical import logical_to_spec

__all__ = ["CheckpointError", "load_pretrained", "save_pretrained", "load_hf_config"]

# Buffers older transformers wrote beside the weights: recomputed, never read.
IGNORED = re.compile(r"\.rotary_emb\.inv_freq$")


def load_hf_config(path: str) -> ModelConfig:
    return families.from_hf_dir(path)


# ----- one parameter's HF tensors ----------------------------------------------------------------------
Shapes = tuple[tuple[int, ...], ...]


@dataclasses.dataclass(frozen=True)
class _Tensors:
    """Where one bound parameter lives in an HF directory: per layer (one entry for a global
    parameter), the spelling the file holds and our shapes (one layer, one expert) of its parts."""

    table: Table
    bound: Bound
    layers: tuple[tuple[Ext, Shapes], ...] = ()

    def name(self, ext: Ext, l: int | None, e: int | None = None) -> str:
        return ext.name if l is None else ((self.bound.hf_layers or self.table.hf_layers) + ext.name).format(l=l, e=e)

    def names(self, layer: int | None, ext: Ext, experts: int) -> list[str]:
        """The file's tensors the parameter reads in ``layer``."""
        if "{e}" in ext.name:
            return [self.name(ext, layer, e) for e in range(experts)]
        return [self.name(ext, layer)]

    def read(self, files: Files, i: int, e: int | None = None) -> np.ndarray:
        """Our array of the ``i``-th layer of the stack (expert ``e``), or of a global parameter."""
        ext, part_shapes = self.layers[i]
        layer = None if self.bound.first is None else self.bound.layers[i]
        if e is not None and "{e}" not in ext.name:  # every expert in one tensor, on its leading axis
            arr = files.read(self.name(ext, layer), (slice(e, e + 1),))[0]
        else:
            arr = files.read(self.name(ext, layer, e))
        return ext.codec.split(arr, part_shapes)[ext.part]


def _part_shapes(table: Table, bound: Bound, ext: Ext, shapes: dict) -> Shapes:
    """Our shapes (one layer, one expert) of the parameters ``ext`` holds."""
    lead = 0 if bound.first is None else 2 if bound.row.stacked == EXPERT else 1
    root = bound.root
    return tuple(tuple(shapes[root + r.path][lead:]) for r in table.parts(bound.row, ext, bound.kind, "hf"))


def _expected(ext: Ext, part_shapes: Shapes, bound: Bound, experts: int) -> tuple[int, ...]:
    shape = ext.codec.join([np.zeros(s, np.int8) for s in part_shapes]).shape
    return ((experts,) if bound.row.stacked == EXPERT and "{e}" not in ext.name else ()) + shape


def _locate(files: Files, table: Table, bound: Bound, shapes: dict, experts: int) -> _Tensors:
    """The spelling of each layer of ``bound`` in the file, its tensors checked for shape; a
    layer the file holds in no spelling is an error naming the first spelling."""
    tensors = _Tensors(table, bound)
    found = []
    for layer in _layers(bound):
        ext = next((x for x in bound.row.hf if tensors.names(layer, x, experts)[0] in files), bound.row.hf[0])
        part_shapes = _part_shapes(table, bound, ext, shapes)
        for name in tensors.names(layer, ext, experts):
            files.check(name, _expected(ext, part_shapes, bound, experts))
        found.append((ext, part_shapes))
    return dataclasses.replace(tensors, layers=tuple(found))


def _layers(bound: Bound) -> list[int | None]:
    return [None] if bound.first is None else list(bound.layers)


def _plan(files: Files, table: Table, abstract: CausalLM, flat: dict,
          cfg: ModelConfig) -> tuple[list[_Tensors | Bound], dict[str, str | None]]:
    """Every parameter bound to its tensors (or, for training state the format has no place
    for, to none); and the tensors no parameter reads, carried (:func:`carry.unused`: name -> the
    family's pattern it matches, None if unknown), after the completeness check on those the
    family spells as its own."""
    shapes = {path: tuple(var.shape) for path, var in flat.items()}
    plan, read = [], set()
    for bound in table.bind(flat, abstract.stack_kinds, f"{files.path}: ", cfg.mtp_kinds()):
        if not bound.row.hf:
            if not bound.row.state:
                complete.check(files.path, unwritten=[bound.name], hint=" (its table row names no HF tensor)")
            plan.append(bound)
            continue
        tensors = _locate(files, table, bound, shapes, cfg.num_experts)
        read |= {n for layer, (ext, _) in zip(_layers(bound), tensors.layers)
                 for n in tensors.names(layer, ext, cfg.num_experts)}
        plan.append(tensors)
    tied = {x.name for r in table.rows if r.tied_to and r.tied_to in shapes and r.path not in shapes for x in r.hf}
    unread = {n: str(files.shape(n)) for n in files.names() if n not in read | tied and not IGNORED.search(n)}
    return plan, carry.unused(files.path, table, unread)



def _sharding_for(mesh, rules):
    def sharding_for(var) -> jax.sharding.Sharding:
        if mesh is None:
            return jax.sharding.make_single_device_sharding(jax.devices()[0])
        spec = logical_to_spec(var.get_metadata()["logical_axes"], rules, mesh.axis_names)
        # A dimension its mesh axes do not divide (a short layer stack of a mixed dense/MoE
        # model under PP) is loaded unsplit; the trainer stores it that way too.
        sizes = [math.prod(mesh.shape[a] for a in ((e,) if isinstance(e, str) else e)) if e else 1 for e in spec]
        spec = jax.sharding.PartitionSpec(*(e if n % k == 0 else None for e, n, k in zip(spec, var.shape, sizes)))
        return jax.sharding.NamedSharding(mesh, spec)

    return sharding_for


def _np_dtype(dtype) -> np.dtype:
    return np.dtype(ml_dtypes.bfloat16) if jnp.dtype(dtype) == jnp.bfloat16 else np.dtype(jnp.dtype(dtype).name)


def load_pretrained(path: str, *, dtype=jnp.bfloat16, mesh: jax.sharding.Mesh | None = None,
                    rules: Rules | None = None, config_overrides: dict[str, Any] | None = None,
                    options: ModelOptions | None = None) -> CausalLM:
    """Build the model of a local HF directory (its family's causal LM).

    ``mesh`` and ``rules`` (a logical-axis table from :mod:`sharding.rules`) decide where each
    parameter lives; without a mesh everything goes to the default device. ``options`` (a
    :class:`~mlir_train.model.options.ModelOptions`; its ``param_dtype`` is ``dtype``) say how
    the model is built to run (``moe_impl``, ``remat``, ...).
    """
    if not os.path.isdir(path):
        raise CheckpointError(f"{path}: not a directory (expected an HF model directory with config.json)")
    cfg = load_hf_config(path)
    if config_overrides:
        cfg = cfg.replace(**config_overrides)
    files = Files(path)
    abstract = families.build_model(cfg, (options or ModelOptions()).replace(param_dtype=dtype), abstract=True)
    graphdef, abstract_state = nnx.split(abstract)
    flat = dict(nnx.to_flat_state(abstract_state))
    if mesh is not None and rules is None:
        from sharding.rules import DATA_PARALLEL

        rules = DATA_PARALLEL
    sharding_for = _sharding_for(mesh, rules)
    # Every tensor located and checked before any is read: a bad checkpoint fails fast and clearly.
    table = families.family_of(cfg).hf_params(cfg)
    if cfg.mtp_num_layers and not any(name.startswith("mtp.") for name in files.names()):
        raise CheckpointError(f"{path}: --mtp-num-layers {cfg.mtp_num_layers} trains the checkpoint's multi-token-"
                              "prediction head, and it has none (no mtp.* tensors); load one that has it, or drop "
                              "the flag")
    plan, carried = _plan(files, table, abstract, flat, cfg)
    carry.say(path, table, carried, "read past; HF exports of this model copy them untouched")
    new_flat = {}
    for item in plan:
        if isinstance(item, Bound):  # training state with no HF tensor (the router's expert bias): zero
            var = flat[item.path]
            value = jax.jit(lambda: jnp.zeros(var.shape, var.dtype), out_shardings=sharding_for(var))()
        else:
            var = flat[item.bound.path]
            value = jax.make_array_from_callback(tuple(var.shape), sharding_for(var),
                                                 _shard_reader(files, item, tuple(var.shape), _np_dtype(dtype)))
        new_flat[item.path if isinstance(item, Bound) else item.bound.path] = var.replace(value)
    return nnx.merge(graphdef, nnx.from_flat_state(new_flat))


def _shard_reader(files: Files, tensors: _Tensors, shape, np_dtype) -> shards.Callback:
    """A ``make_array_from_callback`` callback that reads only the requested shard from disk."""
    if tensors.bound.first is None:
        return shards.whole_callback(lambda: tensors.read(files, 0), np_dtype)
    experts = tensors.bound.row.stacked == EXPERT
    # experts are not kept: each is its own (memory-mapped) tensor or slice, read when asked for
    return shards.stacked_callback(shape, lambda l, e: tensors.read(files, l, e), np_dtype, experts=experts,
                                   cache=0 if experts else 8)


# ----- writing -----------------------------------------------------------------------------------
def save_pretrained(model: CausalLM, path: str, *, dtype=None, max_shard_bytes: int = 2 * 1024**3,
                    carry_from: str | None = None) -> None:
    """Write ``model`` as an HF directory (config.json + sharded safetensors + index).

    ``dtype`` (e.g. ``jnp.bfloat16``) converts on the way out; default keeps each param's dtype.
    ``carry_from``: the HF directory the model came from, whose tensors the model does not use
    are copied byte for byte, whose config.json fields are kept under ours and whose other files
    (generation config, tokenizer) are copied (:mod:`mlir_train.checkpoint.carry`).
    In a multi-process run every process must call this; only process 0 writes.
    """
    from safetensors.numpy import save_file

    cfg = model.cfg
    family = families.family_of(cfg)
    table = family.hf_params(cfg)
    flat = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
    out_dtype = None if dtype is None else _np_dtype(dtype)
    host = lambda x: to_numpy(x) if out_dtype is None else to_numpy(x).astype(out_dtype)
    writer = ShardWriter(path, max_shard_bytes, save_file, enabled=jax.process_index() == 0)
    written: set[tuple] = set()
    for bound in table.bind(flat, model.stack_kinds, f"{path}: ", cfg.mtp_kinds()):
        if not bound.row.hf:
            complete.drop(path, bound.name, bound.row.state, to_numpy(flat[bound.path].get_value()), "HF")
            written.add(bound.path)
        elif bound.path not in written:
            written |= _write(writer, table, bound, flat, host)
    complete.check(path, unwritten=["/".join(map(str, p)) for p in set(flat) - written])
    source = _carry(writer, table, carry_from)
    if jax.process_index() == 0:
        saved_dtype = str(out_dtype or next(iter(flat.values())).get_value().dtype)
        hf_cfg = family.to_hf(cfg) | {"dtype": "bfloat16" if "bfloat16" in saved_dtype else saved_dtype}
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(hf_cfg if source is None else carry.config_fields(source, hf_cfg), f, indent=2)
    writer.close()
    if source is not None and jax.process_index() == 0:
        copied = carry.side_files(source, path)
        log.info(f"{path}: config.json keeps {source}'s fields"
                 + (f"; copied {', '.join(copied)}" if copied else ""))


def _carry(writer: ShardWriter, table: Table, source: str | None) -> str | None:
    """Copy, as stored, the tensors of the HF directory ``source`` the model does not use;
    returns ``source`` (None: nothing to carry from)."""
    if source is None:
        return None
    if os.path.realpath(source) == os.path.realpath(writer.path):
        raise CheckpointError(f"{writer.path} is the HF directory the model was read from: export to another one")
    if not os.path.isfile(os.path.join(source, "config.json")):
        log.warning(f"{writer.path}: {source}, the HF directory the model came from, is gone: the tensors it held "
                    "beside the model's (if any) are not in the export")
        return None
    files = Files(source)
    # What the load read past (carry.unused): the family's declared tensors and those it spells
    # as none of its own (a tensor it does spell was read, or the load failed).
    carried = {n: table.carried_pattern(n) for n in files.names()
               if not IGNORED.search(n) and (table.carried_pattern(n) or not table.spells(n))}
    for name in sorted(carried):
        writer.add_raw(name, files.raw(name))
    carry.say(writer.path, table, carried, f"copied byte for byte from {source}")
    return source


def _write(writer: ShardWriter, table: Table, bound: Bound, flat: dict, host) -> set[tuple]:
    """Write the tensor of ``bound``'s first HF spelling, joined from every parameter it holds,
    one layer (one expert) at a time; returns those parameters' paths."""
    ext = bound.row.hf[0]
    root = bound.root
    paths = [root + r.path for r in table.parts(bound.row, ext, bound.kind, "hf")]
    values = [flat[p].get_value() for p in paths]
    tensors = _Tensors(table, bound)
    if bound.first is None:
        writer.add(ext.name, ext.codec.join([host(v) for v in values]))
        return set(paths)
    for i in range(bound.count):
        layer = [host(v[i]) for v in values]  # one layer at a time: a stacked expert tensor can be tens of GB
        if bound.row.stacked != EXPERT:
            writer.add(tensors.name(ext, bound.layers[i]), ext.codec.join(layer))
        elif "{e}" in ext.name:
            for e in range(layer[0].shape[0]):
                writer.add(tensors.name(ext, bound.layers[i], e), ext.codec.join([p[e] for p in layer]))
        else:
            writer.add(tensors.name(ext, bound.layers[i]),
                       np.stack([ext.codec.join([p[e] for p in layer]) for e in range(layer[0].shape[0])]))
    return set(paths)
