"""One stack per layer kind and one scan over the layer pattern's periods
(mlir_train/model/periods.py, transformer.run_layers).

* the plan: Qwen3.5's 3:1 pattern is one period scan; a remainder that breaks the period, Qwen3's
  ``mlp_only_layers`` and a recompute policy whose checkpoints differ per period run as runs;
* the compiled program: an 8-layer 3:1 model's forward is one scan over its 2 periods;
* the numbers: forward, router stats and every gradient equal running each run as its own scan
  (the previous program), float32;
* an orbax checkpoint of the old one-stack-per-run tree is refused by name.
The pipelined steps (PP2 1F1B and interleaved, which store the same per-kind stacks) are
tests/train/test_qwen3_5_pipeline.py's.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mlir_train.checkpoint.orbax import LAYER_STORAGE, check_layer_storage
from mlir_train.config.policies import RecomputePolicy
from mlir_train.families import build_model, get_model_config
from mlir_train.model import ModelOptions
from mlir_train.model import transformer
from mlir_train.model.periods import PeriodScan, decoder_plan, layer_runs, layer_stacks
from mlir_train.runtime.errors import CheckpointError


def _cfg(layers: int, name: str = "qwen3.5-moe-tiny"):
    return get_model_config(name, vocab_size=512, num_layers=layers)


def _shape(plan):
    return [("period", [(r.kind.mixer, r.count) for r in x.runs], x.reps) if isinstance(x, PeriodScan)
            else (x.kind.mixer, x.count) for x in plan]


def test_stacks_are_one_per_kind_in_layer_order():
    stacks = layer_stacks(_cfg(8))
    assert [(s.kind.mixer, s.layers) for s in stacks] == [("gated_deltanet", (0, 1, 2, 4, 5, 6)), ("attention", (3, 7))]
    assert len(layer_stacks(get_model_config("qwen3-moe-tiny"))) == 1  # Qwen3: one stack, as before


def test_the_plan_scans_whole_periods_and_runs_the_rest():
    assert _shape(decoder_plan(layer_stacks(_cfg(40)))) == [("period", [("gated_deltanet", 3), ("attention", 1)], 10)]
    # 10 layers: two periods, then D D (a remainder that breaks the period)
    assert _shape(decoder_plan(layer_stacks(_cfg(10)))) == [
        ("period", [("gated_deltanet", 3), ("attention", 1)], 2), ("gated_deltanet", 2)]
    # Qwen3 with mlp_only_layers: dense 0 1, then (moe, dense) x 3 from layer 2, then moe
    cfg = get_model_config("qwen3-moe-tiny", num_layers=9, decoder_sparse_step=1, mlp_only_layers=(0, 1, 3, 5, 7))
    plan = decoder_plan(layer_stacks(cfg))
    assert [isinstance(x, PeriodScan) for x in plan] == [False, True, False]
    assert (plan[0].count, plan[1].reps, plan[1].runs[0].first, plan[2].first) == (2, 3, 2, 8)
    assert sum(x.layers * x.reps if isinstance(x, PeriodScan) else x.count for x in plan) == 9


def test_recompute_that_differs_per_period_splits_the_scan():
    stacks = layer_stacks(_cfg(16))
    full = RecomputePolicy(granularity="full", method="uniform", num_layers=1)
    assert _shape(decoder_plan(stacks, full)) == [("period", [("gated_deltanet", 3), ("attention", 1)], 4)]
    # block 5: the first 5 layers recomputed: period 0 whole, period 1 in part, periods 2-3 not
    block5 = RecomputePolicy(granularity="full", method="block", num_layers=5)
    plan = decoder_plan(stacks, block5)
    assert _shape(plan) == [("gated_deltanet", 3), ("attention", 1), ("gated_deltanet", 3), ("attention", 1),
                            ("period", [("gated_deltanet", 3), ("attention", 1)], 2)]
    # every run keeps the pieces it had as its own scan: same layers recomputed as before
    for x in plan:
        runs = x.runs if isinstance(x, PeriodScan) else (x,)
        for r in runs:
            for p in range(x.reps if isinstance(x, PeriodScan) else 1):
                first = r.first + p * (x.layers if isinstance(x, PeriodScan) else 0)
                assert block5.pieces(r.count, (first,)) == block5.pieces(r.count, (r.first,))
    # uniform 2 divides the period: one scan; uniform 3 does not: the periods' checkpoints differ
    assert len(decoder_plan(stacks, RecomputePolicy(granularity="full", method="uniform", num_layers=2))) == 1
    assert len(decoder_plan(stacks, RecomputePolicy(granularity="full", method="uniform", num_layers=3))) > 1


def _top_scans(fn, *args):
    return [e for e in jax.make_jaxpr(fn)(*args).jaxpr.eqns if e.primitive.name == "scan"]


def test_the_forward_is_one_scan_over_the_periods():
    model = build_model(_cfg(8))
    ids = jnp.zeros((1, 8), jnp.int32)
    scans = _top_scans(lambda i: model.hidden_states(i)[0], ids)
    assert [e.params["length"] for e in scans] == [2]  # one scan, over the 2 periods


def _per_run(model, ids):
    """The previous program: every run its own scan."""
    positions = jnp.broadcast_to(jnp.arange(ids.shape[1]), ids.shape)
    context = model.layer_context(jnp.ones(ids.shape, jnp.int32), positions)
    x, stats = model.embed_tokens(ids), []
    for r in layer_runs(model.stack_kinds):
        graph, state = nnx.split(model.layers[r.stack])
        state = jax.tree.map(lambda a: a[r.row:r.row + r.count], state)
        x, s = transformer.run_pieces(graph, transformer.stack_pieces(state, None, model.remat, (r.first,)), x, context)
        stats.append(s)
    return model.final_norm(x), {k: jnp.concatenate([s[k] for s in stats]) for k in stats[0]}


# The loss reads the final states and the router's probabilities against fixed probes. It was the sum of
# their squares, but RMS-normalised states have a nearly constant sum of squares (and the probabilities
# sum to one per token), so every gradient was a small remainder of cancelling terms: in float32 the
# per-run program was itself up to 8.1e-5 of a leaf's largest from float64 and the period scan 9.3e-5,
# while in float64 the two agreed to 1.9e-13 (benchmarks/float64_reference.py --loss squares). The 6e-5
# difference seen with recompute none was that float32 noise, in every leaf (worst: the MLPs' down_proj,
# the embedding, the DeltaNet's norm), not the scan. Against probes the two float32 programs differ by
# at most 2.4e-6 (the decay gate's a_log / dt_bias / wa, each program 1.3e-5 from float64: its gradient is
# the noisiest, as in tests/train/test_qwen3_5_layouts.py), 6.5e-7 elsewhere; the loss, a sum of terms
# of both signs, by 1.3e-6 of itself. Tolerances: 4x each leaf's float32 error against float64.
GRAD_TOL = 1e-5
DECAY_GATE_TOL = 5e-5


def _probe_loss(h, stats):
    p = stats["probs_per_expert"]
    return (jnp.sum(h.astype(jnp.float32) * jnp.cos(jnp.arange(h.size).reshape(h.shape)))
            + jnp.sum(p * jnp.sin(jnp.arange(p.size).reshape(p.shape))))


# Slow (60 s each): the pipeline's period scan against one device (tests/train/test_pipeline.py) runs by default.
@pytest.mark.slow
@pytest.mark.parametrize("remat", ["full", "none"])
def test_the_period_scan_equals_the_per_run_scans(remat):
    cfg = _cfg(8)  # two periods (10 layers, with a remainder, is the same code and twice the compile)
    model = build_model(cfg, ModelOptions(remat=remat))
    graph, state = nnx.split(model)
    ids = jax.random.randint(jax.random.key(0), (1, 8), 0, cfg.vocab_size)

    def loss(state, run):
        h, stats = run(nnx.merge(graph, state), ids)
        return _probe_loss(h, stats), (h, stats)

    (l1, (h1, s1)), g1 = jax.jit(jax.value_and_grad(lambda s: loss(s, lambda m, i: m.hidden_states(i)), has_aux=True))(state)
    (l0, (h0, s0)), g0 = jax.jit(jax.value_and_grad(lambda s: loss(s, _per_run), has_aux=True))(state)
    np.testing.assert_allclose(float(l1), float(l0), rtol=1e-5)
    np.testing.assert_allclose(h1, h0, rtol=1e-6, atol=1e-6)
    for k in s0:
        np.testing.assert_allclose(s1[k], s0[k], rtol=1e-6, atol=1e-6, err_msg=k)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(g1), jax.tree.leaves(g0)):
        scale = float(jnp.max(jnp.abs(b)))
        key = jax.tree_util.keystr(path)
        tol = DECAY_GATE_TOL if any(leaf in key for leaf in ("a_log_H", "dt_bias_H", "wa_DH")) else GRAD_TOL
        np.testing.assert_allclose(a, b, rtol=0, atol=tol * scale, err_msg=key)


def test_an_old_per_run_checkpoint_is_refused_by_name():
    meta = {"model": _cfg(8).as_dict()}
    with pytest.raises(CheckpointError, match="4 stacks, one per run"):
        check_layer_storage(meta, "/ckpt/iter_0000010")
    check_layer_storage({**meta, "layer_storage": LAYER_STORAGE}, "/ckpt")  # written now: loads
    check_layer_storage({"model": get_model_config("qwen3-moe-tiny").as_dict()}, "/ckpt")  # one kind: same tree
