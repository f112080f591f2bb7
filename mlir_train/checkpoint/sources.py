"""Where a run starts: ``--load`` read once, as one :class:`Source` per format.

:func:`detect` is the one reading of a path (``sft``'s ``--load`` and ``convert``'s SRC): an HF
model directory (:class:`HFModel`), a checkpoint of ours (:class:`Ours`, wins where a directory
holds one; ``DIR/<step>`` names one step), a Megatron-LM / AIAK checkpoint (:class:`Megatron`,
legacy ``torch`` or ``torch_dist``), or nothing (:class:`Scratch`). Each Source knows its own
model config, what resuming from it requires, how to lay its weights (and, for ours, the optimizer
and the data position) into a run's state (a :class:`~mlir_train.checkpoint.target.Target`), and how
to write one in its format (``write``: ``--save-hf`` / ``--save-peft``, ``convert``)."""

from __future__ import annotations

import dataclasses
import os
from typing import Any, ClassVar

from mlir_train import families
from mlir_train.checkpoint import orbax, whole
from mlir_train.checkpoint.target import Target
from mlir_train.config.flags import RunConfig
from mlir_train.config.models import ModelConfig
from mlir_train.runtime import log
from mlir_train.runtime.errors import CheckpointError, ConfigError

@dataclasses.dataclass(frozen=True)
class Source:
    """What a run starts from; this base is no checkpoint at all (:class:`Scratch`)."""

    kind: ClassVar[str] = "scratch"
    path: str | None = None

    @property
    def meta(self) -> dict[str, Any] | None:
        return None

    @property
    def seed(self) -> int | None:
        """The seed the checkpoint's run used (None: it records none)."""
        return None if self.meta is None else self.meta.get("rng", {}).get("seed")

    @property
    def iteration(self) -> int:
        return 0

    @property
    def hf_origin(self) -> str | None:
        """The HF directory the weights came from (its untouched tensors and files go into HF
        exports: :mod:`mlir_train.checkpoint.carry`); None: none."""
        return None if self.meta is None else self.meta.get("hf_origin")

    def describe(self) -> str:
        return "random initialisation"

    def own_model_config(self, cfg: RunConfig, tokenizer_size: int) -> ModelConfig | None:
        """The model the checkpoint holds (None: no checkpoint)."""
        return None

    def stored_model_config(self, vocab_size: int | None = None) -> ModelConfig:
        """The model the checkpoint holds, from its own files alone (``convert``)."""
        raise CheckpointError("no checkpoint to convert")

    def check_resume(self, cfg: RunConfig) -> None:
        """Megatron's rule: what the checkpoint lacks, the flags must waive (ConfigError / CheckpointError)."""

    def resume_step_in(self, save_dir: str | None, cfg: RunConfig) -> int | None:
        """The step this run resumes from when it saves into the directory it loaded from."""
        return None

    def initial_state(self, target: Target, cfg: RunConfig, loader) -> dict[str, Any]:
        """The state the run starts from (and, for ours, ``loader`` put where the run was)."""
        return target.init_state(cfg.training.seed)

    def read_params(self, target: Target) -> dict[str, Any]:
        """The weights alone, in the target's master shardings (``convert``)."""
        raise CheckpointError("no checkpoint to read weights from")


@dataclasses.dataclass(frozen=True)
class HFModel(Source):
    """An HF model directory (``config.json`` + safetensors)."""

    kind: ClassVar[str] = "hf"

    @property
    def hf_origin(self) -> str | None:
        return os.path.abspath(self.path)

    def describe(self) -> str:
        return f"{self.path}/config.json"

    def own_model_config(self, cfg: RunConfig, tokenizer_size: int) -> ModelConfig:
        return families.from_hf_dir(self.path)

    def stored_model_config(self, vocab_size: int | None = None) -> ModelConfig:
        return families.from_hf_dir(self.path)

    def initial_state(self, target: Target, cfg: RunConfig, loader) -> dict[str, Any]:
        log.info(f"loading HF weights from {self.path}")
        return target.state_from_params(self._weights(target, target.options))

    def read_params(self, target: Target) -> dict[str, Any]:
        return target.state_from_params(self._weights(target))["params"]

    @staticmethod
    def write(dst: str, target: Target, state: dict[str, Any], *, dtype: str | None = None,
              carry_from: str | None = None) -> None:
        """The plain model of ``state`` (under LoRA the adapters merged in) as an HF directory,
        with what the HF directory ``carry_from`` holds beside the model's weights."""
        import jax.numpy as jnp

        from mlir_train.checkpoint.hf import save_pretrained

        if carry_from and os.path.realpath(carry_from) == os.path.realpath(dst):
            raise CheckpointError(f"{dst} is the HF directory the model was read from: export to another one")
        model, dtype = target.export_model(state), None if dtype is None else jnp.dtype(dtype)
        whole.write(dst, "HF model", lambda d: save_pretrained(model, d, dtype=dtype, carry_from=carry_from))

    def _weights(self, target: Target, options=None) -> dict[str, Any]:
        """The safetensors read shard by shard straight into the target's mesh and rules."""
        import numpy as np
        from flax import nnx

        from mlir_train.checkpoint.hf import load_pretrained

        model = load_pretrained(self.path, dtype=np.float32, mesh=target.mesh, rules=target.rules, options=options)
        return nnx.to_pure_dict(nnx.state(model))


@dataclasses.dataclass(frozen=True)
class Ours(Source):
    """A checkpoint of ours: ``step`` (already checked against its checksums) and its JSON."""

    kind: ClassVar[str] = "ours"
    step: int | None = None
    saved: dict[str, Any] | None = None

    @property
    def meta(self) -> dict[str, Any] | None:
        return self.saved

    @property
    def iteration(self) -> int:
        return int(self.saved["iteration"])

    def describe(self) -> str:
        return f"{self.path} (iteration {self.iteration})"

    def own_model_config(self, cfg: RunConfig, tokenizer_size: int) -> ModelConfig:
        return orbax.model_config(self.saved)

    def stored_model_config(self, vocab_size: int | None = None) -> ModelConfig:
        return orbax.model_config(self.saved)

    def check_resume(self, cfg: RunConfig) -> None:
        ck = cfg.checkpoint
        orbax.resume_check(self.saved, self.describe(), load_optim=not ck.no_load_optim, load_rng=not ck.no_load_rng,
                           finetune=ck.finetune)

    def resume_step_in(self, save_dir: str | None, cfg: RunConfig) -> int | None:
        same = not cfg.checkpoint.finetune and os.path.realpath(save_dir or "") == os.path.realpath(self.path)
        return self.step if same else None

    def initial_state(self, target: Target, cfg: RunConfig, loader) -> dict[str, Any]:
        ck = cfg.checkpoint
        what = "weights only, iteration 0 (--finetune)" if ck.finetune else "weights" if ck.no_load_optim else "full state"
        log.info(f"loading {what} from checkpoint {self.path} (iteration {self.iteration})")
        if not ck.finetune and "opt_state" not in self.saved["items"] and self.iteration:
            log.info(f"checkpoint {self.describe()} holds no optimizer state (--no-save-optim): resuming "
                     "with a fresh optimizer (zero Adam moments, the LR schedule's step count from 0)")
        state, meta = orbax.load_state(self.path, target, load_optim=not ck.no_load_optim, finetune=ck.finetune,
                                       step=self.step, verify=False)
        if not ck.finetune:
            orbax.restore_loader(loader, meta, exact=self.seed == cfg.training.seed)
        return state

    def read_params(self, target: Target) -> dict[str, Any]:
        state, _ = orbax.load_state(self.path, target, load_optim=False, step=self.step, verify=False)
        return state["params"]

    @staticmethod
    def write(dst: str, target: Target, state: dict[str, Any], *, converted_from: str,
              hf_origin: str | None = None) -> None:
        """``state``'s weights alone as a checkpoint at iteration 0 (``--load`` then starts from
        them with a fresh optimizer); ``dst`` must hold no checkpoint yet."""
        whole.write(dst, "mlir-train checkpoint", lambda d: orbax.save_weights(
            d, target.model_cfg, state["params"], converted_from=converted_from, hf_origin=hf_origin))


@dataclasses.dataclass(frozen=True)
class Megatron(Source):
    """A Megatron-LM / AIAK checkpoint (``checkpoint``: its
    :class:`~mlir_train.checkpoint.megatron.read.MegatronCheckpoint`)."""

    kind: ClassVar[str] = "megatron"
    checkpoint: Any = None

    @property
    def iteration(self) -> int:
        return int(self.checkpoint.iteration)

    def describe(self) -> str:
        return self.checkpoint.describe()

    def own_model_config(self, cfg: RunConfig, tokenizer_size: int | None, vocab_size: int | None = None) -> ModelConfig:
        """The checkpoint's args as our config, its vocabulary unpadded to ``vocab_size``, else
        to what it recorded or what ``--model-name`` / the tokenizer say."""
        from mlir_train.checkpoint import megatron as mc

        m = cfg.model
        named = families.from_flags(m, None) if m.model_name else None
        vocab_size = vocab_size or m.vocab_size  # --vocab-size: as Megatron pads from it
        if vocab_size is None:
            vocab_size = mc.unpadded_vocab(self.checkpoint, [named.vocab_size if named else None, tokenizer_size])
        name = named.name if named else os.path.basename(self.checkpoint.root.rstrip("/"))
        return mc.model_config(self.checkpoint, name=name, vocab_size=vocab_size, fallback=named)

    def stored_model_config(self, vocab_size: int | None = None, model_name: str | None = None) -> ModelConfig:
        """Its args as our config, the vocabulary unpadded to ``vocab_size`` (default: recorded);
        ``model_name``: the model when its args do not say (Megatron-Bridge) and its HF class."""
        from mlir_train.checkpoint import megatron as mc

        named = families.get_model_config(model_name) if model_name else None
        vocab_size = vocab_size or mc.unpadded_vocab(self.checkpoint, [named.vocab_size if named else None])
        cfg = mc.model_config(self.checkpoint, name=named.name if named else os.path.basename(os.path.abspath(self.path)),
                              vocab_size=vocab_size, fallback=named)
        if vocab_size is None:
            log.info(f"note: {self.describe()} does not record its unpadded vocabulary; keeping all {cfg.vocab_size} "
                     "(padded) rows. Pass --vocab-size N (e.g. 151936 for Qwen3) to strip the padding")
        return cfg

    def initial_state(self, target: Target, cfg: RunConfig, loader) -> dict[str, Any]:
        import jax
        import numpy as np

        from mlir_train.checkpoint import megatron as mc

        ck = cfg.checkpoint
        log.info(f"loading weights from {self.describe()}")
        for note in mc.resume_notes(self.checkpoint, finetune=ck.finetune, load_optim=not ck.no_load_optim,
                                    load_rng=not ck.no_load_rng):
            log.info(f"note: {note}")
        state = target.state_from_params(self.read_params(target))
        state["iteration"] = jax.device_put(np.int32(0 if ck.finetune else self.iteration),
                                            target.state_shardings["iteration"])
        return state

    def read_params(self, target: Target) -> dict[str, Any]:
        from mlir_train.checkpoint import megatron as mc

        return mc.load_params(self.checkpoint, target.model_cfg, target.param_shapes, target.master_shardings)

    @staticmethod
    def write(dst: str, target: Target, state: dict[str, Any], layout, *, make_vocab_size_divisible_by: int = 128,
              iteration: int | None = None, dtype: str | None = None) -> list[str]:
        """``state``'s weights as a Megatron legacy checkpoint in ``layout`` (a
        :class:`sharding.layout.Layout`); returns the rank files written."""
        from mlir_train.checkpoint import megatron as mc

        return whole.write(dst, "Megatron checkpoint", lambda d: mc.save_params(
            state["params"], target.model_cfg, d, layout, iteration=iteration, dtype=dtype,
            make_vocab_size_divisible_by=make_vocab_size_divisible_by))


@dataclasses.dataclass(frozen=True)
class PeftAdapters(Source):
    """An HF PEFT adapter directory (``adapter_config.json`` + ``adapter_model.safetensors``): LoRA
    adapters to train on their base (``--pretrained-checkpoint``, or its ``base_model_name_or_path``)."""

    kind: ClassVar[str] = "peft"

    def describe(self) -> str:
        return f"{self.path} (PEFT adapters)"

    @staticmethod
    def write(dst: str, target: Target, state: dict[str, Any], *, base: str | None = None,
              layout: str = "per-expert") -> None:
        """A LoRA run's adapters as a PEFT directory for the HF model at ``base``, the routed
        experts' adapters in ``layout`` (``--lora-export-format``)."""
        import jax

        from mlir_train.checkpoint import peft

        cfg = target.model_cfg
        table = families.family_of(cfg).hf_params(cfg)
        params, weights = jax.device_get(state["params"]), state["base"]
        whole.write(dst, "PEFT adapters", lambda d: peft.save_adapters(
            d, params, policy=target.lora, table=table, stack_kinds=target.stack_kinds, num_experts=cfg.num_experts,
            base=base, layout=layout, weights=weights, mlp_only_layers=cfg.mlp_only_layers))

    def recorded_base(self) -> str | None:
        from mlir_train.checkpoint import peft

        base = peft.read_adapter_config(self.path).get("base_model_name_or_path")
        return base if base and os.path.isdir(base) else None


@dataclasses.dataclass(frozen=True)
class Scratch(Source):
    """Random initialisation: no ``--load``, or a missing / empty directory (as Megatron, warned)."""


def detect(load: str | None, *, step: int | None = None, exit_on_missing: bool = False,
           flag: str = "--load") -> Source:
    """Classify ``--load``: an HF directory, ours (wins if the directory holds one; ``DIR/<step>``
    names one step), then a Megatron checkpoint (legacy ``torch`` or ``torch_dist``). ``step``
    (``--ckpt-step``) picks the iteration instead of the newest. A directory that holds files
    but no checkpoint we can read is an error naming what it holds, never a silent fresh start;
    a missing or empty one (or one with only interrupted writes of ours) warns and starts from
    scratch (one script both starts and resumes a job), unless ``exit_on_missing``
    (--exit-on-missing-checkpoint) makes that an error. Our checkpoints are verified here.
    ``flag``: how messages name the path (``convert`` passes "SRC" and ``exit_on_missing``)."""
    from mlir_train.checkpoint import megatron as mc

    if not load:
        if step is not None:
            raise CheckpointError(f"--ckpt-step {step} needs --load")
        return Scratch()
    if os.path.exists(os.path.join(load, "config.json")):
        if step is not None:
            raise CheckpointError(f"--ckpt-step {step}: --load {load} is an HF model directory, which has no steps")
        return HFModel(load)
    from mlir_train.checkpoint import peft

    if peft.is_adapter_dir(load):
        if step is not None:
            raise CheckpointError(f"--ckpt-step {step}: --load {load} is a PEFT adapter directory, which has no steps")
        return PeftAdapters(load)
    parent, base = os.path.split(os.path.normpath(load))
    if orbax.is_step_dir(load) and orbax.has_checkpoint(parent):  # --load DIR/<step>
        if step is not None and step != int(base):
            raise CheckpointError(f"{flag} {load} names iteration {base} but --ckpt-step says {step}")
        load, step = parent, int(base)
    if orbax.has_checkpoint(load):
        try:
            chosen = orbax.verified_step(load, step)
            return Ours(load, step=chosen, saved=orbax.CheckpointManager(load, read_only=True).read_meta(chosen))
        except CheckpointError as e:
            raise CheckpointError(f"{flag} {load}: {e}" if not str(e).startswith(flag) else str(e)) from None
    if step is not None and not mc.looks_like_megatron(load):
        raise CheckpointError(f"{flag} {load} --ckpt-step {step}: no checkpoint there (of ours or Megatron's)")
    try:
        found_megatron = mc.find(load, iteration=step)
    except CheckpointError as e:
        raise CheckpointError(f"{flag} {load}: {e}") from None
    if found_megatron is not None:
        return Megatron(load, checkpoint=found_megatron)
    found = mc.identify(load)
    if found:  # files, but nothing we read: never silently train from scratch
        raise CheckpointError(f"{flag} {load}: {found}. Supported: an HF model directory (config.json + safetensors), "
                              "a mlir-train checkpoint, a Megatron torch or torch_dist checkpoint")
    msg = f"{flag} {load}: no complete checkpoint there, nor an HF model directory (no config.json)"
    if exit_on_missing:
        raise CheckpointError(f"{msg}; --exit-on-missing-checkpoint is set. Check the path, or drop the flag to start "
                              "from scratch" if flag == "--load" else f"{msg}: check the path")
    log.warning(f"{msg}; starting from random initialisation at iteration 0 "
                "(--exit-on-missing-checkpoint makes this an error)")
    return Scratch()


# ----- LoRA: adapters on a base ------------------------------------------------------------------
def lora_record(policy, base: Source, seed: int) -> dict[str, Any]:
    """What a LoRA run's checkpoints record besides the adapters: the policy and the base they
    apply to (its kind and path; a random base by the seed that draws it again)."""
    record = {"kind": base.kind, "path": os.path.abspath(base.path) if base.path else None, "seed": int(seed)}
    if isinstance(base, Ours):
        record["step"] = base.step
    return {"dim": policy.dim, "alpha": policy.alpha, "targets": list(policy.targets),
            "expert_adapters": policy.expert_adapters, "base": record}


def lora_sources(cfg: RunConfig, source: Source) -> tuple[Source, Source | None]:
    """(the base, where the adapters come from or None for fresh ones) of a LoRA run whose
    ``--load`` is ``source``: a LoRA checkpoint of ours or a PEFT directory holds adapters
    (their base: ``--pretrained-checkpoint``, else the one they record); anything else is the
    base itself, which starts LoRA at iteration 0 (``--finetune`` for a checkpoint that is past it)."""
    ck = cfg.checkpoint
    meta_lora = (source.meta or {}).get("lora")
    holds_adapters = meta_lora is not None or isinstance(source, PeftAdapters)
    if ck.pretrained_checkpoint:
        if not holds_adapters and not isinstance(source, Scratch):
            raise ConfigError(f"--pretrained-checkpoint {ck.pretrained_checkpoint} names the base, but --load "
                              f"{ck.load} is a base too (no LoRA adapters); give one of them")
        return detect(ck.pretrained_checkpoint, flag="--pretrained-checkpoint", exit_on_missing=True), \
            source if holds_adapters else None
    if meta_lora is not None:
        base = meta_lora["base"]
        if base["kind"] == "scratch":
            return Scratch(), source
        if not base["path"] or not os.path.exists(base["path"]):
            raise CheckpointError(f"checkpoint {source.describe()} applies to the base {base['path']}, which is not "
                                  "there; give it with --pretrained-checkpoint DIR")
        return detect(base["path"], step=base.get("step"), flag="the recorded base", exit_on_missing=True), source
    if isinstance(source, PeftAdapters):
        recorded = source.recorded_base()
        if recorded is None:
            raise ConfigError(f"--load {ck.load} holds PEFT adapters: give the model they apply to with "
                              "--pretrained-checkpoint DIR (an HF directory, ours or Megatron)")
        return detect(recorded, flag="the adapters' base_model_name_or_path", exit_on_missing=True), source
    if source.iteration and not ck.finetune and source.kind in ("ours", "megatron"):
        raise ConfigError(f"--load {source.describe()} is a full checkpoint at iteration {source.iteration}: add "
                          "--finetune to start LoRA on it at iteration 0")
    return source, None


def check_lora_resume(cfg: RunConfig, source: Source) -> None:
    """A LoRA checkpoint resumes only as the LoRA run it was (same rank, alpha, targets, expert adapters)."""
    saved = (source.meta or {}).get("lora")
    policy = cfg.training.lora
    if isinstance(source, PeftAdapters):
        from mlir_train.checkpoint import peft
        peft.check_continue(source.path, policy)  # before any state is built
    if saved is None:
        return
    if policy is None:
        raise ConfigError(f"--load {source.describe()} holds LoRA adapters (rank {saved['dim']}): add --lora-dim "
                          f"{saved['dim']} and its other LoRA flags to continue it (its merged model comes out with "
                          "--save-hf)")
    mine = lora_record(policy, Scratch(), 0)
    # The targets as the modules they select (the family's names): the same adapters however spelled.
    modules = families.family_of(families.from_saved(source.meta["model"])).params.lora_modules()
    same_targets = policy.modules(modules) == dataclasses.replace(policy, targets=tuple(saved["targets"])).modules(modules)
    for key, flag in (("dim", "--lora-dim"), ("alpha", "--lora-alpha"), ("targets", "--lora-target-modules"),
                      ("expert_adapters", "--lora-expert-adapters")):
        if (not same_targets) if key == "targets" else mine[key] != saved[key]:
            raise ConfigError(f"{flag} {mine[key]} differs from the checkpoint {source.describe()}'s {saved[key]}")


def lora_initial_state(target: Target, base_target: Target, cfg: RunConfig, loader, base: Source, adapters: Source | None):
    """A LoRA run's state: the base's weights (read through ``base_target``, the same layout
    without adapters or optimizer state) in the compute dtype, and the adapters fresh (seed's
    A, B = 0), from a PEFT directory, or with their optimizer state and the data position
    from a LoRA checkpoint of ours."""
    import jax
    import numpy as np

    seed = cfg.training.seed
    as_base = cfg.replace(checkpoint={"finetune": True})
    if isinstance(base, Scratch):
        saved = (adapters.meta or {}).get("lora") if adapters is not None else None
        base_seed = saved["base"]["seed"] if saved else seed  # the seed that drew the base the adapters trained on
        log.info(f"LoRA on a randomly initialised base (seed {base_seed}): adapters learn little there; --load a "
                 "trained model (CPU_SMOKE=1 bash examples/qwen3_30b_a3b_lora.sh adapts the demo's)")
        state = target.init_state(base_seed)
    else:
        log.info(f"LoRA base: {base.describe()}")
        state = target.state_from_params(base.initial_state(base_target, as_base, None)["params"], seed)
    if isinstance(adapters, PeftAdapters):
        from mlir_train.checkpoint import peft

        log.info(f"loading LoRA adapters from {adapters.describe()} (optimizer fresh, iteration 0)")
        table = families.family_of(target.model_cfg).hf_params(target.model_cfg)
        host = peft.load_adapters(adapters.path, target.param_shapes, table, target.stack_kinds, target.model_cfg.num_experts, policy=target.lora)
        state = target.state_with_base(jax.tree.map(lambda x: np.asarray(x, np.float32), host), state["base"])
    elif adapters is not None:
        ck = cfg.checkpoint
        log.info(f"loading LoRA adapters{'' if ck.finetune or ck.no_load_optim else ' and their optimizer state'} "
                 f"from checkpoint {adapters.describe()}")
        restored, meta = orbax.load_state(adapters.path, target, load_optim=not ck.no_load_optim,
                                          finetune=ck.finetune, step=adapters.step, verify=False,
                                          base=state["base"])
        state = restored
        if not ck.finetune:
            orbax.restore_loader(loader, meta, exact=adapters.seed == cfg.training.seed)
    return state
