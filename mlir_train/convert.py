"""``python -m mlir_train.convert SRC DST``: HF model directory <-> mlir-train checkpoint.

The direction follows SRC: an HF directory (``config.json`` + safetensors) becomes a
mlir-train checkpoint at iteration 0 holding the weights only (``--load DST`` then starts
training from them with a fresh optimizer); a mlir-train checkpoint directory (its newest
complete iteration, or ``--step N``) becomes an HF directory that
``transformers.AutoModelForCausalLM.from_pretrained`` loads.

Weights go shard by shard through the devices of a data-parallel mesh with the distributed
optimizer's layout, so no host or device ever holds the whole model. Megatron needs an offline
tool to change TP/PP/EP; our checkpoints load into any layout directly, so this converter only
changes the format.
"""

from __future__ import annotations

import argparse
import os
import sys


def _trainer(model_cfg):
    import optax

    from mlir_train.train import StepConfig, Trainer, model_dims
    from sharding.mesh import ParallelConfig, make_mesh, validate

    parallel = validate(ParallelConfig(distributed_optimizer=True), model_dims(model_cfg))
    return Trainer(model_cfg, StepConfig(), optax.identity(), parallel, make_mesh(parallel))


def hf_to_checkpoint(src: str, dst: str) -> None:
    import numpy as np
    from flax import nnx

    from mlir_train import checkpoint
    from mlir_train.config import ModelConfig
    from mlir_train.hf import load_pretrained

    trainer = _trainer(ModelConfig.from_hf_json(src))
    model = load_pretrained(src, dtype=np.float32, mesh=trainer.mesh, rules=trainer.rules)
    params = trainer.state_from_params(nnx.to_pure_dict(nnx.state(model)))["params"]
    mgr = checkpoint.CheckpointManager(dst)
    if mgr.latest_step() is not None:
        raise checkpoint.CheckpointError(f"{dst} already holds checkpoints {mgr.steps()}; give an empty directory")
    import dataclasses

    mgr.save(0, {"params": params}, {"model": dataclasses.asdict(trainer.model_cfg), "consumed_samples": 0,
                                     "converted_from": os.path.abspath(src)}, force=True)
    mgr.close()


def checkpoint_to_hf(src: str, dst: str, *, step: int | None = None, dtype: str | None = None) -> None:
    import jax.numpy as jnp

    from mlir_train import checkpoint
    from mlir_train.hf import save_pretrained

    meta = checkpoint.CheckpointManager(src, read_only=True).read_meta(step)
    trainer = _trainer(checkpoint.model_config(meta))
    state, meta = checkpoint.load_state(src, trainer, load_optim=False, step=meta["iteration"])
    save_pretrained(trainer.model(state["params"]), dst, dtype=None if dtype is None else jnp.dtype(dtype))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m mlir_train.convert", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("src", help="HF model directory or mlir-train checkpoint directory")
    p.add_argument("dst", help="output directory")
    p.add_argument("--step", type=int, default=None, help="checkpoint iteration to export (default: the newest)")
    p.add_argument("--dtype", default=None, choices=["bfloat16", "float16", "float32"],
                   help="HF export dtype (default: float32, the master weights)")
    args = p.parse_args(argv)

    from mlir_train.errors import CheckpointError

    try:
        if os.path.exists(os.path.join(args.src, "config.json")):
            hf_to_checkpoint(args.src, args.dst)
            print(f"mlir-train: wrote checkpoint (iteration 0, weights only) to {args.dst}")
        else:
            checkpoint_to_hf(args.src, args.dst, step=args.step, dtype=args.dtype)
            print(f"mlir-train: wrote HF model to {args.dst}")
    except (CheckpointError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    from mlir_train.platform import configure_platform

    configure_platform(cpu_devices=8)  # a CPU-only host converts through fake devices like the trainer does
    sys.exit(main())
