"""Megatron-LM / AIAK checkpoints: recognise, read into any layout, write the legacy format.

Two on-disk formats, both under ``DIR/latest_checkpointed_iteration.txt`` (an iteration number
or ``release``) and ``DIR/iter_0000500/`` or ``DIR/release/``:

* legacy ``torch`` (``--ckpt-format torch``, AIAK's default): one
  ``mp_rank_TT[_PPP][_EEE]/model_optim_rng.pt`` per model-parallel rank (``_PPP`` only with
  PP > 1, ``_EEE`` only with EP > 1, as Megatron-LM's ``get_checkpoint_name``), each a pickled
  dict with ``model`` (``model0``, ``model1``... under a virtual pipeline), ``args``,
  ``checkpoint_version``, ``iteration`` and optionally ``optimizer``/``rng_state``. Tensors are
  per-rank shards: layer indices local to the stage (and chunk), experts local to the EP rank,
  ``linear_qkv`` split over TP by query groups, ``linear_fc1`` holding the rank's gate half then
  its up half, vocabulary rows split over TP;
* ``torch_dist`` (Megatron-LM's default): ``metadata.json`` (``sharded_backend: torch_dist``),
  ``common.pt`` (args, iteration) and a torch DCP checkpoint (``.metadata`` + ``*.distcp``) of
  *global* tensors: layers stacked on a leading axis, experts on a second, ``linear_fc1`` as
  all gate rows then all up rows.

Reading never imports Megatron: pickled Megatron classes (``MCoreMetadata``, enums in ``args``)
are replaced by inert stubs. It needs torch (the files are torch pickles); torch is imported
only here, only when a Megatron checkpoint is read or written.

:func:`load_params` builds each parameter of our model with ``jax.make_array_from_callback`` in
the run's own shardings; the callback reads only the layers (and experts) of the shard asked
for: from memory-mapped legacy files (``torch.load(mmap=True)``, only the TP pieces of that
layer) or as DCP reads of that layer's region. No host holds the whole model. The vocabulary
padding Megatron adds (``--make-vocab-size-divisible-by`` x TP) is stripped to the model's
vocabulary; :func:`save_legacy` adds it back.

Megatron's layouts, matched numerically against megatron-core in ``tests/checkpoint/test_megatron_checkpoint.py``:
``linear_qkv`` rows are, per query group, that group's G query heads then its key head then its
value head (``[K, G+2, H]`` x D); RoPE is the same non-interleaved rotate-half as HF's; the
router is ``[E, D]``; global expert ``e`` is local expert ``e % L`` of EP rank ``e // L``.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import pickle
import re
import types
from typing import Any

import numpy as np

from mlir_train.checkpoint import integrity
from mlir_train.config.models import ModelConfig
from mlir_train.runtime.errors import CheckpointError

TRACKER = "latest_checkpointed_iteration.txt"
SUPPORTED_DIST_BACKENDS = {("torch_dist", 1)}


class MegatronCheckpointError(CheckpointError):
    """A Megatron checkpoint that cannot be read or does not fit this run (names the file)."""


# ----- unpickling without Megatron -------------------------------------------------------------
_STUB_PREFIXES = ("megatron", "transformer_engine", "apex", "nemo", "modelopt", "aiak", "loongforge")


@functools.cache
def _stub_class(module: str, name: str) -> type:
    def __init__(self, *args, **kwargs):
        self._args, self._kwargs = args, kwargs

    def __setstate__(self, state):
        if isinstance(state, dict):
            self.__dict__.update(state)
        else:
            self._state = state

    def __repr__(self):
        return f"<{module}.{name} (stub) {getattr(self, '_args', ())!r}>"

    def __call__(self, *a, **k):  # pickled functions (e.g. init methods in args) become stubs too
        return self

    return type(name, (), {"__init__": __init__, "__setstate__": __setstate__, "__repr__": __repr__,
                           "__call__": __call__, "__module__": f"stub:{module}"})


class _StubUnpickler(pickle.Unpickler):
    """Megatron (and TE, Apex, ...) classes become stubs; everything else unpickles normally,
    and a class that no longer exists becomes a stub too rather than failing the whole file."""

    def find_class(self, module: str, name: str):
        if module.split(".")[0] in _STUB_PREFIXES:
            return _stub_class(module, name)
        try:
            return super().find_class(module, name)
        except (ImportError, AttributeError):
            return _stub_class(module, name)


_pickle_module = types.SimpleNamespace(
    Unpickler=_StubUnpickler, load=lambda f, **kw: _StubUnpickler(f, **kw).load(), __name__="mlir_train_stub_pickle")


def _torch():
    try:
        import torch
    except ImportError:
        raise MegatronCheckpointError(
            "reading or writing Megatron checkpoints needs torch (its files are torch pickles): "
            "pip install torch (the CPU build is enough)") from None
    return torch


def _torch_load(path: str, *, mmap: bool = True) -> Any:
    torch = _torch()
    try:
        return torch.load(path, map_location="cpu", weights_only=False, mmap=mmap, pickle_module=_pickle_module)
    except RuntimeError as e:
        if mmap and "mmap" in str(e):  # an old (non-zip) torch.save file cannot be memory-mapped
            return _torch_load(path, mmap=False)
        raise MegatronCheckpointError(f"{path}: cannot read it as a torch file ({e})") from e
    except (pickle.UnpicklingError, EOFError, OSError) as e:
        raise MegatronCheckpointError(f"{path}: cannot read it as a torch file ({type(e).__name__}: {e})") from e


def _args_dict(args: Any) -> dict[str, Any]:
    if args is None:
        return {}
    if isinstance(args, dict):
        return dict(args)
    return dict(vars(args))


# ----- finding a checkpoint ----------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class MegatronCheckpoint:
    """One iteration of a Megatron checkpoint directory."""

    root: str                 # the --load directory
    directory: str            # iter_XXXXXXX/ or release/
    format: str               # "torch" | "torch_dist"
    iteration: int            # 0 for release
    release: bool
    args: dict[str, Any]      # Megatron's argparse namespace, as a dict (may be empty)
    checkpoint_version: float | None
    has_optimizer: bool
    has_rng: bool

    def describe(self) -> str:
        it = "release" if self.release else f"iteration {self.iteration}"
        return f"Megatron {self.format} checkpoint {self.directory} ({it})"


_RANK_DIR = re.compile(r"^mp_rank_(\d{2})(?:_(\d{3}))?(?:_(\d{3}))?$")


def looks_like_megatron(path: str) -> bool:
    """A tracker file, or iter_*/release sub-directories: a Megatron checkpoint (readable or not)."""
    if not os.path.isdir(path):
        return False
    names = os.listdir(path)
    return TRACKER in names or any(n == "release" or re.fullmatch(r"iter_\d{7}", n) for n in names)


def find(path: str, *, iteration: int | None = None) -> MegatronCheckpoint | None:
    """The checkpoint at ``path`` (the tracker's iteration, or ``iteration``), None when ``path``
    is no Megatron checkpoint directory; raises when it is one we cannot read, naming why."""
    if not looks_like_megatron(path):
        if _is_iteration_dir(path):  # --load DIR/iter_0000500 itself, as some scripts pass it
            base = os.path.basename(os.path.normpath(path))
            it = int(base[5:]) if re.fullmatch(r"iter_\d{7}", base) else 0
            return _read_iteration_dir(os.path.dirname(os.path.normpath(path)), path, it, base == "release")
        return None
    names = os.listdir(path)
    if iteration is not None:
        sub, release = f"iter_{iteration:07d}", False
    elif TRACKER in names:
        with open(os.path.join(path, TRACKER)) as f:
            tag = f.read().strip()
        if tag == "release":
            sub, release, iteration = "release", True, 0
        elif tag.isdigit():
            sub, release, iteration = f"iter_{int(tag):07d}", False, int(tag)
        else:
            raise MegatronCheckpointError(f"{path}/{TRACKER}: holds {tag!r}, expected an iteration number or 'release'")
    else:  # no tracker (copied by hand): the newest iteration, else release
        iters = sorted(int(n[5:]) for n in names if re.fullmatch(r"iter_\d{7}", n))
        if iters:
            sub, release, iteration = f"iter_{iters[-1]:07d}", False, iters[-1]
        else:
            sub, release, iteration = "release", True, 0
    directory = os.path.join(path, sub)
    if not os.path.isdir(directory):
        raise MegatronCheckpointError(f"{path}: the tracker names {sub}, which does not exist there")
    return _read_iteration_dir(path, directory, iteration, release)


def is_megatron_dir(path: str) -> bool:
    """A Megatron checkpoint directory (its root, or one iter_*/release directory of it)."""
    return looks_like_megatron(path) or _is_iteration_dir(path)


def _is_iteration_dir(path: str) -> bool:
    if not os.path.isdir(path):
        return False
    names = os.listdir(path)
    return "metadata.json" in names and "common.pt" in names or any(
        _RANK_DIR.match(n) and os.path.exists(os.path.join(path, n, "model_optim_rng.pt")) for n in names)


def _read_iteration_dir(path: str, directory: str, iteration: int, release: bool) -> MegatronCheckpoint:
    inside = os.listdir(directory)
    if integrity.MANIFEST in inside:  # written by our exporter (save_legacy); Megatron's own have none
        check = integrity.verify_step(directory)
        if not check.usable:
            raise MegatronCheckpointError(f"Megatron checkpoint {check.describe()}")
    if "metadata.json" in inside:
        import json

        with open(os.path.join(directory, "metadata.json")) as f:
            meta = json.load(f)
        backend = (meta.get("sharded_backend"), meta.get("sharded_backend_version"))
        if backend not in SUPPORTED_DIST_BACKENDS or meta.get("common_backend", "torch") != "torch":
            raise MegatronCheckpointError(
                f"{directory}: Megatron distributed checkpoint with sharded backend {backend[0]} version {backend[1]} "
                f"(common backend {meta.get('common_backend')}): written by an unsupported version; supported: "
                "torch_dist v1. Re-save it with --ckpt-format torch_dist or torch")
        common = _torch_load(os.path.join(directory, "common.pt"), mmap=False) \
            if os.path.exists(os.path.join(directory, "common.pt")) else {}
        keys = _DistReader(directory).keys()
        return MegatronCheckpoint(
            root=path, directory=directory, format="torch_dist", iteration=iteration, release=release,
            args=_args_dict(common.get("args")), checkpoint_version=common.get("checkpoint_version"),
            has_optimizer=any(k.startswith("optimizer.") for k in keys), has_rng="rng_state" in common or any(
                k.startswith("rng_state") for k in keys))
    ranks = [n for n in inside if _RANK_DIR.match(n)]
    if ranks:
        first = os.path.join(directory, sorted(ranks)[0], "model_optim_rng.pt")
        if not os.path.exists(first):
            raise MegatronCheckpointError(f"{directory}/{sorted(ranks)[0]}: no model_optim_rng.pt in it")
        sd = _torch_load(first)
        return MegatronCheckpoint(
            root=path, directory=directory, format="torch", iteration=int(sd.get("iteration", iteration) or 0)
            if not release else 0, release=release, args=_args_dict(sd.get("args")),
            checkpoint_version=sd.get("checkpoint_version"), has_optimizer="optimizer" in sd,
            has_rng="rng_state" in sd)
    if ".metadata" in inside:
        raise MegatronCheckpointError(f"{directory}: a plain torch DCP checkpoint (Megatron --ckpt-format torch_dcp "
                                      "or fsdp_dtensor), which is not supported; re-save with --ckpt-format torch_dist")
    raise MegatronCheckpointError(f"{directory}: neither mp_rank_* directories (legacy torch format) nor "
                                  f"metadata.json (torch_dist); it holds {_listing(inside)}")


def _listing(names: list[str], n: int = 8) -> str:
    names = sorted(names)
    return ", ".join(names[:n]) + (f" ... ({len(names)} entries)" if len(names) > n else "") if names else "nothing"


def identify(path: str) -> str | None:
    """What a non-empty directory that is no checkpoint we read holds, for the error message;
    None when it is missing, empty, or holds only interrupted mlir-train writes (no checkpoint yet)."""
    if not os.path.isdir(path):
        return None
    names = [n for n in os.listdir(path) if not n.startswith(".")] or os.listdir(path)
    # interrupted or set-aside writes of ours, and a --save lock left behind: still no checkpoint
    ours_partial = lambda n: re.fullmatch(r"\d+(\.orbax-checkpoint-tmp.*|\.(partial|corrupt|superseded)-\d+)?|\.lock", n)
    if not names or all(ours_partial(n) for n in names):
        return None
    has = set(names)

    def sub_has(pattern: str) -> bool:
        return any(re.fullmatch(pattern, f) for n in names if os.path.isdir(os.path.join(path, n))
                   for f in os.listdir(os.path.join(path, n)))

    if "latest" in has and any(n.startswith("global_step") for n in names) or sub_has(r".*_model_states\.pt|zero_pp_rank_.*"):
        return "a DeepSpeed checkpoint (global_step*/ with *_model_states.pt); convert it to HF first"
    if any(n.endswith(".nemo") for n in names) or "model_weights" in has:
        return "a NeMo checkpoint; export it to HF first"
    if any(n.endswith((".safetensors", ".bin")) for n in names) and "config.json" not in has:
        return "model weights (*.safetensors / *.bin) but no config.json: an incomplete HF directory"
    if ".metadata" in has or any(n.endswith(".distcp") for n in names):
        return ("a torch DCP checkpoint without Megatron's iter_*/ layout (give --load the directory that holds "
                "latest_checkpointed_iteration.txt)")
    if any(_RANK_DIR.match(n) for n in names):
        return ("Megatron mp_rank_* directories without their iter_*/release parent (give --load the directory that "
                "holds latest_checkpointed_iteration.txt)")
    return f"no checkpoint we can read (it holds {_listing(names)})"


# ----- the model shape from Megatron's args ----------------------------------------------------------
def model_config(ckpt: MegatronCheckpoint, *, name: str, vocab_size: int | None = None,
                 fallback: ModelConfig | None = None) -> ModelConfig:
    """Our model config from the checkpoint's ``args`` (``fallback``, e.g. the --model-name
    config, when it has none). ``vocab_size`` is the vocabulary to strip the padding back to
    (default: Megatron's ``--vocab-size`` if set, else the padded size)."""
    a = ckpt.args
    if not a:
        if fallback is None:
            raise MegatronCheckpointError(f"{ckpt.describe()} stores no 'args'; give --model-name (and overrides) so "
                                          "its shape is known")
        return fallback if vocab_size is None else fallback.replace(vocab_size=vocab_size)
    where = ckpt.describe()

    def need(cond: bool, what: str) -> None:
        if not cond:
            raise MegatronCheckpointError(f"{where}: {what}; only Qwen3 / Qwen3-MoE models are supported")

    need(a.get("normalization", "RMSNorm") == "RMSNorm", f"normalization={a.get('normalization')!r}")
    need(bool(a.get("swiglu", True)), "swiglu is off")
    need(not a.get("add_bias_linear", False) and not a.get("add_qkv_bias", False), "linear biases are on")
    need(a.get("position_embedding_type", "rope") == "rope", f"position_embedding_type={a.get('position_embedding_type')!r}")
    need(float(a.get("rotary_percent", 1.0) or 1.0) == 1.0, f"rotary_percent={a.get('rotary_percent')}")
    need(not a.get("rotary_interleaved", False), "rotary_interleaved is on")
    need(bool(a.get("qk_layernorm", True)), "qk_layernorm is off")
    need(not a.get("moe_shared_expert_intermediate_size"), "it has shared experts")
    need(a.get("moe_router_score_function", "softmax") == "softmax",
         f"moe_router_score_function={a.get('moe_router_score_function')!r}")
    need(not a.get("mtp_num_layers"), "it has multi-token-prediction layers")
    heads = int(a["num_attention_heads"])
    groups = int(a["num_query_groups"]) if a.get("group_query_attention") and a.get("num_query_groups") else heads
    hidden = int(a["hidden_size"])
    layers = int(a["num_layers"])
    experts = int(a.get("num_experts") or 0)
    kinds: list[int]
    freq = a.get("moe_layer_freq", 1)
    if not experts:
        kinds = [0] * layers
    elif isinstance(freq, int):
        kinds = [1 if i % freq == 0 else 0 for i in range(layers)]
    else:
        kinds = [int(x) for x in freq]
    padded = a.get("padded_vocab_size")
    vocab = vocab_size or a.get("vocab_size") or padded
    if vocab is None:
        raise MegatronCheckpointError(f"{where}: its args hold no padded_vocab_size; pass the vocabulary size")
    return ModelConfig(
        name=name, vocab_size=int(vocab), hidden_size=hidden, num_layers=layers, num_heads=heads,
        num_kv_heads=groups, head_dim=int(a.get("kv_channels") or hidden // heads),
        intermediate_size=int(a.get("ffn_hidden_size") or 0), num_experts=experts,
        moe_intermediate_size=int(a.get("moe_ffn_hidden_size") or a.get("ffn_hidden_size") or 0) if experts else 0,
        top_k=int(a.get("moe_router_topk") or 0) if experts else 0,
        # top-k of the logits then softmax over the k (pre_softmax off) = HF's renormalised top-k
        norm_topk_prob=bool(experts) and not a.get("moe_router_pre_softmax", False),
        mlp_only_layers=tuple(i for i, k in enumerate(kinds) if not k) if experts else (),
        rope_theta=float(a.get("rotary_base") or 10000),
        rope_scaling_factor=float(a.get("rotary_seq_len_interpolation_factor") or 1.0),
        rms_norm_eps=float(a.get("norm_epsilon") or 1e-5),
        # Megatron's default ties them; an args namespace without the flag: look for the LM head
        tie_word_embeddings=(not a["untie_embeddings_and_output_weights"]) if "untie_embeddings_and_output_weights" in a
        else not open_source(ckpt).has_output_layer(),
        max_position_embeddings=int(a.get("max_position_embeddings") or a.get("seq_length") or 4096),
        init_std=float(a.get("init_method_std") or 0.02),
    )


def padded_vocab(ckpt: MegatronCheckpoint) -> int | None:
    v = ckpt.args.get("padded_vocab_size")
    return int(v) if v else None


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
            m = _RANK_DIR.match(n)
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
                                          f"(keys: {_listing(list(sd))})")
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
        return _torch_load(self.files[key])

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
            _torch().float32, _torch().float64) else t.detach().numpy()

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


class _DistReader:
    """Region reads from a torch DCP directory on one process, no process group, no Megatron."""

    def __init__(self, directory: str):
        _torch()
        from torch.distributed.checkpoint import FileSystemReader

        class Reader(FileSystemReader):
            def read_metadata(self, *a, **k):
                with open(os.path.join(directory, ".metadata"), "rb") as f:
                    md = _StubUnpickler(f).load()
                if getattr(md, "storage_meta", None) is None:
                    from torch.distributed.checkpoint.metadata import StorageMeta

                    md.storage_meta = StorageMeta()
                md.storage_meta.load_id = self.load_id
                return md

        self.directory = directory
        if not os.path.exists(os.path.join(directory, ".metadata")):
            raise MegatronCheckpointError(f"{directory}: no .metadata (torch DCP index) in it")
        self.reader = Reader(directory)
        try:
            self.metadata = self.reader.read_metadata()
        except Exception as e:  # noqa: BLE001 - any unpickling failure: name the file
            raise MegatronCheckpointError(f"{directory}/.metadata: cannot read it ({type(e).__name__}: {e})") from e
        self.reader.set_up_storage_reader(self.metadata, True)

    def keys(self) -> list[str]:
        return list(self.metadata.state_dict_metadata)

    def shape(self, key: str) -> tuple[int, ...] | None:
        md = self.metadata.state_dict_metadata.get(key)
        return tuple(md.size) if md is not None and hasattr(md, "size") else None

    def read(self, key: str, index: tuple[slice, ...]) -> np.ndarray:
        torch = _torch()
        from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
        from torch.distributed.checkpoint.planner import LoadPlan
        from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

        md = self.metadata.state_dict_metadata[key]
        shape = tuple(md.size)
        index = tuple(index) + (slice(None),) * (len(shape) - len(index))
        starts = [s.indices(n)[0] for s, n in zip(index, shape)]
        sizes = [len(range(*s.indices(n))) for s, n in zip(index, shape)]
        dest = torch.empty(sizes, dtype=md.properties.dtype)
        items = create_read_items_for_chunk_list(
            key, md, [ChunkStorageMetadata(offsets=torch.Size(starts), sizes=torch.Size(sizes))])
        covered = sum(int(np.prod(it.lengths)) for it in items)
        if covered != dest.numel():
            raise MegatronCheckpointError(f"{self.directory}: {key}{list(zip(starts, sizes))} is not fully stored "
                                          f"({covered} of {dest.numel()} values); truncated checkpoint?")

        class Planner(DefaultLoadPlanner):
            def resolve_tensor(self, item):
                return dest[tuple(slice(o, o + n) for o, n in zip(item.dest_offsets, item.lengths))]

            def commit_tensor(self, item, tensor):
                pass

        planner = Planner()
        planner.set_up_planner({}, self.metadata, True)
        plan = self.reader.prepare_local_plan(LoadPlan(items))
        self.reader.read_data(plan, planner).wait()
        out = dest.numpy() if dest.dtype in (torch.float32, torch.float64) else dest.float().numpy()
        return out


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
        self.r = _DistReader(ckpt.directory)
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


def layer_stacks(cfg: ModelConfig) -> list[tuple[int, int, bool]]:
    import itertools

    out, start = [], 0
    for is_moe, group in itertools.groupby(cfg.layer_kinds()):
        n = len(list(group))
        out.append((start, n, is_moe))
        start += n
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
    stacks = layer_stacks(cfg)
    flat_shardings = dict(_leaves(shardings))
    out: dict = {}
    for path, shape_struct in _leaves(param_shapes):
        shape = tuple(shape_struct.shape)
        if path[0] == "layers":
            first, _, is_moe = stacks[int(path[1])]
            leaf = "/".join(str(p) for p in path[2:])
            expert = is_moe and leaf in ("mlp/gate_proj", "mlp/up_proj", "mlp/down_proj")
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


def _whole_callback(source, cfg, leaf, shape, dtype):
    @functools.cache
    def whole():
        return _check(_ours_from(source, cfg, leaf, None, None), shape, leaf, source.ckpt.directory)

    return lambda index: np.asarray(whole()[index], dtype=dtype)


def _layer_callback(source, cfg, leaf, first, shape, expert, dtype):
    per = shape[2:] if expert else shape[1:]

    @functools.lru_cache(maxsize=16)
    def one(l: int, e: int | None):
        what = f"layer {first + l}" + (f" expert {e}" if e is not None else "") + f" {leaf}"
        try:
            arr = _ours_from(source, cfg, leaf, first + l, e)
        except ValueError as err:  # e.g. a reshape of a tensor of another shape than the config's
            if isinstance(err, MegatronCheckpointError):
                raise
            raise MegatronCheckpointError(f"{source.ckpt.directory}: {what}: {err}; does the model config "
                                          "(--model-name / overrides / the checkpoint's args) match its tensors?") from err
        return _check(arr, per, what, source.ckpt.directory)

    def callback(index):
        index = tuple(index) + (slice(None),) * (len(shape) - len(index))
        layers = range(*index[0].indices(shape[0]))
        if not expert:
            return np.stack([one(l, None)[index[1:]] for l in layers]).astype(dtype)
        experts = range(*index[1].indices(shape[1]))
        return np.stack([np.stack([one(l, e)[index[2:]] for e in experts]) for l in layers]).astype(dtype)

    return callback


# ----- writing the legacy format -------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class MegatronLayout:
    tensor: int = 1
    pipeline: int = 1
    expert: int = 1
    expert_tensor: int | None = None  # None: = tensor
    make_vocab_size_divisible_by: int = 128

    @property
    def etp(self) -> int:
        return self.expert_tensor or self.tensor


def megatron_args(cfg: ModelConfig, layout: MegatronLayout, padded: int) -> dict[str, Any]:
    """The Megatron arguments a loader of the written checkpoint reads (names as Megatron-LM's)."""
    kinds = cfg.layer_kinds()
    return dict(
        num_layers=cfg.num_layers, hidden_size=cfg.hidden_size, ffn_hidden_size=cfg.intermediate_size or None,
        num_attention_heads=cfg.num_heads, group_query_attention=cfg.num_kv_heads != cfg.num_heads,
        num_query_groups=cfg.num_kv_heads, kv_channels=cfg.head_dim,
        num_experts=cfg.num_experts or None, moe_ffn_hidden_size=cfg.moe_intermediate_size or None,
        moe_router_topk=cfg.top_k or 2, moe_router_pre_softmax=not cfg.norm_topk_prob,
        moe_layer_freq=[int(k) for k in kinds] if cfg.is_moe and not all(kinds) else 1,
        moe_router_score_function="softmax", moe_shared_expert_intermediate_size=None,
        normalization="RMSNorm", norm_epsilon=cfg.rms_norm_eps, qk_layernorm=True, swiglu=True,
        add_bias_linear=False, add_qkv_bias=False, position_embedding_type="rope", add_position_embedding=False,
        rotary_base=int(cfg.rope_theta),
        rotary_percent=1.0, rotary_interleaved=False,
        rotary_seq_len_interpolation_factor=None if cfg.rope_scaling_factor == 1.0 else cfg.rope_scaling_factor,
        max_position_embeddings=cfg.max_position_embeddings, padded_vocab_size=padded, vocab_size=cfg.vocab_size,
        make_vocab_size_divisible_by=layout.make_vocab_size_divisible_by,
        untie_embeddings_and_output_weights=not cfg.tie_word_embeddings, init_method_std=cfg.init_std,
        tensor_model_parallel_size=layout.tensor, pipeline_model_parallel_size=layout.pipeline,
        expert_model_parallel_size=layout.expert, expert_tensor_parallel_size=layout.etp,
        virtual_pipeline_model_parallel_size=None, context_parallel_size=1, ckpt_format="torch",
        transformer_impl="local", moe_grouped_gemm=False, bf16=False, fp16=False,
    )


def save_legacy(layer_array, global_array, cfg: ModelConfig, dst: str, layout: MegatronLayout, *,
                iteration: int | None = None, dtype=None) -> list[str]:
    """Write ``cfg``'s weights as a Megatron legacy ``torch`` checkpoint in ``layout`` under ``dst``
    (``release`` unless ``iteration``). ``layer_array(leaf, l, e)`` / ``global_array(leaf)`` give
    our arrays (e.g. ``"attn/q_proj"`` ``[D, N, H]``) for one layer (expert) / global parameter on
    the host. Files are written one at a time, each from only the layers and experts it holds,
    with Megatron's local-spec names (``local_experts.<j>``). Returns the files written."""
    import argparse

    torch = _torch()
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
    multiple = layout.make_vocab_size_divisible_by * tp
    padded = -(-cfg.vocab_size // multiple) * multiple
    per_stage = l_all // pp
    local_e = e_all // ep if cfg.is_moe else 0
    torch_dtype = dtype or torch.float32

    def t_(a: np.ndarray):
        return torch.from_numpy(np.array(a, dtype=np.float32)).to(torch_dtype)

    def pad_rows(w):  # Megatron pads the vocabulary with zero rows (never looked up, never predicted)
        return np.concatenate([w, np.zeros((padded - w.shape[0], w.shape[1]), w.dtype)]) if padded > w.shape[0] else w

    def tp_rows(w, t, n):  # [gate_t; up_t] style splits take the rank's part of each half separately
        return np.split(w, n)[t]

    sub = "release" if iteration is None else f"iter_{iteration:07d}"
    ns = argparse.Namespace(**megatron_args(cfg, layout, padded), iteration=iteration or 0)
    written = []
    for p in range(pp):
        for t in range(tp):
            for e_rank in range(ep):
                sd: dict[str, Any] = {}
                if p == 0:
                    sd["embedding.word_embeddings.weight"] = t_(tp_rows(pad_rows(global_array("embed")), t, tp))
                for i in range(per_stage):
                    l, pre = p * per_stage + i, f"decoder.layers.{i}."
                    q, k, v = (layer_array(f"attn/{w}_proj", l, None) for w in "qkv")
                    d, n, h = q.shape
                    g = n // cfg.num_kv_heads
                    # per query group: its G query heads, then its key head, then its value head
                    qkv = np.concatenate([q.transpose(1, 2, 0).reshape(cfg.num_kv_heads, g, h, d),
                                          k.transpose(1, 2, 0)[:, None], v.transpose(1, 2, 0)[:, None]],
                                         axis=1).reshape(-1, d)
                    sd[pre + "input_layernorm.weight"] = t_(layer_array("input_norm/scale", l, None))
                    sd[pre + "self_attention.linear_qkv.weight"] = t_(tp_rows(qkv, t, tp))
                    sd[pre + "self_attention.linear_proj.weight"] = t_(np.split(
                        layer_array("attn/o_proj", l, None).reshape(n * h, d).T, tp, axis=1)[t])
                    sd[pre + "self_attention.q_layernorm.weight"] = t_(layer_array("attn/q_norm/scale", l, None))
                    sd[pre + "self_attention.k_layernorm.weight"] = t_(layer_array("attn/k_norm/scale", l, None))
                    sd[pre + "pre_mlp_layernorm.weight"] = t_(layer_array("post_attn_norm/scale", l, None))
                    if cfg.layer_is_moe(l):
                        sd[pre + "mlp.router.weight"] = t_(layer_array("mlp/router", l, None).T)
                        x = t % etp  # the file of dense TP rank t holds expert-tensor rank t % ETP
                        for j in range(local_e):
                            e = e_rank * local_e + j
                            gate, up, down = (layer_array(f"mlp/{w}", l, e) for w in ("gate_proj", "up_proj", "down_proj"))
                            sd[pre + f"mlp.experts.local_experts.{j}.linear_fc1.weight"] = t_(np.concatenate(
                                [tp_rows(gate.T, x, etp), tp_rows(up.T, x, etp)]))
                            sd[pre + f"mlp.experts.local_experts.{j}.linear_fc2.weight"] = t_(
                                np.split(down.T, etp, axis=1)[x])
                    else:
                        gate, up, down = (layer_array(f"mlp/{w}", l, None) for w in ("gate_proj", "up_proj", "down_proj"))
                        sd[pre + "mlp.linear_fc1.weight"] = t_(np.concatenate([tp_rows(gate.T, t, tp), tp_rows(up.T, t, tp)]))
                        sd[pre + "mlp.linear_fc2.weight"] = t_(np.split(down.T, tp, axis=1)[t])
                if p == pp - 1:
                    sd["decoder.final_layernorm.weight"] = t_(global_array("final_norm/scale"))
                    if not cfg.tie_word_embeddings:
                        sd["output_layer.weight"] = t_(tp_rows(pad_rows(global_array("lm_head").T), t, tp))
                # Megatron's linear layers keep an (empty) extra state; strict loads expect the keys.
                sd.update({k[: -len("weight")] + "_extra_state": None for k in list(sd)
                           if re.search(r"(linear_\w+|output_layer)\.weight$", k)})
                name = f"mp_rank_{t:02d}" + (f"_{p:03d}" if pp > 1 else "") + (f"_{e_rank:03d}" if ep > 1 else "")
                path = os.path.join(dst, sub, name, "model_optim_rng.pt")
                os.makedirs(os.path.dirname(path), exist_ok=True)
                torch.save({"args": ns, "checkpoint_version": 3.0, "iteration": iteration or 0, "model": sd}, path)
                written.append(path)
                del sd
    # Megatron records no checksums; ours beside the rank directories (Megatron ignores the file)
    # let our reader tell a flipped bit from a good export.
    integrity.write_manifest(os.path.join(dst, sub))
    with open(os.path.join(dst, TRACKER), "w") as f:
        f.write("release" if iteration is None else str(iteration))
    return written


def unpadded_vocab(ckpt: MegatronCheckpoint, candidates: list[int | None]) -> int | None:
    """The vocabulary under Megatron's padding: its ``--vocab-size`` when recorded, else the
    first candidate (the named model's vocabulary, the tokenizer's size) that pads to exactly
    the checkpoint's ``padded_vocab_size`` (``--make-vocab-size-divisible-by`` x TP), else None
    (keep the padded rows)."""
    a = ckpt.args
    if a.get("vocab_size"):
        return int(a["vocab_size"])
    padded = padded_vocab(ckpt)
    if padded is None:
        return next((c for c in candidates if c), None)
    multiple = int(a.get("make_vocab_size_divisible_by") or 128) * int(a.get("tensor_model_parallel_size") or 1)
    return next((int(c) for c in candidates if c and c <= padded and -(-c // multiple) * multiple == padded), None)


def resume_notes(ckpt: MegatronCheckpoint, *, finetune: bool, load_optim: bool, load_rng: bool) -> list[str]:
    """What of a Megatron checkpoint besides the weights a run cannot take, said once each."""
    notes = []
    if not finetune and ckpt.iteration:
        what = "optimizer state, LR-scheduler position" if load_optim and ckpt.has_optimizer else "LR-scheduler position"
        notes.append(f"continuing Megatron's iteration count from {ckpt.iteration}; its {what} and data-loader "
                     "position cannot be taken (optax state differs from Megatron's), so they start fresh "
                     "(--finetune restarts at iteration 0)")
    elif load_optim and ckpt.has_optimizer and not finetune:
        notes.append("Megatron's optimizer state cannot be taken (optax state differs from Megatron's); it starts fresh")
    if load_rng and ckpt.has_rng:
        notes.append("Megatron's RNG state does not apply here (all randomness comes from --seed)")
    return notes
