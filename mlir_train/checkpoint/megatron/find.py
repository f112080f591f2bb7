"""Recognising a Megatron checkpoint: its directory, tracker and iteration, its args and format.

:func:`find` turns a ``--load`` directory (the one holding
``latest_checkpointed_iteration.txt``, or one ``iter_*`` / ``release`` directory of it) into a
:class:`MegatronCheckpoint`; :func:`model_config` reads our model's shape from its ``args``.
The file formats are described in :mod:`~mlir_train.checkpoint.megatron.read`.
"""

from __future__ import annotations

import os
import re
from typing import Any

from mlir_train import families
from mlir_train.checkpoint import integrity
from mlir_train.checkpoint.megatron.source import open_source
from mlir_train.checkpoint.megatron.read import (
    RANK_DIR, DistReader, MegatronCheckpoint, MegatronCheckpointError, listing, torch_load)
from mlir_train.config.sections import padded_vocab_size
from mlir_train.config.models import ModelConfig
from mlir_train.families.table import VOCAB
from mlir_train.runtime.errors import CheckpointError, read_json_object, read_text

TRACKER = "latest_checkpointed_iteration.txt"
SUPPORTED_DIST_BACKENDS = {("torch_dist", 1)}


def _args_dict(args: Any) -> dict[str, Any]:
    if args is None:
        return {}
    if isinstance(args, dict):
        return dict(args)
    return dict(vars(args))


# ----- finding a checkpoint ----------------------------------------------------------------------
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
        tag = read_text(os.path.join(path, TRACKER), MegatronCheckpointError).strip()
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
        RANK_DIR.match(n) and os.path.exists(os.path.join(path, n, "model_optim_rng.pt")) for n in names)


def _read_iteration_dir(path: str, directory: str, iteration: int, release: bool) -> MegatronCheckpoint:
    inside = os.listdir(directory)
    if integrity.MANIFEST in inside:  # written by our exporter (save_legacy); Megatron's own have none
        check = integrity.verify_step(directory)
        if not check.usable:
            raise MegatronCheckpointError(f"Megatron checkpoint {check.describe()}")
    if "metadata.json" in inside:
        meta = read_json_object(os.path.join(directory, "metadata.json"), MegatronCheckpointError,
                                "Megatron's checkpoint metadata")
        backend = (meta.get("sharded_backend"), meta.get("sharded_backend_version"))
        if backend not in SUPPORTED_DIST_BACKENDS or meta.get("common_backend", "torch") != "torch":
            raise MegatronCheckpointError(
                f"{directory}: Megatron distributed checkpoint with sharded backend {backend[0]} version {backend[1]} "
                f"(common backend {meta.get('common_backend')}): written by an unsupported version; supported: "
                "torch_dist v1. Re-save it with --ckpt-format torch_dist or torch")
        common = torch_load(os.path.join(directory, "common.pt"), mmap=False) \
            if os.path.exists(os.path.join(directory, "common.pt")) else {}
        keys = DistReader(directory).keys()
        return MegatronCheckpoint(
            root=path, directory=directory, format="torch_dist", iteration=iteration, release=release,
            args=_args_dict(common.get("args")), checkpoint_version=common.get("checkpoint_version"),
            has_optimizer=any(k.startswith("optimizer.") for k in keys), has_rng="rng_state" in common or any(
                k.startswith("rng_state") for k in keys))
    ranks = [n for n in inside if RANK_DIR.match(n)]
    if ranks:
        first = os.path.join(directory, sorted(ranks)[0], "model_optim_rng.pt")
        if not os.path.exists(first):
            raise MegatronCheckpointError(f"{directory}/{sorted(ranks)[0]}: no model_optim_rng.pt in it")
        sd = torch_load(first)
        return MegatronCheckpoint(
            root=path, directory=directory, format="torch", iteration=int(sd.get("iteration", iteration) or 0)
            if not release else 0, release=release, args=_args_dict(sd.get("args")),
            checkpoint_version=sd.get("checkpoint_version"), has_optimizer="optimizer" in sd,
            has_rng="rng_state" in sd)
    if ".metadata" in inside:
        raise MegatronCheckpointError(f"{directory}: a plain torch DCP checkpoint (Megatron --ckpt-format torch_dcp "
                                      "or fsdp_dtensor), which is not supported; re-save with --ckpt-format torch_dist")
    raise MegatronCheckpointError(f"{directory}: neither mp_rank_* directories (legacy torch format) nor "
                                  f"metadata.json (torch_dist); it holds {listing(inside)}")

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
    if any(RANK_DIR.match(n) for n in names):
        return ("Megatron mp_rank_* directories without their iter_*/release parent (give --load the directory that "
                "holds latest_checkpointed_iteration.txt)")
    return f"no checkpoint we can read (it holds {listing(names)})"


# ----- the model shape from Megatron's args ----------------------------------------------------------
def model_config(ckpt: MegatronCheckpoint, *, name: str, vocab_size: int | None = None,
                 fallback: ModelConfig | None = None) -> ModelConfig:
    """Our model config from the checkpoint's ``args`` (``fallback``, e.g. the --model-name
    config, when it has none), by the model family whose Megatron mapping takes them.
    ``vocab_size`` is the vocabulary to strip the padding back to (default: Megatron's
    ``--vocab-size`` if set, else the padded size)."""
    a = ckpt.args
    if not a:
        if fallback is None:
            raise MegatronCheckpointError(f"{ckpt.describe()} stores no 'args'; give --model-name (and overrides) so "
                                          "its shape is known")
        return fallback if vocab_size is None else fallback.replace(vocab_size=vocab_size)
    vocab = vocab_size or a.get("vocab_size") or a.get("padded_vocab_size")
    if vocab is None:
        raise MegatronCheckpointError(f"{ckpt.describe()}: its args hold no padded_vocab_size; pass the vocabulary size")
    try:
        return families.from_megatron(a, name=name, vocab_size=int(vocab),
                                      has_tensor=lambda table, tensor: open_source(ckpt, table).has(tensor))
    except MegatronCheckpointError:
        raise
    except CheckpointError as e:
        raise MegatronCheckpointError(f"{ckpt.describe()}: {e}") from None


def padded_vocab(ckpt: MegatronCheckpoint) -> int | None:
    v = ckpt.args.get("padded_vocab_size")
    return int(v) if v else None


def unpadded_vocab(ckpt: MegatronCheckpoint, candidates: list[int | None]) -> int | None:
    """The vocabulary under Megatron's padding: its ``--vocab-size`` when recorded, else the
    first candidate (the named model's vocabulary, the tokenizer's size) that pads to exactly
    the checkpoint's ``padded_vocab_size`` (``--make-vocab-size-divisible-by`` x TP), else None
    (keep the padded rows)."""
    a = ckpt.args
    if a.get("vocab_size"):
        return int(a["vocab_size"])
    padded = padded_vocab(ckpt)
    if padded is None:  # no args (Megatron-Bridge keeps its config elsewhere): the first that fits its rows
        rows = _embedding_rows(ckpt)
        return next((int(c) for c in candidates if c and (rows is None or c <= rows)), None)
    divisible_by, tp = int(a.get("make_vocab_size_divisible_by") or 128), int(a.get("tensor_model_parallel_size") or 1)
    fits = lambda c: c <= padded and padded_vocab_size(c, divisible_by, tp) == padded
    return next((int(c) for c in candidates if c and fits(c)), None)


def _embedding_rows(ckpt: MegatronCheckpoint) -> int | None:
    """The rows of a torch_dist checkpoint's input embedding (as any family's table spells it)."""
    if ckpt.format != "torch_dist":
        return None
    reader = DistReader(ckpt.directory)
    names = {n for f in families.FAMILIES.values() for r in f.params.rows
             if r.megatron is not None and r.megatron.split == VOCAB and r.megatron.stage == "first" for n in r.megatron.names}
    shapes = [reader.shape(p + n) for n in sorted(names) for p in ("", "model.")]
    return next((s[0] for s in shapes if s), None)


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
