"""The program XLA:GPU builds, compiled deviceless for 8 x H200 on this CPU-only machine.

Needs ``jax-cuda12-plugin``, ``jax-cuda12-pjrt`` and ``nvidia-cuda-nvcc-cu12`` (the ``test``
extra installs them); without them the GPU tests skip and say why. The CPU-side pieces (device
descriptions, HLO counting on an XLA:CPU program, the platform decision) run everywhere.
"""


import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from mlir_train.model import flops
from mlir_train.planner import hlo as hlo_stats
from mlir_train.runtime import platform_setup
from mlir_train.planner import plan
from mlir_train.planner import targets
from mlir_train.families import get_model_config
from mlir_train.model import kernel_options
from mlir_train.model.moe.block import DEFAULT_MOE_IMPL
from tests.helpers import GPU_MISSING, run_planner

# JAX decides once per process whether its persistent cache is on (conftest turns it on), so
# plan.main's switch-off may come too late here: a deviceless executable found in the cache
# cannot be reloaded (no client), JAX warns and compiles it again.
pytestmark = pytest.mark.filterwarnings("ignore:Error reading persistent compilation cache entry")

needs_gpu_compiler = pytest.mark.skipif(GPU_MISSING is not None, reason=f"deviceless XLA:GPU: {GPU_MISSING}")

# Small models: Qwen3 layers at toy widths, 2 layers, short sequences (each compile ~15 s of CPU).
DENSE = ["--model-name", "qwen3-tiny", "--num-layers", "2", "--seq-length", "128", "--micro-batch-size", "2",
         "--global-batch-size", "16", "--bf16", "--num-devices", "8", "--device-kind", "h200"]
MOE = ["--model-name", "qwen3-moe-tiny", "--num-layers", "2", "--seq-length", "64", "--micro-batch-size", "2",
       "--global-batch-size", "16", "--bf16", "--num-devices", "8", "--device-kind", "h200"]


@pytest.fixture(autouse=True, scope="module")
def _restore_compilation_cache():
    """plan.main turns JAX's persistent cache off for deviceless compiles (they cannot be
    cached); the rest of the session keeps conftest's cache."""
    enabled = jax.config.jax_enable_compilation_cache
    yield
    jax.config.update("jax_enable_compilation_cache", enabled)


# ----- runs everywhere ----------------------------------------------------------------------

@pytest.mark.parametrize("name", [k for k, v in targets.DEVICE_KINDS.items() if v.compiles_for_gpu])
def test_device_descriptions_match_the_table(name):
    kind = targets.DEVICE_KINDS[name]
    text = kind.target_config()
    assert f"device_memory_size: {kind.memory_bytes}" in text
    assert "collective_memory_granularity" not in text.split("# Changed:")[-1].split("\n", 2)[-1]
    # The datasheet peak agrees with the description's tensor-core rates (bf16) within 2 %.
    assert targets.spec_bf16_tflops(kind) == pytest.approx(kind.bf16_tflops, rel=0.02)


def test_hlo_stats_counts_loop_trip_counts_on_a_cpu_program():
    """Matmul FLOPs and collectives of a scanned, sharded program, counted from its HLO text."""
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "tensor"))

    def loss(w, x):
        def layer(h, w_l):
            return jnp.tanh(h @ w_l), None
        return jax.lax.scan(layer, x, w)[0].sum()

    x = jax.ShapeDtypeStruct((256, 128), jnp.float32, sharding=NamedSharding(mesh, P("data", None)))
    w = jax.ShapeDtypeStruct((3, 128, 128), jnp.float32, sharding=NamedSharding(mesh, P(None, None, "tensor")))
    compiled = jax.jit(jax.grad(loss)).lower(w, x).compile()
    stats = hlo_stats.analyze(compiled.as_text())
    # Per device: 128 rows x 128 x 32 columns per layer, 3 layers, forward + 2 backward matmuls.
    assert stats.matmul_flops == 3 * 3 * 2 * 128 * 128 * 32
    assert stats.unknown_loops == 0 and stats.collectives  # the column shards meet in collectives


HLO = """HloModule m, entry_computation_layout={()->()}

%body (p: (s32[], bf16[64,128])) -> (s32[], bf16[64,128]) {
  %p = (s32[], bf16[64,128]{1,0}) parameter(0)
  %x = bf16[64,128]{1,0} get-tuple-element(%p), index=1
  %w = bf16[128,256]{1,0} constant({...})
  %gemm = (bf16[64,256]{1,0}, s8[4194304]{0}) custom-call(%x, %w), custom_call_target="__cublas$gemm", metadata={op_name="dot"}, backend_config={"operation_queue_id":"0","gemm_backend_config":{"alpha_real":1,"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["0"],"lhs_batch_dimensions":[],"rhs_batch_dimensions":[]},"epilogue":"DEFAULT"}}
  %ags = (bf16[64,128]{1,0}, bf16[512,128]{1,0}) all-gather-start(%x), channel_id=1, replica_groups=[1,8]<=[8], dimensions={0}
  %agd = bf16[512,128]{1,0} all-gather-done(%ags)
  %fa = bf16[64,64]{1,0} custom-call(%x), custom_call_target="__cudnn$fmhaSoftmax"
  ROOT %t = (s32[], bf16[64,128]{1,0}) tuple(%i, %x)
}

%branch_small (a: bf16[64,128]) -> bf16[64,128] {
  %a = bf16[64,128]{1,0} parameter(0)
  ROOT %ar = bf16[64,128]{1,0} all-reduce(%a), replica_groups={}, to_apply=%add
}

%branch_big (b: bf16[64,128]) -> bf16[64,128] {
  %b = bf16[64,128]{1,0} parameter(0)
  %c = bf16[128,128]{1,0} constant({...})
  ROOT %d = bf16[64,128]{1,0} dot(%b, %c), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%fused_lt (param_0: s32[]) -> pred[] {
  %param_0 = s32[] parameter(0)
  %n = s32[] constant(7)
  ROOT %cmp = pred[] compare(%param_0, %n), direction=LT
}

%cond2 (c: (s32[], bf16[64,128])) -> pred[] {
  %c = (s32[], bf16[64,128]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%c), index=0
  ROOT %lt = pred[] fusion(%i), kind=kLoop, calls=%fused_lt
}

%body2 (q: (s32[], bf16[64,128])) -> (s32[], bf16[64,128]) {
  %q = (s32[], bf16[64,128]{1,0}) parameter(0)
  %v = bf16[64,128]{1,0} get-tuple-element(%q), index=1
  %m = bf16[128,128]{1,0} constant({...})
  %e = bf16[64,128]{1,0} dot(%v, %m), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  ROOT %t2 = (s32[], bf16[64,128]{1,0}) tuple(%j, %e)
}

ENTRY %main () -> bf16[64,128] {
  %init = (s32[], bf16[64,128]{1,0}) constant({...})
  %loop = (s32[], bf16[64,128]{1,0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"5"}}
  %y = bf16[64,128]{1,0} get-tuple-element(%loop), index=1
  %one = s32[] constant(1)
  %start = s32[] copy(%one)
  %init2 = (s32[], bf16[64,128]{1,0}) tuple(%start, %y)
  %loop2 = (s32[], bf16[64,128]{1,0}) while(%init2), condition=%cond2, body=%body2, backend_config={"known_induction_variable":{"tuple_index":"0"}}
  %z = bf16[64,128]{1,0} get-tuple-element(%loop2), index=1
  %k = s32[] constant(0)
  ROOT %r = bf16[64,128]{1,0} conditional(%k, %z, %z), branch_computations={%branch_small, %branch_big}
}
"""


def test_hlo_stats_reads_gemm_custom_calls_async_collectives_and_branches():
    hi = hlo_stats.analyze(HLO)
    gemm, dot = 2 * 64 * 256 * 128, 2 * 64 * 128 * 128
    # The first loop's 5 GEMMs, the second's 6 dots (no known_trip_count: 1 <= i < 7, read from
    # the loop itself, as after XLA's loop rewrites), the costliest branch's dot.
    assert hi.matmul_flops == 5 * gemm + 6 * dot + dot and hi.unknown_loops == 0
    assert hi.collectives["all-gather"].count == 5 and hi.collectives["all-gather"].bytes == 5 * 512 * 128 * 2
    assert "all-reduce" not in hi.collectives and hi.conditionals == 1
    assert hi.uncounted_custom_calls == {"__cudnn$fmhaSoftmax": 5}  # listed, never silently dropped
    lo = hlo_stats.analyze(HLO, branch="min")
    assert lo.matmul_flops == 5 * gemm + 6 * dot and lo.collectives["all-reduce"].bytes == 64 * 128 * 2


def test_platform_is_decided_from_the_machine_not_the_installed_plugins(monkeypatch):
    # A CPU-only machine with the CUDA plugin installed: CPU, with the XLA:CPU workaround, and
    # JAX_PLATFORMS=cpu so the plugin is never initialised.
    monkeypatch.setattr(platform_setup, "_installed_plugins", lambda: {"cuda"})
    monkeypatch.setattr(platform_setup, "_has_cuda_device", lambda: False)
    env = {}
    setup = platform_setup.apply_platform_settings(env)
    assert setup.platform == "cpu" and env["JAX_PLATFORMS"] == "cpu"
    assert "--xla_disable_hlo_passes=all-reduce-promotion" in env["XLA_FLAGS"]
    assert "xla_gpu" not in env["XLA_FLAGS"] and "XLA_PYTHON_CLIENT_MEM_FRACTION" not in env
    # The same install on a GPU machine: the GPU settings, none of the CPU ones.
    monkeypatch.setattr(platform_setup, "_has_cuda_device", lambda: True)
    env = {}
    setup = platform_setup.apply_platform_settings(env)
    assert setup.platform == "gpu" and "JAX_PLATFORMS" not in env
    assert "--xla_gpu_enable_latency_hiding_scheduler=true" in env["XLA_FLAGS"]
    assert "all-reduce-promotion" not in env["XLA_FLAGS"] and env["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.95"
    assert "XLA_PYTHON_CLIENT_MEM_FRACTION=0.95" in setup.describe()


def test_users_gpu_settings_win():
    env = {"JAX_PLATFORMS": "cuda", "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.7",
           "XLA_FLAGS": "--xla_gpu_enable_latency_hiding_scheduler=false --xla_gpu_all_gather_combine_threshold_bytes=1"}
    setup = platform_setup.apply_platform_settings(env)
    assert setup.platform == "gpu"
    assert "--xla_gpu_enable_latency_hiding_scheduler=false" in env["XLA_FLAGS"]
    assert "--xla_gpu_enable_latency_hiding_scheduler=true" not in env["XLA_FLAGS"]
    assert "--xla_gpu_all_gather_combine_threshold_bytes=1" in env["XLA_FLAGS"].split()
    assert env["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.7"
    assert {"--xla_gpu_enable_latency_hiding_scheduler", "XLA_PYTHON_CLIENT_MEM_FRACTION"} <= set(setup.kept)
    # The user's own disabled passes are kept and the CPU workaround joins them.
    env = {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_disable_hlo_passes=foo"}
    platform_setup.apply_platform_settings(env)
    assert "--xla_disable_hlo_passes=foo,all-reduce-promotion" in env["XLA_FLAGS"].split()


def test_gpu_flags_this_jaxlib_lacks_are_left_out(monkeypatch):
    # An unknown name in XLA_FLAGS aborts the process (flags come and go between XLA versions).
    assert platform_setup._unknown_to_jaxlib(list(platform_setup.GPU_XLA_FLAGS)) == set()
    monkeypatch.setattr(platform_setup, "_unknown_to_jaxlib", lambda names: {"xla_gpu_enable_pipelined_all_gather"})
    env = {"JAX_PLATFORMS": "cuda"}
    setup = platform_setup.apply_platform_settings(env)
    assert "pipelined_all_gather" not in env["XLA_FLAGS"] and "--xla_gpu_enable_latency_hiding_scheduler=true" in env["XLA_FLAGS"]
    assert setup.skipped == ("--xla_gpu_enable_pipelined_all_gather",) and "unknown to this jaxlib" in setup.describe()


def test_cpu_mesh_gets_the_cpu_moe_path():
    mesh = Mesh(np.array(jax.devices()[:8]), ("data",))
    assert platform_setup.mesh_platform(mesh) == "cpu"
    assert kernel_options(platform_setup.mesh_platform(mesh), is_moe=True).moe_impl == DEFAULT_MOE_IMPL["cpu"]


def test_planner_without_a_gpu_target_says_so():
    """P800: memory only (CPU compile, estimate verdict), labelled; so is --xla-cpu."""
    target, note = plan.choose_compiler(targets.DEVICE_KINDS["p800"])
    assert target is None and "no XLA:GPU target" in note and "memory only" in note
    target, note = plan.choose_compiler(targets.DEVICE_KINDS["h200"], force_cpu=True)
    assert target is None and "XLA:CPU" in note
    if GPU_MISSING:
        target, note = plan.choose_compiler(targets.DEVICE_KINDS["h200"])
        assert target is None and "not available" in note and "jax-cuda12-plugin" in note


# ----- deviceless XLA:GPU -----------------------------------------------------------------

@needs_gpu_compiler
def test_gpu_mesh_gets_the_gpu_moe_path_from_a_cpu_host():
    assert jax.default_backend() == "cpu"
    devices = targets.compile_only_devices("h200", 8)
    mesh = Mesh(np.array(devices).reshape(2, 4), ("data", "expert"))
    assert platform_setup.mesh_platform(mesh) == "gpu"
    assert kernel_options(platform_setup.mesh_platform(mesh), is_moe=True).moe_impl == DEFAULT_MOE_IMPL["gpu"]
    assert DEFAULT_MOE_IMPL["gpu"] != DEFAULT_MOE_IMPL["cpu"]


@pytest.fixture(scope="module")
def dense_tp2():
    """qwen3-tiny (2 layers) under TP2 + SP, DP4, recompute off, compiled for 8 x H200."""
    [p], text = run_planner(DENSE + ["--tensor-model-parallel-size", "2", "--sequence-parallel"])
    return p, text


@needs_gpu_compiler
def test_planner_fits_by_the_compiled_figure(dense_tp2):
    p, text = dense_tp2
    assert p.error is None and p.compiled_for_target and p.compiler == "XLA:GPU h200 (deviceless)"
    assert p.verdict_from == "compiled" and p.needed_bytes == p.compiled_needed_bytes
    # Arguments are the state + batch the analytic breakdown counts (+ the int32 iteration).
    assert p.compiled_argument_bytes - (p.master_bytes + p.optimizer_bytes + p.batch_bytes) in (0, 4)
    assert p.compiled_needed_bytes >= max(p.compiled_argument_bytes, p.compiled_temp_bytes)
    assert p.fits and "FITS in 141 GiB" in text and "(compiled by XLA:GPU h200 (deviceless))" in text
    assert "analytic breakdown" in text and "compiled vs analytic" in text


@needs_gpu_compiler
def test_planner_does_not_fit_when_the_compiled_step_is_bigger_than_the_device(dense_tp2):
    p, _ = dense_tp2
    memory_gib = 0.9 * p.compiled_needed_bytes / plan.GIB  # below what the compiler says it needs
    [small], text = run_planner(DENSE + ["--tensor-model-parallel-size", "2", "--sequence-parallel",
                                          "--device-memory-gb", f"{memory_gib:.6f}"])
    assert small.verdict_from == "compiled" and not small.fits
    assert "DOES NOT FIT" in text and small.compiled_needed_bytes > plan.USABLE_FRACTION * small.capacity_bytes


@needs_gpu_compiler
def test_tensor_parallel_collectives_and_dense_flops_match_megatron(dense_tp2):
    p, text = dense_tp2
    # Sequence parallelism: the activations are all-gathered before and reduce-scattered after
    # each TP block; the data-parallel gradients are all-reduced.
    assert {"all-gather", "reduce-scatter", "all-reduce"} <= set(p.collectives)
    assert all(c["count"] > 0 and c["bytes"] > 0 for c in p.collectives.values())
    assert "all-gather" in text and "reduce-scatter" in text
    # The compiled matmuls are Megatron's model FLOPs with recompute off, within 1.15x (the
    # router-free dense model; the rest is attention's full T x T square and its recomputed
    # scores, which Megatron's causal count halves).
    cfg = get_model_config("qwen3-tiny", num_layers=2)
    model = flops.num_floating_point_operations(cfg, 128, 16)  # vocab 2048 needs no TP padding
    assert p.flops_per_step == pytest.approx(model)
    assert 1.0 <= p.flop_ratio <= 1.15, p.flop_ratio


@needs_gpu_compiler
def test_expert_parallel_step_has_all_to_all_and_the_gpu_moe_path():
    [p], text = run_planner(MOE + ["--expert-model-parallel-size", "4"])
    assert p.error is None and p.compiled_for_target
    assert p.moe_impl == DEFAULT_MOE_IMPL["gpu"]
    kinds = set(p.collectives)
    assert kinds & {"all-to-all", "ragged-all-to-all"}, kinds
    assert "MoE: " + p.moe_impl in text
