"""Recompute controls (megatron-core 0.16's --recompute-*): each changes what the compiled step
keeps for its backward and nothing else.

(a) loss and gradients equal those without recompute (float32, tiny models; through the
pipeline too); (b) the compiled step's temporaries (``memory_analysis().temp_size_in_bytes``,
as the planner reads them) move the right way; (c) the flags are validated as megatron-core
validates them, naming the flags.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mlir_train.config import cli
from mlir_train.runtime.errors import ConfigError
from mlir_train.train import build
from mlir_train.families import get_model_config
from mlir_train.families import init_model
from mlir_train.model import ModelOptions
from mlir_train.config.policies import RecomputePolicy
from mlir_train.train.optim import make_optimizer
from mlir_train.train.schedule import megatron_lr_schedule
from mlir_train.train.trainer import StepConfig
from mlir_train.train.build import build_trainer
from sharding.mesh import make_mesh
from sharding.layout import Layout
from tests.helpers import AUX_AND_Z_LOSS, pipeline_schedule

FAST_COMPILE = {"xla_backend_optimization_level": 0}
MOE = get_model_config("qwen3-moe-tiny", vocab_size=128, num_layers=4, hidden_size=64, num_heads=2, num_kv_heads=1,
                       head_dim=32, moe_intermediate_size=64, num_experts=4)
DENSE = get_model_config("qwen3-tiny", vocab_size=128, num_layers=4, hidden_size=64, num_heads=2, num_kv_heads=1,
                         head_dim=32, intermediate_size=256)

NONE = RecomputePolicy()
FULL = RecomputePolicy("full")


def uniform(n):
    return RecomputePolicy("full", "uniform", n)


def block(n):
    return RecomputePolicy("full", "block", n)


def selective(*modules):
    return RecomputePolicy("selective", modules=modules)


def _loss_and_grad(cfg, policy, rows, seq, **options):
    """The jitted value-and-grad of a loss over logits and router statistics, and its inputs."""
    model = init_model(cfg, options=ModelOptions(remat=policy, **options))
    graphdef, state = nnx.split(model)
    ids = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (rows, seq)), jnp.int32)
    seg = jnp.asarray(np.repeat([[1] * (seq // 2) + [2] * (seq // 4) + [0] * (seq - seq // 2 - seq // 4)], rows, 0))

    def loss(state):
        logits, stats = nnx.merge(graphdef, state)(ids, segment_ids=seg, return_router_stats=True)
        aux = 0.01 * jnp.sum(stats["probs_per_expert"] ** 2) if stats else 0.0
        return jnp.mean(jax.nn.logsumexp(logits, -1) - logits[..., 0]) + aux

    return jax.jit(jax.value_and_grad(loss)).lower(state).compile(FAST_COMPILE), state


@functools.lru_cache(maxsize=None)
def _temp_bytes(cfg, policy, moe_kw: bool = True) -> int:
    compiled, _ = _loss_and_grad(cfg, policy, 4, 256, **(MOE_KW if moe_kw else {}))
    return compiled.memory_analysis().temp_size_in_bytes


def _assert_same(got, ref):
    np.testing.assert_allclose(float(got[0]), float(ref[0]), rtol=1e-6)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got[1]), jax.tree.leaves(ref[1])):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-5 * float(np.abs(b).max()) + 1e-9,
                                   err_msg=jax.tree_util.keystr(path))


# ----- (a) the numbers do not change ---------------------------------------------------------------
MOE_KW = dict(moe_impl="padded", capacity_factor=2.0)  # the batched [E, C, D] experts, where moe_act acts
CASES = {  # the default suite runs uniform2, moe and dense-mlp+layernorm
    "uniform2": (MOE, uniform(2)), "block1": (MOE, block(1)), "moe": (MOE, selective("moe")),
    "core_attn+layernorm+moe_act": (MOE, selective("core_attn", "layernorm", "moe_act")),
    "dense-mlp+layernorm": (DENSE, selective("mlp", "layernorm")),
    "full": (MOE, FULL), "block3": (MOE, block(3)), "dense-uniform2": (DENSE, uniform(2)),
}
SLOW_CASES = {"full", "block3", "dense-uniform2", "block1", "core_attn+layernorm+moe_act"}  # those modules: EP2xTP2-selective below


@pytest.fixture(scope="module")
def references():
    out = {}
    for name, cfg in (("moe", MOE), ("dense", DENSE)):
        fn, state = _loss_and_grad(cfg, NONE, 2, 32, **(MOE_KW if cfg is MOE else {}))
        out[name] = fn(state)
    return out


@pytest.mark.parametrize("case", [c if c not in SLOW_CASES else pytest.param(c, marks=pytest.mark.slow) for c in CASES])
def test_recompute_changes_no_number(case, references):
    cfg, policy = CASES[case]
    fn, state = _loss_and_grad(cfg, policy, 2, 32, **(MOE_KW if cfg is MOE else {}))
    _assert_same(fn(state), references["moe" if cfg is MOE else "dense"])


@pytest.mark.slow
def test_moe_act_on_the_dropless_experts_changes_no_number():
    """The default CPU experts (dropless blocked, custom VJP) with moe + moe_act."""
    ref = _loss_and_grad(MOE, NONE, 2, 32)
    got = _loss_and_grad(MOE, selective("moe_act", "layernorm"), 2, 32)
    _assert_same(got[0](got[1]), ref[0](ref[1]))


# ----- (b) what the compiled step keeps ------------------------------------------------------------
def test_full_recompute_methods_order_the_compiled_memory():
    """4 layers, 4 x 256 tokens (measured 2026-12-01, XLA:CPU temp MB): none 59.8, block 2 38.4,
    block 3 18.7, every layer 16.2, uniform groups of 2 39.0. Block N trades N layers' kept
    activations for one recomputed layer's working set, so block 1 of 4 is about none (62.1)."""
    t = {name: _temp_bytes(MOE, p) for name, p in
         (("none", NONE), ("full", FULL), ("block2", block(2)), ("block3", block(3)), ("uniform2", uniform(2)))}
    assert t["full"] < t["block3"] < t["block2"] < 0.8 * t["none"], t
    assert t["full"] < t["uniform2"] < 0.8 * t["none"], t


def test_selective_modules_lie_between_none_and_full():
    """Measured 2026-12-01 (MB): none 59.8, core_attn 58.9 (our attention keeps only its output
    and log-sum-exp already), layernorm 55.2, moe_act 44.0, moe 26.8, full 16.2. Since every
    RMSNorm reruns from its input (issue 49) "layernorm" saves only the normed rows the matmuls
    keep, about what "core_attn" saves: their order is XLA's (jax 0.12.1: 52.6 / 52.2 of 55.0)."""
    t = {m: _temp_bytes(MOE, selective(m)) for m in ("core_attn", "layernorm", "moe_act", "moe")}
    none, full = _temp_bytes(MOE, NONE), _temp_bytes(MOE, FULL)
    assert full < t["moe"] < t["moe_act"] < min(t["layernorm"], t["core_attn"]), (t, none, full)
    assert max(t["layernorm"], t["core_attn"]) < none, (t, none, full)
    assert _temp_bytes(DENSE, selective("mlp"), False) < _temp_bytes(DENSE, NONE, False)


# ----- through the pipeline ------------------------------------------------------------------------
PP_ROWS, PP_SEQ, PP_MICRO = 8, 32, 2


def _pipeline_step(parallel, policy, cfg=MOE, compile_only=False, schedule="1f1b"):
    mesh = make_mesh(parallel, devices=jax.devices()[:parallel.num_devices])
    opt = make_optimizer(lr_schedule=megatron_lr_schedule(lr=1e-3, train_iters=10), weight_decay=0.1, clip_grad=1.0)
    step_cfg = StepConfig(num_micro_batches=PP_MICRO, balancing=AUX_AND_Z_LOSS, micro_batch_size=2)
    trainer = build_trainer(cfg, step_cfg, opt, parallel, mesh, options=ModelOptions(remat=policy),
                            schedule=pipeline_schedule(cfg, parallel, PP_MICRO, schedule))
    shape = (PP_MICRO, PP_ROWS // PP_MICRO, PP_SEQ)
    if compile_only:
        batch = {k: jax.ShapeDtypeStruct(shape, jnp.float32 if k == "loss_mask" else jnp.int32,
                                         sharding=trainer.batch_sharding)
                 for k in ("input_ids", "labels", "loss_mask", "segment_ids", "positions")}
        return trainer.lower_train_step(trainer.abstract_state(), batch).compile(FAST_COMPILE)
    rng = np.random.default_rng(0)
    ids = rng.integers(0, cfg.vocab_size, (PP_ROWS, PP_SEQ)).astype(np.int32)
    seg = np.repeat([[1] * 20 + [2] * 8 + [0] * 4], PP_ROWS, 0).astype(np.int32)
    pos = np.repeat([list(range(20)) + list(range(8)) + [0] * 4], PP_ROWS, 0).astype(np.int32)
    data = dict(input_ids=ids, labels=np.roll(ids, -1, 1), loss_mask=(seg != 0).astype(np.float32),
                segment_ids=seg, positions=pos)
    state = trainer.init_state(seed=0)
    batch = trainer.shard_batch({k: v.reshape(shape) for k, v in data.items()})
    compiled = trainer.lower_train_step(state, batch).compile(FAST_COMPILE)
    with jax.set_mesh(mesh):
        new_state, metrics = compiled(state, batch)
    return jax.device_get(new_state), jax.device_get(metrics)


@pytest.fixture(scope="module")
def pp1_reference():
    return _pipeline_step(Layout(num_devices=1), NONE)


LAYOUT_CASES = {
    # PP2 (2 layers per stage) with the recompute method per stage
    "PP2-block1-1f1b": (Layout(pipeline=2, num_devices=2), block(1), "1f1b"),
    "PP2-uniform2-gpipe": (Layout(pipeline=2, num_devices=2), uniform(2), "gpipe"),
    # the submodule checkpoints around the expert- and tensor-parallel regions
    "EP2xTP2-selective": (Layout(expert=2, tensor=2, num_devices=4),
                          selective("core_attn", "layernorm", "moe_act", "moe"), "1f1b"),
    # 1F1B keeps each chunk's vjp residuals between its ticks: whole layers recomputed (only
    # their inputs kept), and submodules recomputed inside the kept residuals
    "PP2-full-1f1b": (Layout(pipeline=2, num_devices=2), FULL, "1f1b"),
    "PP2-selective-1f1b": (Layout(pipeline=2, num_devices=2), selective("core_attn", "layernorm", "moe_act", "moe"),
                           "1f1b"),
}
SLOW_LAYOUT_CASES = {"PP2-uniform2-gpipe", "PP2-selective-1f1b", "PP2-full-1f1b"}  # PP2-full: 2026-12-08, CI time


@pytest.mark.parametrize("case", [c if c not in SLOW_LAYOUT_CASES else pytest.param(c, marks=pytest.mark.slow)
                                  for c in LAYOUT_CASES])
def test_recompute_in_a_layout_equals_one_device(case, pp1_reference):
    """One training step (float32) against one device without recompute."""
    parallel, policy, schedule = LAYOUT_CASES[case]
    state, metrics = _pipeline_step(parallel, policy, schedule=schedule)
    ref_state, ref_metrics = pp1_reference
    # The layout tests' comparison (tests/helpers.assert_same_step): losses, the gradients read from Adam's
    # first moment, and the updated weights, where a noise-level gradient (|g| < 1e-6) may step anywhere in
    # +-lr (jax 0.12.1's summation order moved one k_proj weight of EP2xTP2-selective 5.5e-5, lr 1e-3).
    from tests.helpers import assert_same_step

    assert_same_step((state, metrics, None), (ref_state, ref_metrics, None))


@pytest.mark.slow  # ~17-35 s; the unpipelined memory order and PP2 equality stay in the default suite
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_pipelined_recompute_orders_the_compiled_memory(schedule):
    """PP2 of an 8-layer dense model (4 layers a stage), 2 micro-batches: every layer < block 2
    of each stage's 4 < none, for GPipe (every micro-batch's residuals) and 1F1B (the residuals
    of the items in flight, whatever the policy keeps of them)."""
    cfg = DENSE.replace(num_layers=8)
    parallel = Layout(pipeline=2, num_devices=2)
    t = {name: _pipeline_step(parallel, p, cfg, compile_only=True, schedule=schedule)
         .memory_analysis().temp_size_in_bytes for name, p in (("none", NONE), ("block2", block(2)), ("full", FULL))}
    assert t["full"] < t["block2"] < t["none"], t


def test_pieces_follow_megatrons_layer_positions():
    assert uniform(2).pieces(4) == [(0, 4, 2)]
    assert uniform(2).pieces(4, (1,)) == [(0, 1, 1), (1, 2, 2), (3, 1, 1)]  # a stack starting mid-group
    assert uniform(2).pieces(4, (0, 1)) == [(0, 1, 1), (1, 1, 1), (2, 1, 1), (3, 1, 1)]  # stages disagree
    assert block(1).pieces(4) == [(0, 1, 1), (1, 3, 0)]
    assert block(3).pieces(4, (2,)) == [(0, 1, 1), (1, 3, 0)]  # chunk positions 2..5: only 2 is among the first 3
    assert block(3).pieces(2, (5,)) == [(0, 2, 0)]
    assert block(3).pieces(4, (0, 2)) == [(0, 3, 1), (3, 1, 0)]  # recomputed where any stage does
    assert FULL.pieces(3) == [(0, 3, 1)] and NONE.pieces(3) == [(0, 3, 0)] == selective("moe").pieces(3)
    assert uniform(1).pieces(4, (3,)) == FULL.pieces(4)  # uniform 1 is every layer on its own: the same program


def test_stage_program_records_where_each_run_starts():
    """A mixed dense/MoE pipeline: the offsets the recompute method counts from, per segment."""
    from mlir_train.config.models import LayerKind
    from mlir_train.model import Stack
    from mlir_train.train.pipeline import make_schedule, stage_program

    schedule = make_schedule(8, 2)  # layers 0-3 on stage 0, 4-7 on stage 1
    # kinds: dense, dense, moe x 3, dense x 3 -> stage 0 = [d d][m m], stage 1 = [m][d d d]
    dense, moe = LayerKind(moe=False), LayerKind(moe=True)
    program = stage_program(schedule, (Stack(dense, (0, 1, 5, 6, 7)), Stack(moe, (2, 3, 4))))
    # stage 1's MoE run starts its chunk (position 0), stage 0's at position 2
    assert [(seg.is_moe, seg.offsets) for seg in program] == [(False, (0,)), (True, (0, 2)), (False, (1,))]


# ----- (c) the flags -------------------------------------------------------------------------------
def _policy(*argv):
    return cli.parse(list(argv)).training.recompute


def test_flags_give_megatrons_policy():
    assert _policy("--recompute-granularity", "full") == FULL
    assert _policy("--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers", "2") == block(2)
    assert _policy("--recompute-granularity", "selective") == selective("core_attn")  # megatron-core's default
    assert _policy("--recompute-activations") == selective("core_attn")
    assert _policy("--recompute-granularity", "selective", "--recompute-modules", "layernorm", "moe_act") == \
        selective("layernorm", "moe_act")
    # --moe-layer-recompute appends moe to the (default) modules, as megatron-core does
    assert _policy("--moe-layer-recompute") == selective("core_attn", "moe")
    assert _policy("--moe-layer-recompute", "--recompute-granularity", "selective", "--recompute-modules", "mlp") == \
        selective("mlp", "moe")
    assert _policy() == NONE


@pytest.mark.parametrize("argv,names", [
    (["--recompute-method", "block", "--recompute-num-layers", "1"], "--recompute-method block needs --recompute-granularity full"),
    (["--recompute-granularity", "selective", "--recompute-method", "uniform", "--recompute-num-layers", "1"],
     "--recompute-method uniform needs --recompute-granularity full"),
    (["--recompute-granularity", "full", "--recompute-method", "block"], "--recompute-method block needs --recompute-num-layers"),
    (["--recompute-granularity", "full", "--recompute-num-layers", "2"], "--recompute-num-layers 2 needs"),
    (["--recompute-granularity", "selective", "--recompute-num-layers", "2"], "--recompute-num-layers 2 needs"),
    (["--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers", "0"],
     "--recompute-num-layers 0: must be at least 1"),
    (["--recompute-granularity", "full", "--recompute-modules", "moe"], "--recompute-modules applies to"),
    (["--recompute-modules", "core_attn"], "--recompute-modules applies to"),
    (["--recompute-granularity", "selective", "--recompute-modules", "shared_experts"], "not recomputed on its own"),
    (["--recompute-granularity", "selective", "--recompute-modules", "mla_up_proj"], "multi-latent attention"),
    (["--recompute-granularity", "selective", "--recompute-modules", "attention"], "invalid choice"),
    (["--moe-layer-recompute", "--recompute-granularity", "full"], "--moe-layer-recompute with --recompute-granularity full"),
    (["--recompute-activations", "--recompute-granularity", "full"], "--recompute-activations"),
])
def test_bad_recompute_flags_stop_naming_them(argv, names, capsys):
    with pytest.raises(SystemExit) as e:
        cli.parse(argv)
    assert e.value.code == 2 and names in capsys.readouterr().err


def test_uniform_groups_must_divide_each_chunk():
    """megatron-core's uniform method runs layers[i:i + N] of each chunk and fails past the end."""
    def resolve(*argv, num_devices=1):
        cfg = cli.parse(["--micro-batch-size", "1", "--global-batch-size", "4", "--recompute-granularity", "full",
                         "--recompute-method", *argv])
        return build.resolve(cfg, MOE, num_devices=num_devices, platform="cpu")

    assert resolve("uniform", "--recompute-num-layers", "2").recompute == uniform(2)
    with pytest.raises(ConfigError, match="must divide the layers of each model"):
        resolve("uniform", "--recompute-num-layers", "3")
    with pytest.raises(ConfigError, match=r"each pipeline chunk \(1\)"):  # 4 layers, 2 stages x 2 chunks
        resolve("uniform", "--recompute-num-layers", "2", "--pipeline-model-parallel-size", "2",
                "--num-layers-per-virtual-pipeline-stage", "1", num_devices=2)
    assert resolve("block", "--recompute-num-layers", "9").recompute == block(9)  # block: at most all of them


@pytest.mark.slow  # ~18 s cold; the compiled memory of each policy is in the two tests above
def test_planner_compiles_the_policy():
    """``python -m mlir_train.plan`` takes the recompute flags: its compiled temporaries and its
    labelled activation estimate both drop from none to block 3 of 4 to every layer."""
    from mlir_train.planner.plan import candidate, plan_layout

    cfg = cli.parse(["--model-name", "qwen3-moe-tiny", "--vocab-size", "256", "--seq-length", "256",
                     "--micro-batch-size", "4", "--global-batch-size", "4", "--moe-expert-capacity-factor", "2"])
    plans = {p.name: plan_layout(cfg, candidate(recompute=p), 1, memory_gb=80, peak_tflops=None, assumed_mfu=0.4)
             for p in (NONE, block(3))}
    plans["full"] = plan_layout(cfg, candidate(recompute=FULL), 1, memory_gb=80, peak_tflops=None, assumed_mfu=0.4,
                                compile_step=False)
    assert all(p.error is None for p in plans.values()), {k: p.error for k, p in plans.items()}
    none, blk, full = plans["none"], plans["full-block3"], plans["full"]
    assert blk.compiled_temp_bytes < 0.8 * none.compiled_temp_bytes, (blk.compiled_temp_bytes, none.compiled_temp_bytes)
    assert full.activation_bytes < blk.activation_bytes < none.activation_bytes
    assert "recompute=full-block3" in blk.name


@pytest.mark.slow
def test_mixed_pipeline_with_uniform_groups_equals_one_device():
    """A dense first layer over PP2: stage 0 runs [dense, MoE], stage 1 [MoE, MoE], so the MoE
    segment starts at chunk position 1 on one stage and 0 on the other; uniform groups of 2
    are then split at both stages' boundaries (one SPMD program)."""
    mixed = MOE.replace(mlp_only_layers=(0,))
    ref_state, ref_metrics = _pipeline_step(Layout(num_devices=1), NONE, mixed)
    state, metrics = _pipeline_step(Layout(pipeline=2, num_devices=2), uniform(2), mixed)
    for key in ("lm loss", "grad-norm", "load_balancing_loss", "z_loss"):
        np.testing.assert_allclose(metrics[key], ref_metrics[key], rtol=2e-5, err_msg=key)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(state["params"]), jax.tree.leaves(ref_state["params"])):
        np.testing.assert_allclose(a, b, atol=5e-5, err_msg=jax.tree_util.keystr(path))
