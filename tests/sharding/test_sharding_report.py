"""mlir_train.train.sharding_report.sharding_report: every array listed, per-device bytes right. Nothing compiles."""

import math

import jax
import pytest

from mlir_train.families import get_model_config
from mlir_train.train.sharding_report import sharding_report
from mlir_train.train.optim import make_optimizer
from mlir_train.train.trainer import StepConfig, Trainer
from mlir_train.train.build import build_trainer
from sharding.mesh import make_mesh
from sharding.layout import Layout

TINY = get_model_config("qwen3-moe-tiny", vocab_size=512, num_layers=2)


def _trainer(parallel: Layout, compute_dtype: str = "float32") -> Trainer:
    optimizer = make_optimizer(lr_schedule=1e-3, weight_decay=0.1)
    return build_trainer(TINY, StepConfig(compute_dtype=compute_dtype), optimizer, parallel, make_mesh(parallel))


def _sections(report: str) -> dict[str, str]:
    """Section title (first words after '== ') -> its text."""
    blocks = [b for b in report.split("\n\n") if b.startswith("== ")]
    return {b.split("\n", 1)[0][3:].split(",")[0]: b for b in blocks}


def _row(section: str, path: str) -> list[str]:
    (line,) = [ln for ln in section.splitlines() if ln.split("  ")[0].strip() == path]
    return line.split()


def _param_paths(trainer: Trainer) -> list[str]:
    return [jax.tree_util.keystr(p, simple=True, separator="/")
            for p, _ in jax.tree_util.tree_flatten_with_path(trainer.param_shapes)[0]]


def test_every_parameter_in_every_layout():
    trainer = _trainer(Layout(tensor=2, expert=2, distributed_optimizer=True))
    sections = _sections(sharding_report(trainer))
    assert set(sections) == {"parameters", "float32 master weights", "optimizer state"}
    paths = _param_paths(trainer)
    assert len(paths) == 15
    for path in paths:
        _row(sections["parameters"], path)
        _row(sections["float32 master weights"], path)
        _row(sections["optimizer state"], f"1/mu/{path}")  # Adam's first and second moments
        _row(sections["optimizer state"], f"1/nu/{path}")


@pytest.mark.parametrize("compute_dtype,itemsize", [("float32", 4), ("bfloat16", 2)])
def test_per_device_bytes_of_a_tensor_parallel_weight(compute_dtype, itemsize):
    """q_proj [layers 2, embed 128, q_heads 4, head_dim 32] is column-parallel: heads split over
    TP2. Its ZeRO-1 master copy and moments are further split over the 4 data ranks (data x
    expert) on the largest free dimension, the embedding dimension."""
    trainer = _trainer(Layout(tensor=2, expert=2, distributed_optimizer=True), compute_dtype)
    sections = _sections(sharding_report(trainer))
    row = _row(sections["parameters"], "layers/0/attn/q_proj")
    assert "(2, 128, 2, 32)" in " ".join(row) and compute_dtype in row
    assert " ".join(row[-2:]) == f"{2 * 128 * 2 * 32 * itemsize / 1024:.2f} KiB"
    for section, path in (("float32 master weights", "layers/0/attn/q_proj"), ("optimizer state", "1/nu/layers/0/attn/q_proj")):
        row = _row(sections[section], path)
        assert "(2, 32, 2, 32)" in " ".join(row)
        assert " ".join(row[-2:]) == f"{2 * 32 * 2 * 32 * 4 / 1024:.2f} KiB"


@pytest.mark.parametrize("parallel,master_split", [
    (Layout(), 1.0),                      # DDP: the whole state on every device
    (Layout(tensor=2, expert=2, distributed_optimizer=True), 8.0),
])
def test_state_total_per_device(parallel, master_split):
    """The last line's totals equal the shard shapes jax itself gives for the state shardings."""
    trainer = _trainer(parallel)
    shard_bytes = lambda shapes, shardings: sum(
        math.prod(sh.shard_shape(s.shape)) * s.dtype.itemsize
        for s, sh in zip(jax.tree.leaves(shapes), jax.tree.leaves(shardings)))
    master = shard_bytes(trainer.param_shapes, trainer.state_shardings["params"])
    opt = shard_bytes(jax.eval_shape(trainer.optimizer.init, trainer.param_shapes), trainer.state_shardings["opt_state"])
    last = sharding_report(trainer).splitlines()[-1]
    mib = lambda n: f"{n / 2**20:.3f} MiB"
    assert last == f"training state per device: {mib(master)} master weights + {mib(opt)} optimizer state = {mib(master + opt)}"
    whole = sum(math.prod(s.shape) * 4 for s in jax.tree.leaves(trainer.param_shapes))
    # ZeRO over DP4 on top of TP2 / EP2: ~8x, a little less as the norm scales are not TP-split.
    assert whole / master == pytest.approx(master_split, rel=0.02)
