"""Qwen3.5 / Qwen3-Next through pipeline stages equal one device: the 3:1 DeltaNet / attention
stack split over the stages, the stage program keyed by layer kind (a chunk's runs line up on
the stacks' kind period, ``mlir_train.train.pipeline.program.stage_program``).

One optimizer step on ``tests/train/test_layouts.py``'s packed batch, compared with the
one-device step under :func:`tests.helpers.assert_step_matches` (loss, grad norm, router
statistics, gradients, updated parameters). The splits: an uneven one that breaks the period
(4 layers as [D D D] | [A]: each stage pads the run it lacks), an even one (8 layers, a whole
period per stage), interleaved 1F1B (2 stages x 2 chunks of 2 layers: [D D] [D A] per stage),
Megatron's --decoder-first-pipeline-num-layers 3 of 8 ([D D D] | [A D D D A]), Qwen3-Next's
dense first layer (four layer kinds). PP x CP is refused for the family (see
``tests/train/test_qwen3_5_layouts.py``). The step cases are slow (see below).
"""

from __future__ import annotations

import functools
import time

import numpy as np
import pytest

from mlir_train.families import get_model_config
from mlir_train.train.pipeline import make_schedule, stage_program
from mlir_train.model.periods import layer_stacks
from sharding.layout import Layout
from tests.helpers import assert_step_matches, train_one_step
from tests.train.test_qwen3_5_layouts import _largest_differences


def _cfg(name: str, layers: int):
    return get_model_config(name, vocab_size=512, num_layers=layers)


CASES = {  # name: (model, layers, pipeline schedule arguments)
    "moe4-PP2-1f1b-3|1": ("qwen3.5-moe-tiny", 4, dict(kind="1f1b", first_stage_layers=3)),
    "moe8-PP2-1f1b": ("qwen3.5-moe-tiny", 8, dict(kind="1f1b")),
    "moe8-PP2-interleaved": ("qwen3.5-moe-tiny", 8, dict(kind="1f1b", virtual=2)),
    "moe8-PP2-1f1b-first3": ("qwen3.5-moe-tiny", 8, dict(kind="1f1b", first_stage_layers=3)),
    "next8-PP2-interleaved": ("qwen3-next-tiny", 8, dict(kind="1f1b", virtual=2)),
    "next4-PP2-1f1b": ("qwen3-next-tiny", 4, dict(kind="1f1b")),
}


@functools.cache
def _reference(model: str, layers: int):
    return train_one_step(_cfg(model, layers), None)


# Every step case is slow: a pipelined step of the mixed stack took 450-600 s to compile and run on
# the 2 shared cores (load 8), the one-device reference ~60 s more. The default suite keeps the stage
# program (below) and the pipeline-mesh checkpoint round trip (tests/checkpoint/test_hf_qwen3_5.py).
@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_pipelined_step_matches_single_device(name):
    model, layers, pipeline = CASES[name]
    ref = _reference(model, layers)
    start = time.perf_counter()
    got = train_one_step(_cfg(model, layers), Layout(pipeline=2), pipeline=pipeline)
    seconds = time.perf_counter() - start
    assert_step_matches(got, ref, moe=True)
    assert "collective-permute" in got.hlo
    print(f"{name}: {seconds:.0f} s; " + _largest_differences(got, ref))


def test_stage_program_follows_the_kind_period():
    """Qwen3.5's 48 layers over 4 stages: 12 layers a stage, three whole periods, so the
    program is [D x 3, A x 1] x 3 with no padding; 8 layers as 3 | 5 pad the short stage's
    missing runs."""
    kinds = layer_stacks(_cfg("qwen3.5-moe-tiny", 48))
    program = stage_program(make_schedule(48, 4), kinds)
    assert [(s.kind.mixer, s.slots) for s in program] == [("gated_deltanet", 3), ("attention", 1)] * 3
    assert all(s.active.all() for s in program)
    # MoE rows of stage 1's first attention layer (layer 15): the router order is the layer order
    assert program[1].moe_rows[1, 0, 0] == 15
    kinds = layer_stacks(_cfg("qwen3.5-moe-tiny", 8))
    program = stage_program(make_schedule(8, 2, first_stage_layers=3), kinds)
    assert [(s.kind.mixer, s.slots) for s in program] == [("gated_deltanet", 3), ("attention", 1)] * 2
    np.testing.assert_array_equal([s.active[0, 0].sum() for s in program], [3, 0, 0, 0])
    np.testing.assert_array_equal([s.active[1, 0].sum() for s in program], [0, 1, 3, 1])
