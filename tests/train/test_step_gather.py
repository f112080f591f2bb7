"""The compute-dtype weights are gathered once per step, not once per micro-batch (issue 24).

Megatron's distributed optimizer keeps its bf16 model weights whole over the data-parallel
ranks for the whole step and all-gathers the updated ones once. Under ``--use-distributed-optimizer``
(ZeRO-1: float32 master weights split over the data ranks) the step must likewise all-gather
them to the compute layout before the micro-batch accumulation loop, not inside it. Under FSDP
the gather stays inside the loop: not holding whole weights is its point.

Read from the compiled step's optimized HLO: the all-gathers of a parameter's compute shape
(whole, or one stacked layer) that sit in a computation reached from a ``while`` body (the
accumulation scan, and the layer scans within it) against those outside every loop, compiled
without XLA's loop-invariant code motion (which XLA:CPU applies to them and XLA:GPU does not).
Equality of the step with one device is ``tests/train/test_layouts.py``'s (its distributed
optimizer layout goes through the same path). ~15 s of CPU (four compiled steps of the dense model).
"""

from __future__ import annotations

import re

import jax
import pytest

from sharding.layout import Layout
from tests.helpers import COMPILER_OPTIONS, MODELS, collectives, packed_batch, train_one_step

# XLA:CPU hoists loop-invariant all-gathers out of a while loop by itself (XLA:GPU, as the
# communication audit shows, does not): compile without that pass so the HLO shows where the
# program places the gather.
NO_HOIST = {**COMPILER_OPTIONS, "xla_disable_hlo_passes":
            "while-loop-invariant-code-motion,while-loop-expensive-invariant-code-motion"}

_HEADER = re.compile(r"^(ENTRY )?%(\S+) .*\{$")
_CALLS = re.compile(r"(?:body|condition|calls|to_apply|true_computation|false_computation)=%([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_WHILE_BODY = re.compile(r"\bwhile\(.*body=%([\w.\-]+)")


def _computations(hlo: str) -> tuple[dict[str, str], str]:
    """HLO text by computation name, and the entry computation's name."""
    comps, entry, name, lines = {}, None, None, []
    for line in hlo.splitlines():
        m = _HEADER.match(line)
        if m:
            name, lines = m[2], []
            entry = name if m[1] else entry
        elif line.startswith("}") and name is not None:
            comps[name], name = "\n".join(lines), None
        elif name is not None:
            lines.append(line)
    return comps, entry


def _called(text: str) -> set[str]:
    out = set(_CALLS.findall(text))
    for group in _BRANCHES.findall(text):
        out.update(n.strip().lstrip("%") for n in group.split(","))
    return out


def _in_loops(hlo: str) -> tuple[str, str]:
    """(HLO of the computations reached from a while body, HLO of the rest)."""
    comps, _ = _computations(hlo)
    todo = [b for text in comps.values() for b in _WHILE_BODY.findall(text)]
    assert todo, "no while loop in the compiled step"
    seen = set()
    while todo:
        c = todo.pop()
        if c in seen or c not in comps:
            continue
        seen.add(c)
        todo.extend(_called(comps[c]))
    inside = "\n".join(comps[c] for c in seen)
    outside = "\n".join(t for c, t in comps.items() if c not in seen)
    return inside, outside


def _param_gathers(run, hlo: str) -> list[tuple[int, ...]]:
    """All-gathers in ``hlo`` that produce a parameter split over the data ranks in its compute
    shape (whole, or one layer of a stacked parameter)."""
    trainer, mesh = run.trainer, run.trainer.mesh
    is_spec = lambda x: isinstance(x, jax.sharding.PartitionSpec)
    compute = jax.tree.leaves(trainer.specs.compute, is_leaf=is_spec)
    stored = jax.tree.leaves(trainer.specs.optimizer, is_leaf=is_spec)
    shapes = set()
    for p, c_spec, s_spec in zip(jax.tree.leaves(trainer.param_shapes), compute, stored):
        c_shape = jax.sharding.NamedSharding(mesh, c_spec).shard_shape(p.shape)
        if jax.sharding.NamedSharding(mesh, s_spec).shard_shape(p.shape) != c_shape:
            shapes.update({c_shape, c_shape[1:]})
    return [s for op in collectives(hlo) if op.kind == "all-gather" for s in op.shapes if s in shapes]


@pytest.mark.parametrize("layout,hoisted", [
    (Layout(tensor=2, distributed_optimizer=True), True),   # DP4 x TP2, ZeRO-1
    (Layout(fsdp=True), False),                             # FSDP8
], ids=["DP4xTP2+distopt", "FSDP8"])
def test_weights_are_gathered_outside_the_accumulation_loop_unless_fsdp(layout, hoisted):
    run = train_one_step(MODELS["dense"], layout)
    batch = run.trainer.shard_batch(packed_batch(MODELS["dense"].vocab_size))
    hlo = run.trainer.lower_train_step(run.state, batch).compile(NO_HOIST).as_text()
    inside, outside = _in_loops(hlo)
    in_loop, before = _param_gathers(run, inside), _param_gathers(run, outside)
    if hoisted:
        assert before, "no weight all-gather outside the loops"
        assert not in_loop, f"weights all-gathered inside the accumulation loop (per micro-batch): {in_loop}"
    else:
        assert in_loop, "FSDP gathers its weights per use, inside the loop; none found there"
