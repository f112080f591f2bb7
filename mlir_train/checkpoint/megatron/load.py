"""Megatron's tensors laid into our parameters, for any layout it was saved in.

A source gives a checkpoint's tensors as Megatron's *global* per-layer tensors, whatever layout
wrote them: the legacy format's per-rank shards (layer indices local to the stage and chunk,
experts local to the EP rank, ``linear_qkv`` split over TP by query groups, ``linear_fc1``
holding the rank's gate half then its up half, vocabulary rows split over TP) assembled, or
torch_dist's global tensors (layers stacked on a leading axis, experts on a second,
``linear_fc1`` as all gate rows then all up rows) read by region.

:func:`load_params` builds each parameter of our model with ``jax.make_array_from_callback`` in
the run's own shardings (:mod:`mlir_train.checkpoint.shards`); the callback reads only the
layers (and experts) of the shard asked for: from memory-mapped legacy files (only the TP pieces
of that layer) or as DCP reads of that layer's region. No host holds the whole model. The
vocabulary padding Megatron adds (``--make-vocab-size-divisible-by`` x TP) is stripped to the
model's vocabulary; :func:`~mlir_train.checkpoint.megatron.save.save_legacy` adds it back.

Megatron's layouts, matched numerically against megatron-core in ``tests/checkpoint/test_megatron_checkpoint.py``:
``linear_qkv`` rows are, per query group, that group's G query heads then its key head then its
value head (``[K, G+2, H]`` x D); RoPE is the same non-interleaved rotate-half as HF's; the
router is ``[E, D]``; global expert ``e`` is local expert ``e % L`` of EP rank ``e // L``.
"""

from __future__ import annotations

import functools
import os
import re
from typing import Any

import numpy as np

from mlir_train.checkpoint import shards
from mlir_train.checkpoint.megatron.read import (
    RANK_DIR, DistReader, MegatronCheckpoint, MegatronCheckpointError, import_torch, listing, torch_load)
from mlir_train.config.models import ModelConfig
from mlir_train.model.transformer import layer_stacks


# ----- the checkpoint as Megatron's global per-layer tensors -------------------------------------------
# Kinds (global shapes, per layer l, per expert e):
#   qkv [(K*(G+2))*H, D]   proj [D, N*H]   q_norm, k_norm [H]   in_norm, mlp_norm [D]
#   router [E, D]   fc1 [2F, D] (all gate rows, then all up rows)   fc2 [D, F]
#   e_fc1 [2Fe, D], e_fc2 [D, Fe] (per expert)   embed, output [Vp, D]   final_norm [D]
class _Source:
    def layer(self, kind: str, l: int, e: int | None = None) -> np.ndarray:  # pragma: no cover - interface
        raise NotImplementedError

    def whole(self, kind: str) -> np.ndarray:  # pragma: no cover - interface
        raise NotImplementedError


_LAYER_KEY = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_LEGACY_NAMES = {  # our kind <- the per-layer suffixes that hold it (local spec, TE spec)
    "in_norm": ("input_layernorm.weight", "self_attention.linear_qkv.layer_norm_weight"),
    "qkv": ("self_attention.linear_qkv.weight",),
    "proj": ("self_attention.linear_proj.weight",),
    "q_norm": ("self_attention.q_layernorm.weight",),
    "k_norm": ("self_attention.k_layernorm.weight",),
    "mlp_norm": ("pre_mlp_layernorm.weight", "mlp.linear_fc1.layer_norm_weight"),
    "router": ("mlp.router.weight",),
    "fc1": ("mlp.linear_fc1.weight",),
    "fc2": ("mlp.linear_fc2.weight",),
}
_EXPERT_PATTERNS = (  # local expert weights: SequentialMLP, TE grouped GEMM, legacy GroupedMLP
    re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.linear_fc([12])\.weight$"),
    re.compile(r"^mlp\.experts\.linear_fc([12])\.weight(\d+)$"),
    re.compile(r"^mlp\.experts\.weight([12])$"),
)
_IGNORED = re.compile(r"(^|\.)_extra_state(/.*)?$|\.inv_freq$")


class _LegacySource(_Source):
    """Per-rank ``model_optim_rng.pt`` files, memory-mapped, assembled into global per-layer tensors."""

    def __init__(self, ckpt: MegatronCheckpoint):
        self.ckpt = ckpt
        self.files: dict[tuple[int, int, int], str] = {}
        for n in os.listdir(ckpt.directory):
            m = RANK_DIR.match(n)
            if m:
                f = os.path.join(ckpt.directory, n, "model_optim_rng.pt")
                if not os.path.exists(f):
                    raise MegatronCheckpointError(f"{ckpt.directory}/{n}: no model_optim_rng.pt in it")
                tp, a, b = int(m.group(1)), m.group(2), m.group(3)
                pp_size_hint = int(ckpt.args.get("pipeline_model_parallel_size") or (2 if b is not None else 1))
                # mp_rank_TT_XXX is TT + PP rank with PP > 1, else TT + EP rank (get_checkpoint_name)
                if b is not None:
                    key = (tp, int(a), int(b))
                elif a is not None and pp_size_hint > 1:
                    key = (tp, int(a), 0)
                elif a is not None:
                    key = (tp, 0, int(a))
                else:
                    key = (tp, 0, 0)
                self.files[key] = f
        self.tp = 1 + max(k[0] for k in self.files)
        self.pp = 1 + max(k[1] for k in self.files)
        self.ep = 1 + max(k[2] for k in self.files)
        a = ckpt.args
        for name, have in (("tensor_model_parallel_size", self.tp), ("pipeline_model_parallel_size", self.pp),
                           ("expert_model_parallel_size", self.ep)):
            if a.get(name) and int(a[name]) != have:
                raise MegatronCheckpointError(f"{ckpt.directory}: args say {name}={a[name]} but the mp_rank_* "
                                              f"directories there span {have}; incomplete copy?")
        self.etp = int(a.get("expert_tensor_parallel_size") or self.tp)
        if self.etp > self.tp or self.tp % self.etp:
            raise MegatronCheckpointError(
                f"{ckpt.directory}: expert_tensor_parallel_size {self.etp} with TP {self.tp} "
                "(--expert-tensor-parallel-size must divide --tensor-model-parallel-size here): the legacy format "
                "names files by the dense TP rank (Megatron's get_checkpoint_name), so expert-tensor ranks beyond it "
                "would share one file; a torch_dist checkpoint (--ckpt-format torch_dist) holds any layout")
        for t in range(self.tp):
            for p in range(self.pp):
                if not any((t, p, e) in self.files for e in range(self.ep)):
                    raise MegatronCheckpointError(f"{ckpt.directory}: no file for tensor rank {t}, pipeline rank {p}")
        self._open = functools.lru_cache(maxsize=None)(self._load)
        self._experts_in = functools.lru_cache(maxsize=None)(self._scan_experts)  # one key scan per layer
        sd = self._open(next(iter(sorted(self.files))))
        self.chunk_keys = sorted((k for k in sd if re.fullmatch(r"model\d*", k)), key=lambda k: int(k[5:] or 0))
        if not self.chunk_keys:
            raise MegatronCheckpointError(f"{self.files[min(self.files)]}: no 'model' state dict in it "
                                          f"(keys: {listing(list(sd))})")
        # Global layer order: chunk-major, then stage (Megatron's layer offsets, even or not).
        self.layer_at: list[tuple[int, int, int]] = []  # global layer -> (pp, chunk, local index)
        self.local_experts: int | None = None
        for c, ck in enumerate(self.chunk_keys):
            for p in range(self.pp):
                model = self._model((self._any_file(p), c))
                local = sorted({int(m.group(1)) for k in model if (m := _LAYER_KEY.match(k))})
                if local != list(range(len(local))):
                    raise MegatronCheckpointError(f"{self.files[self._any_file(p)]}: local layer indices {local}")
                self.layer_at += [(p, c, i) for i in local]
        self._check_keys()

    def _any_file(self, p: int, t: int = 0, e: int | None = None) -> tuple[int, int, int]:
        for ee in ([e] if e is not None else range(self.ep)):
            if (t, p, ee) in self.files:
                return (t, p, ee)
        raise MegatronCheckpointError(f"{self.ckpt.directory}: no file for tensor rank {t}, pipeline rank {p}"
                                      + (f", expert rank {e}" if e is not None else ""))

    def _load(self, key: tuple[int, int, int]) -> dict:
        return torch_load(self.files[key])

    def _model(self, where: tuple[tuple[int, int, int], int]) -> dict:
        key, c = where
        sd = self._open(key)
        ck = self.chunk_keys[c]
        if ck not in sd:
            raise MegatronCheckpointError(f"{self.files[key]}: no '{ck}' in it")
        return sd[ck]

    def _check_keys(self) -> None:
        """Every tensor in every file must be one we map: nothing is silently dropped."""
        known = {s for v in _LEGACY_NAMES.values() for s in v}
        top = {"embedding.word_embeddings.weight", "decoder.final_layernorm.weight", "output_layer.weight"}
        for key in sorted(self.files):
            for c in range(len(self.chunk_keys)):
                for k, v in self._model((key, c)).items():
                    if isinstance(v, dict):  # e.g. language_model.encoder...: pre-mcore Megatron-LM models
                        raise MegatronCheckpointError(
                            f"{self.files[key]}: '{k}' is a nested state dict, as the pre-megatron-core (legacy "
                            "GPT model) format writes it; only megatron-core GPTModel checkpoints are read (convert "
                            "it with Megatron-LM's tools/checkpoint first)")
                    if _IGNORED.search(k) or not hasattr(v, "shape"):
                        continue
                    m = _LAYER_KEY.match(k)
                    ok = k in top if m is None else (m.group(2) in known or any(p.match(m.group(2)) for p in _EXPERT_PATTERNS))
                    if not ok:
                        raise MegatronCheckpointError(
                            f"{self.files[key]}: tensor {k} {tuple(v.shape)} has no counterpart in a Qwen3 model "
                            "(shared experts, biases, MTP layers and other architectures are not supported)")

    def _tensor(self, key: tuple[int, int, int], c: int, name: str, what: str) -> np.ndarray:
        model = self._model((key, c))
        if name not in model:
            raise MegatronCheckpointError(f"{self.files[key]}: missing {name} ({what})")
        t = model[name]
        return t.detach().float().numpy() if t.dtype.is_floating_point and t.dtype not in (
            import_torch().float32, import_torch().float64) else t.detach().numpy()

    def _layer_name(self, key, c, i: int, kind: str) -> str:
        model = self._model((key, c))
        for suffix in _LEGACY_NAMES[kind]:
            name = f"decoder.layers.{i}.{suffix}"
            if name in model:
                return name
        raise MegatronCheckpointError(f"{self.files[key]}: missing decoder.layers.{i}.{_LEGACY_NAMES[kind][0]}")

    def layer(self, kind: str, l: int, e: int | None = None) -> np.ndarray:
        if l >= len(self.layer_at):
            raise MegatronCheckpointError(f"{self.ckpt.directory}: has {len(self.layer_at)} layers, layer {l} asked for")
        p, c, i = self.layer_at[l]
        if kind in ("e_fc1", "e_fc2"):
            return self._expert(kind, p, c, i, e)
        get = lambda t: self._tensor(self._any_file(p, t), c, self._layer_name(self._any_file(p, t), c, i, kind), kind)
        if kind in ("qkv",):
            return np.concatenate([get(t) for t in range(self.tp)], axis=0)
        if kind in ("proj", "fc2"):
            return np.concatenate([get(t) for t in range(self.tp)], axis=1)
        if kind == "fc1":
            halves = [np.split(get(t), 2, axis=0) for t in range(self.tp)]
            return np.concatenate([h[0] for h in halves] + [h[1] for h in halves], axis=0)
        return get(0)

    def _scan_experts(self, key, c: int, i: int) -> tuple[str, int]:
        model = self._model((key, c))
        prefix = f"decoder.layers.{i}."
        ids = set()
        style = None
        for k in model:
            if not k.startswith(prefix):
                continue
            rest = k[len(prefix):]
            for s, pat in enumerate(_EXPERT_PATTERNS):
                m = pat.match(rest)
                if m:
                    style = s
                    if s == 0:
                        ids.add(int(m.group(1)))
                    elif s == 1:
                        ids.add(int(m.group(2)))
        if style is None:
            raise MegatronCheckpointError(f"{self.files[key]}: layer {i} has no expert weights")
        if style == 2:
            num = self.ckpt.args.get("num_experts")
            if not num:
                raise MegatronCheckpointError(f"{self.files[key]}: GroupedMLP weights need num_experts in args")
            return "grouped", int(num) // self.ep
        return ("sequential" if style == 0 else "te"), len(ids)

    def _expert(self, kind, p, c, i, e) -> np.ndarray:
        style, local = self._experts_in(self._any_file(p), c, i)
        ep_rank, j = divmod(e, local)
        which = kind[-1]
        pieces = []
        for x in range(self.etp):
            t = next((t for t in range(x, self.tp, self.etp) if (t, p, ep_rank) in self.files), None)
            if t is None:
                raise MegatronCheckpointError(f"{self.ckpt.directory}: no file holds expert rank {ep_rank}'s "
                                              f"expert-tensor rank {x} (pipeline rank {p})")
            key = (t, p, ep_rank)
            if style == "sequential":
                w = self._tensor(key, c, f"decoder.layers.{i}.mlp.experts.local_experts.{j}.linear_fc{which}.weight", kind)
            elif style == "te":
                w = self._tensor(key, c, f"decoder.layers.{i}.mlp.experts.linear_fc{which}.weight{j}", kind)
            else:  # GroupedMLP: weight1 [D, L*2F_r] -> [L, D, 2F_r]; weight2 [L*F_r, D] -> [L, F_r, D]
                g = self._tensor(key, c, f"decoder.layers.{i}.mlp.experts.weight{which}", kind)
                d = int(self.ckpt.args["hidden_size"])
                w = g.reshape(local, d, -1)[j].T if which == "1" else g.reshape(local, -1, d)[j].T
            pieces.append(w)
        if which == "2":
            return np.concatenate(pieces, axis=1)
        halves = [np.split(w, 2, axis=0) for w in pieces]
        return np.concatenate([h[0] for h in halves] + [h[1] for h in halves], axis=0)

    def whole(self, kind: str) -> np.ndarray:
        if kind == "embed":
            return np.concatenate([self._tensor(self._any_file(0, t), 0, "embedding.word_embeddings.weight", kind)
                                   for t in range(self.tp)], axis=0)
        last_c, last_p = len(self.chunk_keys) - 1, self.pp - 1
        if kind == "output":
            return np.concatenate([self._tensor(self._any_file(last_p, t), last_c, "output_layer.weight", kind)
                                   for t in range(self.tp)], axis=0)
        if kind == "final_norm":
            return self._tensor(self._any_file(last_p), last_c, "decoder.final_layernorm.weight", kind)
        raise KeyError(kind)

    def has_output_layer(self) -> bool:
        return "output_layer.weight" in self._model((self._any_file(self.pp - 1), len(self.chunk_keys) - 1))




_DIST_NAMES = {
    "in_norm": ("decoder.layers.self_attention.linear_qkv.layer_norm_weight", "decoder.layers.input_layernorm.weight"),
    "qkv": ("decoder.layers.self_attention.linear_qkv.weight",),
    "proj": ("decoder.layers.self_attention.linear_proj.weight",),
    "q_norm": ("decoder.layers.self_attention.q_layernorm.weight",),
    "k_norm": ("decoder.layers.self_attention.k_layernorm.weight",),
    "mlp_norm": ("decoder.layers.mlp.linear_fc1.layer_norm_weight", "decoder.layers.pre_mlp_layernorm.weight"),
    "router": ("decoder.layers.mlp.router.weight",),
    "fc1": ("decoder.layers.mlp.linear_fc1.weight",),
    "fc2": ("decoder.layers.mlp.linear_fc2.weight",),
    "e_fc1": ("decoder.layers.mlp.experts.experts.linear_fc1.weight", "decoder.layers.mlp.experts.linear_fc1.weight"),
    "e_fc2": ("decoder.layers.mlp.experts.experts.linear_fc2.weight", "decoder.layers.mlp.experts.linear_fc2.weight"),
    "embed": ("embedding.word_embeddings.weight",),
    "output": ("output_layer.weight",),
    "final_norm": ("decoder.final_layernorm.weight",),
}


class _DistSource(_Source):
    """Global tensors of a torch_dist checkpoint: layers stacked (``decoder.layers.<name>``
    ``[L, ...]``) or, when dense and MoE layers are mixed, one per layer
    (``decoder.layers.<i>.<name>``, as megatron-core writes heterogeneous blocks)."""

    _LAYERS = "decoder.layers."

    def __init__(self, ckpt: MegatronCheckpoint):
        self.ckpt = ckpt
        self.r = DistReader(ckpt.directory)
        self.keys = set(self.r.keys())
        self.prefix = "model." if any(k.startswith("model.decoder.") for k in self.keys) else ""
        self._names: dict = {}
        known = {c for cands in _DIST_NAMES.values() for c in cands}
        for k in sorted(self.keys):
            if k.startswith(("optimizer", "rng_state", "rerun_state", "opt_param")) or _IGNORED.search(k) \
                    or self.r.shape(k) is None:
                continue
            name = k[len(self.prefix):] if k.startswith(self.prefix) else k
            name = re.sub(r"_[wv]$", "", name)
            m = re.match(r"^decoder\.layers\.\d+\.(.+)$", name)
            if (self._LAYERS + m.group(1) if m else name) not in known:
                raise MegatronCheckpointError(f"{ckpt.directory}: tensor {k} {self.r.shape(k)} has no counterpart in "
                                              "a Qwen3 model (shared experts, biases, MTP layers and other "
                                              "architectures are not supported)")

    def _has(self, name: str) -> bool:
        return name in self.keys or name + "_w" in self.keys

    def _name(self, kind: str, l: int | None) -> tuple[str, bool]:
        """(checkpoint key, stacked over layers) for ``kind`` of layer ``l``."""
        if (kind, l) not in self._names:
            found = None
            for c in _DIST_NAMES[kind]:
                if self._has(self.prefix + c):
                    found = (self.prefix + c, c.startswith(self._LAYERS))
                    break
                per = f"{self.prefix}{self._LAYERS}{l}.{c[len(self._LAYERS):]}"
                if l is not None and c.startswith(self._LAYERS) and self._has(per):
                    found = (per, False)
                    break
            if found is None:
                where = "" if l is None else f" (layer {l})"
                raise MegatronCheckpointError(f"{self.ckpt.directory}: no tensor {_DIST_NAMES[kind][0]}{where} in it")
            self._names[(kind, l)] = found
        return self._names[(kind, l)]

    def _read(self, name: str, index: tuple) -> np.ndarray:
        if name not in self.keys:  # gate and up stored apart (_w, _v)
            return np.concatenate([self.r.read(name + "_w", index), self.r.read(name + "_v", index)], axis=-2)
        return self.r.read(name, index)

    def layer(self, kind: str, l: int, e: int | None = None) -> np.ndarray:
        name, stacked = self._name(kind, l)
        index = ((slice(l, l + 1),) if stacked else ()) + ((slice(e, e + 1),) if e is not None else ())
        out = self._read(name, index)
        return out.reshape(out.shape[len(index):])

    def whole(self, kind: str) -> np.ndarray:
        return self._read(self._name(kind, None)[0], ())

    def has_output_layer(self) -> bool:
        return self._has(self.prefix + "output_layer.weight")


def open_source(ckpt: MegatronCheckpoint) -> _Source:
    return _LegacySource(ckpt) if ckpt.format == "torch" else _DistSource(ckpt)


# ----- our parameters from Megatron's tensors -------------------------------------------------------
def _qkv_split(qkv: np.ndarray, cfg: ModelConfig) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    k, h, d = cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size
    g = cfg.num_heads // k
    w = qkv.reshape(k, g + 2, h, d)  # per query group: its G query heads, its key head, its value head
    q = w[:, :g].reshape(k * g, h, d).transpose(2, 0, 1)
    return q, w[:, g].transpose(2, 0, 1), w[:, g + 1].transpose(2, 0, 1)


def _ours_from(source: _Source, cfg: ModelConfig, leaf: str, l: int | None, e: int | None) -> np.ndarray:
    """Our per-layer (per-expert) array ``leaf`` (e.g. "attn/q_proj") of global layer ``l``."""
    v = cfg.vocab_size
    if l is None:
        if leaf == "embed":
            return _rows(source.whole("embed"), v, "embedding.word_embeddings.weight")
        if leaf == "lm_head":
            return np.ascontiguousarray(_rows(source.whole("output"), v, "output_layer.weight").T)
        if leaf == "final_norm/scale":
            return source.whole("final_norm")
        raise KeyError(leaf)
    f = cfg.moe_intermediate_size if e is not None else cfg.intermediate_size
    simple = {"input_norm/scale": "in_norm", "post_attn_norm/scale": "mlp_norm", "attn/q_norm/scale": "q_norm",
              "attn/k_norm/scale": "k_norm"}
    if leaf in simple:
        return source.layer(simple[leaf], l)
    if leaf in ("attn/q_proj", "attn/k_proj", "attn/v_proj"):
        q, k, vv = _qkv_split(source.layer("qkv", l), cfg)
        return {"attn/q_proj": q, "attn/k_proj": k, "attn/v_proj": vv}[leaf]
    if leaf == "attn/o_proj":
        return source.layer("proj", l).T.reshape(cfg.num_heads, cfg.head_dim, cfg.hidden_size)
    if leaf == "mlp/router":
        return np.ascontiguousarray(source.layer("router", l).T)
    fc1, fc2 = ("e_fc1", "e_fc2") if e is not None else ("fc1", "fc2")
    if leaf in ("mlp/gate_proj", "mlp/up_proj"):
        w = source.layer(fc1, l, e)
        if w.shape[0] != 2 * f:
            raise MegatronCheckpointError(f"layer {l} {fc1}: {w.shape[0]} rows, expected 2 x {f} (gate and up)")
        return np.ascontiguousarray((w[:f] if leaf == "mlp/gate_proj" else w[f:]).T)
    if leaf == "mlp/down_proj":
        return np.ascontiguousarray(source.layer(fc2, l, e).T)
    raise KeyError(leaf)


def _rows(w: np.ndarray, v: int, name: str) -> np.ndarray:
    if w.shape[0] < v:
        raise MegatronCheckpointError(f"{name} has {w.shape[0]} rows (padded vocabulary), fewer than the model's "
                                      f"vocabulary {v}")
    return w[:v]


def _leaves(params_shapes: dict, prefix=()) -> list[tuple[tuple, Any]]:
    out = []
    for k, v in params_shapes.items():
        if isinstance(v, dict):
            out += _leaves(v, prefix + (k,))
        else:
            out.append((prefix + (k,), v))
    return out


def load_params(ckpt: MegatronCheckpoint, cfg: ModelConfig, param_shapes: dict, shardings: dict,
                *, dtype=np.float32) -> dict:
    """Our parameter tree (nested dicts like ``nnx.to_pure_dict`` of the model) read from
    ``ckpt``: each leaf a ``jax.Array`` in ``shardings`` (same tree), built shard by shard."""
    import jax

    source = open_source(ckpt)
    if not cfg.tie_word_embeddings and not source.has_output_layer():
        raise MegatronCheckpointError(f"{ckpt.describe()}: no output_layer.weight (tied embeddings?) but the model "
                                      "has an untied LM head")
    if getattr(source, "layer_at", None) is not None and len(source.layer_at) != cfg.num_layers:
        raise MegatronCheckpointError(f"{ckpt.describe()}: holds {len(source.layer_at)} layers, the model has "
                                      f"{cfg.num_layers}")
    stacks = layer_stacks(cfg)  # as the model builds them
    flat_shardings = dict(_leaves(shardings))
    out: dict = {}
    for path, shape_struct in _leaves(param_shapes):
        shape = tuple(shape_struct.shape)
        if path[0] == "layers":
            first, _, kind = stacks[int(path[1])]
            leaf = "/".join(str(p) for p in path[2:])
            expert = kind.moe and leaf in ("mlp/gate_proj", "mlp/up_proj", "mlp/down_proj")
            callback = _layer_callback(source, cfg, leaf, first, shape, expert, dtype)
        else:
            leaf = "/".join(str(p) for p in path)
            callback = _whole_callback(source, cfg, leaf, shape, dtype)
        arr = jax.make_array_from_callback(shape, flat_shardings[path], callback)
        node = out
        for p in path[:-1]:
            node = node.setdefault(p, {})
        node[path[-1]] = arr
    return out


def _check(arr: np.ndarray, want: tuple[int, ...], what: str, ckpt_dir: str) -> np.ndarray:
    if tuple(arr.shape) != tuple(want):
        raise MegatronCheckpointError(f"{ckpt_dir}: {what} has shape {tuple(arr.shape)} in our layout, the model "
                                      f"expects {tuple(want)}; does --model-name / its overrides match the checkpoint?")
    return arr


def _whole_callback(source, cfg, leaf, shape, dtype) -> shards.Callback:
    read = lambda: _check(_ours_from(source, cfg, leaf, None, None), shape, leaf, source.ckpt.directory)
    return shards.whole_callback(read, dtype)


def _layer_callback(source, cfg, leaf, first, shape, expert, dtype) -> shards.Callback:
    per = shape[2:] if expert else shape[1:]

    def one(l: int, e: int | None) -> np.ndarray:
        what = f"layer {first + l}" + (f" expert {e}" if e is not None else "") + f" {leaf}"
        try:
            arr = _ours_from(source, cfg, leaf, first + l, e)
        except ValueError as err:  # e.g. a reshape of a tensor of another shape than the config's
            if isinstance(err, MegatronCheckpointError):
                raise
            raise MegatronCheckpointError(f"{source.ckpt.directory}: {what}: {err}; does the model config "
                                          "(--model-name / overrides / the checkpoint's args) match its tensors?") from err
        return _check(arr, per, what, source.ckpt.directory)

    return shards.stacked_callback(shape, one, dtype, experts=expert, cache=16)
