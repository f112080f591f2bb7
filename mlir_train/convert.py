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
  size Megatron recorded, else kept padded);
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
import os
import sys


def _trainer(model_cfg):
    import optax

    from mlir_train.train.trainer import StepConfig, model_dims
    from mlir_train.train.build import build_trainer
    from sharding.mesh import make_mesh, validate
    from sharding.layout import Layout

    parallel = validate(Layout(distributed_optimizer=True), model_dims(model_cfg))
    return build_trainer(model_cfg, StepConfig(), optax.identity(), parallel, make_mesh(parallel))


def _hf_params(src: str):
    import numpy as np
    from flax import nnx

    from mlir_train.config.models import ModelConfig
    from mlir_train.checkpoint.hf import load_pretrained

    trainer = _trainer(ModelConfig.from_hf_json(src))
    model = load_pretrained(src, dtype=np.float32, mesh=trainer.mesh, rules=trainer.rules)
    return trainer, trainer.state_from_params(nnx.to_pure_dict(nnx.state(model)))["params"]


def hf_to_checkpoint(src: str, dst: str) -> None:
    trainer, params = _hf_params(src)
    _save_ours(trainer, params, dst, src)


def _save_ours(trainer, params, dst: str, src: str) -> None:
    from mlir_train.checkpoint import orbax as checkpoint

    mgr = checkpoint.CheckpointManager(dst)
    if mgr.latest_step() is not None:
        raise checkpoint.CheckpointError(f"{dst} already holds checkpoints {mgr.steps()}; give an empty directory")
    import dataclasses

    mgr.save(0, {"params": params}, {"model": dataclasses.asdict(trainer.model_cfg), "consumed_samples": 0,
                                     "converted_from": os.path.abspath(src)}, force=True)
    mgr.close()


def _ours_params(src: str, step: int | None):
    from mlir_train.checkpoint import orbax as checkpoint

    meta = checkpoint.CheckpointManager(src, read_only=True).read_meta(step)
    trainer = _trainer(checkpoint.model_config(meta))
    state, meta = checkpoint.load_state(src, trainer, load_optim=False, step=meta["iteration"])
    return trainer, state["params"]


def checkpoint_to_hf(src: str, dst: str, *, step: int | None = None, dtype: str | None = None) -> None:
    trainer, params = _ours_params(src, step)
    _save_hf(trainer, params, dst, dtype)


def _save_hf(trainer, params, dst: str, dtype: str | None) -> None:
    import jax.numpy as jnp

    from mlir_train.checkpoint.hf import save_pretrained

    save_pretrained(trainer.model(params), dst, dtype=None if dtype is None else jnp.dtype(dtype))


def _megatron_params(src: str, step: int | None, vocab_size: int | None):
    from mlir_train.checkpoint.megatron import read as mc

    ckpt = mc.find(src, iteration=step)
    if ckpt is None:
        raise mc.MegatronCheckpointError(f"{src}: not a Megatron checkpoint directory")
    vocab_size = vocab_size or mc.unpadded_vocab(ckpt, [])
    cfg = mc.model_config(ckpt, name=os.path.basename(os.path.abspath(src)), vocab_size=vocab_size)
    if vocab_size is None:
        print(f"mlir-train: note: {ckpt.describe()} does not record its unpadded vocabulary; keeping all "
              f"{cfg.vocab_size} (padded) rows. Pass --vocab-size N (e.g. 151936 for Qwen3) to strip the padding")
    trainer = _trainer(cfg)
    return trainer, mc.load_params(ckpt, cfg, trainer.param_shapes, trainer.master_shardings)


def megatron_to(src: str, dst: str, *, to: str, step: int | None = None, vocab_size: int | None = None,
                dtype: str | None = None) -> None:
    """A Megatron checkpoint as an HF directory (``to="hf"``) or a mlir-train checkpoint."""
    trainer, params = _megatron_params(src, step, vocab_size)
    if to == "hf":
        _save_hf(trainer, params, dst, dtype)
    else:
        _save_ours(trainer, trainer.state_from_params(params)["params"], dst, src)


def to_megatron(trainer, params, dst: str, layout, *, iteration: int | None = None, dtype: str | None = None) -> list[str]:
    """Our parameters (any sharding) as a Megatron legacy checkpoint in ``layout``, read to
    the host one layer (one expert) at a time."""
    import jax
    import numpy as np

    from mlir_train.checkpoint.megatron import read as mc

    if os.path.isdir(dst) and os.listdir(dst):
        raise mc.MegatronCheckpointError(f"{dst} is not empty; give an empty or new directory")
    cfg = trainer.model_cfg
    stacks = mc.layer_stacks(cfg)  # (first layer, count, is_moe) per stack, as the model builds them

    def leaf_of(tree, leaf: str):
        for part in leaf.split("/"):
            tree = tree[part]
        return tree

    def layer_array(leaf: str, l: int, e: int | None):
        si = next(i for i, (first, n, _) in enumerate(stacks) if first <= l < first + n)
        x = leaf_of(params["layers"][si], leaf)[l - stacks[si][0]]
        return np.asarray(jax.device_get(x if e is None else x[e]), np.float32)

    def global_array(leaf: str):
        return np.asarray(jax.device_get(leaf_of(params, leaf)), np.float32)

    torch_dtype = None
    if dtype is not None:
        import torch

        torch_dtype = getattr(torch, dtype)
    return mc.save_legacy(layer_array, global_array, cfg, dst, layout, iteration=iteration, dtype=torch_dtype)


def main(argv: list[str] | None = None) -> int:
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
    m = p.add_argument_group("Megatron output (--to megatron)")
    m.add_argument("--tensor-model-parallel-size", type=int, default=1)
    m.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    m.add_argument("--expert-model-parallel-size", type=int, default=1)
    m.add_argument("--expert-tensor-parallel-size", type=int, default=None, help="default: = TP")
    m.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    m.add_argument("--iteration", type=int, default=None, help="write iter_N (default: release)")
    args = p.parse_args(argv)

    from mlir_train.checkpoint.megatron import read as mc
    from mlir_train.runtime.errors import CheckpointError

    is_hf = os.path.exists(os.path.join(args.src, "config.json"))
    try:
        is_megatron = not is_hf and mc.is_megatron_dir(args.src)
        to = args.to or ("mlir-train" if is_hf else "hf")
        if to == "megatron":
            if is_megatron:
                raise mc.MegatronCheckpointError(f"{args.src} is already a Megatron checkpoint; convert it to HF first "
                                                 "to change its layout, or --load it directly (any layout)")
            trainer, params = _hf_params(args.src) if is_hf else _ours_params(args.src, args.step)
            layout = mc.MegatronLayout(args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
                                       args.expert_model_parallel_size, args.expert_tensor_parallel_size,
                                       args.make_vocab_size_divisible_by)
            files = to_megatron(trainer, params, args.dst, layout, iteration=args.iteration, dtype=args.dtype)
            print(f"mlir-train: wrote a Megatron legacy checkpoint ({len(files)} mp_rank files, TP{layout.tensor} "
                  f"PP{layout.pipeline} EP{layout.expert} ETP{layout.etp}) to {args.dst}")
        elif is_megatron:
            megatron_to(args.src, args.dst, to=to, step=args.step, vocab_size=args.vocab_size, dtype=args.dtype)
            print(f"mlir-train: wrote {'HF model' if to == 'hf' else 'checkpoint (weights only)'} to {args.dst}")
        elif is_hf:
            if to != "mlir-train":
                raise CheckpointError(f"{args.src} is already an HF directory (--to {to})")
            hf_to_checkpoint(args.src, args.dst)
            print(f"mlir-train: wrote checkpoint (iteration 0, weights only) to {args.dst}")
        else:
            if to != "hf":
                raise CheckpointError(f"{args.src}: a mlir-train checkpoint converts to hf or megatron (--to {to})")
            from mlir_train.checkpoint.orbax import has_checkpoint

            found = None if has_checkpoint(args.src) else mc.identify(args.src)
            if found:
                raise CheckpointError(f"{args.src}: {found}")
            checkpoint_to_hf(args.src, args.dst, step=args.step, dtype=args.dtype)
            print(f"mlir-train: wrote HF model to {args.dst}")
    except (CheckpointError, mc.MegatronCheckpointError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    from mlir_train.runtime.platform_setup import configure_platform

    configure_platform(cpu_devices=8)  # a CPU-only host converts through fake devices like the trainer does
    sys.exit(main())
