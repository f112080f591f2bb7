"""Expert parallelism: all-to-all dispatch over the expert axis equals the single-device model.

Compiles are the cost on CPU, so each mesh compiles one program that returns the logits,
router stats and gradients together, and the dispatch-only checks use a lone MoE block.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import sharding
from mlir_train.families import init_model
from mlir_train.model import ModelOptions, logical_axes
from mlir_train.model.moe import block as moe_lib
from mlir_train.model.kernels.blocks import xla_block_kernels
from sharding import Layout
from tests.helpers import B, COMPILER_OPTIONS, T, TINY_MOE, moe_block, moe_block_inputs, run_moe_block


MESHES = {
    "EP2xDP4": Layout(expert=2, num_devices=8),
    "EP4xTP2": Layout(expert=4, tensor=2, num_devices=8),
    "EP8": Layout(expert=8, num_devices=8),
    "TP2xEP2xDP2": Layout(tensor=2, expert=2, num_devices=8),
}


def _inputs():
    rng = np.random.default_rng(0)
    ids = jnp.asarray(rng.integers(0, TINY_MOE.vocab_size, (B, T)), jnp.int32)
    # Two packed documents and some padding, so padding exclusion in the stats is exercised.
    seg = np.ones((B, T), np.int32)
    seg[0, 9:] = 2
    seg[1, 12:] = 0
    return ids, jnp.asarray(seg)


def _step(graphdef, ids, seg):
    def loss_fn(state):
        logits, stats = nnx.merge(graphdef, state)(ids, segment_ids=seg, return_router_stats=True)
        aux = jnp.sum(stats["probs_per_expert"] * stats["tokens_per_expert"]) / jnp.sum(stats["num_tokens"]) ** 2
        return jnp.mean(jax.nn.logsumexp(logits, -1)) + 0.1 * aux, (logits, stats)

    return jax.jit(jax.value_and_grad(loss_fn, has_aux=True))


@pytest.fixture(scope="module")
def reference():
    model = init_model(TINY_MOE, options=ModelOptions(moe_impl="padded"))
    graphdef, state = nnx.split(model)
    ids, seg = _inputs()
    return model, graphdef, state, _step(graphdef, ids, seg).lower(state).compile(COMPILER_OPTIONS)(state)


@pytest.mark.parametrize("name", list(MESHES))
def test_expert_parallel_model_equals_one_device(name, reference):
    model, graphdef, state, ((ref_loss, (ref_logits, ref_stats)), ref_grads) = reference
    cfg = MESHES[name]
    mesh, rules = sharding.make_mesh(cfg), sharding.rules_for(cfg)
    ids, seg = _inputs()
    with jax.set_mesh(mesh), sharding.use_rules(rules):
        state = jax.device_put(state, sharding.tree_shardings(logical_axes(model), rules, mesh))
        compiled = _step(graphdef, ids, seg).lower(state).compile(COMPILER_OPTIONS)
        (loss, (logits, stats)), grads = compiled(state)
    assert "all-to-all" in compiled.as_text()
    # Experts really are split: each device holds E / EP of them.
    gate = state["layers"][0]["mlp"]["gate_proj"][...]
    assert gate.addressable_shards[0].data.shape[1] == TINY_MOE.num_experts // cfg.expert

    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(logits), np.asarray(ref_logits), atol=1e-5, rtol=1e-5)
    assert set(stats) == set(ref_stats)
    for key in ref_stats:  # global-batch router stats, not per-rank ones
        assert stats[key].shape == ref_stats[key].shape, key
        if key in ("ep_overflow_rows", "ep_further_rounds"):  # the exchange's later rounds: none on one device
            assert float(ref_stats[key].sum()) == 0 and float(stats[key].sum()) >= 0
            continue
        np.testing.assert_allclose(np.asarray(stats[key]), np.asarray(ref_stats[key]), rtol=1e-5, atol=1e-5, err_msg=key)
    assert float(stats["dropped_tokens"].sum()) == 0  # dropless by default
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(ref_grads)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-6, rtol=1e-4, err_msg=jax.tree_util.keystr(path))


def test_logical_axis_lookup():
    assert sharding.mesh_axes_of("exp") == ((), 1)  # no rules, no mesh: single-device paths
    cfg = MESHES["TP2xEP2xDP2"]
    with jax.set_mesh(sharding.make_mesh(cfg)), sharding.use_rules(sharding.rules_for(cfg)):
        assert sharding.mesh_axes_of("exp") == (("expert",), 2)
        assert sharding.mesh_axes_of("act_tokens") == (("data", "expert"), 4)
        assert sharding.mesh_axes_of("moe_mlp") == (("tensor",), 2)
    cfg = Layout(tensor=2, num_devices=8)
    with jax.set_mesh(sharding.make_mesh(cfg)), sharding.use_rules(sharding.rules_for(cfg)):
        assert sharding.mesh_axes_of("exp") == ((), 1)


# ----- the dispatch alone, on one MoE block -----------------------------------------------------


def test_capacity_is_per_rank_as_in_megatron():
    """With a capacity factor, each rank keeps at most C = ceil(cf * S_local * K / E) of *its own*
    tokens per expert (Megatron's drop is per rank too), so the EP run equals the single-device
    block applied to each rank's token chunk separately, and counts the same drops. Which
    assignments a rank drops (by probability or position) is the local padded path's rule,
    tested in test_model.py."""
    cfg = MESHES["TP2xEP2xDP2"]
    ranks = 4  # token chunks: data x expert
    block = moe_block(impl="padded", capacity_factor=0.5, drop_policy="probs")
    x, valid = moe_block_inputs()
    (_, (y, stats)), hlo = run_moe_block(block, x, valid, cfg)
    assert "all-to-all" in hlo

    s_local = B * T // ranks
    chunks = [
        run_moe_block(block, xc[None], vc[None])[0][1]
        for xc, vc in zip(x.reshape(ranks, s_local, -1), valid.reshape(ranks, s_local))
    ]
    ref_y = jnp.concatenate([c[0].reshape(s_local, -1) for c in chunks]).reshape(x.shape)
    ref_dropped = sum(float(c[1]["dropped_tokens"]) for c in chunks)
    assert ref_dropped > 0
    assert float(stats["dropped_tokens"]) == ref_dropped
    np.testing.assert_allclose(np.asarray(y), np.asarray(ref_y), atol=1e-5, rtol=1e-5)


def test_dropless_fallback_and_ragged_dispatch():
    """Padded dispatch with every token routed to the experts of rank 0 (the buffer overflows,
    the rest goes in a second round), and the ragged_all_to_all dispatcher
    (run here through a dense emulation of ragged_all_to_all, which XLA:CPU lacks), both equal
    the dense reference, values and gradients."""
    cfg = MESHES["EP4xTP2"]
    x, valid = moe_block_inputs()

    skewed = moe_block(impl="padded")
    skewed.router[...] = jnp.zeros_like(skewed.router[...])  # ties: experts 0 and 1 for every token
    ref_skewed = moe_block(impl="dense")
    ref_skewed.router[...] = skewed.router[...]
    (_, (y, stats)), _ = run_moe_block(skewed, x, valid, cfg)
    (_, (ref_y, _)), _ = run_moe_block(ref_skewed, x, valid)
    assert float(stats["tokens_per_expert"][0]) == int(valid.sum())
    assert float(stats["dropped_tokens"]) == 0
    np.testing.assert_allclose(np.asarray(y), np.asarray(ref_y), atol=1e-5, rtol=1e-5)

    ragged = moe_block(impl="ragged", ragged_all_to_all=moe_lib.ragged_all_to_all_dense)
    ((_, (y, _)), grads), hlo = run_moe_block(ragged, x, valid, cfg, grads=True)
    ((_, (ref_y, _)), ref_grads), _ = run_moe_block(moe_block(impl="dense"), x, valid, grads=True)
    assert "all-to-all" in hlo
    np.testing.assert_allclose(np.asarray(y), np.asarray(ref_y), atol=1e-5, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-6, rtol=1e-4)


OVERFLOW_LAYOUTS = {
    "EP2xDP4": Layout(expert=2, num_devices=8),
    "EP4xTP2": Layout(expert=4, tensor=2, num_devices=8),
    "EP8": Layout(expert=8, num_devices=8),
    # MoE parallel folding: the all-to-all over tensor ranks (ETP1 < TP2), and data ranks in the
    # expert-tensor group (ETP4 > TP2), whose ranks gather each other's tokens first.
    "TP2xEP4xETP1": Layout(tensor=2, expert=4, expert_tensor=1, sequence_parallel=True, num_devices=8),
    "TP2xEP2xETP4": Layout(tensor=2, expert=2, expert_tensor=4, num_devices=8),
}


def _expected_overflow(block, cfg, impl):
    """Rows past the exchange buffer when every token picks experts 0 and 1 (a zero router),
    from the buffer sizes the dispatchers document (per rank and expert on the padded path, per
    receiving rank on the ragged ones)."""
    from mlir_train.model.moe import exchange
    from mlir_train.model.moe.parallel import width_token_axes

    mesh, rules = sharding.make_mesh(cfg), sharding.rules_for(cfg)
    with jax.set_mesh(mesh), sharding.use_rules(rules):
        token_ranks, ep = sharding.mesh_axes_of("act_tokens")[1], sharding.mesh_axes_of("exp")[1]
        w = int(np.prod([mesh.shape[a] for a in width_token_axes()]))
    plan, e, k = block.plan, TINY_MOE.num_experts, TINY_MOE.top_k
    s = B * T // token_ranks
    if impl == "padded":  # per rank, from its own tokens (the expert-tensor ranks gather slots)
        c = min(s, -(-max(1, -(-int(plan.ep_buffer_factor * s * k * 1000) // (e * 1000))) // 8) * 8)
        return token_ranks * 2 * max(0, s - c)
    # Ragged: the expert-tensor ranks that hold other tokens gather them first (w x the rows, the
    # same on each of them: counted once), then each EP group of them exchanges.
    s *= w
    align = plan.block_kernels.block_rows if impl == "grouped" else 8
    rows, _ = exchange.exchange_capacity(plan, s, k, ep, align)
    el = e // ep
    owners = [min(2, el)] + ([1] if el == 1 else [])  # rows of experts 0 and 1 per receiving rank
    return (token_ranks // (ep * w)) * sum(max(0, ep * s * n - rows) for n in owners)


# Every layout with the grouped dispatcher; the padded and ragged ones on two by default.
OVERFLOW_CASES = [pytest.param(name, impl, marks=[] if impl == "grouped" or name in ("EP4xTP2", "TP2xEP2xETP4")
                               else [pytest.mark.slow])
                  for name in OVERFLOW_LAYOUTS for impl in ("padded", "ragged", "grouped")]


@pytest.mark.parametrize("name, impl", OVERFLOW_CASES)
def test_overflow_rounds_are_exact_and_counted(name, impl):
    """A tiny --moe-ep-buffer-factor and every token routed to experts 0 and 1: the exchange
    overflows its buffer and runs in further rounds; values and gradients still equal the dense
    one-device block, and the overflowing rows are counted exactly."""
    cfg = OVERFLOW_LAYOUTS[name]
    x, valid = moe_block_inputs()
    kw = dict(platform="cpu", ragged_all_to_all=moe_lib.ragged_all_to_all_dense) if impl != "padded" else {}
    if impl == "grouped":  # blocks of 8 rows, so that these few tokens can fill several buffers
        kw["block_kernels"] = xla_block_kernels(8)
    block = moe_block(impl=impl, ep_buffer_factor=0.25, **kw)
    block.router[...] = jnp.zeros_like(block.router[...])  # ties: experts 0 and 1 for every token
    ref = moe_block(impl="dense")
    ref.router[...] = block.router[...]
    ((_, (y, stats)), grads), hlo = run_moe_block(block, x, valid, cfg, grads=True)
    ((_, (ref_y, _)), ref_grads), _ = run_moe_block(ref, x, valid, grads=True)
    np.testing.assert_allclose(np.asarray(y), np.asarray(ref_y), atol=1e-5, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-6, rtol=1e-4)
    expected = _expected_overflow(block, cfg, impl)
    assert expected > 0
    assert float(stats["ep_overflow_rows"]) == expected
    assert float(stats["ep_further_rounds"]) >= 1  # the same on every rank: the most any took
    assert float(stats["dropped_tokens"]) == 0
    assert "conditional" in hlo  # the further rounds are a branch, taken only on overflow


def test_balanced_routing_takes_one_round():
    """The default factor at a balanced routing: no overflow counted, the same result."""
    cfg = OVERFLOW_LAYOUTS["EP4xTP2"]
    x, valid = moe_block_inputs()
    block = moe_block(impl="grouped", platform="cpu", ragged_all_to_all=moe_lib.ragged_all_to_all_dense,
                      ep_buffer_factor=4.0)
    (_, (y, stats)), _ = run_moe_block(block, x, valid, cfg)
    (_, (ref_y, _)), _ = run_moe_block(moe_block(impl="dense"), x, valid)
    np.testing.assert_allclose(np.asarray(y), np.asarray(ref_y), atol=1e-5, rtol=1e-5)
    assert float(stats["ep_overflow_rows"]) == 0 and float(stats["ep_further_rounds"]) == 0


def test_buffer_factor_flag_reaches_the_block_and_overflow_reaches_the_log():
    """--moe-ep-buffer-factor: parsed, refused when not positive (one ConfigError naming it),
    given to every MoE block; a step's overflow rows and further rounds are in the logged
    scalars, never on the console line: the run reports the rounds once, at its end, and warns
    only when they cost real time."""
    from mlir_train.config import cli
    from mlir_train.families import get_model_config
    from mlir_train.runtime.errors import ConfigError
    from mlir_train.train.build import resolve
    from mlir_train.train.metrics import ExchangeRounds, console_line, router_scalars

    base = ["--micro-batch-size", "1", "--seq-length", "16"]
    model = get_model_config("qwen3-moe-tiny")
    assert cli.parse(base).extras.moe_ep_buffer_factor == moe_lib.DEFAULT_EP_BUFFER_FACTOR
    run = resolve(cli.parse(base + ["--moe-ep-buffer-factor", "3"]), model, num_devices=1, platform="cpu")
    assert run.options.ep_buffer_factor == 3.0
    built = nnx.eval_shape(lambda: init_model(model, options=run.options))
    assert all(layer.mlp.plan.ep_buffer_factor == 3.0 for layer in built.layers)
    with pytest.raises(ConfigError, match="--moe-ep-buffer-factor must be positive"):
        resolve(cli.parse(base + ["--moe-ep-buffer-factor", "0"]), model, num_devices=1, platform="cpu")

    m = {"load_balancing_loss": 0.01, "dropped_tokens": 0.0, "ep_overflow_rows": 12.0, "ep_further_rounds": 1.0}
    scalars = router_scalars(m, model)
    assert scalars["ep overflow rows"] == 12.0 and scalars["ep further rounds"] == 1.0
    step = {"consumed samples": 8, "iteration-time": 0.1, "learning-rate": 1e-4, "batch-size": 8, "lm loss": 2.0,
            "loss-scale": 1.0, "grad-norm": 1.0, "skipped iterations": 0, "supervised-tokens-per-sec": 1.0,
            "supervised-tokens-per-sec-per-device": 1.0, "slot-tokens-per-sec": 1.0, "throughput": 1.0}
    assert "ep " not in console_line(1, 10, step | scalars, None)


@pytest.mark.parametrize("further, level", [(0.0, None), (1.0, "info"), (8.0, "warning")])
def test_exchange_rounds_are_reported_once_and_warned_only_when_costly(further, level, capsys):
    """Two MoE layers x two micro-batches = 4 layer passes a step, over 4 steps: 1 further round
    in all is 6% more exchange work (an info line), 8 in each step 200%: every pass ran the exchange
    three times on average (a warning naming the flag)."""
    from mlir_train.train.metrics import ExchangeRounds

    rounds = ExchangeRounds(layer_passes=4, buffer_factor=1.0)
    for i in range(4):
        rounds.add({"ep overflow rows": 5.0 if further else 0.0,
                    "ep further rounds": further if (i == 0 or further > 1) else 0.0})
    rounds.report()
    out = capsys.readouterr().out
    if level is None:
        assert out == ""
        return
    assert out.count("\n") == 1 and "MoE exchange" in out and "--moe-ep-buffer-factor 1 buffers" in out
    assert ("WARNING:" in out) == ("a larger --moe-ep-buffer-factor" in out) == (level == "warning")


def test_pipelined_step_with_overflow_rounds_equals_one_device():
    """The seed's layout (TP2 x PP2 x EP2, SP, distributed optimizer) with a buffer so small that
    every step overflows: the rounds inside the pipeline's stages still train exactly like one
    device, and the step's metrics count the rows."""
    from tests.helpers import assert_same_step, pipeline_step

    ref = pipeline_step(Layout(num_devices=1), jax.devices()[:1])
    seed = Layout(tensor=2, pipeline=2, expert=2, sequence_parallel=True, distributed_optimizer=True, num_devices=8)
    out = pipeline_step(seed, jax.devices(), options=ModelOptions(ep_buffer_factor=0.25))
    assert_same_step(out, ref)
    assert float(ref[1]["ep_overflow_rows"]) == 0 and float(out[1]["ep_overflow_rows"]) > 0


def test_planner_reads_traffic_next_to_buffer_size():
    """``moe_audit.ep_exchange_report`` on the CPU padded dispatcher's program: four token
    all-to-alls (dispatch and return, forward and backward), each through the [E, C, D] buffer,
    against the S*K rows a rank routes."""
    from mlir_train.planner.moe_audit import ep_exchange_report

    cfg = MESHES["EP8"]
    x, valid = moe_block_inputs()
    block = moe_block(impl="padded")
    (_, hlo) = run_moe_block(block, x, valid, cfg, grads=True)
    s, k, e, d = B * T // 8, TINY_MOE.top_k, TINY_MOE.num_experts, TINY_MOE.hidden_size
    c = -(-int(block.plan.ep_buffer_factor * s * k) // e)
    c = -(-c // 8) * 8
    ex = ep_exchange_report(hlo, s * k, d * 4)
    assert ex.kind == "all-to-all" and ex.exchanges == 4, ex
    assert ex.buffer_bytes == ex.exchanges * e * c * d * 4
    assert ex.traffic_bytes == ex.exchanges * s * k * d * 4
