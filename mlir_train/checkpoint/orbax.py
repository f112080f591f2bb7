"""Training checkpoints: Orbax, asynchronous, restorable into any mesh and parallel layout.

This module is what a run reads and writes of them (its state, the resume rules, which step to
load); :mod:`~mlir_train.checkpoint.manager` holds Orbax's part (:class:`CheckpointManager`,
the commit with its checksums).

A checkpoint directory holds one Orbax step directory per saved iteration::

    DIR/<iteration>/params      float32 master weights (the model's nnx state as pure arrays)
    DIR/<iteration>/opt_state   optax state (absent when written with --no-save-optim)
    DIR/<iteration>/loss_scale  fp16 loss-scaler state (absent without --fp16)
    DIR/<iteration>/meta        JSON: iteration, consumed samples, data-loader position, seed,
                                model config, tokenizer size, parallel layout, the run's flags
    DIR/<iteration>/checksums.json  size and BLAKE2b of every other file of the step
    DIR/.lock                   the job saving into DIR (while it runs)

Arrays are written from each device's own shards and restored straight into an abstract
target (``jax.ShapeDtypeStruct`` with the *new* run's shardings), so a checkpoint written under
TP2 x EP2 with the distributed optimizer loads under DP8 or EP4 with no conversion step, and
nothing is ever gathered onto one device.

``save`` blocks only while the arrays are copied off the devices; the files are written in a
background thread (``async_save=True``), so training continues. A step directory appears under
its final name only once it is complete (Orbax writes ``<step>.orbax-checkpoint-tmp`` and
renames it), so a job killed mid-write leaves the previous checkpoint as the newest; step
directories that lack Orbax's commit marker anyway (copied or truncated by hand) are set aside
as ``<step>.partial`` and ignored. A write that fails (a full disk) leaves the previous steps
as they were; its tmp directory is renamed ``<step>.partial-<time>`` and the error says how much
space the next save needs and how much is free.

Every step also carries ``checksums.json`` (:mod:`mlir_train.checkpoint.integrity`), part of
the same commit (:class:`_SaveHashes`: each process hashes its own shards in its commit, the
primary writes the manifest into the tmp directory before Orbax's rename); a load verifies it
first, every process hashing its share. ``--load DIR``
takes the newest step that verifies (a warning names any newer corrupt one and its file); an
explicit step (``--ckpt-step N``, or ``--load DIR/N``) that fails is an error. The ``Checkpointer``
holds ``DIR/.lock`` so a second job saving into the same directory is refused.
``python -m mlir_train.checkpoint verify DIR`` checks every step.
"""

from __future__ import annotations

import os
from typing import Any

import jax
import jax.numpy as jnp

from mlir_train import families
from mlir_train.checkpoint import integrity
from mlir_train.checkpoint.manager import (  # noqa: F401 - the manager's names, from where callers import them
    ARRAY_ITEMS, FORMAT_VERSION, KILL_POINTS, CheckpointManager, _check_step)
from mlir_train.checkpoint.target import Target
from mlir_train.config.models import ModelConfig
from mlir_train.runtime import log
from mlir_train.runtime.errors import CheckpointError

# Fields that change parameter shapes: a mismatch is an error. Other architecture fields
# (rope_theta, rms_norm_eps, ...) change numerics only and are reported but allowed.
SHAPE_FIELDS = ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                "intermediate_size", "num_experts", "moe_intermediate_size", "decoder_sparse_step",
                "mlp_only_layers", "tie_word_embeddings")
NUMERIC_FIELDS = ("top_k", "norm_topk_prob", "rope_theta", "rope_scaling_factor", "rms_norm_eps")
# How the decoder layers' parameters are stored (``params["layers"][k]``): one stack per layer
# kind (mlir_train.model.periods). Checkpoints written before it have no such field and stored
# one stack per run of consecutive equal layers: the same for a model of one kind (the released
# Qwen3), another tree for a mixed one (Qwen3.5's 3:1 pattern, Qwen3 with mlp_only_layers).
LAYER_STORAGE = "stack-per-kind"

# ----- a run's state --------------------------------------------------------------------------
def model_config(meta: dict[str, Any]) -> ModelConfig:
    """The model config a checkpoint's JSON recorded (:func:`mlir_train.families.from_saved`)."""
    return families.from_saved(meta["model"])


def check_model(meta: dict[str, Any], model_cfg: ModelConfig, where: str) -> None:
    """Raise naming every shape-changing field that differs; print numeric-only differences."""
    saved = model_config(meta)
    diff = lambda fields: [f"{f}: checkpoint {getattr(saved, f)!r} vs this run {getattr(model_cfg, f)!r}"
                           for f in fields if getattr(saved, f) != getattr(model_cfg, f)]
    if bad := diff(SHAPE_FIELDS):
        raise CheckpointError(f"{where} was written for a different model ({saved.name}): " + "; ".join(bad))
    if soft := diff(NUMERIC_FIELDS):
        log.info(f"note: {where} differs from this run in " + "; ".join(soft))


def check_layer_storage(meta: dict[str, Any], where: str) -> None:
    """Refuse a checkpoint of a mixed-kind model written with the old one-stack-per-run tree
    (:data:`LAYER_STORAGE`): its layers would restore into the wrong stacks."""
    if meta.get("layer_storage") == LAYER_STORAGE:
        return
    saved = model_config(meta)
    kinds = saved.layer_kinds()
    runs = 1 + sum(a != b for a, b in zip(kinds, kinds[1:]))
    if runs != len(set(kinds)):
        raise CheckpointError(
            f"{where} stores {saved.name}'s decoder layers as {runs} stacks, one per run of equal layers (the tree "
            f"before one stack per layer kind, {len(set(kinds))} here); this version cannot restore it. Load and "
            "export it with the version that wrote it (--save-hf, or mlir_train.convert), then --load the HF "
            "directory")


def resume_check(meta: dict[str, Any], where: str, *, load_optim: bool, load_rng: bool, finetune: bool) -> None:
    """Megatron's rule for what a checkpoint lacks: resuming (not ``--finetune``) a checkpoint
    written with ``--no-save-optim`` needs ``--no-load-optim``, one written with ``--no-save-rng``
    needs ``--no-load-rng``; Megatron exits there too. A checkpoint at iteration 0 (converted
    from HF, Megatron's "release") has nothing to resume and passes."""
    if finetune or int(meta["iteration"]) == 0:
        return
    it = int(meta["iteration"])
    if load_optim and "opt_state" not in meta["items"]:
        raise CheckpointError(
            f"checkpoint {where} (iteration {it}) holds no optimizer state (written with --no-save-optim). As Megatron, "
            f"add --no-load-optim to resume at iteration {it} with a fresh optimizer (zero Adam moments, the LR "
            "schedule's step count from 0), or --finetune to take the weights and restart at iteration 0")
    if load_rng and "rng" not in meta:
        raise CheckpointError(
            f"checkpoint {where} (iteration {it}) holds no RNG state (written with --no-save-rng: no seed, so no data "
            f"order). As Megatron, add --no-load-rng to resume at iteration {it} at the same position in the data, in "
            "the order this run's --seed gives, or --finetune to take the weights and restart at iteration 0")


def load_state(directory: str, target: Target, *, load_optim: bool = True, finetune: bool = False,
               step: int | None = None, verify: bool = True, base: Any = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """Restore a run's state from ``directory`` into ``target``'s (the trainer's) own shardings.

    Megatron's semantics: ``finetune`` loads the weights only and restarts at iteration 0;
    ``load_optim=False`` (``--no-load-optim``) keeps the iteration but starts the optimizer
    (moments, its step count and so the LR schedule) and the loss scaler fresh. A checkpoint
    written without optimizer state (``--no-save-optim``, or ``mlir_train.convert`` from HF)
    loads the same way (:func:`resume_check` is the CLI's guard that the flags say so).
    The step's files are checked against its checksums first (``verify=False``: the caller
    did, e.g. :func:`resolve_start`). Under LoRA the checkpoint holds the adapters (and their
    optimizer state) only; ``base`` is the frozen base they apply to (the target's compute-dtype
    tree, already loaded). Returns ``(state, meta)``.
    """
    mgr = CheckpointManager(directory, read_only=True)
    step = mgr._step_or_latest(step)
    if verify:
        mgr.check_step(step)
    meta = mgr.read_meta(step)
    check_layer_storage(meta, directory)
    abstract = {k: v for k, v in target.abstract_state().items() if k in ARRAY_ITEMS}
    with_optim = load_optim and not finetune and "opt_state" in meta["items"]
    if not with_optim:
        abstract["opt_state"] = abstract["loss_scale"] = None
    restored = mgr.restore(abstract, step, verify=False)
    state = target.state_from_params(restored["params"]) if base is None else target.state_with_base(
        restored["params"], base)
    if with_optim:
        state["opt_state"] = restored["opt_state"]
        if restored.get("loss_scale") is not None:
            state["loss_scale"] = restored["loss_scale"]
    iteration = 0 if finetune else int(meta["iteration"])
    state["iteration"] = jax.device_put(jnp.asarray(iteration, jnp.int32), target.state_shardings["iteration"])
    mgr._mgr.close()
    return state, meta


def save_weights(directory: str, model_cfg: ModelConfig, params: Any, *, converted_from: str,
                 hf_origin: str | None = None) -> None:
    """``params`` alone as a checkpoint at iteration 0 (no optimizer state: ``--load`` starts
    from them with a fresh one), recording where they came from (``hf_origin``: the HF directory
    whose untouched tensors HF exports carry); ``directory`` must hold none yet."""
    mgr = CheckpointManager(directory)
    if mgr.latest_step() is not None:
        raise CheckpointError(f"{directory} already holds checkpoints {mgr.steps()}; give an empty directory")
    meta = {"model": model_cfg.as_dict(), "layer_storage": LAYER_STORAGE,
            "consumed_samples": 0, "converted_from": os.path.abspath(converted_from)}
    mgr.save(0, {"params": params}, meta | ({"hf_origin": hf_origin} if hf_origin else {}), force=True)
    mgr.close()


def restore_loader(loader, meta: dict[str, Any], *, exact: bool = True) -> None:
    """Put ``loader`` where the checkpointed run's loader was. With ``exact=False`` (another
    seed, --no-load-rng) only the position in the row stream is kept: same number of rows
    consumed, the new seed's order."""
    saved = meta.get("data_loader")
    if saved is None:  # e.g. converted from HF: nothing consumed yet
        return
    if exact and "seed" in saved:  # --no-save-rng drops the seed: only the position can be kept
        loader.restore(saved)
        return
    consumed = int(meta["consumed_samples"])
    loader.restore({**saved, "seed": loader.seed, "num_rows": loader.dataset.num_rows,
                    "epoch": consumed // loader.dataset.num_rows, "position": consumed % loader.dataset.num_rows})


# ----- where a run starts -----------------------------------------------------------------------


def is_step_dir(path: str) -> bool:
    """Whether ``path`` is one complete step directory of ours (``DIR/<step>``)."""
    return integrity.is_step_name(os.path.basename(os.path.normpath(path))) and integrity.is_complete(path)


def has_checkpoint(path: str) -> bool:
    """Whether ``path`` holds at least one complete checkpoint of ours."""
    if not os.path.isdir(path):
        return False
    return CheckpointManager(path, read_only=True).latest_step() is not None  # a damaged step: its error


def verified_step(load: str, step: int | None) -> int:
    """The step of ours to load: ``step`` if given (it must verify: no fallback from an explicit
    choice), else the newest that verifies, with a warning naming each newer corrupt step, its
    file and the step used instead. No step verifies: an error, never a fresh start. Every
    process of a multi-host job hashes its share of each step's files (one read of the
    checkpoint in all, spread over the hosts) and the verdicts are exchanged (file names and
    problems, no data), so all processes choose the same step or stop with the same error."""
    return _choose_step(load, step, integrity.Exchange.of_processes())


def _choose_step(load: str, step: int | None, exchange: integrity.Exchange) -> int:
    directory, steps = os.path.abspath(load), integrity.complete_steps(load)
    if step is not None:
        if step not in steps:
            raise CheckpointError(f"{directory}: no complete checkpoint for iteration {step} (have {steps})")
        _check_step(directory, step, exchange)
        return step
    corrupt = []
    for s in reversed(steps):
        check = integrity.verify_step(os.path.join(directory, str(s)), exchange)
        if not check.usable:
            corrupt.append(check)
            continue
        for bad in corrupt:
            log.warning(f"{bad.describe()}; falling back to the newest checkpoint that verifies, "
                  f"{os.path.join(directory, str(s))} (iteration {s}): the {int(os.path.basename(bad.step_dir)) - s} "
                  f"iterations after it are trained again")
        if check.status == "unverified":
            log.warning(f"checkpoint {check.step_dir} {check.problem}")
        return s
    raise CheckpointError(f"--load {load}: no checkpoint there verifies: " + "; ".join(c.describe() for c in corrupt))
