"""``python -m mlir_train.convert SRC DST``: HF model directory, mlir-train checkpoint, Megatron checkpoint.

The direction follows SRC unless ``--to`` says otherwise:

* an HF directory (``config.json`` + safetensors) becomes a mlir-train checkpoint at iteration
  0 holding the weights only (``--load DST`` then starts training from them with a fresh
  optimizer);
* a mlir-train checkpoint directory (its newest complete iteration, or ``--step N``) becomes an
  HF directory that ``transformers.AutoModelForCausalLM.from_pretrained`` loads;
* a Megatron checkpoint (legacy ``torch`` or ``torch_dist``, any TP/PP/EP/ETP split; the
  tracker's iteration or ``--step N``) becomes an HF directory, or with ``--to mlir-train`` a
  mlir-train checkpoint; its vocabulary padding is stripped to ``--vocab-size`` (default: the
  size Megatron recorded, else kept padded); ``--model-name`` names the model where its args do
  not (Megatron-Bridge's checkpoints carry none);
* ``--to megatron`` writes an HF directory or a mlir-train checkpoint as a Megatron legacy
  ``torch`` checkpoint (``release``, or ``iter_N`` with ``--iteration N``) split for
  ``--tensor-model-parallel-size``, ``--pipeline-model-parallel-size``,
  ``--expert-model-parallel-size`` and ``--expert-tensor-parallel-size``, its vocabulary padded
  to ``--make-vocab-size-divisible-by`` x TP as Megatron pads it.

Weights go shard by shard through the devices of a data-parallel mesh with the distributed
optimizer's layout, so no host or device ever holds the whole model (Megatron files are read
and written one layer at a time). Megatron checkpoints of any layout also ``--load`` directly;
converting is for other tools (``from_pretrained``, serving) and for going back to Megatron.
"""

from __future__ import annotations

import argparse
import sys

# what each source format converts to by default
DEFAULT_TARGET = {"hf": "mlir-train", "ours": "hf", "megatron": "hf"}
SAME_FORMAT = {  # the source is already in the format asked for
    ("hf", "hf"): "{src} is already an HF directory (--to hf)",
    ("ours", "mlir-train"): "{src}: a mlir-train checkpoint converts to hf or megatron (--to mlir-train)",
    ("megatron", "megatron"): "{src} is already a Megatron checkpoint; convert it to HF first to change its layout, "
                              "or --load it directly (any layout)",
}


def _trainer(model_cfg):
    """A data-parallel trainer with the distributed optimizer's layout: the weights pass shard by shard."""
    from mlir_train.train.build import build_trainer
    from mlir_train.train.trainer import model_dims
    from sharding.layout import Layout
    from sharding.mesh import validate

    return build_trainer(model_cfg, layout=validate(Layout(distributed_optimizer=True), model_dims(model_cfg)))


def _refuse_adapters(src) -> None:
    """LoRA adapters are no model to convert: say what SRC holds and how to get a model or a PEFT
    directory out of it."""
    from mlir_train.runtime.errors import CheckpointError

    lora = (src.meta or {}).get("lora")
    if src.kind == "peft":
        raise CheckpointError(
            f"SRC {src.path} is a PEFT adapter directory (LoRA adapters, not a model): load it on its base with peft "
            "(PeftModel.from_pretrained), or merge it into an HF model with python -m mlir_train.sft --load "
            f"{src.path} --pretrained-checkpoint BASE <its LoRA flags> --train-iters 0 --save-hf DIR")
    if lora is not None:
        raise CheckpointError(
            f"SRC {src.path} holds LoRA adapters (rank {lora['dim']}, alpha {lora['alpha']:g}) of the base "
            f"{lora['base']['path'] or 'drawn by seed ' + str(lora['base']['seed'])}, not a model: run its training "
            f"command with --load {src.path} --train-iters {src.iteration} (nothing more to train) and --save-hf DIR "
            "for the merged model, or --save-peft DIR for the adapters in PEFT format")


def convert(args) -> str:
    """One conversion: SRC detected once (:func:`mlir_train.checkpoint.sources.detect`), its
    weights read through a data-parallel trainer and written by the target format's source
    (:meth:`~mlir_train.checkpoint.sources.Source.write`). Returns what was written."""
    from mlir_train.checkpoint import sources, whole
    from mlir_train.runtime.errors import CheckpointError
    from sharding.layout import Layout

    whole.check_destinations({"DST": args.dst}, {"SRC": args.src})
    src = sources.detect(args.src, step=args.step, exit_on_missing=True, flag="SRC")
    _refuse_adapters(src)
    to = args.to or DEFAULT_TARGET[src.kind]
    if (src.kind, to) in SAME_FORMAT:
        raise CheckpointError(SAME_FORMAT[src.kind, to].format(src=args.src))
    if args.model_name and src.kind != "megatron":
        raise CheckpointError(f"--model-name {args.model_name}: SRC {args.src} brings its own model config; the flag "
                              "is for a Megatron checkpoint (drop it)")
    named = {"model_name": args.model_name} if args.model_name else {}
    trainer = _trainer(src.stored_model_config(args.vocab_size, **named))
    state = trainer.state_from_params(src.read_params(trainer))
    if to == "megatron":
        layout = Layout(tensor=args.tensor_model_parallel_size, pipeline=args.pipeline_model_parallel_size,
                        expert=args.expert_model_parallel_size,
                        expert_tensor=args.expert_tensor_parallel_size or None)  # 0 too: = TP, as before
        files = sources.Megatron.write(args.dst, trainer, state, layout, iteration=args.iteration, dtype=args.dtype,
                                       make_vocab_size_divisible_by=args.make_vocab_size_divisible_by)
        return (f"a Megatron legacy checkpoint ({len(files)} mp_rank files, TP{layout.tensor} PP{layout.pipeline} "
                f"EP{layout.expert} ETP{layout.etp})")
    if to == "hf":
        sources.HFModel.write(args.dst, trainer, state, dtype=args.dtype, carry_from=src.hf_origin)
        return "HF model"
    sources.Ours.write(args.dst, trainer, state, converted_from=args.src, hf_origin=src.hf_origin)
    return "checkpoint (iteration 0, weights only)"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m mlir_train.convert", description=__doc__.split("\n\n")[0],
                                epilog=__doc__.split("\n\n", 1)[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("src", help="HF model directory, mlir-train checkpoint or Megatron checkpoint directory")
    p.add_argument("dst", help="output directory")
    p.add_argument("--to", choices=["hf", "mlir-train", "megatron"], default=None,
                   help="output format (default: HF for checkpoints, mlir-train for an HF directory)")
    p.add_argument("--step", type=int, default=None, help="checkpoint iteration to export (default: the newest)")
    p.add_argument("--dtype", default=None, choices=["bfloat16", "float16", "float32"],
                   help="HF / Megatron export dtype (default: float32, the master weights)")
    p.add_argument("--vocab-size", type=int, default=None,
                   help="Megatron source: strip its padded vocabulary to this size (default: the size it recorded)")
    p.add_argument("--model-name", default=None,
                   help="Megatron source: the model (registry name or HF config) when its args do not say "
                        "(Megatron-Bridge's checkpoints), and the release whose HF class it is written as")
    m = p.add_argument_group("Megatron output (--to megatron)")
    m.add_argument("--tensor-model-parallel-size", type=int, default=1)
    m.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    m.add_argument("--expert-model-parallel-size", type=int, default=1)
    m.add_argument("--expert-tensor-parallel-size", type=int, default=None, help="default: = TP")
    m.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    m.add_argument("--iteration", type=int, default=None, help="write iter_N (default: release)")
    return p


def main(argv: list[str] | None = None) -> int:
    """Exit status: 0, or 2 with one ``mlir-train: error:`` line naming what is wrong."""
    from mlir_train.runtime import errors, log

    args = _parser().parse_args(argv)
    try:
        wrote = convert(args)
    except errors.user_errors() + (FileNotFoundError,) as e:
        return errors.report(e)
    log.info(f"wrote {wrote} to {args.dst}")
    return 0


if __name__ == "__main__":
    from mlir_train.runtime.platform_setup import configure_platform

    configure_platform(cpu_devices=8)  # a CPU-only host converts through fake devices like the trainer does
    sys.exit(main())
