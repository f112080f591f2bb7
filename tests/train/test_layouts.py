"""Every parallel layout trains exactly like one device, and is really parallel.

For the tiny MoE model (and the dense tiny model under TP + SP) in float32, one optimizer step
(two micro-batches of packed rows, Megatron's Adam with clipping and weight decay, warmup 0 so
the step moves the weights) is taken on a 1-device mesh and on each layout of issue 5 over the
8 fake CPU devices, from the same seed on the same batch, under Megatron's default loss
normalisation (per data-parallel micro-batch) and, for two layouts, under
``--calculate-per-token-loss``. Compared:

* the initial weights ``init_state(seed)`` gives, born sharded: bit-identical (the RNG is
  partitionable, so sharding the init changes nothing);
* ``lm loss`` and ``grad-norm``: rtol 1e-5. A layout only reorders float32 sums (partial sums
  over tensor ranks, the gradient all-reduce over data ranks, the expert all-to-all); measured
  differences are ~1e-7 relative.
* the gradients, read back from Adam's first moment after the step (``mu = (1 - beta1) * g``
  with g the clipped gradient): within ``1e-5 * max|mu|`` of each tensor (measured <= 1.1e-6).
  Adam's *update* is nearly blind to gradient errors (it is ``lr * g / (|g| + eps)``: a
  gradient twice too large moves the weight the same), so the gradients are compared directly;
* the updated weights, in two parts. Where the reference gradient is |g| >= 1e-6 (100 x Adam's
  eps) the first step ``lr * g / (|g| + eps)`` is insensitive to float32 noise in g: within
  ``1e-3 * lr`` (measured <= 1.2e-4 * lr). Below that, g is itself at the level of the
  summation noise (a router column no token picks, a near-cancelling sum), and Adam scales it
  up to a step anywhere in ``±lr``: within ``0.25 * lr`` (measured <= 0.07 * lr, in a few dozen
  of ~600k weights).

The same compiled steps are then read for their collectives (``Compiled.as_text()``): the
SPMD partitioner must have emitted what each layout is supposed to cost, and the state they
return must really be split (per-device bytes of the parameter and optimizer-state shards).

Under XLA:CPU there is no reduce-scatter in any of these programs (measured on jax 0.10.2):
CPU lowers a reduce-scatter to an all-reduce followed by a dynamic-slice of the local shard.
So the SP and ZeRO checks look for the other half of the pattern, which does show up: the
all-gather over the tensor ranks that SP inserts in front of each TP region, and the
all-gathers of the ZeRO-sharded master weights back to the compute layout.

Finally three iterations through the CLI (``mlir_train.sft.main``) on the bundled data agree
in ``metrics.jsonl`` between pure DP and TP2 x EP2 x DP2 with SP and the distributed
optimizer.

Timing (2 cores): the module takes ~50 s of CPU: ~27 s for the nine compiled steps (LLVM -O0,
see ``COMPILER_OPTIONS``; 171 s with the default -O2), ~20-40 s for the two CLI runs.
"""

from __future__ import annotations

import collections
import functools

import jax
import numpy as np
import pytest

from mlir_train.model import ModelOptions
from sharding.table import held_bytes
from sharding.layout import Layout
from tests.helpers import Collective, MODELS, ROWS, SEQ, StepResult, assert_step_matches, cli_metrics, collectives, train_one_step

MODELS["moe-loop"] = MODELS["moe-ragged"] = MODELS["moe"]
# Issue 5's layouts on 8 devices (Megatron sizes: DP = 8 / TP, EP carved out of DP).
LAYOUTS = {
    "DP8": Layout(),
    "TP2xDP4": Layout(tensor=2),
    "TP2xDP4+SP": Layout(tensor=2, sequence_parallel=True),
    "EP2xDP4": Layout(expert=2),
    "EP4xTP2": Layout(tensor=2, expert=4),
    "TP2xEP2xDP2+distopt": Layout(tensor=2, expert=2, distributed_optimizer=True),
    "FSDP8": Layout(fsdp=True),  # weights themselves split over the data ranks
}
SINGLE = "1 device"
# "moe-loop": the same model with the dropless experts' block loop forced (the form larger
# expert matmuls take; this tiny one would take the batched form), under tensor parallelism.
# "moe-ragged": the experts as ``ragged_dot`` groups (the GPU/TPU path) with its custom gradient,
# inside the pure-DP manual region.
CASES = [("moe", name) for name in LAYOUTS] + [("dense", "TP2xDP4+SP"), ("moe-loop", "TP2xDP4"), ("moe-ragged", "DP8")]
PER_TOKEN_CASES = [("moe", "DP8"), ("moe", "TP2xDP4")]


@functools.cache
def run_step(model: str, layout: str, per_token: bool = False) -> StepResult:
    """One train step of ``model`` on ``layout`` (or on ``SINGLE``), compiled once and cached
    for the module: the equivalence, collective and memory tests all read the same run."""
    options = {"moe-ragged": ModelOptions(moe_impl="ragged"), "moe-loop": ModelOptions(moe_block_loop=True)}.get(model)
    return train_one_step(MODELS[model], None if layout == SINGLE else LAYOUTS[layout], options, per_token)


@pytest.fixture(scope="module", autouse=True)
def _forget_runs():
    """The cached runs hold compiled programs and device state: drop them with the module."""
    yield
    run_step.cache_clear()


# ----- one step equals one device ------------------------------------------------------------


@pytest.mark.parametrize("model,layout,per_token", [(m, l, False) for m, l in CASES] + [(m, l, True) for m, l in PER_TOKEN_CASES],
                         ids=[f"{m}-{l}" for m, l in CASES] + [f"{m}-{l}-per-token" for m, l in PER_TOKEN_CASES])
def test_step_matches_single_device(model, layout, per_token):
    ref = run_step("moe" if model.startswith("moe") else model, SINGLE, per_token)
    assert_step_matches(run_step(model, layout, per_token), ref, moe=model.startswith("moe"))


def test_the_two_loss_normalisations_differ_on_this_batch():
    """Otherwise the per-token cases above would only repeat the default ones."""
    default, per_token = run_step("moe", SINGLE, False), run_step("moe", SINGLE, True)
    for key in ("lm loss", "grad-norm"):  # lm loss: each mode reports its own objective
        assert abs(default.metrics[key] / per_token.metrics[key] - 1) > 1e-4, key


# ----- collectives in the compiled step --------------------------------------------------------


def _has(ops: list[Collective], kind: str, group: int) -> bool:
    return any(op.kind == kind and op.group == group for op in ops)


def _summary(ops: list[Collective]) -> str:
    return str(sorted(collections.Counter((op.kind, op.group) for op in ops).items(), key=str))


# (kind, ranks per group) the compiled step must contain, and why.
EXPECTED = {
    "DP8": [("all-reduce", 8)],                             # gradients over 8 data ranks
    "TP2xDP4": [("all-reduce", 2), ("all-reduce", 4)],      # row-parallel partial sums; gradients over DP4
    "TP2xDP4+SP": [("all-gather", 2), ("all-reduce", 4)],   # the sequence gathered before each TP region
    "EP2xDP4": [("all-to-all", 2), ("all-reduce", 8)],      # token dispatch/combine; dense grads over DP8
    "EP4xTP2": [("all-to-all", 4), ("all-reduce", 2)],
    "TP2xEP2xDP2+distopt": [("all-to-all", 2), ("all-reduce", 2), ("all-gather", 4)],  # ZeRO gathers over DP4
    "FSDP8": [("all-gather", 8)],  # every weight gathered from its 8 shards for compute
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_collectives_of_each_layout(layout):
    ops = collectives(run_step("moe", layout).hlo)
    for kind, group in EXPECTED[layout]:
        assert _has(ops, kind, group), f"{layout}: no {kind} over {group} ranks in the compiled step; has {_summary(ops)}"
    if LAYOUTS[layout].expert == 1:
        assert not any(op.kind == "all-to-all" for op in ops), f"{layout}: all-to-all without expert parallelism"


@pytest.mark.parametrize("layout", ["DP8", "TP2xDP4", "TP2xDP4+SP"])
def test_pure_data_parallel_moe_keeps_tokens_on_their_rank(layout):
    """Without expert ranks each data rank routes and runs its own tokens: nothing (tokens,
    routing, replicated expert weights) is all-gathered over the data ranks. Left to XLA,
    the sort by expert over the global batch gathered everything to every rank."""
    parallel = LAYOUTS[layout]
    data = 8 // parallel.tensor
    ops = collectives(run_step("moe", layout).hlo)
    assert not _has(ops, "all-gather", data), f"{layout}: all-gather over the {data} data ranks: {_summary(ops)}"


def test_sequence_parallel_gathers_the_sequence_over_tensor_ranks():
    """TP without SP keeps the residual stream whole on every tensor rank: no all-gather over
    the 2 tensor ranks at all. SP splits it along the sequence, so each TP region starts with
    one (and ends with the all-reduce + dynamic-slice XLA:CPU uses for a reduce-scatter)."""
    plain = collectives(run_step("moe", "TP2xDP4").hlo)
    sp = collectives(run_step("moe", "TP2xDP4+SP").hlo)
    assert not _has(plain, "all-gather", 2), _summary(plain)
    gathers = [op for op in sp if op.kind == "all-gather" and op.group == 2]
    # Residual-stream activations: [rows per data rank, SEQ, hidden] once gathered.
    assert any((ROWS // 4, SEQ, MODELS["moe"].hidden_size) in op.shapes for op in gathers), gathers


def test_distributed_optimizer_gathers_master_weights_to_the_compute_layout():
    """ZeRO-1: master weights live split over the data ranks; the step all-gathers each one
    back to its compute layout (whole, or one stacked layer at a time inside the layer scan)."""
    run = run_step("moe", "TP2xEP2xDP2+distopt")
    trainer, mesh = run.trainer, run.trainer.mesh
    gathered = {s for op in collectives(run.hlo) if op.kind == "all-gather" for s in op.shapes}
    is_spec = lambda x: isinstance(x, jax.sharding.PartitionSpec)
    compute = jax.tree.leaves(trainer.specs.compute, is_leaf=is_spec)
    master = jax.tree.leaves(trainer.state_shardings["params"], is_leaf=lambda x: isinstance(x, jax.sharding.NamedSharding))
    split, missing = 0, []
    shapes = [(jax.tree_util.keystr(p, simple=True, separator="/"), x)
              for p, x in jax.tree_util.tree_flatten_with_path(trainer.param_shapes)[0]]
    for (path, shape), c_spec, m_sharding in zip(shapes, compute, master):
        compute_shape = jax.sharding.NamedSharding(mesh, c_spec).shard_shape(shape.shape)
        if m_sharding.shard_shape(shape.shape) == compute_shape:
            continue  # nothing divides: replicated over the data ranks, nothing to gather
        split += 1
        per_layer = compute_shape[1:] if path.startswith("layers/") else None
        if compute_shape not in gathered and per_layer not in gathered:
            missing.append((path, compute_shape))
    assert split >= 10, "the distributed optimizer split (almost) nothing"
    assert not missing, f"ZeRO-split weights never all-gathered to their compute shape: {missing}"


# ----- the state is really split ----------------------------------------------------------------


device_bytes = held_bytes  # bytes of a tree's shards on its fullest device


def test_parameters_and_optimizer_state_are_split():
    total = device_bytes(run_step("moe", SINGLE).state["params"])  # one whole float32 copy
    params = {name: device_bytes(run_step("moe", name).state["params"]) / total for name in LAYOUTS}
    opt = {name: device_bytes(run_step("moe", name).state["opt_state"]) / (2 * total) for name in LAYOUTS}  # mu + nu
    report = f"per-device fraction of the whole: params {params}, Adam state {opt}"
    assert params["DP8"] == pytest.approx(1.0) and opt["DP8"] == pytest.approx(1.0, abs=1e-3), report  # DDP: replicated
    # TP2 halves every weight except norms and the router (a few percent of the bytes).
    assert 0.5 < params["TP2xDP4"] < 0.55 and opt["TP2xDP4"] == pytest.approx(params["TP2xDP4"], abs=1e-3), report
    # EP4 x TP2: experts split 8 ways on top of TP2 for the rest.
    assert params["EP4xTP2"] < 0.4, report
    # ZeRO-1 over DP4 (DP2 for experts, already split over EP) on top of TP2: master weights and
    # both moments shrink ~8x against DP8 without the distributed optimizer (norm scales split
    # 4 ways only: they are not tensor-parallel).
    assert params["TP2xEP2xDP2+distopt"] < 0.14 and opt["TP2xEP2xDP2+distopt"] < 0.14, report
    # FSDP over 8 data ranks: weights and moments both ~1/8 (tiny norm vectors may not divide).
    assert params["FSDP8"] < 0.2 and opt["FSDP8"] < 0.2, report
    # And each array's shards are what the layout's specs say (no silent replication).
    for name in LAYOUTS:
        state, shardings = run_step("moe", name).state, run_step("moe", name).trainer.state_shardings
        for x, sharding in zip(jax.tree.leaves(state["params"]), jax.tree.leaves(shardings["params"])):
            assert x.sharding.is_equivalent_to(sharding, x.ndim), (name, x.sharding, sharding)


# ----- the CLI -----------------------------------------------------------------------------------


@pytest.mark.slow  # ~50 s cold; each layout's step is in test_step_matches_single_device
def test_cli_iterations_agree_across_layouts(tmp_path):
    # Both runs take 2 micro-batches of the same 8 rows (DP8 x 1 and DP4 x 2): the MoE aux loss
    # is formed per micro-batch (as Megatron's), so a different split would change it. So would
    # a different --micro-batch-size under Megatron's default loss normalisation (per data-parallel
    # micro-batch), hence --calculate-per-token-loss: the step tests above cover the default.
    per_token = ["--calculate-per-token-loss"]
    dp = cli_metrics(tmp_path, "dp", ["--micro-batch-size", "1", *per_token])
    runs = {
        "tp-ep-sp-distopt": ["--micro-batch-size", "2", "--tensor-model-parallel-size", "2",
                             "--expert-model-parallel-size", "2", "--sequence-parallel", "--use-distributed-optimizer"],
        # Megatron's FSDP spellings: parameters sharded over the data ranks as well.
        "fsdp2": ["--micro-batch-size", "1", "--use-torch-fsdp2"],
        "megatron-fsdp-tp": ["--micro-batch-size", "2", "--tensor-model-parallel-size", "2", "--use-megatron-fsdp",
                             "--data-parallel-sharding-strategy", "optim_grads_params"],
    }
    for name, flags in runs.items():
        par = cli_metrics(tmp_path, name, [*flags, *per_token])
        assert [r["iteration"] for r in dp] == [r["iteration"] for r in par] == [1, 2, 3]
        for a, b in zip(dp, par):
            # Measured <= 2e-7 relative over the 3 iterations; the margin is for Adam's ±lr steps on
            # near-zero gradients (see the module docstring), which compound over iterations.
            for key in ("lm loss", "grad-norm", "load_balancing_loss"):
                np.testing.assert_allclose(b[key], a[key], rtol=1e-5, err_msg=f"{name} iteration {a['iteration']} {key}")
            assert a["loss tokens"] == b["loss tokens"]
    assert dp[-1]["lm loss"] < dp[0]["lm loss"]


def test_cli_fsdp_with_pipeline_is_refused_by_name(tmp_path, capsys):
    with pytest.raises(SystemExit):
        cli_metrics(tmp_path, "fsdp-pp", ["--micro-batch-size", "1", "--use-torch-fsdp2",
                                           "--pipeline-model-parallel-size", "2"])
    err = capsys.readouterr().err
    assert "--use-torch-fsdp2" in err and "--pipeline-model-parallel-size" in err
