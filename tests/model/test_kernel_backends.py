"""``--moe-gemm-backend`` and ``--attention-kernel``: flag parsing and refusals by name, the
tokamax paths against our references on CPU (tokamax's own ``implementation="xla"``), and, where
the deviceless XLA:GPU compiler is installed, each GPU backend's compiled HLO for 8 x H200: its
kernel calls, no dense fallback, and the FLOP bounds (benchmarks/README.md has the figures)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mlir_train.families import get_model_config
from mlir_train.model import ModelOptions, kernel_options
from mlir_train.model.moe import dispatch as moe_dispatch
from mlir_train.model.kernels.blocks import xla_block_kernels
from mlir_train.model.moe import experts as moe_experts
from mlir_train.model.attention import attention_mask, masked_attention, pallas_mha_missing
from sharding import Layout



def _tokamax():
    return pytest.importorskip("tokamax", reason="tokamax not installed (pip install 'tokamax>=0.0.12')")


# ----- flags ------------------------------------------------------------------------------------
def test_auto_keeps_todays_choices():
    assert kernel_options("cpu", is_moe=True) == ModelOptions(attention_impl="xla", moe_impl="padded", moe_platform="cpu")
    gpu = kernel_options("gpu", is_moe=True)
    assert gpu.moe_impl == "grouped" and gpu.moe_kernels is None and gpu.attention_impl == "docs-flash"
    assert kernel_options("gpu", is_moe=False, context_parallel=2) == ModelOptions(attention_impl="xla")
    assert kernel_options("gpu", is_moe=True, moe_backend="tokamax", attention_backend="mlir") == ModelOptions(
        attention_impl="docs-flash", moe_impl="grouped", moe_platform="gpu", moe_kernels="tokamax")
    if pallas_mha_missing() is None:  # jax < 0.12: JAX's own Pallas-Triton mha stays selectable
        assert kernel_options("gpu", is_moe=False, attention_backend="pallas-mha").attention_impl == "flash"


def test_pallas_mha_is_refused_by_name_where_jax_removed_it(monkeypatch):
    """jax 0.12 removed jax.experimental.pallas.ops.gpu.attention: --attention-kernel pallas-mha is
    refused naming the flag, the jax version and the alternatives, never swapped for another kernel;
    the default never needs it."""
    from mlir_train.model import attention, platform

    message = attention.pallas_mha_missing.__wrapped__()
    if message is None:  # this jax still ships it: make it look removed
        import importlib

        real = importlib.import_module
        monkeypatch.setattr(importlib, "import_module", lambda name, *a: (_ for _ in ()).throw(
            ImportError("gone")) if name == attention.PALLAS_MHA_MODULE else real(name, *a))
        message = attention.pallas_mha_missing.__wrapped__()
    assert "--attention-kernel pallas-mha" in message and jax.__version__ in message and "auto" in message
    monkeypatch.setattr(platform, "pallas_mha_missing", lambda: message)
    with pytest.raises(ValueError, match="--attention-kernel pallas-mha needs"):
        kernel_options("gpu", is_moe=True, attention_backend="pallas-mha")
    assert kernel_options("gpu", is_moe=True).attention_impl == "docs-flash"
    assert kernel_options("gpu", is_moe=True, moe_backend="padded").moe_impl == "padded"


@pytest.mark.parametrize("kwargs, message", [
    (dict(platform="cpu", moe_backend="tokamax"), "--moe-gemm-backend tokamax: a GPU kernel"),
    (dict(platform="cpu", moe_backend="mosaic"), "--moe-gemm-backend mosaic: a GPU kernel"),
    (dict(platform="cpu", attention_backend="tokamax"), "--attention-kernel tokamax: a GPU kernel"),
    (dict(platform="gpu", attention_backend="pallas-mha", context_parallel=2), "--attention-kernel pallas-mha (does not|needs jax)"),
    (dict(platform="gpu", attention_backend="flash"), "--attention-kernel 'flash'"),
])
def test_refusals_name_the_flag(kwargs, message):
    with pytest.raises(ValueError, match=message):
        kernel_options(kwargs.pop("platform"), is_moe=True, **kwargs)


def test_cli_parses_and_refuses_before_compiling():
    from mlir_train.config import cli
    from mlir_train.runtime.errors import ConfigError
    from mlir_train.train.build import resolve

    base = ["--micro-batch-size", "1", "--seq-length", "16"]
    cfg = cli.parse(base + ["--moe-gemm-backend", "tokamax", "--attention-kernel", "xla"])
    assert (cfg.extras.moe_gemm_backend, cfg.extras.attention_kernel) == ("tokamax", "xla")
    model = get_model_config("qwen3-moe-tiny")
    with pytest.raises(ConfigError, match="--moe-gemm-backend tokamax: a GPU kernel"):
        resolve(cfg, model, num_devices=1, platform="cpu")
    cfg = cli.parse(base + ["--moe-gemm-backend", "mosaic", "--moe-expert-capacity-factor", "1.0"])
    with pytest.raises(ConfigError, match="--moe-gemm-backend mosaic runs the dropless"):
        resolve(cfg, model, num_devices=1, platform="gpu")
    with pytest.raises(SystemExit):
        cli.parse(["--attention-kernel", "cudnn"])


# ----- tokamax against the references on CPU ----------------------------------------------------
def test_tokamax_block_kernels_equal_reference_on_cpu():
    """grouped_experts (values and every gradient) on tokamax's ragged dots (its XLA
    implementation, which runs on CPU) equals it on our ragged_dot reference kernels."""
    _tokamax()
    b, d, f, e = 8, 32, 16, 3
    rng = np.random.default_rng(0)
    layout = moe_dispatch.block_grouping(jnp.asarray([12, 0, 20], jnp.int32), b, 7)  # 2 + 0 + 3 blocks, 2 spare
    r = 7 * b
    live = (np.arange(r) < 5 * b)[:, None]
    x = jnp.asarray(rng.standard_normal((r, d)) * live, jnp.float32)
    weight = jnp.asarray(rng.random(r) * live[:, 0], jnp.float32)
    ws = [jnp.asarray(rng.standard_normal(s) * 0.3, jnp.float32) for s in ((e, d, f), (e, d, f), (e, f, d))]

    def run(kernels):
        def loss(x, weight, *ws):
            return jnp.sum(jnp.sin(moe_experts.grouped_experts(kernels, x, weight, *ws, *layout)))

        return jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4))(x, weight, *ws)

    from mlir_train.model.kernels.tokamax_ops import tokamax_block_kernels

    got, want = run(tokamax_block_kernels(b, implementation="xla")), run(xla_block_kernels(b))
    for a, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(w), rtol=1e-5, atol=1e-5)


def test_tokamax_attention_equals_masked_attention_on_cpu():
    """Packed documents as per-query key starts (tokamax's reference implementation) give the
    packed-document causal attention of attention_mask, values and gradients."""
    _tokamax()
    from mlir_train.model.kernels.tokamax_ops import document_starts, tokamax_attention

    b, t, kv, g, h = 2, 32, 2, 2, 16
    rng = np.random.default_rng(1)
    q, k, v = (jnp.asarray(rng.standard_normal(s), jnp.float32) for s in ((b, t, kv * g, h), (b, t, kv, h), (b, t, kv, h)))
    seg = jnp.asarray([[1] * 10 + [2] * 15 + [0] * 7, [3] * 32])
    np.testing.assert_array_equal(np.asarray(document_starts(seg))[0, [0, 9, 10, 24, 25, 31]], [0, 0, 10, 10, 25, 25])

    def ours(q, k, v):
        return masked_attention(q.reshape(b, t, kv, g, h), k, v, attention_mask(seg)).reshape(b, t, kv * g, h)

    def theirs(q, k, v):
        return tokamax_attention(q, k, v, seg, implementation="xla")

    got, want = theirs(q, k, v), ours(q, k, v)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-5)
    dgot = jax.grad(lambda *a: jnp.sum(jnp.sin(theirs(*a))), argnums=(0, 1, 2))(q, k, v)
    dwant = jax.grad(lambda *a: jnp.sum(jnp.sin(ours(*a))), argnums=(0, 1, 2))(q, k, v)
    for a, w in zip(dgot, dwant):
        np.testing.assert_allclose(np.asarray(a), np.asarray(w), rtol=1e-4, atol=1e-4)


# ----- compiled for 8 x H200, deviceless --------------------------------------------------------
@pytest.fixture(scope="module")
def h200_devices(h200_devices):
    """conftest's H200 devices, where tokamax is installed too."""
    _tokamax()
    return h200_devices


# tests/planner/test_gpu_compile.py's SMALL layer: a quarter-size Qwen3-30B-A3B MoE layer.
SMALL = get_model_config("qwen3-30b-a3b", num_layers=1).replace(hidden_size=256, moe_intermediate_size=128, num_experts=32)


@pytest.mark.parametrize("layout, parallel", [
    ("DP8", Layout(num_devices=8)),
    pytest.param("TP2xEP4", Layout(tensor=2, expert=4, num_devices=8), marks=pytest.mark.slow),
])
def test_tokamax_moe_does_the_routed_work_on_h200(h200_devices, layout, parallel):
    """~15 s: 9 tokamax ragged-dot kernels (3 forward, 3 input-gradient, 3 weight-gradient), no
    dense ragged_dot (XLA's would be E/K = 4x here), within 1.3x of the routed FLOPs."""
    from mlir_train.planner.moe_audit import audit_moe_layer

    a = audit_moe_layer(SMALL, parallel, h200_devices, impl="grouped", tokens_per_rank=1024, layout=layout,
                        block_kernels="tokamax")
    assert a.kernel_calls == 9 and a.while_loops == 0
    assert a.ratio <= 1.3, a


def test_tokamax_attention_compiles_and_skips_other_documents_on_h200(h200_devices):
    """The three tokamax kernels (forward, dQ, dK/dV), no dense attention dot; with 4 documents
    per row the forward's work drops below the one-document figure (earlier documents' key tiles
    skipped). tokamax 0.0.12's backward visits every causal tile, so fwd+bwd stays above
    Megatron's causal count (6 half-matmuls): 9 half-matmuls for one document, ~8.3 for four."""
    from tests.helpers import compiled_attention_grads, one_device_mesh
    from mlir_train.planner.hlo import matmul_flops
    from mlir_train.model.kernels.tokamax_ops import document_starts, tokamax_attention
    from mlir_train.runtime.platform_setup import compile_target

    b, t, kv, g, h = 1, 1024, 2, 4, 128
    mesh = one_device_mesh(h200_devices)
    flops = matmul_flops(compiled_attention_grads(tokamax_attention, mesh, t=t, kv=kv, g=g, h=h,
                                                  under=compile_target(mesh)).as_text())
    assert sorted(c.kind for c in flops.attention_calls) == ["dkv", "dq", "fwd"] and flops.dot_flops == 0
    full = 2.0 * b * kv * g * t * t * h  # one [T, S] matmul over every position pair
    one_doc = flops.attention_flops
    assert 0.5 * 9 * full / 2 <= one_doc <= 1.15 * 9 * full / 2
    starts = np.asarray(document_starts(jnp.repeat(jnp.arange(1, 5), t // 4)[None]))[0]
    packed = sum(c.flops(starts) for c in flops.attention_calls)
    fwd_one, fwd_packed = (sum(c.flops(s) for c in flops.attention_calls if c.kind == "fwd") for s in (None, starts))
    assert fwd_packed < 0.45 * fwd_one and packed < one_doc


# ----- tokamax's versions: the GPU kernel by name, a missing one named by flag -------------------
def test_tokamax_moe_names_the_gpu_kernel_and_guards_the_device(monkeypatch):
    """The block kernels ask tokamax for ``"mosaic_gpu"`` by name (its ``"mosaic"`` picks the GPU or
    the TPU kernel from the default device's kind string), and, since a named implementation skips
    tokamax's own device check from 0.0.17, refuse a non-GPU default device themselves, naming the
    flag: on CPU, never a silent dense fallback (tokamax 0.0.12 and 0.0.17)."""
    tokamax = _tokamax()
    from mlir_train.model.kernels.tokamax_ops import tokamax_block_kernels

    asked = []
    monkeypatch.setattr(tokamax, "ragged_dot", lambda *a, implementation=None, **k: asked.append(implementation))
    kernels = tokamax_block_kernels(8)
    x, w, nb = jnp.ones((16, 4)), jnp.ones((2, 4, 4)), jnp.asarray([1, 1], jnp.int32)
    with pytest.raises(ValueError, match="--moe-gemm-backend tokamax: tracing on a cpu default device"):
        kernels.matmul(x, w, None, 2, None, nb)
    monkeypatch.setattr("mlir_train.model.kernels.tokamax_ops._check_gpu_device", lambda flag: None)
    with pytest.raises(Exception):  # the stub returns None; what it was asked for is what counts
        kernels.matmul(x, w, None, 2, None, nb)
    assert asked == ["mosaic_gpu"]


def test_tokamax_missing_implementation_names_the_flag(monkeypatch):
    """tokamax registers an implementation only where its imports succeed (from 0.0.17 ``"triton"``
    needs jax_triton and triton): a missing one is an ImportError naming the flag and what to install,
    raised when the kernels are built, not a KeyError or a fallback at trace time."""
    _tokamax()
    from tokamax._src.ops.attention import api as attention_api
    from tokamax._src.ops.ragged_dot import api

    from mlir_train.model.kernels.tokamax_ops import tokamax_attention, tokamax_block_kernels

    monkeypatch.setattr(api, "IMPLEMENTATIONS", {"xla": api.IMPLEMENTATIONS["xla"], "mosaic_gpu": None})
    with pytest.raises(ImportError, match=r"--moe-gemm-backend tokamax: tokamax .* no 'triton' ragged dot.*jax-triton"):
        tokamax_block_kernels(8, implementation_t="triton")
    assert tokamax_block_kernels(8).name == "tokamax"
    monkeypatch.setattr(api, "IMPLEMENTATIONS", {"xla": api.IMPLEMENTATIONS["xla"]})
    with pytest.raises(ImportError, match=r"--moe-gemm-backend tokamax: .* no 'mosaic_gpu' ragged dot"):
        tokamax_block_kernels(8)
    assert tokamax_block_kernels(8, implementation="xla").name == "tokamax-xla"
    monkeypatch.setattr(attention_api, "IMPLEMENTATIONS", {"xla": attention_api.IMPLEMENTATIONS["xla"]})
    q = jnp.ones((1, 8, 2, 16))
    with pytest.raises(ImportError, match=r"--attention-kernel tokamax: .* no 'mosaic_gpu' flash attention"):
        tokamax_attention(q, q, q, jnp.ones((1, 8), jnp.int32))


def test_tokamax_kernels_are_read_in_the_compiled_hlo_on_h200(h200_devices):
    """~5 s: tokamax's Mosaic-GPU ragged dots (forward and ragged-contracting) compiled for H200 are
    read by the planner as tokamax kernels, whichever version put the op's JSON where (0.0.12:
    ``op_name``; 0.0.17: ``metadata_payload``), and no dense dot is left."""
    from jax.sharding import NamedSharding, PartitionSpec

    from mlir_train.model.kernels.tokamax_ops import tokamax_block_kernels
    from mlir_train.planner.hlo import matmul_flops
    from mlir_train.planner.moe_audit import compile_without_cache
    from mlir_train.runtime.platform_setup import compile_target
    from tests.helpers import one_device_mesh

    mesh = one_device_mesh(h200_devices)
    rep = NamedSharding(mesh, PartitionSpec())
    kernels = tokamax_block_kernels(64)
    r, k, n, e = 512, 256, 128, 4

    def f(x, w, num_blocks):
        y = kernels.matmul(x, w, None, jnp.int32(r // 64), None, num_blocks)
        return y, kernels.matmul_t(x.T, y, None, jnp.int32(r // 64), None, num_blocks)

    args = (jax.ShapeDtypeStruct((r, k), jnp.bfloat16, sharding=rep), jax.ShapeDtypeStruct((e, k, n), jnp.bfloat16, sharding=rep),
            jax.ShapeDtypeStruct((e,), jnp.int32, sharding=rep))
    with compile_target(mesh):
        lowered = jax.jit(f).lower(*args)
    flops = matmul_flops(compile_without_cache(lowered).as_text())
    assert sorted((c.name, c.rows, c.flops_bound) for c in flops.kernels) == [
        ("tokamax_ragged_dot", r, 2.0 * r * k * n), ("tokamax_ragged_dot_t", r, 2.0 * r * k * n)]
    assert flops.dot_flops == 0
