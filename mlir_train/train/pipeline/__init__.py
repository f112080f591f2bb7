"""Pipeline parallelism inside the one compiled train step: 1F1B (plain and interleaved),
GPipe and circular schedules, over even, uneven and mixed dense/MoE stages.

* :mod:`.schedule`: the :class:`Schedule` Megatron's flags ask for, and what each costs;
* :mod:`.program`: the stage program (which layers each chunk runs) and the weights' storage;
* :mod:`.stage`: what every schedule runs on a stage (setup, chunk forward, router terms);
* :mod:`.one_f_one_b`: 1F1B, plain and interleaved, with its own backward;
* :mod:`.gpipe`: GPipe and circular, autodiff through the tick scan (and evaluation).
"""

from mlir_train.train.pipeline.gpipe import pipeline_loss
from mlir_train.train.pipeline.one_f_one_b import pipeline_value_and_grad
from mlir_train.train.pipeline.program import Segment, stage_program, storage_axes
from mlir_train.train.pipeline.schedule import SCHEDULES, Schedule, from_stages, make_schedule, to_stages

__all__ = ["SCHEDULES", "Schedule", "Segment", "from_stages", "make_schedule", "pipeline_loss",
           "pipeline_value_and_grad", "stage_program", "storage_axes", "to_stages"]
