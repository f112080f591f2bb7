"""The router losses at data-parallel size 2 against megatron-core itself (``tests/mcore_router_dp.py``:
two gloo ranks, megatron-core's ``TopKRouter`` under its ``DistributedDataParallel``, its
no-pipeline schedule and ``finalize_model_grads``).

Megatron forms ``aux_loss``, ``seq_aux_loss`` and z-loss on each data-parallel rank from that
rank's tokens, ``global_aux_loss`` from every rank's counts; by default each rank's loss is scaled
by 1/num_microbatches and the ranks average their gradients, under
``--calculate-per-token-loss`` each rank's loss is scaled by its router tokens and the summed
gradient divided by the global batch's loss tokens; Sinkhorn balances each rank's tokens,
padding included. Ours forms all of it per balancing group (``--micro-batch-size`` rows, one
rank's micro-batch) in one program: the router weight's gradient, the logged losses and the
Sinkhorn routing must equal megatron-core's.
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("megatron.core")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from mlir_train.families import get_model_config  # noqa: E402
from mlir_train.config.policies import TRACKER_NAMES, LoadBalancing, RouterConfig  # noqa: E402
from mlir_train.model import losses  # noqa: E402
from mlir_train.model.moe.block import MoE  # noqa: E402
from tests import mcore_router_dp  # noqa: E402

DP, MBS, M, T, H, E, K = 2, 2, 2, 8, 16, 8, 2

CASES = [
    dict(name="aux", type="aux_loss", coeff=1e-2, z=1e-3, per_token=False),
    dict(name="aux-per-token", type="aux_loss", coeff=1e-2, z=1e-3, per_token=True),
    dict(name="global", type=["aux_loss", "global_aux_loss"], coeff=[1e-2, 3e-2], per_token=False),
    dict(name="global-per-token", type=["aux_loss", "global_aux_loss"], coeff=[1e-2, 3e-2], per_token=True),
    # Megatron's seq_aux_loss takes each row as a sequence with the rows' mean token count; with
    # no padding that is each document's own count, which is how ours counts.
    dict(name="seq", type="seq_aux_loss", coeff=1e-2, per_token=False, padding=False),
    dict(name="seq-per-token", type="seq_aux_loss", coeff=1e-2, per_token=True, padding=False),
    dict(name="sinkhorn", type="sinkhorn", coeff=0.0, z=1e-3, per_token=False),
]
for c in CASES:
    c["topk"] = K


def _inputs():
    rng = np.random.default_rng(0)
    rows = DP * MBS
    valid = np.ones((M, rows, T), bool)
    valid[0, 1, -3:] = False  # padding at the ends of some rows (segment id 0)
    valid[1, 2, -5:] = False
    valid[1, 3, -1:] = False
    return dict(x=rng.standard_normal((M, rows, T, H)).astype(np.float32),
                valid=valid,
                w=(0.5 * rng.standard_normal((H, E))).astype(np.float32),
                loss_tokens=rng.integers(3, 20, (M, DP)).astype(np.int64))


@pytest.fixture(scope="module")
def megatron_runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("router_dp")
    inputs = _inputs()
    np.savez(out / "inputs.npz", **inputs)
    mcore_router_dp.run({"inputs": str(out / "inputs.npz"), "cases": CASES}, str(out), DP)
    return inputs, {c["name"]: dict(np.load(out / f"{c['name']}.npz")) for c in CASES}


def _ours(case, inputs, balancing_rows=MBS):
    """Our router over each whole micro-batch (all ranks' rows in one program): the step's
    router objective summed over micro-batches and its gradient in the router weight, the
    logged per-layer values summed over micro-batches, the routing weights per token."""
    lb = LoadBalancing.from_flags(case["type"], case["coeff"], case.get("z"))
    cfg = get_model_config("qwen3-moe-tiny", hidden_size=H, num_experts=E, top_k=K)
    router = RouterConfig(balancing_rows=balancing_rows, sinkhorn=lb.sinkhorn, per_sequence_stats=lb.per_sequence)
    with nnx.use_eager_sharding(False):
        graphdef, state = nnx.split(MoE(cfg, nnx.Rngs(0), out_std=0.02, router=router))
    state = nnx.to_pure_dict(state)
    valid = inputs["valid"] if case.get("padding", True) else np.ones_like(inputs["valid"])
    loss_tokens = jnp.float32(inputs["loss_tokens"].sum()) if case["per_token"] else None

    def total(w):
        block = nnx.merge(graphdef, {**state, "router": w})
        objective, counts, logged, routed = 0.0, None, {}, []
        for i in range(M):
            weights, experts, stats = block.route(
                jnp.asarray(inputs["x"][i]).reshape(-1, H), jnp.asarray(valid[i]).reshape(-1),
                segment_ids_BT=jnp.asarray(valid[i], jnp.int32), rows=DP * MBS)
            obj, per_layer, counts = losses.router_losses(
                {k: v[None] for k, v in stats.items()}, lb, K, counts, i, num_micro_batches=M, loss_tokens=loss_tokens)
            objective = objective + obj
            for name, v in per_layer.items():
                logged[name] = logged.get(name, 0.0) + v[0]
            routed.append(jnp.zeros((weights.shape[0], E)).at[jnp.arange(weights.shape[0])[:, None], experts].set(weights))
        return objective, (logged, jnp.stack(routed))

    (_, (logged, routed)), grad = jax.value_and_grad(total, has_aux=True)(jnp.asarray(inputs["w"]))
    return np.asarray(grad), {k: float(v) for k, v in logged.items()}, np.asarray(routed)


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_router_losses_equal_megatron_at_two_data_parallel_ranks(megatron_runs, case):
    inputs, runs = megatron_runs
    want = runs[case["name"]]
    grad, logged, routed = _ours(case, inputs)
    scale = np.abs(want["grad"]).max()
    assert scale > 0
    np.testing.assert_allclose(grad, want["grad"], rtol=0, atol=2e-5 * scale, err_msg="router weight gradient")
    # Megatron's tracker as its training log reduces it: aux and seq per rank, averaged over
    # the ranks; global over all ranks together; summed over micro-batches (its z-loss entry is
    # rank 0's own, not reduced, so it is not compared).
    types = [case["type"]] if isinstance(case["type"], str) else case["type"]
    for name in (TRACKER_NAMES[t] for t in types if t in TRACKER_NAMES):
        np.testing.assert_allclose(logged[name], float(want[f"tracker_{name}"]), rtol=1e-5, err_msg=name)
    if case["type"] == "sinkhorn":  # each rank's tokens balanced alone, padding included
        np.testing.assert_allclose(routed, want["probs"].reshape(routed.shape), rtol=1e-5, atol=1e-7)
    # The test tells the semantics apart: pooling every rank's tokens (what a DP=1 reading of
    # Megatron gives) would not match at two ranks.
    if case["name"] == "seq":
        return  # one document per row, as many per rank: the mean of the ranks' means is the pooled mean
    pooled_grad, _, pooled_routed = _ours(case, inputs, balancing_rows=None)
    if case["type"] == "sinkhorn":
        assert not np.allclose(pooled_routed, routed, rtol=1e-3)
    else:
        assert np.abs(pooled_grad - want["grad"]).max() > 1e-3 * scale
