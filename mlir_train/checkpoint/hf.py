"""Hugging Face interop: build our model from an HF Qwen3 / Qwen3-MoE directory, and write one back.

``load_pretrained(path, dtype=jnp.bfloat16, mesh=None, rules=None)`` reads ``config.json`` and
the safetensors weights (one file or sharded with ``model.safetensors.index.json``). Expert
weights are read in either layout: the per-expert names of the Qwen release checkpoints
(``mlp.experts.{i}.gate_proj.weight`` ...) or transformers 5's fused tensors
(``mlp.experts.gate_up_proj`` ``[E, 2F, D]``, ``mlp.experts.down_proj`` ``[E, D, F]``).

Nothing is materialised whole: the model is first built abstractly, each parameter gets its
target sharding (from ``mesh`` and the logical-axis ``rules``), and
``jax.make_array_from_callback`` asks for one device shard at a time, which we read straight
from the memory-mapped safetensors (only the layers and experts that shard holds).

The loaded model is called as ``model(input_ids)`` (int32 ``[B, T]``) and returns float
logits ``[B, T, V]``; ``segment_ids=``/``positions=`` and ``return_router_stats=True`` are
documented in :mod:`mlir_train.model.transformer`.

``save_pretrained(model, path)`` writes ``config.json`` and safetensors with the release
names, which ``transformers.AutoModelForCausalLM.from_pretrained`` loads.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx

from mlir_train.checkpoint import shards
from mlir_train.config.models import ModelConfig
from mlir_train import families
from mlir_train.model import CausalLM, ModelOptions
from mlir_train.runtime import log
from mlir_train.runtime.errors import CheckpointError
from sharding import Rules
from sharding.logical import logical_to_spec

__all__ = ["CheckpointError", "load_pretrained", "save_pretrained", "load_hf_config"]


# ----- the name and layout mapping, defined once for both directions ---------------------------
@dataclasses.dataclass(frozen=True)
class _Entry:
    """One of our per-layer (or global) parameters and its HF tensor.

    ``to_ours`` maps the HF array to our per-layer layout, ``to_hf`` back. ``per_expert``
    entries have ``{e}`` in ``hf_name`` and our array has a leading expert axis.
    """

    ours: tuple[str, ...]
    hf_name: str
    to_ours: Callable[[np.ndarray], np.ndarray]
    to_hf: Callable[[np.ndarray], np.ndarray]
    per_expert: bool = False


def _transpose(w: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(w.T)


def _identity(w: np.ndarray) -> np.ndarray:
    return w


def _layer_entries(cfg: ModelConfig, moe: bool) -> list[_Entry]:
    d, n, k, h = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    p = "model.layers.{l}."
    entries = [
        _Entry(("input_norm", "scale"), p + "input_layernorm.weight", _identity, _identity),
        _Entry(("post_attn_norm", "scale"), p + "post_attention_layernorm.weight", _identity, _identity),
        _Entry(("attn", "q_proj"), p + "self_attn.q_proj.weight",
               lambda w: w.T.reshape(d, n, h), lambda w: _transpose(w.reshape(d, n * h))),
        _Entry(("attn", "k_proj"), p + "self_attn.k_proj.weight",
               lambda w: w.T.reshape(d, k, h), lambda w: _transpose(w.reshape(d, k * h))),
        _Entry(("attn", "v_proj"), p + "self_attn.v_proj.weight",
               lambda w: w.T.reshape(d, k, h), lambda w: _transpose(w.reshape(d, k * h))),
        _Entry(("attn", "o_proj"), p + "self_attn.o_proj.weight",
               lambda w: w.T.reshape(n, h, d), lambda w: _transpose(w.reshape(n * h, d))),
        _Entry(("attn", "q_norm", "scale"), p + "self_attn.q_norm.weight", _identity, _identity),
        _Entry(("attn", "k_norm", "scale"), p + "self_attn.k_norm.weight", _identity, _identity),
    ]
    if moe:
        entries += [
            _Entry(("mlp", "router"), p + "mlp.gate.weight", _transpose, _transpose),
            _Entry(("mlp", "gate_proj"), p + "mlp.experts.{e}.gate_proj.weight", _transpose, _transpose, True),
            _Entry(("mlp", "up_proj"), p + "mlp.experts.{e}.up_proj.weight", _transpose, _transpose, True),
            _Entry(("mlp", "down_proj"), p + "mlp.experts.{e}.down_proj.weight", _transpose, _transpose, True),
        ]
    else:
        entries += [
            _Entry(("mlp", "gate_proj"), p + "mlp.gate_proj.weight", _transpose, _transpose),
            _Entry(("mlp", "up_proj"), p + "mlp.up_proj.weight", _transpose, _transpose),
            _Entry(("mlp", "down_proj"), p + "mlp.down_proj.weight", _transpose, _transpose),
        ]
    return entries


def _global_entries(cfg: ModelConfig) -> list[_Entry]:
    entries = [
        _Entry(("embed",), "model.embed_tokens.weight", _identity, _identity),
        _Entry(("final_norm", "scale"), "model.norm.weight", _identity, _identity),
    ]
    if not cfg.tie_word_embeddings:
        entries.append(_Entry(("lm_head",), "lm_head.weight", _transpose, _transpose))
    return entries


# ----- reading safetensors ---------------------------------------------------------------------
class _Checkpoint:
    """Lazy, memory-mapped access to the tensors of an HF checkpoint directory."""

    def __init__(self, path: str):
        from safetensors import safe_open

        self.path = path
        index = os.path.join(path, "model.safetensors.index.json")
        if os.path.exists(index):
            try:
                with open(index) as f:
                    weight_map = json.load(f)["weight_map"]
            except (json.JSONDecodeError, KeyError) as e:
                raise CheckpointError(f"{index}: not a valid safetensors index ({e})") from None
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
            if not files:
                raise CheckpointError(f"{path}: no *.safetensors files and no model.safetensors.index.json")
            weight_map = None
        self.handles = {}
        self.where: dict[str, str] = {}
        for file in files:
            full = os.path.join(path, file)
            if not os.path.exists(full):
                raise CheckpointError(f"{index}: lists {file}, which does not exist in {path}")
            handle = safe_open(full, framework="np")
            self.handles[file] = handle
            for name in handle.keys():
                self.where[name] = file
        if weight_map is not None:
            missing = [n for n, f in weight_map.items() if n not in self.where]
            if missing:
                raise CheckpointError(f"{index}: tensor {missing[0]} is listed but not found in {weight_map[missing[0]]}")

    def __contains__(self, name: str) -> bool:
        return name in self.where

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.handles[self.where[name]].get_slice(name).get_shape())

    def read(self, name: str, index: tuple[slice, ...] | int | None = None) -> np.ndarray:
        handle = self.handles[self.where[name]]
        if index is None:
            return handle.get_tensor(name)
        return handle.get_slice(name)[index]

    def location(self, name: str) -> str:
        return os.path.join(self.path, self.where[name])


def load_hf_config(path: str) -> ModelConfig:
    return families.from_hf_dir(path)


def _expected_hf_shape(entry: _Entry, our_shape: tuple[int, ...]) -> tuple[int, ...]:
    return entry.to_hf(np.zeros(our_shape, np.int8)).shape


class _ExpertReader:
    """Reads one expert's weight for one layer, from per-expert or fused (transformers 5) tensors."""

    def __init__(self, ckpt: _Checkpoint, cfg: ModelConfig, entry: _Entry, per_layer_shape: tuple[int, ...]):
        self.ckpt, self.cfg, self.entry = ckpt, cfg, entry
        self.expert_shape = per_layer_shape[1:]  # ours, without the expert axis

    def fused_name(self, layer: int) -> str | None:
        prefix = f"model.layers.{layer}.mlp.experts."
        which = self.entry.ours[-1]
        name = prefix + ("down_proj" if which == "down_proj" else "gate_up_proj")
        return name if name in self.ckpt else None

    def check(self, layer: int) -> None:
        f = self.cfg.moe_intermediate_size
        fused = self.fused_name(layer)
        if fused is not None:
            e, d = self.cfg.num_experts, self.cfg.hidden_size
            want = (e, d, f) if self.entry.ours[-1] == "down_proj" else (e, 2 * f, d)
            _check_shape(self.ckpt, fused, want)
            return
        want = _expected_hf_shape(self.entry, self.expert_shape)
        for e in range(self.cfg.num_experts):
            _check_shape(self.ckpt, self.entry.hf_name.format(l=layer, e=e), want)

    def read(self, layer: int, expert: int) -> np.ndarray:
        fused = self.fused_name(layer)
        if fused is None:
            return self.entry.to_ours(self.ckpt.read(self.entry.hf_name.format(l=layer, e=expert)))
        f = self.cfg.moe_intermediate_size
        which = self.entry.ours[-1]
        if which == "down_proj":  # fused [E, D, F]: y = W_e @ h, same as the per-expert [D, F]
            return _transpose(self.ckpt.read(fused, (slice(expert, expert + 1),))[0])
        rows = slice(0, f) if which == "gate_proj" else slice(f, 2 * f)
        return _transpose(self.ckpt.read(fused, (slice(expert, expert + 1), rows))[0])


def _check_shape(ckpt: _Checkpoint, name: str, want: tuple[int, ...]) -> None:
    if name not in ckpt:
        raise CheckpointError(f"{ckpt.path}: missing tensor {name} (expected shape {want})")
    got = ckpt.shape(name)
    if got != tuple(want):
        raise CheckpointError(f"{ckpt.location(name)}: tensor {name} has shape {got}, expected {tuple(want)}")


def _walk_params(abstract_model: CausalLM, cfg: ModelConfig) -> Iterator[tuple[tuple, _Entry, int | None, bool]]:
    """Yield (our flat path, entry, first global layer or None, stack is MoE) for every param."""
    for entry in _global_entries(cfg):
        yield entry.ours, entry, None, False
    for i, stack in enumerate(abstract_model.stack_kinds):
        for entry in _layer_entries(cfg, stack.moe):
            yield ("layers", i) + entry.ours, entry, stack.first, stack.moe


def load_pretrained(
    path: str,
    *,
    dtype=jnp.bfloat16,
    mesh: jax.sharding.Mesh | None = None,
    rules: Rules | None = None,
    config_overrides: dict[str, Any] | None = None,
    options: ModelOptions | None = None,
) -> CausalLM:
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
    ckpt = _Checkpoint(path)
    abstract = families.build_model(cfg, (options or ModelOptions()).replace(param_dtype=dtype), abstract=True)
    graphdef, abstract_state = nnx.split(abstract)
    flat = dict(nnx.to_flat_state(abstract_state))

    if mesh is not None and rules is None:
        from sharding.rules import DATA_PARALLEL

        rules = DATA_PARALLEL

    def sharding_for(var) -> jax.sharding.Sharding:
        if mesh is None:
            return jax.sharding.SingleDeviceSharding(jax.devices()[0])
        spec = logical_to_spec(var.get_metadata()["logical_axes"], rules, mesh.axis_names)
        # A dimension its mesh axes do not divide (a short layer stack of a mixed dense/MoE
        # model under PP) is loaded unsplit; the trainer stores it that way too.
        sizes = [math.prod(mesh.shape[a] for a in ((e,) if isinstance(e, str) else e)) if e else 1 for e in spec]
        spec = jax.sharding.PartitionSpec(*(e if n % k == 0 else None for e, n, k in zip(spec, var.shape, sizes)))
        return jax.sharding.NamedSharding(mesh, spec)

    np_dtype = np.dtype(ml_dtypes.bfloat16) if jnp.dtype(dtype) == jnp.bfloat16 else np.dtype(jnp.dtype(dtype).name)
    plan = list(_walk_params(abstract, cfg))
    # Validate every tensor before reading any, so a bad checkpoint fails fast and clearly.
    for our_path, entry, first, _ in plan:
        var = flat[our_path]
        if first is None:
            _check_shape(ckpt, entry.hf_name, _expected_hf_shape(entry, var.shape))
            continue
        n_layers = var.shape[0]
        for l in range(first, first + n_layers):
            if entry.per_expert:
                _ExpertReader(ckpt, cfg, entry, var.shape[1:]).check(l)
            else:
                _check_shape(ckpt, entry.hf_name.format(l=l), _expected_hf_shape(entry, var.shape[1:]))

    new_flat = {}
    for our_path, entry, first, _ in plan:
        var = flat[our_path]
        shape = tuple(var.shape)
        callback = _shard_reader(ckpt, cfg, entry, first, shape, np_dtype)
        value = jax.make_array_from_callback(shape, sharding_for(var), callback)
        new_flat[our_path] = var.replace(value)
    for our_path, var in flat.items():
        if our_path[-1] == "expert_bias" and our_path not in new_flat:
            # Aux-loss-free balancing state (--moe-router-enable-expert-bias): Qwen3-MoE's HF format
            # has no such tensor; training starts it at zero, as Megatron does.
            value = jax.jit(lambda: jnp.zeros(var.shape, var.dtype), out_shardings=sharding_for(var))()
            new_flat[our_path] = var.replace(value)
    missing = set(flat) - set(new_flat)
    if missing:  # a param our model has that the mapping does not cover: a bug here, not in the file
        raise AssertionError(f"no HF mapping for parameters {sorted(missing)}")
    state = nnx.from_flat_state(new_flat)
    return nnx.merge(graphdef, state)


def _shard_reader(ckpt, cfg, entry: _Entry, first: int | None, shape, np_dtype) -> shards.Callback:
    """A ``make_array_from_callback`` callback that reads only the requested shard from disk."""
    if first is None:
        return shards.whole_callback(lambda: entry.to_ours(ckpt.read(entry.hf_name)), np_dtype)
    if entry.per_expert:
        expert_reader = _ExpertReader(ckpt, cfg, entry, shape[1:])
        # experts are not kept: each is its own (memory-mapped) tensor or slice, read when asked for
        return shards.stacked_callback(shape, lambda l, e: expert_reader.read(first + l, e), np_dtype,
                                       experts=True, cache=0)
    return shards.stacked_callback(shape, lambda l, _: entry.to_ours(ckpt.read(entry.hf_name.format(l=first + l))),
                                   np_dtype, experts=False, cache=8)


# ----- writing -----------------------------------------------------------------------------------
def _to_numpy(x: jax.Array) -> np.ndarray:
    """Gather one parameter to host (one tensor at a time, never the whole model)."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        x = multihost_utils.process_allgather(x, tiled=True)
    return np.asarray(jax.device_get(x))


def save_pretrained(model: CausalLM, path: str, *, dtype=None, max_shard_bytes: int = 2 * 1024**3) -> None:
    """Write ``model`` as an HF directory (config.json + sharded safetensors + index).

    ``dtype`` (e.g. ``jnp.bfloat16``) converts on the way out; default keeps each param's dtype.
    In a multi-process run every process must call this; only process 0 writes.
    """
    from safetensors.numpy import save_file

    cfg = model.cfg
    flat = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
    out_dtype = None if dtype is None else (
        np.dtype(ml_dtypes.bfloat16) if jnp.dtype(dtype) == jnp.bfloat16 else np.dtype(jnp.dtype(dtype).name)
    )
    writer = _ShardWriter(path, max_shard_bytes, save_file, enabled=jax.process_index() == 0)
    def host(x: jax.Array) -> np.ndarray:
        arr = _to_numpy(x)
        return arr if out_dtype is None else arr.astype(out_dtype)

    for our_path, var in flat.items():
        if our_path[-1] == "expert_bias" and np.any(_to_numpy(var.get_value()) != 0):
            log.warning(f"{path}: the expert bias of {'/'.join(map(str, our_path[:-1]))} "
                        "(--moe-router-enable-expert-bias) has no place in the HF Qwen3-MoE format and is not written; "
                        "the exported model routes without it")
    for our_path, entry, first, _ in _walk_params(model, cfg):
        value = flat[our_path].get_value()
        if first is None:
            writer.add(entry.hf_name, entry.to_hf(host(value)))
            continue
        for l in range(value.shape[0]):
            layer = host(value[l])  # one layer at a time: a stacked expert tensor can be tens of GB
            if entry.per_expert:
                for e in range(layer.shape[0]):
                    writer.add(entry.hf_name.format(l=first + l, e=e), entry.to_hf(layer[e]))
            else:
                writer.add(entry.hf_name.format(l=first + l), entry.to_hf(layer))
    if jax.process_index() == 0:
        saved_dtype = str(out_dtype or next(iter(flat.values())).get_value().dtype)
        hf_cfg = families.family_of(cfg).to_hf(cfg) | {"dtype": "bfloat16" if "bfloat16" in saved_dtype else saved_dtype}
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(hf_cfg, f, indent=2)
    writer.close()


class _ShardWriter:
    def __init__(self, path: str, max_bytes: int, save_file, enabled: bool):
        self.path, self.max_bytes, self.save_file, self.enabled = path, max_bytes, save_file, enabled
        self.pending: dict[str, np.ndarray] = {}
        self.pending_bytes = 0
        self.files: list[dict[str, np.ndarray]] = []
        self.weight_map: dict[str, int] = {}
        self.written: list[str] = []
        if enabled:
            os.makedirs(path, exist_ok=True)

    def add(self, name: str, arr: np.ndarray) -> None:
        if not self.enabled:
            return
        if self.pending and self.pending_bytes + arr.nbytes > self.max_bytes:
            self._flush()
        self.pending[name] = np.ascontiguousarray(arr)
        self.pending_bytes += arr.nbytes

    def _flush(self) -> None:
        name = f"model-{len(self.written) + 1:05d}.safetensors"
        self.save_file(self.pending, os.path.join(self.path, name), metadata={"format": "pt"})
        for k in self.pending:
            self.weight_map[k] = len(self.written)
        self.written.append(name)
        self.pending, self.pending_bytes = {}, 0

    def close(self) -> None:
        if not self.enabled:
            return
        if self.pending or not self.written:
            self._flush()
        if len(self.written) == 1:
            os.replace(os.path.join(self.path, self.written[0]), os.path.join(self.path, "model.safetensors"))
            return
        total = len(self.written)
        final = [f"model-{i + 1:05d}-of-{total:05d}.safetensors" for i in range(total)]
        for old, new in zip(self.written, final):
            os.replace(os.path.join(self.path, old), os.path.join(self.path, new))
        index = {"metadata": {}, "weight_map": {k: final[i] for k, i in sorted(self.weight_map.items())}}
        with open(os.path.join(self.path, "model.safetensors.index.json"), "w") as f:
            json.dump(index, f, indent=2)
