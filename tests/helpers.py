"""Helpers the tests share, in one module (tests import nothing from each other's files).

* paths: :data:`ROOT`;
* deviceless XLA:GPU: one attention's forward and backward compiled for one compile-only GPU
  device (conftest's ``h200_devices``);
* one train step of a tiny model on a layout, on a fixed packed batch, and its comparison with
  one device; the collectives of a compiled program;
* short SFT runs through the CLI (:func:`sft_args`, :func:`tiny_argv`, :func:`cli_metrics`);
* one MoE block on a mesh (:func:`moe_block`, :func:`run_moe_block`);
* an HF source directory carrying tensors no parameter reads (:func:`make_source`, :func:`assert_carried`).
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import re
import zlib
import shutil
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import sharding
from mlir_train import sft
from mlir_train.checkpoint.hf_files import Files, Raw, write_raw
from mlir_train.families import get_model_config
from mlir_train.data.config import DEFAULT_DATA, DEFAULT_TOKENIZER
from mlir_train.model import ModelOptions
from mlir_train.model.moe import block as moe_lib
from mlir_train.planner import plan, targets
from mlir_train.planner.moe_audit import compile_without_cache
from mlir_train.train.build import build_trainer
from mlir_train.train.optim import make_optimizer
from mlir_train.train.schedule import megatron_lr_schedule
from mlir_train.config.policies import LoadBalancing
from mlir_train.train.pipeline import Schedule, make_schedule
from mlir_train.train.trainer import StepConfig, Trainer, model_dims
from sharding.layout import Layout
from sharding.mesh import make_mesh, validate

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository


# ----- deviceless XLA:GPU --------------------------------------------------------------------------
@contextlib.contextmanager
def float64():
    """The library's float32 computations in float64, for an oracle that tells float32 reordering
    from a different computation: x64 on, and every ``jnp.float32`` the library names (its
    upcasts are explicit) read as ``jnp.float64``. Only for code that reads ``jnp.float32`` at
    call time (not module-level constants such as train/step.py's ``DTYPES``: a whole step runs
    in float64 in its own process, benchmarks/float64_reference.py)."""
    float32 = jnp.float32
    jnp.float32 = jnp.float64
    try:
        with jax.enable_x64(True):
            yield
    finally:
        jnp.float32 = float32


def one_device_mesh(devices) -> Mesh:
    return Mesh(np.array(devices[:1]), ("d",))


def compiled_attention_grads(attend, mesh: Mesh, *, t: int, kv: int = 2, g: int = 2, h: int = 128,
                             dump_to=None, under=None):
    """``jax.grad`` of ``sum(attend(q, k, v, segment_ids))`` over q, k and v (bf16, batch 1, ``kv``
    kv heads of ``g`` query heads each, head dim ``h``), compiled for ``mesh`` without the
    persistent cache; ``dump_to``: XLA's dump directory (the per-kernel PTX); ``under``: a context
    the lowering runs in (default ``jax.set_mesh(mesh)``, so kernels see the target's devices)."""
    rep = NamedSharding(mesh, PartitionSpec())
    q = jax.ShapeDtypeStruct((1, t, kv * g, h), jnp.bfloat16, sharding=rep)
    k = jax.ShapeDtypeStruct((1, t, kv, h), jnp.bfloat16, sharding=rep)
    seg = jax.ShapeDtypeStruct((1, t), jnp.int32, sharding=rep)
    loss = jax.grad(lambda q, k, v, s: jnp.sum(attend(q, k, v, s).astype(jnp.float32)), argnums=(0, 1, 2))
    with under if under is not None else jax.set_mesh(mesh):
        lowered = jax.jit(loss).lower(q, k, k, seg)
    return compile_without_cache(lowered, {"xla_dump_to": str(dump_to)} if dump_to is not None else None)


# ----- one train step on a layout, compared with one device (was tests/train/test_layouts.py) ----
SEED = 3


LR = 1e-3


BETA1 = 0.9


MICRO, ROWS, SEQ = 2, 8, 32  # batch [micro-batches, rows per micro-batch, tokens per row]
AUX_LOSS = LoadBalancing.from_flags("aux_loss", 1e-2)  # --moe-aux-loss-coeff 1e-2
AUX_AND_Z_LOSS = LoadBalancing.from_flags("aux_loss", 1e-2, z_loss_coeff=1e-3)  # and --moe-z-loss-coeff 1e-3


def pipeline_schedule(cfg, parallel: Layout, micro: int, kind: str = "1f1b", virtual: int | None = None,
                      **uneven) -> Schedule | None:
    """``build_trainer``'s ``schedule`` for ``parallel``'s pipeline stages over ``micro``
    micro-batches (``virtual``: layers per virtual stage; ``uneven``: the first/last stage's
    layers); None without pipeline stages."""
    if parallel.pipeline == 1:
        return None
    return make_schedule(cfg.num_layers, parallel.pipeline, kind=kind, layers_per_virtual_stage=virtual,
                         num_micro_batches=micro, **uneven)


MODELS = {
    "moe": get_model_config("qwen3-moe-tiny", vocab_size=512, num_layers=2),
    "dense": get_model_config("qwen3-tiny", vocab_size=512, num_layers=2),
}


# LLVM -O0 for the CPU code: cuts XLA:CPU compile time ~6x, and compiles are most of this module's cost.
# It changes code generation only, not the optimized HLO the collective checks read, and the
# reference step is compiled the same way.
COMPILER_OPTIONS = {"xla_backend_optimization_level": 0}


# Loss normalisation (losses.loss_token_weights): Megatron's default, each data-parallel
# micro-batch of MICRO_BATCH_SIZE rows normalised by its own loss tokens (the rows of one
# micro-batch slice are 4 such groups here, as TP2xDP4 would hold them), for every case above;
# --calculate-per-token-loss (the global token count) for the PER_TOKEN_CASES.
MICRO_BATCH_SIZE = 2


def packed_batch(vocab: int) -> dict[str, np.ndarray]:
    """A fixed SFT-like batch ``[MICRO, ROWS, SEQ]``: rows packed with 1-3 documents and a
    padded tail (segment id 0), positions restarting per document, labels the next token of
    the same document, loss only on each document's "response" (its second half), and the
    second micro-batch with about half the loss tokens of the first (so the two loss
    normalisations weigh the tokens differently)."""
    rng = np.random.default_rng(0)
    shape = (MICRO, ROWS, SEQ)
    ids = rng.integers(1, vocab, shape).astype(np.int32)
    segment_ids = np.zeros(shape, np.int32)
    positions = np.zeros(shape, np.int32)
    labels = np.zeros(shape, np.int32)
    loss_mask = np.zeros(shape, np.int32)
    for m in range(MICRO):
        for r in range(ROWS):
            end = SEQ - int(rng.integers(0, 7))
            cuts = sorted(int(c) for c in rng.choice(np.arange(4, end - 3), size=int(rng.integers(0, 3)), replace=False))
            bounds = [0, *cuts, end]
            for doc, (a, b) in enumerate(zip(bounds[:-1], bounds[1:]), start=1):
                segment_ids[m, r, a:b] = doc
                positions[m, r, a:b] = np.arange(b - a)
                labels[m, r, a:b - 1] = ids[m, r, a + 1:b]
                response = a + (b - a) // 2
                loss_mask[m, r, response:b - 1] = 1
    loss_mask[1] &= (rng.random((ROWS, SEQ)) < 0.5).astype(np.int32)
    assert loss_mask[0].sum() > 1.5 * loss_mask[1].sum() > 0
    return dict(input_ids=ids, labels=labels, loss_mask=loss_mask, segment_ids=segment_ids, positions=positions)


class StepResult(NamedTuple):
    trainer: Trainer
    hlo: str  # optimized HLO of the compiled train step
    init_params: Any  # host copies
    metrics: dict[str, float]
    params: Any
    adam_mu: Any
    state: Any  # the (device) state after the step


def adam_mu(opt_state) -> Any:
    (adam,) = [s for s in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, optax.ScaleByAdamState))
               if isinstance(s, optax.ScaleByAdamState)]
    return adam.mu


def train_one_step(cfg, layout: Layout | None, options: ModelOptions | None = None,
                   per_token: bool = False, step: dict | None = None, init=None, pipeline: dict | None = None) -> StepResult:
    """One train step of model ``cfg`` on ``layout`` (None: one device) on :func:`packed_batch`;
    ``step``: StepConfig fields on top; ``init(trainer, state)``: the state to start from
    (default ``init_state(SEED)``); ``pipeline``: :func:`pipeline_schedule`'s arguments under
    pipeline stages."""
    if layout is None:
        parallel = Layout(num_devices=1)
        mesh = make_mesh(parallel, devices=jax.devices()[:1])
    else:
        parallel = validate(layout, model_dims(cfg), seq_length=SEQ)
        mesh = make_mesh(parallel)
    schedule = megatron_lr_schedule(lr=LR, min_lr=LR / 10, train_iters=10, lr_decay_style="cosine", lr_warmup_iters=0)
    optimizer = make_optimizer(lr_schedule=schedule, weight_decay=0.1, beta1=BETA1, beta2=0.95, clip_grad=1.0)
    step_cfg = StepConfig(**dict(num_micro_batches=MICRO, balancing=AUX_LOSS, micro_batch_size=MICRO_BATCH_SIZE,
                                 per_token_loss=per_token) | (step or {}))
    trainer = build_trainer(cfg, step_cfg, optimizer, parallel, mesh, options=options or ModelOptions(),
                            schedule=pipeline_schedule(cfg, parallel, MICRO, **(pipeline or {})))
    state = trainer.init_state(SEED)
    if init is not None:
        state = init(trainer, state)
    init_params = jax.device_get(state["params"])
    # As the loader does: under context parallelism the rows go in Megatron's load-balanced order.
    batch = trainer.shard_batch(packed_batch(cfg.vocab_size))
    compiled = trainer.lower_train_step(state, batch).compile(COMPILER_OPTIONS)
    state, metrics = compiled(state, batch)
    return StepResult(
        trainer=trainer,
        hlo=compiled.as_text(),
        init_params=init_params,
        metrics={k: float(v) for k, v in jax.device_get(metrics).items() if np.ndim(v) == 0},
        params=jax.device_get(state["params"]),
        adam_mu=jax.device_get(adam_mu(state["opt_state"])),
        state=state,
    )


def named_leaves(tree) -> list[tuple[str, np.ndarray]]:
    return [(jax.tree_util.keystr(p, simple=True, separator="/"), np.asarray(x))
            for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]]


def random_lora_b(trainer, state):
    """The state with every adapter's B drawn at random (std 0.2), in the trainer's sharding: a
    ``train_one_step`` ``init``. LoRA's B starts at zero, which leaves A without gradient on the
    first step and would make a one-step comparison vacuous for A."""
    def draw(path, x):
        if getattr(path[-1], "key", None) != "b":
            return x
        seed = zlib.crc32(jax.tree_util.keystr(path).encode())
        return 0.2 * jax.random.normal(jax.random.key(seed), x.shape, x.dtype)

    params = jax.jit(lambda p: jax.tree_util.tree_map_with_path(draw, p),
                     out_shardings=trainer.master_shardings)(state["params"])
    return dict(state, params=params)


def assert_step_matches(got: StepResult, ref: StepResult, *, moe: bool, grad_tol: float = 1e-5,
                        leaf_tols: dict[str, float] | None = None) -> None:
    """One step of a layout equals the one-device step (tolerances: the module docstring);
    ``grad_tol``: each gradient's tolerance, as a fraction of its largest element; ``leaf_tols``:
    another for the leaves whose path ends in a key (a leaf whose float32 noise is larger)."""
    for (path, a), (_, b) in zip(named_leaves(got.init_params), named_leaves(ref.init_params)):
        np.testing.assert_array_equal(a, b, err_msg=f"initial {path}")
    assert got.metrics["loss tokens"] == ref.metrics["loss tokens"]
    for key in ("lm loss", "grad-norm") + (("load_balancing_loss",) if moe else ()):
        np.testing.assert_allclose(got.metrics[key], ref.metrics[key], rtol=1e-5, err_msg=key)
    assert ref.metrics["grad-norm"] > 1.0  # clipping is active, so its global norm is exercised too
    for (path, a), (_, b) in zip(named_leaves(got.adam_mu), named_leaves(ref.adam_mu)):
        assert np.abs(b).max() > 0, f"{path}: no gradient at all; the test would prove nothing"
        tol = next((t for k, t in (leaf_tols or {}).items() if path.endswith(k)), grad_tol)
        np.testing.assert_allclose(a, b, rtol=0, atol=tol * np.abs(b).max(), err_msg=f"gradient (Adam mu) {path}")
    leaves = zip(named_leaves(got.params), named_leaves(ref.params), named_leaves(ref.init_params),
                 named_leaves(ref.adam_mu))
    for (path, a), (_, b), (_, p0), (_, mu) in leaves:
        clear = np.abs(mu) / (1 - BETA1) >= 1e-6
        np.testing.assert_allclose(a[clear], b[clear], rtol=0, atol=1e-3 * LR, err_msg=f"updated {path}")
        np.testing.assert_allclose(a[~clear], b[~clear], rtol=0, atol=0.25 * LR, err_msg=f"updated {path} (|g| < 1e-6)")
        assert np.abs(b - p0).max() > 0.5 * LR, f"{path} did not move; the comparison would be vacuous"


_COLLECTIVE = re.compile(
    r"^\s*(?:ROOT )?%\S+ = (?P<shape>.+?) (?P<kind>all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)"
    r"(?:-start)?\((?P<rest>.*)$",
    re.MULTILINE,
)


class Collective(NamedTuple):
    kind: str
    shapes: tuple[tuple[int, ...], ...]  # output shapes (several when XLA combined ops into a tuple)
    group: int | None  # ranks per replica group; None where the HLO does not say plainly


def _group_size(attrs: str, num_devices: int) -> int | None:
    """Replica-group size, from any of the spellings XLA prints: ``{{0,1},{2,3}}``, iota
    ``[4,2]<=[8]`` (4 groups of 2) and ``mesh['axis_0'=4,'axis_1'=2] {'axis_1'}`` (the
    product of the named axes)."""
    if m := re.search(r"replica_groups=\{\{([\d,]*)\}", attrs):
        return len(m.group(1).split(","))
    if re.search(r"replica_groups=\{\}", attrs):
        return num_devices
    if m := re.search(r"replica_groups=\[\d+,(\d+)\]<=", attrs):
        return int(m.group(1))
    if m := re.search(r"replica_groups=mesh\[([^\]]*)\] \{([^}]*)\}", attrs):
        sizes = {k: int(v) for k, v in re.findall(r"'(\w+)'=(\d+)", m.group(1))}
        return math.prod(sizes[a] for a in re.findall(r"'(\w+)'", m.group(2)))
    return None


def collectives(hlo: str, num_devices: int = 8) -> list[Collective]:
    out = []
    for m in _COLLECTIVE.finditer(hlo):
        shapes = tuple(tuple(int(d) for d in dims.split(",") if d) for dims in re.findall(r"[a-z]\w*\[([\d,]*)\]", m["shape"]))
        out.append(Collective(m["kind"], shapes, _group_size(m["rest"], num_devices)))
    return out


def cli_metrics(tmp_path, name: str, layout_flags: list[str]) -> list[dict]:
    """Three iterations of ``sft.main`` on the bundled data with ``layout_flags``: the metrics.jsonl rows."""
    log_dir = tmp_path / name
    sft.main([
        "--model-name", "qwen3-moe-tiny", "--num-layers", "2",
        "--tokenizer-type", "HFTokenizer", "--hf-tokenizer-path", DEFAULT_TOKENIZER,
        "--data-path", DEFAULT_DATA, "--split", "100,0,0", "--chat-template", "alpaca", "--packing-sft-data",
        "--seq-length", "64", "--global-batch-size", "16", "--train-iters", "3",
        "--lr", "1e-3", "--lr-decay-style", "cosine", "--min-lr", "1e-4", "--clip-grad", "1.0",
        "--moe-aux-loss-coeff", "1e-2", "--eval-interval", "0", "--log-interval", "1",
        "--data-cache-path", str(tmp_path / "cache"), "--tensorboard-dir", str(log_dir),
        *layout_flags,
    ])
    return [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]


# ----- a short SFT through the CLI (was tests/train/test_train.py) ----------------------------
def sft_args(tmp_path, *extra):
    return [
        "--model-name", "qwen3-moe-tiny", "--num-layers", "2",
        "--hf-tokenizer-path", DEFAULT_TOKENIZER,
        "--data-path", DEFAULT_DATA,
        "--tokenizer-type", "HFTokenizer", "--chat-template", "alpaca", "--packing-sft-data", "--split", "90,10,0",
        "--seq-length", "128", "--micro-batch-size", "1", "--global-batch-size", "8",
        "--lr", "3e-3", "--min-lr", "3e-4", "--lr-warmup-iters", "2", "--lr-decay-style", "cosine",
        "--moe-aux-loss-coeff", "1e-2", "--log-interval", "1", "--eval-iters", "2",
        "--data-cache-path", str(tmp_path / "cache"), "--tensorboard-dir", str(tmp_path / "tb"),
        *extra,
    ]


# ----- a tiny run for the checkpoint tests (was tests/checkpoint/test_checkpoint.py) ----------
def tiny_argv(shared, tmp_path, name, *extra):
    return [
        "--model-name", "qwen3-moe-tiny", "--hf-tokenizer-path", DEFAULT_TOKENIZER,
        "--data-path", DEFAULT_DATA, "--split", "100,0,0", "--chat-template", "alpaca", "--packing-sft-data",
        "--seq-length", "64", "--global-batch-size", "8", "--micro-batch-size", "1", "--train-iters", "4",
        "--eval-interval", "0", "--lr", "1e-3", "--lr-warmup-iters", "1", "--log-interval", "1",
        "--data-cache-path", shared["data"],
        "--tensorboard-dir", str(tmp_path / "tb" / name), *extra,
    ]


# ----- one MoE block on a mesh (was tests/train/test_expert_parallel.py) ----------------------
TINY_MOE = get_model_config("qwen3-moe-tiny", vocab_size=512, num_layers=2)


B, T = 8, 16  # 128 tokens: 16 per rank on 8 token ranks, enough to overflow the capacity guess


def moe_block(**kwargs):
    return moe_lib.MoE(TINY_MOE, nnx.Rngs(1), TINY_MOE.init_std, **kwargs)


def moe_block_inputs():
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((B, T, TINY_MOE.hidden_size)), jnp.float32)
    valid = np.ones((B, T), bool)
    valid[2, 5:] = False
    return x, jnp.asarray(valid)


def run_moe_block(block, x, valid, cfg=None, grads=False):
    graphdef, state = nnx.split(block)

    def f(state, x):
        y, stats = nnx.merge(graphdef, state)(x, valid)
        return jnp.sum(jnp.sin(y)), (y, stats)

    f = jax.value_and_grad(f, argnums=(0, 1), has_aux=True) if grads else f
    if cfg is None:
        return jax.jit(f).lower(state, x).compile(COMPILER_OPTIONS)(state, x), None
    mesh, rules = sharding.make_mesh(cfg), sharding.rules_for(cfg)
    with jax.set_mesh(mesh), sharding.use_rules(rules):
        compiled = jax.jit(f).lower(state, x).compile(COMPILER_OPTIONS)
        return compiled(state, x), compiled.as_text()


# ----- one pipelined train step, compared with one device (was tests/train/test_pipeline.py) ----
PIPELINE_CFG = get_model_config("qwen3-moe-tiny", vocab_size=512, num_layers=4)


def pipeline_batch(seed=0):
    """Rows packed with three documents each (lengths vary by row), some rows padded at the end."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, PIPELINE_CFG.vocab_size, (ROWS, SEQ)).astype(np.int32)
    seg = np.zeros((ROWS, SEQ), np.int32)
    pos = np.zeros((ROWS, SEQ), np.int32)
    for r in range(ROWS):
        cuts = [0, 5 + r, 14 + r, SEQ - (r % 3) * 4]
        for d in range(3):
            seg[r, cuts[d]:cuts[d + 1]] = d + 1
            pos[r, cuts[d]:cuts[d + 1]] = np.arange(cuts[d + 1] - cuts[d])
    mask = (rng.random((ROWS, SEQ)) < 0.7).astype(np.float32) * (seg != 0)
    return dict(input_ids=ids, labels=np.roll(ids, -1, 1), loss_mask=mask, segment_ids=seg, positions=pos)


def pipeline_step(parallel, devices, layers_per_virtual_stage=None, schedule="1f1b", cfg=PIPELINE_CFG, per_token=False,
                  options: ModelOptions | None = None, **uneven):
    mesh = make_mesh(parallel, devices=devices)
    opt = make_optimizer(lr_schedule=megatron_lr_schedule(lr=1e-3, train_iters=10), weight_decay=0.1, clip_grad=1.0)
    # Megatron's default loss normalisation per data-parallel micro-batch of 2 rows (two such
    # groups per micro-batch slice), or --calculate-per-token-loss.
    step_cfg = StepConfig(num_micro_batches=MICRO, balancing=AUX_AND_Z_LOSS, micro_batch_size=2,
                          per_token_loss=per_token)
    trainer = build_trainer(cfg, step_cfg, opt, parallel, mesh, options=options or ModelOptions(),
                            schedule=pipeline_schedule(cfg, parallel, MICRO, schedule, layers_per_virtual_stage, **uneven))
    state = trainer.init_state(seed=0)
    batch = trainer.shard_batch({k: v.reshape(MICRO, ROWS // MICRO, SEQ) for k, v in pipeline_batch().items()})
    compiled = trainer.lower_train_step(state, batch).compile(COMPILER_OPTIONS)
    with jax.set_mesh(mesh):
        new_state, metrics = compiled(state, batch)
    return jax.device_get(new_state), jax.device_get(metrics), compiled.as_text()


def assert_same_step(out, ref):
    (state, metrics, _), (ref_state, ref_metrics, _) = out, ref
    assert set(metrics) == set(ref_metrics)
    for key in ("lm loss", "grad-norm", "load_balancing_loss", "z_loss"):
        np.testing.assert_allclose(metrics[key], ref_metrics[key], rtol=2e-5, err_msg=key)
    for key in ("loss tokens", "tokens_per_expert", "dropped_tokens"):
        np.testing.assert_array_equal(metrics[key], ref_metrics[key], err_msg=key)
    # The gradients, read from Adam's first moment (mu = (1 - beta1) * clipped g), to 1e-5 of each
    # tensor's largest. Adam's first update is ~lr * g / (|g| + eps): on clear gradients it is
    # insensitive to rounding (5e-5 = 0.05 lr); a gradient at the summation-noise level
    # (|g| < 1e-6, a few weights in 1e5) can step anywhere in +-lr, as test_layouts explains.
    mu, ref_mu = adam_mu(state["opt_state"]), adam_mu(ref_state["opt_state"])
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(mu), jax.tree.leaves(ref_mu)):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5 * np.abs(b).max(), err_msg=f"mu {jax.tree_util.keystr(path)}")
    leaves = zip(jax.tree_util.tree_leaves_with_path(state["params"]), jax.tree.leaves(ref_state["params"]),
                 jax.tree.leaves(ref_mu))
    for (path, a), b, m in leaves:
        clear = np.abs(m) / (1 - 0.9) >= 1e-6
        np.testing.assert_allclose(a[clear], b[clear], atol=5e-5, err_msg=jax.tree_util.keystr(path))
        np.testing.assert_allclose(a[~clear], b[~clear], atol=0.25e-3, err_msg=f"{jax.tree_util.keystr(path)} (|g| < 1e-6)")


# ----- the planner run in-process (was tests/planner/test_gpu_plan.py) ------------------------
GPU_MISSING = targets.gpu_compiler_missing()


def run_planner(argv):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        plans = plan.main(argv)
    return plans, out.getvalue()


# ----- HF reference models -----------------------------------------------------------------------
def perturb_torch(model, seed: int) -> None:
    """Add 0.05 N(0, 1) to every tensor of a torch model: HF inits norms to 1 (and peft B to 0), so
    a swapped or transposed weight would otherwise not show."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))


# ----- an HF source directory carrying tensors no parameter reads (checkpoint/carry.py) -------------
SIDE_FILES = {"generation_config.json": '{"do_sample": true, "temperature": 0.6}',
              "tokenizer_config.json": '{"model_max_length": 4096}', "chat_template.jinja": "{{ messages }}"}
SOURCE_FIELDS = {"mtp_num_hidden_layers": 1, "vision_config": {"depth": 2}, "torch_dtype": "bfloat16"}


def extras() -> dict[str, Raw]:
    rng = np.random.default_rng(0)
    return {
        "mtp.layers.0.fc.weight": Raw("BF16", (8, 64), rng.normal(size=(8, 64)).astype(ml_dtypes.bfloat16).tobytes()),
        "model.visual.patch_embed.proj.weight": Raw("F16", (4, 3), rng.normal(size=(4, 3)).astype(np.float16).tobytes()),
        "unknown.step_counter": Raw("I64", (1,), np.array([42], np.int64).tobytes()),
    }


def make_source(model_dir: str, dst: str) -> str:
    """``model_dir`` (an HF directory of ours) with :func:`extras` in a second shard, an index
    over both, extra config.json fields and the side files."""
    os.makedirs(dst)
    shutil.copy(os.path.join(model_dir, "model.safetensors"), os.path.join(dst, "model-00001-of-00002.safetensors"))
    write_raw(os.path.join(dst, "model-00002-of-00002.safetensors"), extras(), {"format": "pt"})
    names = list(Files(model_dir).names())
    weight_map = {n: "model-00001-of-00002.safetensors" for n in names} | \
        {n: "model-00002-of-00002.safetensors" for n in extras()}
    json.dump({"metadata": {}, "weight_map": weight_map}, open(os.path.join(dst, "model.safetensors.index.json"), "w"))
    config = json.load(open(os.path.join(model_dir, "config.json")))
    json.dump(config | SOURCE_FIELDS, open(os.path.join(dst, "config.json"), "w"))
    for name, text in SIDE_FILES.items():
        open(os.path.join(dst, name), "w").write(text)
    return dst


def assert_carried(export: str, source: str) -> None:
    """``export`` holds every extra tensor of ``source`` byte for byte, its config fields and side files."""
    files = Files(export)
    for name, raw in extras().items():
        assert files.raw(name) == raw, name
    config = json.load(open(os.path.join(export, "config.json")))
    assert {k: config[k] for k in ("mtp_num_hidden_layers", "vision_config")} == \
        {k: SOURCE_FIELDS[k] for k in ("mtp_num_hidden_layers", "vision_config")}
    assert "torch_dtype" not in config and config["dtype"] == "float32"
    for name, text in SIDE_FILES.items():
        assert open(os.path.join(export, name)).read() == text


# The decay gate's gradients (g = -exp(a_log) softplus(x wa + dt_bias): sums over every token): one
# device's own float32 gradient of a_log / dt_bias is DECAY_GATE_NOISE of its largest element away
# from the float64 one, ~10x any other leaf's (why is not identified; figures in
# tests/train/test_qwen3_5_layouts.py's docstring, Qwen3-Next's the largest). Two float32 runs that sum
# in different orders differ by up to the sum of their two errors; the tolerance is that with a
# margin of 2. That the layouts compute the same function is shown in float64 (1e-13), by
# benchmarks/float64_reference.py and tests/model/test_gdn_context.py.
DECAY_GATE_NOISE = 1.8e-5
DECAY_GATE_TOLS = {leaf: 4 * DECAY_GATE_NOISE for leaf in ("a_log_H", "dt_bias_H", "wa_DH")}
