"""Context parallelism (``--context-parallel-size``): the sequence split over the context ranks.

* the load-balanced ("zig-zag") layout is Megatron's own: megatron-core 0.16.1's
  ``get_batch_on_this_cp_rank`` runs here on CPU (its CP rank and size monkeypatched) and each
  rank's slice of our layout equals what it hands that rank;
* one training step of the tiny MoE model in float32 on packed rows whose documents cross the
  2 x CP chunk boundaries, under CP alone and composed with TP + SP, EP, PP (1F1B) and the
  distributed optimizer, equals the single-device step (loss, grad norm, router statistics,
  gradients, updated weights; the helpers of ``tests/train/test_pipeline.py``);
* attention really runs split: the compiled step all-gathers K/V over the context ranks and
  each rank's score matrix holds ``1/CP`` of the queries;
* the CLI takes ``--context-parallel-size`` and checks ``--seq-length`` as Megatron does.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from sharding.context import from_zigzag, to_zigzag, zigzag_order
from sharding.mesh import validate
from sharding.layout import Layout, LayoutError
from tests.helpers import cli_metrics, collectives
from tests.helpers import MICRO, PIPELINE_CFG as CFG, ROWS, SEQ, assert_same_step, pipeline_batch, pipeline_step


# ----- the layout is Megatron's ----------------------------------------------------------------


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_zigzag_slices_are_megatrons_get_batch_on_this_cp_rank(cp, monkeypatch):
    torch = pytest.importorskip("torch")
    from megatron.core import parallel_state, utils

    seq = 48
    tokens = torch.arange(3 * seq).reshape(3, seq)
    ours = to_zigzag(tokens.numpy(), cp, axis=1)
    for rank in range(cp):
        monkeypatch.setattr(parallel_state, "get_context_parallel_world_size", lambda: cp)
        monkeypatch.setattr(parallel_state, "get_context_parallel_rank", lambda rank=rank: rank)
        theirs = utils.get_batch_on_this_cp_rank({"tokens": tokens.clone(), "labels": tokens.clone() + 1})
        part = slice(rank * seq // cp, (rank + 1) * seq // cp)
        np.testing.assert_array_equal(ours[:, part], theirs["tokens"].numpy())
        np.testing.assert_array_equal(ours[:, part] + 1, theirs["labels"].numpy())


def test_zigzag_round_trips_and_refuses_uneven_chunks():
    x = np.arange(2 * 24).reshape(2, 24)
    for cp in (1, 2, 3, 4):
        assert sorted(zigzag_order(24, cp)) == list(range(24))
        np.testing.assert_array_equal(from_zigzag(to_zigzag(x, cp), cp), x)
    np.testing.assert_array_equal(zigzag_order(8, 2), [0, 1, 6, 7, 2, 3, 4, 5])
    with pytest.raises(ValueError, match="2 x --context-parallel-size"):
        zigzag_order(20, 3)


# ----- one step equals one device ----------------------------------------------------------------


def test_packed_documents_cross_the_chunk_boundaries():
    """Otherwise the equality below would not show that documents are stitched back together."""
    seg = pipeline_batch()["segment_ids"]
    chunk = SEQ // 4  # CP = 2
    crossing = [(seg[:, b - 1] == seg[:, b]) & (seg[:, b] > 0) for b in range(chunk, SEQ, chunk)]
    assert all(c.any() for c in crossing)


LAYOUTS = {
    "CP2xDP4": Layout(context=2, num_devices=8),
    "CP4xTP2-SP": Layout(context=4, tensor=2, sequence_parallel=True, num_devices=8),
    "CP2xEP4-distopt": Layout(context=2, expert=4, distributed_optimizer=True, num_devices=8),
    "CP2xTP2xPP2-SP": Layout(context=2, tensor=2, pipeline=2, sequence_parallel=True, num_devices=8),
    # TP 4 > the model's 2 kv heads: each tensor rank holds both and attends with its own one
    "CP2xTP4-SP": Layout(context=2, tensor=4, sequence_parallel=True, num_devices=8),
}


@pytest.fixture(scope="module")
def reference():
    return pipeline_step(Layout(num_devices=1), jax.devices()[:1])


SLOW = {"CP4xTP2-SP", "CP2xDP4", "CP2xTP4-SP"}  # CP2xTP4-SP: 2026-12-08, the default lanes' time (CI)  # ~10-25 s each; CP over data ranks is also in CP2xEP4-distopt, TP + SP in CP2xTP2xPP2-SP


@pytest.mark.parametrize("name", [n if n not in SLOW else pytest.param(n, marks=pytest.mark.slow) for n in LAYOUTS])
def test_context_parallel_step_equals_one_device(name, reference, monkeypatch):
    from mlir_train.model import attention

    monkeypatch.setattr(attention, "KEY_BLOCK", 8)  # the gathered row of 32 keys in 4 blocks
    parallel = validate(LAYOUTS[name], seq_length=SEQ)
    out = pipeline_step(parallel, jax.devices()[:8])
    assert_same_step(out, reference)
    assert "all-gather" in out[2]


def test_context_parallel_attention_gathers_kv_over_the_context_ranks():
    """The CP2xDP4 step attends with K/V all-gathered over groups of 2 (the context ranks), and
    each rank's forward scores cover its own queries only: [rows/DP, K, G * SEQ/CP, SEQ]."""

    parallel = validate(LAYOUTS["CP2xDP4"], seq_length=SEQ)
    _, _, hlo = pipeline_step(parallel, jax.devices()[:8])
    rows = ROWS // MICRO // parallel.data_parallel
    kv, g, h = CFG.num_kv_heads, CFG.num_heads // CFG.num_kv_heads, CFG.head_dim
    gathers = [c for c in collectives(hlo) if c.kind == "all-gather" and c.group == 2]
    assert any((rows, SEQ, kv, h) in c.shapes for c in gathers), gathers
    # half the queries against one block (here: the whole row) of keys
    assert f"f32[{rows},{kv},{g * SEQ // 2},{SEQ}]" in hlo
    assert f"f32[{rows},{kv},{g * SEQ},{SEQ}]" not in hlo


@pytest.mark.parametrize("order", ["plain", "zigzag"])
def test_blocked_attention_equals_masked_attention(order):
    """The key-blocked online softmax (the CP attention core), forward and gradients, against
    the whole-matrix masked attention on packed rows, with queries in the original or the
    load-balanced order and keys in blocks of 8 of 32."""
    import jax.numpy as jnp

    from mlir_train.model.attention import attention_mask, blocked_attention, masked_attention

    rng = np.random.default_rng(0)
    b, t, kv, g, h = 2, 32, 2, 2, 8
    q, k, v = (jnp.asarray(rng.normal(size=shape), jnp.float32)
               for shape in ((b, t, kv, g, h), (b, t, kv, h), (b, t, kv, h)))
    seg = pipeline_batch()["segment_ids"][:b]
    order_T = jnp.asarray(zigzag_order(t, 2 if order == "zigzag" else 1))
    perm = lambda x: jnp.take(x, order_T, axis=1)  # the rows in the layout's order
    ref = lambda q, k, v: jnp.sum(jnp.sin(masked_attention(q, k, v, attention_mask(jnp.asarray(seg)))))
    seg_p = perm(jnp.asarray(seg))
    got = lambda q, k, v: jnp.sum(jnp.sin(blocked_attention(perm(q), perm(k), perm(v), seg_p, seg_p, order_T, order_T,
                                                            block=8)))
    a, ga = jax.value_and_grad(ref, argnums=(0, 1, 2))(q, k, v)
    z, gz = jax.value_and_grad(got, argnums=(0, 1, 2))(q, k, v)
    # A sum of 2048 sines of float32 softmax outputs: its last bits depend on the summation order,
    # which changes between XLA versions (jax 0.12.1: 2.1e-6 relative).
    np.testing.assert_allclose(z, a, rtol=5e-6)
    for x, y in zip(gz, ga):
        np.testing.assert_allclose(x, y, rtol=0, atol=1e-6 * np.abs(y).max())


# ----- flags -------------------------------------------------------------------------------------


def test_seq_length_is_checked_as_megatron_does():
    with pytest.raises(LayoutError, match=r"--seq-length \(36\) is not divisible by 2 x --context-parallel-size = 8"):
        validate(Layout(context=4, num_devices=8), seq_length=36)
    with pytest.raises(LayoutError, match=r"--context-parallel-size \(2\) x --tensor-model-parallel-size \(4\)"):
        validate(Layout(context=2, tensor=4, sequence_parallel=True, num_devices=8), seq_length=12)
    validate(Layout(context=2, tensor=4, sequence_parallel=True, num_devices=8), seq_length=16)


def test_flash_attention_is_not_picked_under_context_parallelism():
    from mlir_train.model import kernel_options

    assert kernel_options("gpu", is_moe=False).attention_impl == "docs-flash"
    assert kernel_options("gpu", is_moe=False, context_parallel=2).attention_impl == "xla"


@pytest.mark.slow  # ~80 s on 2 cores: two CLI runs
def test_cli_context_parallel_run_equals_data_parallel(tmp_path):
    """Three iterations on the bundled data: DP8 against CP2 x TP2 + SP (DP2), both 2 micro-batches
    of the same 8 rows per step (the aux loss is formed per micro-batch), with
    --calculate-per-token-loss so the rows per data-parallel micro-batch may differ."""

    per_token = ["--calculate-per-token-loss"]
    dp = cli_metrics(tmp_path, "dp", ["--micro-batch-size", "1", *per_token])
    cp = cli_metrics(tmp_path, "cp", ["--micro-batch-size", "4", "--context-parallel-size", "2",
                                       "--tensor-model-parallel-size", "2", "--sequence-parallel", *per_token])
    assert [r["iteration"] for r in dp] == [r["iteration"] for r in cp] == [1, 2, 3]
    for a, b in zip(dp, cp):
        for key in ("lm loss", "grad-norm", "load_balancing_loss"):
            np.testing.assert_allclose(b[key], a[key], rtol=1e-5, err_msg=f"iteration {a['iteration']} {key}")
        assert a["loss tokens"] == b["loss tokens"]


def test_cli_flags_reach_the_layout():
    """--context-parallel-size is no longer refused; Megatron's --seq-length check names the flags."""
    from mlir_train.families import get_model_config
    from mlir_train.config.cli import parse
    from mlir_train.runtime.errors import ConfigError
    from mlir_train.train.build import resolve

    base = ["--model-name", "qwen3-moe-tiny", "--micro-batch-size", "1", "--global-batch-size", "8",
            "--context-parallel-size", "2", "--cp-comm-type", "p2p"]
    model = get_model_config("qwen3-moe-tiny")
    run = resolve(parse([*base, "--seq-length", "64"]), model, num_devices=8, platform="cpu")
    assert (run.parallel.context, run.parallel.data_parallel, run.num_micro_batches) == (2, 4, 2)
    assert run.options.attention_impl == "xla"
    with pytest.raises(ConfigError, match="--seq-length"):
        resolve(parse([*base, "--seq-length", "66"]), model, num_devices=8, platform="cpu")


def test_context_ranks_across_processes_are_detected():
    """A row fed by one process must land on that process's devices (shard_batch feeds whole rows)."""
    import types

    from sharding.context import split_within_processes
    from sharding.mesh import make_mesh

    mesh = make_mesh(Layout(context=2, num_devices=8))
    assert split_within_processes(mesh, ("context",))
    fake = types.SimpleNamespace(axis_names=mesh.axis_names, shape=mesh.shape,
                                 devices=np.vectorize(lambda d: types.SimpleNamespace(process_index=d.id % 2))(mesh.devices))
    assert not split_within_processes(fake, ("context",))
    assert split_within_processes(fake, ())


@pytest.mark.slow  # ~18 s cold; eval runs the training forward, which the step tests cover
def test_context_parallel_eval_equals_one_device():
    """Evaluation (forward only, a [micro, rows, seq] batch and one [rows, seq] micro-batch, the
    two ways shard_batch lays rows out) under CP2 x DP4 sums the same token losses as one device."""
    from mlir_train.train.optim import make_optimizer
    from mlir_train.train.trainer import StepConfig
    from mlir_train.train.build import build_trainer
    from sharding.mesh import make_mesh

    batch = {k: v.reshape(MICRO, ROWS // MICRO, SEQ) for k, v in pipeline_batch().items()}
    out = {}
    for key, (par, devices) in {"one": (Layout(num_devices=1), jax.devices()[:1]),
                                "cp": (LAYOUTS["CP2xDP4"], jax.devices()[:8])}.items():
        trainer = build_trainer(CFG, StepConfig(num_micro_batches=MICRO), make_optimizer(lr_schedule=lambda _: 1e-3, weight_decay=0.0),
                          par, make_mesh(par, devices=devices))
        params = trainer.init_state(seed=0)["params"]
        out[key] = [jax.device_get(trainer.eval_step(params, trainer.shard_batch(batch))),
                    jax.device_get(trainer.eval_step(params, trainer.shard_batch({k: v[0] for k, v in batch.items()},
                                                                                 micro=False)))]
    for got, ref in zip(out["cp"], out["one"]):
        assert got["loss_tokens"] == ref["loss_tokens"] > 0
        np.testing.assert_allclose(got["ce_sum"], ref["ce_sum"], rtol=1e-5)


def test_planner_search_tries_context_parallelism_for_long_rows():
    from mlir_train.config.cli import parse
    from mlir_train.planner.plan import activation_bytes, candidate, candidate_layouts

    def layouts(seq):
        return candidate_layouts(parse(["--model-name", "qwen3-30b-a3b", "--seq-length", str(seq),
                                        "--micro-batch-size", "1"]), 8)

    assert {l.context for l in layouts(2048)} == {1}
    long = layouts(32768)
    assert {l.context for l in long} == {1, 2, 4, 8}
    assert all(8 % (l.tensor * l.pipeline * l.context) == 0 for l in long)
    from mlir_train.families import get_model_config

    cfg = get_model_config("qwen3-30b-a3b")
    est = {cp: activation_bytes(cfg, candidate(tensor=2, context=cp, recompute="full"), micro_batch=1, seq=32768,
                                dtype_bytes=2) for cp in (1, 2, 4)}
    assert est[1] > 1.9 * est[2] > 3.6 * est[4]  # a context rank holds 1/CP of the row (estimate)
