"""--expert-tensor-parallel-size != --tensor-model-parallel-size trains exactly like one device.

Megatron's MoE parallel folding: the experts' grid (ETP x EP x EDP) is laid over the same
ranks as the dense grid (TP x CP x DP) independently, e.g. attention TP2 while the experts run
ETP1 x EP4 on the same 8 ranks (the expert all-to-all then spans dense tensor ranks), or the
expert width split over more ranks than the dense layers' (ETP2 > TP1: the expert-tensor group
takes in dense data ranks, so its ranks hold different tokens and gather them before the
experts, as Megatron's expert-tensor all-gather does).

* One optimizer step of the tiny MoE model (``tests/train/test_layouts.py``'s packed batch and
  tolerances, via its ``train_one_step``/``assert_step_matches``) on folding layouts, with and
  without SP and the distributed optimizer, under 1F1B pipelining, and on ETP > TP layouts,
  with the padded (CPU default) and ragged experts and a capacity factor that drops nothing;
  Adam's second moment is compared too.
* The MoE block alone for what a whole step cannot show cheaply: a capacity that does drop is
  per rank (each rank of the folded token axes drops from its own tokens, as in Megatron), and
  the dropless ragged / block-grouped dispatchers (``ragged_all_to_all`` emulated densely on
  CPU; the grouped path on its ``ragged_dot`` reference kernels) equal the dense reference.
* One CLI run on the bundled data (folding, SP) agrees with pure DP.

Timing (2 cores shared with other jobs, cold compile cache, -O0 compiles): 215 s for the
default set: 9-42 s per compiled step case (the first includes the one-device reference; five
by default, five more marked slow), 2-5 s per block case, 49 s the CLI pair, 7 s the checkpoint.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import sharding
from mlir_train.model import ModelOptions
from mlir_train.model.moe import block as moe_lib
from sharding import Layout
from tests.helpers import (
    B, T, MODELS, assert_step_matches, cli_metrics, moe_block, moe_block_inputs, named_leaves, run_moe_block, train_one_step,
)

MOE = MODELS["moe"]  # 8 experts, top-2, expert width 64
# Capacity C = ceil(cf * S_r * K / E) = S_r at cf = E / K: a rank can never overflow it, so the
# capacity path (per-rank padded buffers, gathered over expert-tensor ranks) runs and must equal
# the one-device step exactly.
NO_DROP_CAPACITY = {"capacity_factor": MOE.num_experts / MOE.top_k}
STEP_CASES = {
    # folding: the expert all-to-all spans the dense tensor ranks
    "TP2xEP4xETP1+SP": (Layout(tensor=2, expert=4, expert_tensor=1, sequence_parallel=True), None),
    "TP2xEP4xETP1+distopt": (Layout(tensor=2, expert=4, expert_tensor=1, distributed_optimizer=True), None),
    "TP2xEP4xETP1+SP+fsdp": (Layout(tensor=2, expert=4, expert_tensor=1, sequence_parallel=True, fsdp=True),
                             None),
    "TP4xEP2xETP1+SP+distopt": (Layout(tensor=4, expert=2, expert_tensor=1, sequence_parallel=True,
                                               distributed_optimizer=True), None),
    "PP2xTP2xEP2xETP1+SP": (Layout(pipeline=2, tensor=2, expert=2, expert_tensor=1, sequence_parallel=True), None),
    # ETP > TP: the expert-tensor group holds dense data ranks
    "TP1xEP2xETP2+distopt": (Layout(expert=2, expert_tensor=2, distributed_optimizer=True), None),
    "TP1xEP2xETP2-capacity": (Layout(expert=2, expert_tensor=2), NO_DROP_CAPACITY),
    "TP1xEP1xETP2": (Layout(expert_tensor=2), None),  # the data-parallel region, blocked experts
    "TP1xEP1xETP2-ragged": (Layout(expert_tensor=2), {"moe_impl": "ragged"}),
    "TP2xEP2xETP4+SP": (Layout(tensor=2, expert=2, expert_tensor=4, sequence_parallel=True), None),
}
# Left to the slow run (~30 s each on 2 busy cores); the block tests below cover their paths
# (no SP, capacity, ragged, ETP > TP > 1) at a fraction of the cost.
SLOW_STEP_CASES = {"TP1xEP2xETP2+distopt", "TP4xEP2xETP1+SP+distopt", "TP1xEP1xETP2", "TP2xEP4xETP1+distopt", "TP2xEP4xETP1+SP+fsdp", "TP1xEP2xETP2-capacity", "TP1xEP1xETP2-ragged", "TP2xEP2xETP4+SP"}


@functools.cache
def _reference():
    return train_one_step(MOE, None)


@functools.cache
def _run(name):
    layout, kwargs = STEP_CASES[name]
    return train_one_step(MOE, layout, ModelOptions(**kwargs) if kwargs else None)


@pytest.fixture(scope="module", autouse=True)
def _forget_runs():
    yield
    _reference.cache_clear()
    _run.cache_clear()


def _adam_nu(state):
    (adam,) = [s for s in jax.tree.leaves(state["opt_state"], is_leaf=lambda x: isinstance(x, optax.ScaleByAdamState))
               if isinstance(s, optax.ScaleByAdamState)]
    return jax.device_get(adam.nu)


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW_STEP_CASES else n
                                  for n in STEP_CASES])
def test_step_matches_single_device(name):
    ref, got = _reference(), _run(name)
    assert_step_matches(got, ref, moe=True)
    # Adam's second moment is (1 - beta2) g^2 after one step: relative to each tensor's largest.
    for (path, a), (_, b) in zip(named_leaves(_adam_nu(got.state)), named_leaves(_adam_nu(ref.state))):
        np.testing.assert_allclose(a, b, rtol=0, atol=2e-5 * np.abs(b).max(), err_msg=f"Adam nu {path}")
    # The experts really are split as the expert grid says in the compute layout: E / EP experts
    # and F / ETP columns per device (the stored float32 masters may be split further by ZeRO).
    layout = STEP_CASES[name][0]
    gate = got.trainer.compute_shardings["layers"][0]["mlp"]["gate_proj"]
    shape = (MOE.num_layers, MOE.num_experts, MOE.hidden_size, MOE.moe_intermediate_size)
    assert gate.shard_shape(shape)[1:] == (MOE.num_experts // layout.expert, MOE.hidden_size,
                                           MOE.moe_intermediate_size // layout.etp), (name, gate)
    if layout.expert > 1:
        assert "all-to-all" in got.hlo


def test_token_axes_cover_the_folded_tensor_ranks():
    """Which ranks hold distinct tokens inside the MoE: every data rank, plus under folding the
    dense tensor ranks that are expert (or expert-data) ranks; not the tensor ranks that split
    the expert width too (ETP = TP keeps Megatron's layout: tokens gathered over TP)."""
    def lookup(cfg, name):
        cfg = sharding.validate(cfg)
        with jax.set_mesh(sharding.make_mesh(cfg)), sharding.use_rules(sharding.rules_for(cfg)):
            return sharding.mesh_axes_of(name)

    folding = Layout(tensor=2, expert=4, expert_tensor=1, num_devices=8)
    assert lookup(folding, "act_tokens") == (("data", "expert", "tensor_expert"), 8)
    assert lookup(folding, "exp") == (("expert", "tensor_expert"), 4)
    assert lookup(folding, "moe_mlp") == ((), 1)
    wide = Layout(tensor=1, expert=2, expert_tensor=2, num_devices=8)
    assert lookup(wide, "act_tokens")[1] == 8 and lookup(wide, "moe_mlp") == (("data_etensor",), 2)
    default = Layout(tensor=2, expert=2, num_devices=8)
    assert lookup(default, "act_tokens") == (("data", "expert"), 4)


# ----- the MoE block alone ------------------------------------------------------------------

BLOCK_LAYOUTS = {
    "TP2xEP4xETP1": Layout(tensor=2, expert=4, expert_tensor=1, num_devices=8),
    "TP1xEP2xETP2": Layout(expert=2, expert_tensor=2, num_devices=8),
    "TP1xEP1xETP2": Layout(expert_tensor=2, num_devices=8),
}


@pytest.mark.parametrize("name", [n if n == "TP2xEP4xETP1" else pytest.param(n, marks=pytest.mark.slow)
                                  for n in BLOCK_LAYOUTS])
def test_capacity_drops_per_rank(name):
    """A capacity that drops: each of the 8 token ranks keeps at most C of its own tokens per
    expert, so the layout equals the one-device block on each rank's chunk, drops included."""
    cfg = BLOCK_LAYOUTS[name]
    block = moe_block(impl="padded", capacity_factor=0.5, drop_policy="probs")
    x, valid = moe_block_inputs()
    (_, (y, stats)), _ = run_moe_block(block, x, valid, cfg)
    ranks = 8
    s_local = B * T // ranks
    chunks = [run_moe_block(block, xc[None], vc[None])[0][1]
              for xc, vc in zip(x.reshape(ranks, s_local, -1), valid.reshape(ranks, s_local))]
    ref_y = jnp.concatenate([c[0].reshape(s_local, -1) for c in chunks]).reshape(x.shape)
    ref_dropped = sum(float(c[1]["dropped_tokens"]) for c in chunks)
    assert ref_dropped > 0
    assert float(stats["dropped_tokens"]) == ref_dropped
    np.testing.assert_allclose(np.asarray(y), np.asarray(ref_y), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("impl", ["ragged", "grouped"])
@pytest.mark.parametrize("name", ["TP2xEP4xETP1", "TP2xEP2xETP4"])
def test_dropless_dispatchers_equal_the_dense_reference(impl, name):
    cfg = BLOCK_LAYOUTS.get(name) or Layout(tensor=2, expert=2, expert_tensor=4, num_devices=8)
    x, valid = moe_block_inputs()
    block = moe_block(impl=impl, ragged_all_to_all=moe_lib.ragged_all_to_all_dense, platform="cpu")
    assert block.plan.dropless_dispatch == impl and block.plan.ragged_all_to_all is not None
    ((_, (y, _)), grads), hlo = run_moe_block(block, x, valid, cfg, grads=True)
    ((_, (ref_y, _)), ref_grads), _ = run_moe_block(moe_block(impl="dense"), x, valid, grads=True)
    assert "all-to-all" in hlo
    np.testing.assert_allclose(np.asarray(y), np.asarray(ref_y), atol=1e-5, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-6, rtol=1e-4)


# ----- checkpoints --------------------------------------------------------------------------


def test_checkpoint_saved_under_folding_restores_into_etp_equal_tp(tmp_path):
    """Our checkpoints hold global arrays: the state after a folding step (experts over EP4 with
    the tensor ranks among them, ETP1) restores exactly into TP2 x EP2 (ETP = TP, experts F-split
    over "tensor", ZeRO-1 moments), each array in the target's own sharding."""
    import dataclasses

    from mlir_train.checkpoint import orbax as checkpoint
    from mlir_train.train.optim import make_optimizer
    from mlir_train.train.trainer import StepConfig, model_dims
    from mlir_train.train.build import build_trainer

    saved = _run("TP2xEP4xETP1+SP")
    mgr = checkpoint.CheckpointManager(str(tmp_path / "ck"), max_to_keep=1)
    assert mgr.save(1, saved.state, {"model": dataclasses.asdict(MOE)}, force=True)
    mgr.close()
    parallel = sharding.validate(Layout(tensor=2, expert=2, distributed_optimizer=True), model_dims(MOE))
    target = build_trainer(MOE, StepConfig(), make_optimizer(lr_schedule=lambda i: 1e-3, weight_decay=0.1, beta1=0.9,
                                                       beta2=0.95, clip_grad=1.0),
                     parallel, sharding.make_mesh(parallel))
    state, meta = checkpoint.load_state(str(tmp_path / "ck"), target)
    assert meta["iteration"] == 1
    for key in ("params", "opt_state"):
        assert jax.tree.structure(saved.state[key]) == jax.tree.structure(state[key]), key
        for (path, a), b, sh in zip(named_leaves(jax.device_get(saved.state[key])), jax.tree.leaves(state[key]),
                                    jax.tree.leaves(target.state_shardings[key])):
            np.testing.assert_array_equal(a, np.asarray(b), err_msg=f"{key} {path}")
            assert b.sharding.is_equivalent_to(sh, b.ndim), (path, b.sharding, sh)


# ----- the CLI ------------------------------------------------------------------------------


@pytest.mark.slow  # ~25-50 s; the flag reaching the layout is in tests/config/test_flags.py, the step in the cases above
def test_cli_folding_agrees_with_data_parallel(tmp_path):
    per_token = ["--calculate-per-token-loss"]  # see tests/train/test_layouts.py's CLI test
    dp = cli_metrics(tmp_path, "dp", ["--micro-batch-size", "1", *per_token])
    fold = cli_metrics(tmp_path, "fold", ["--micro-batch-size", "2", "--tensor-model-parallel-size", "2",
                                           "--expert-model-parallel-size", "4", "--expert-tensor-parallel-size", "1",
                                           "--sequence-parallel", *per_token])
    assert [r["iteration"] for r in fold] == [1, 2, 3]
    for a, b in zip(dp, fold):
        for key in ("lm loss", "grad-norm", "load_balancing_loss"):
            np.testing.assert_allclose(b[key], a[key], rtol=1e-5, err_msg=f"iteration {a['iteration']} {key}")


# ----- the planner --------------------------------------------------------------------------


def test_planner_layouts_carry_etp():
    """The planner names ETP where it differs from TP, builds the trainer with it (the exact state
    sizes come from its shardings) and splits the estimated expert activations by it."""
    from mlir_train.config import cli
    from mlir_train.families import get_model_config
    from mlir_train.planner.plan import activation_bytes, candidate, candidate_layouts

    fold = candidate(tensor=2, expert=4, expert_tensor=1, sequence_parallel=True)
    assert fold.etp == 1 and "ETP1" in fold.name(8) and "ETP" not in candidate(tensor=2, expert=2).name(8)
    cfg = get_model_config("qwen3-30b-a3b")
    est = lambda layout: activation_bytes(cfg, layout, micro_batch=1, seq=4096, dtype_bytes=2)
    # ETP1 under TP2: half the tokens per rank dispatched, each to experts of full width.
    assert est(fold) != est(candidate(tensor=2, expert=4, sequence_parallel=True))
    run_cfg = cli.parse(["--model-name", "qwen3-moe-tiny", "--expert-tensor-parallel-size", "1"])
    layouts = candidate_layouts(run_cfg, 8)
    assert {l.expert_tensor for l in layouts} == {1}
    assert any(l.tensor == 2 and l.expert == 8 for l in layouts)  # EP beyond DP: folding


@pytest.mark.slow  # ~60 s of CPU per deviceless XLA:GPU compile
@pytest.mark.filterwarnings("ignore:Error reading persistent compilation cache entry")
@pytest.mark.parametrize("flags", [
    ["--tensor-model-parallel-size", "2", "--expert-model-parallel-size", "4", "--expert-tensor-parallel-size", "1"],
    ["--tensor-model-parallel-size", "2", "--expert-model-parallel-size", "2", "--expert-tensor-parallel-size", "4"],
], ids=["TP2xEP4xETP1", "TP2xEP2xETP4"])
def test_gpu_grouped_path_compiles_deviceless(flags):
    """The GPU path (block-grouped Mosaic-GPU experts, ragged all-to-all) under folding and under
    ETP > TP > 1 (rows gathered over the expert-tensor data ranks, the kernels manual over the
    tensor ranks), compiled by XLA:GPU for 8 x H200 on this CPU-only machine."""
    from tests.helpers import GPU_MISSING, run_planner

    if GPU_MISSING is not None:
        pytest.skip(f"deviceless XLA:GPU: {GPU_MISSING}")
    enabled = jax.config.jax_enable_compilation_cache
    try:
        (p,), out = run_planner(["--model-name", "qwen3-moe-tiny", "--num-layers", "2", "--moe-ffn-hidden-size", "512",
                                  "--seq-length", "64", "--micro-batch-size", "2", "--global-batch-size", "16", "--bf16",
                                  "--num-devices", "8", "--device-kind", "h200", "--sequence-parallel", *flags])
    finally:
        jax.config.update("jax_enable_compilation_cache", enabled)
    assert p.error is None, out
    assert p.compiled_for_target and p.moe_impl == "grouped", out
    assert "ragged-all-to-all" in p.collectives, out
