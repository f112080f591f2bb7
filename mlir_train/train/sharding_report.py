"""Where a :class:`~mlir_train.train.trainer.Trainer`'s arrays live, as one printable report.

``sharding_report(trainer)`` is the notebook-sized version of ``--print-sharding``: for every
parameter its shape, dtype, logical axes, mesh spec and per-device shape and bytes, in the three
layouts a training step uses:

1. the compute copy the forward/backward runs on (in the compute dtype; made inside the step);
2. the float32 master weights as stored between steps (split over the data ranks as well under
   FSDP, and under ``--use-distributed-optimizer``, which counts them as optimizer state as
   Megatron does);
3. the optimizer state (Adam's moments, step counts), ZeRO-1-split over the data ranks under
   ``--use-distributed-optimizer``, replicated over them otherwise;

and a last line with what the state costs each device. Everything is computed from the
trainer's abstract shapes and specs (``sharding.table``): nothing is allocated or compiled,
so it works for a full-size model on a laptop.
"""

from __future__ import annotations

from typing import Any

import jax
import optax

from mlir_train.train.trainer import DTYPES, Trainer
from sharding.table import sharding_rows, sharding_table


def _specs(shardings: Any) -> Any:
    return jax.tree.map(lambda s: s.spec, shardings)


def _state_trees(trainer: Trainer) -> dict[str, tuple[Any, Any, Any]]:
    """``section title -> (shapes, logical axes, specs)`` for the three layouts."""
    compute_dtype = DTYPES[trainer.step_cfg.compute_dtype]
    compute_shapes = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, compute_dtype), trainer.param_shapes)
    opt_shapes = jax.eval_shape(trainer.optimizer.init, trainer.param_shapes)
    opt_logical = optax.tree_map_params(
        trainer.optimizer, lambda _, names: names, opt_shapes, trainer.logical, transform_non_params=lambda _: None
    )
    master_note = "split like the optimizer state" if trainer.parallel.distributed_optimizer or trainer.parallel.fsdp else "laid out like the parameters"
    return {
        f"parameters, compute layout ({compute_dtype.dtype.name}, as the forward/backward uses them)":
            (compute_shapes, trainer.logical, trainer.specs.compute),
        f"float32 master weights, stored between steps ({master_note})":
            (trainer.param_shapes, trainer.logical, _specs(trainer.state_shardings["params"])),
        "optimizer state": (opt_shapes, opt_logical, _specs(trainer.state_shardings["opt_state"])),
    }


def sharding_report(trainer: Trainer) -> str:
    """The parameter, master-weight and optimizer-state sharding tables of ``trainer``, and
    the per-device bytes of the training state (master weights + optimizer state)."""
    mesh = trainer.mesh
    sections, per_device = [], []
    for title, (shapes, logical, specs) in _state_trees(trainer).items():
        sections.append(f"== {title}\n{sharding_table(shapes, logical, specs, mesh)}")
        per_device.append(sum(r["device_bytes"] for r in sharding_rows(shapes, logical, specs, mesh)))
    _, master, opt = per_device
    mib = lambda n: f"{n / 2**20:.3f} MiB"
    sections.append(
        f"training state per device: {mib(master)} master weights + {mib(opt)} optimizer state = {mib(master + opt)}"
    )
    return "\n\n".join(sections)
