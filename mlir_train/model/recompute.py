"""What the backward pass recomputes instead of keeping: megatron-core 0.16's recompute controls.

One frozen :class:`RecomputePolicy` is built from the flags (``--recompute-granularity``,
``--recompute-method``, ``--recompute-num-layers``, ``--recompute-modules``,
``--moe-layer-recompute``) and handed to the model; nothing else changes the numbers, only
what the compiled step saves for its backward (``tests/model/test_recompute.py`` checks both).

* **full** granularity checkpoints whole decoder layers (``jax.checkpoint`` that saves nothing
  but its inputs). ``method="uniform"`` with ``num_layers=N`` splits each pipeline chunk's
  layers (the whole stack without a pipeline) into groups of N and checkpoints each group's
  input: the group is recomputed at once in the backward. ``method="block"`` checkpoints only
  the first N layers of each chunk, one by one; the others keep their activations.
  ``method=None`` (megatron-core requires a method) is every layer on its own, the same as
  uniform with N = 1.
* **selective** granularity recomputes submodules (:data:`MODULES`, default ``core_attn``):
  ``core_attn``, ``mlp`` and ``moe`` are normal checkpoints (a nested ``jax.checkpoint``
  around the submodule: its input is kept, its insides recomputed); ``layernorm`` and
  ``moe_act`` are megatron-core's *output-discarding* checkpoints: the module and the matmuls
  that consume its output form one checkpoint, whose backward reruns only the module (a
  matmul's output is not needed to differentiate it), so the module's output is not kept for
  those matmuls' weight gradients: the norms keep only the residual stream they read (in MoE
  layers the dropless experts still keep the normed tokens), the expert activation only its
  two fc1 outputs. (Under sequence parallelism the attention's is what the step does anyway:
  its projections' gathered input is gathered again in the backward, as Megatron's
  column-parallel linears do, and the input norm reruns with it; every RMSNorm reruns from its
  input rather than keep its float32 upcast.) (A name-based ``jax.checkpoint`` policy cannot do this: a value not saved
  under its name is saved as its producer's output, and a checkpoint nested in one with a
  policy takes the outer policy.)

Where a group of ``uniform`` would cross from a dense into an MoE stack (layers of one kind
are scanned as one stack), it is checkpointed as two pieces; in a pipeline whose stages
start a stack at different chunk positions, the pieces are split at every stage's group
boundary, and ``block`` recomputes a slot on every stage if it is among the first N layers on
any stage (one SPMD program runs on all stages).
"""

from __future__ import annotations

from collections.abc import Callable

import jax


def checkpointed(fn: Callable, on: bool) -> Callable:
    """``fn`` as a normal checkpoint (inputs kept, insides recomputed in the backward) if ``on``."""
    return jax.checkpoint(fn, policy=jax.checkpoint_policies.nothing_saveable) if on else fn
