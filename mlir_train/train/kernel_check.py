"""Start-up self-check of the GPU kernels a run selected, before its first step.

Each hand-written kernel the model is built with (the MoE experts' block matmuls, the fused
attention) runs once, forward and backward, at the run's widths (hidden size, expert width per
tensor rank, heads per tensor rank, head dim, sequence length) on a few rows or one sequence,
against its XLA reference in float32. A kernel that raises, returns non-finite values or
differs by more than its dtype's tolerance either stops the run (:class:`ConfigError`, exit 2)
naming the kernel and the flag that selects the fallback, or, where that flag was left at
``auto``, is replaced by the fallback with a loud line and the run goes on. One line reports the
seconds the check took; ``--no-kernel-self-check`` skips it.

What is checked comes from what the model is built with (:func:`selected`): its
``attention_impl`` (a key of :data:`ATTENTION_KERNELS`) and, for dropless ``grouped`` MoE
blocks, the ``BlockKernels`` in their plan (any whose name is not ``"xla"``, the reference).
A new backend is an entry in those tables and, if it falls back elsewhere, in
:data:`FALLBACKS`. On CPU nothing is selected by default; tests run the check on the Pallas and
Mosaic-GPU interpreters (``interpret``).

Shape suffixes as in :mod:`mlir_train.model.layers` and :mod:`mlir_train.model.moe.experts`.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping
from typing import Any

from mlir_train.runtime import log as console
from mlir_train.runtime.errors import ConfigError

# Worst |kernel - reference| over the largest |reference| of each output and gradient, with the
# reference in float32 from the same (rounded) inputs: bf16 keeps 8 mantissa bits (4e-3 per
# rounding; the kernels round their intermediates too), fp16 11. float32 allows TF32 tensor-core
# matmuls (10 bits). A wrong tile or a race is off by O(1) of the largest value.
TOLERANCE = {"bfloat16": 3e-2, "float16": 5e-3, "float32": 5e-3}
# The attention reference's float32 [heads, T, T] scores above this many elements (1 GiB; a
# 32k-token run): the check takes one kv group and the blocked XLA reference instead.
REFERENCE_SCORES = 2**28


@dataclasses.dataclass(frozen=True)
class Fallback:
    """What a failed kernel is replaced by: ``flag value`` selects it on the command line (its
    dest ``choice`` left at ``auto`` lets the check switch by itself), ``changes`` (ModelOptions
    fields) rebuild the model with it."""

    flag: str
    value: str
    changes: dict[str, Any]
    describe: str

    @property
    def choice(self) -> str:
        return self.flag.lstrip("-").replace("-", "_")


ATTENTION_FALLBACK = Fallback("--attention-kernel", "xla", {"attention_impl": "xla"},
                              "XLA attention (layers.masked_attention)")
MOE_FALLBACK = Fallback("--moe-gemm-backend", "padded", {"moe_impl": "padded"},
                        "the padded/blocked XLA experts (moe_impl='padded')")


def _flash(interpret: bool):
    from mlir_train.model.attention import flash_attention

    return lambda q, k, v, seg: flash_attention(q, k, v, seg, interpret=interpret)


def _tokamax(interpret: bool):
    """tokamax's Mosaic-GPU flash attention; it has no CPU interpreter here, so ``interpret``
    runs its XLA implementation (the mask and layout plumbing are ours either way)."""
    from mlir_train.model.attention import kernel_attention

    return lambda q, k, v, seg: kernel_attention(q, k, v, seg, implementation="xla" if interpret else "mosaic_gpu")


def _docs_flash(interpret: bool):
    from mlir_train.model.attention import docs_flash_attention

    return lambda q, k, v, seg: docs_flash_attention(q, k, v, seg, interpret=interpret)


# attention_impl -> (kernel name, (interpret) -> fn(q_BTNH, k_BSKH, v_BSKH, segment_ids_BT) -> o_BTNH)
ATTENTION_KERNELS: dict[str, tuple[str, Callable[[bool], Callable]]] = {
    "flash": ("flash attention (Pallas-Triton mha)", _flash),
    "tokamax": ("tokamax flash attention (Mosaic-GPU)", _tokamax),
    "docs-flash": ("document-skipping flash attention (our Pallas-Triton, --attention-kernel mlir)", _docs_flash),
}
# kernel name (attention_impl, or BlockKernels.name) -> fallback; MoE block kernels not named
# here fall back to MOE_FALLBACK.
FALLBACKS: dict[str, Fallback] = {"flash": ATTENTION_FALLBACK, "tokamax": ATTENTION_FALLBACK,
                                  "docs-flash": ATTENTION_FALLBACK}


@dataclasses.dataclass(frozen=True)
class Shapes:
    """The widths one device's kernels see in the run, and the few rows the check uses."""

    hidden: int = 0
    moe_width: int = 0          # expert SwiGLU width per expert-tensor rank
    experts: int = 0            # experts the check routes rows to (a few of the rank's)
    heads: int = 0              # query heads per tensor rank
    kv_heads: int = 0           # kv heads per tensor rank
    head_dim: int = 0
    seq_length: int = 0
    dtype: str = "bfloat16"

    @classmethod
    def of_run(cls, run) -> "Shapes":
        """From a :class:`~mlir_train.config.flags.Run`: its model, layout, sequence and dtype."""
        m, p = run.model, run.parallel
        tp = p.tensor
        kv = m.num_kv_heads // tp if m.num_kv_heads % tp == 0 else 1  # replicated kv heads: one group per rank
        return cls(hidden=m.hidden_size, moe_width=(m.moe_intermediate_size or 0) // max(p.etp, 1),
                   experts=min(4, max((m.num_experts or 0) // max(p.expert, 1), 1)),
                   heads=m.num_heads // tp, kv_heads=kv, head_dim=m.head_dim, seq_length=run.seq_length,
                   dtype=run.compute_dtype)


@dataclasses.dataclass(frozen=True)
class Kernel:
    """One selected kernel: ``run(shapes)`` gives its worst relative error (raises on failure)."""

    key: str
    name: str
    run: Callable[[Shapes], float]
    fallback: Fallback


def selected(attention_impl: str | None, block_kernels=None, *, interpret: bool = False) -> list[Kernel]:
    """The kernels to check for a model built with ``attention_impl`` and (dropless grouped
    MoE) ``block_kernels``; ``interpret`` runs the Pallas attention kernel in its interpreter
    (the Mosaic block kernels carry their own interpreter setting)."""
    out = []
    if attention_impl in ATTENTION_KERNELS:
        name, build = ATTENTION_KERNELS[attention_impl]
        fn = build(interpret)
        out.append(Kernel(attention_impl, name, lambda s: check_attention(fn, s),
                          FALLBACKS.get(attention_impl, ATTENTION_FALLBACK)))
    if block_kernels is not None and block_kernels.name != "xla":
        name = f"MoE expert matmuls ({block_kernels.name} block kernels)"
        out.append(Kernel(block_kernels.name, name, lambda s: check_block_kernels(block_kernels, s),
                          FALLBACKS.get(block_kernels.name, MOE_FALLBACK)))
    return out


def selected_by(model) -> list[Kernel]:
    """:func:`selected` for a built (or abstract) :class:`~mlir_train.model.CausalLM`: its
    attention implementation and the block kernels of its first dropless grouped MoE block."""
    from mlir_train.model.moe.block import MoE

    kernels = None
    for stack in model.layers:
        mlp = getattr(stack, "mlp", None)
        if isinstance(mlp, MoE) and mlp.plan.dropless_dispatch == "grouped":
            kernels = mlp.plan.block_kernels
            break
    return selected(getattr(model, "attention_impl", None), kernels)


# ----- the checks ----------------------------------------------------------------------------------
def _relative_error(got, want) -> float:
    import jax
    import numpy as np

    worst = 0.0
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
        if not np.all(np.isfinite(g)):
            return float("inf")
        scale = max(float(np.max(np.abs(w))), 1e-30)
        worst = max(worst, float(np.max(np.abs(g - w))) / scale)
    return worst


def _compare(kernel_loss, reference_loss, args, dtype: str) -> float:
    """Worst relative error of the kernel's loss gradients against the reference's (the last
    argument is the output's cotangent: its gradient is the output), the reference in float32
    at the highest matmul precision."""
    import jax
    import jax.numpy as jnp

    grad = lambda f: jax.jit(jax.grad(f, argnums=tuple(range(len(args)))))
    low = [a.astype(dtype) if jnp.issubdtype(a.dtype, jnp.floating) else a for a in args]
    got = grad(kernel_loss)(*low)
    with jax.default_matmul_precision("highest"):
        high = [a.astype(jnp.float32) if jnp.issubdtype(a.dtype, jnp.floating) else a for a in low]
        want = grad(reference_loss)(*high)
    return _relative_error(got, want)


def check_attention(fn: Callable, s: Shapes) -> float:
    """``fn`` (the kernel's ``(q_BTNH, k_BSKH, v_BSKH, segment_ids_BT) -> o_BTNH``) against
    :func:`~mlir_train.model.attention.masked_attention` on one sequence of ``s.seq_length``
    tokens packed with two documents and padding."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from mlir_train.model.attention import attention_mask, blocked_attention, masked_attention

    t, n, kv, h = s.seq_length, s.heads, s.kv_heads, s.head_dim
    long = n * t * t > REFERENCE_SCORES
    if long:  # one kv group, and a reference that holds one key block of scores at a time
        n, kv = n // kv, 1
    keys = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(keys[0], (1, t, n, h), jnp.float32)
    k, v = (jax.random.normal(key, (1, t, kv, h), jnp.float32) for key in keys[1:3])
    w = jax.random.normal(keys[3], (1, t, n, h), jnp.float32)
    first, second = t * 5 // 8, t * 7 // 8
    seg = jnp.asarray(np.array([[1] * first + [2] * (second - first) + [0] * (t - second)]), jnp.int32)

    def kernel(q, k, v, w):
        return jnp.sum(fn(q, k, v, seg).astype(jnp.float32) * w)

    def reference(q, k, v, w):
        q_BTKGH = q.reshape(1, t, kv, n // kv, h)
        if long:
            order = jnp.arange(t, dtype=jnp.int32)
            o = blocked_attention(q_BTKGH, k, v, seg, seg, order, order)
        else:
            o = masked_attention(q_BTKGH, k, v, attention_mask(seg))
        return jnp.sum(o.reshape(1, t, n, h) * w)

    return _compare(kernel, reference, (q, k, v, w), s.dtype)


def check_block_kernels(kernels, s: Shapes) -> float:
    """``grouped_experts`` on ``kernels`` against the same on ``xla_block_kernels``: a few
    experts with uneven rows (two blocks, none, one, a partial one) and a spare block."""
    import jax
    import jax.numpy as jnp

    from mlir_train.model.moe.dispatch import block_grouping
    from mlir_train.model.moe.experts import grouped_experts, xla_block_kernels

    b, e, d, f = kernels.block_rows, s.experts, s.hidden, s.moe_width
    sizes = [2 * b - 7, 0, b, 5][:e] + [b // 2] * max(e - 4, 0)
    n_blocks = sum(-(-x // b) for x in sizes) + 1
    layout = block_grouping(jnp.asarray(sizes, jnp.int32), b, n_blocks)
    keys = jax.random.split(jax.random.key(1), 6)
    r = n_blocks * b
    x = jax.random.normal(keys[0], (r, d), jnp.float32)
    weight = jax.random.uniform(keys[1], (r,), jnp.float32)
    wg, wu = (jax.random.normal(key, (e, d, f), jnp.float32) / d ** 0.5 for key in keys[2:4])
    wd = jax.random.normal(keys[4], (e, f, d), jnp.float32) / f ** 0.5
    dy = jax.random.normal(keys[5], (r, d), jnp.float32)
    reference_kernels = xla_block_kernels(b)

    def loss(block_kernels):
        def f(x, weight, wg, wu, wd, dy):
            return jnp.sum(grouped_experts(block_kernels, x, weight, wg, wu, wd, *layout).astype(jnp.float32) * dy)
        return f

    return _compare(loss(kernels), loss(reference_kernels), (x, weight, wg, wu, wd, dy), s.dtype)


# ----- at start-up -----------------------------------------------------------------------------------
def self_check(kernels: list[Kernel], shapes: Shapes, choices: Mapping[str, Any] | None = None,
               log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Run ``kernels`` at ``shapes``; the model kwargs of the fallbacks taken (empty when all
    passed). ``choices``: the run's flags by dest (``RunConfig.flat()``): a failed kernel whose
    fallback flag is absent or ``auto`` falls back loudly, any other value stops the run with a
    :class:`ConfigError` naming the kernel and the flag."""
    import jax

    if not kernels:
        return {}
    choices = choices or {}
    tol = TOLERANCE.get(shapes.dtype, TOLERANCE["float32"])
    start = time.perf_counter()
    results = []
    for kernel in kernels:
        try:
            err = kernel.run(shapes)
            problem = None if err <= tol else (
                "non-finite values" if err == float("inf") else f"max relative error {err:.2e} > {tol:.0e}")
        except Exception as e:  # noqa: BLE001 - any failure of the kernel is what we report
            err, problem = None, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
        results.append((kernel, err, problem))
    failed = _agreed([problem is not None for _, _, problem in results])
    summary = ", ".join(f"{k.name} {'FAILED' if bad else f'ok ({err:.1e})'}" for (k, err, _), bad in zip(results, failed))
    (log or console.info)(f"kernel self-check took {time.perf_counter() - start:.1f}s ({shapes.dtype}, tolerance "
                          f"{tol:.0e}): {summary}")
    overrides: dict[str, Any] = {}
    for (kernel, err, problem), bad in zip(results, failed):
        if not bad:
            continue
        problem = problem or "failed on another process"
        fb = kernel.fallback
        chosen = choices.get(fb.choice)
        if chosen not in (None, "auto"):
            raise ConfigError(
                f"kernel self-check: {kernel.name} (selected by {fb.flag} {chosen}) failed on "
                f"{jax.devices()[0].device_kind}: {problem}; select the fallback with {fb.flag} {fb.value}, "
                f"or skip this check with --no-kernel-self-check")
        (log or console.warning)(f"kernel self-check: {kernel.name} failed: {problem}; falling back to "
                                 f"{fb.describe} ({fb.flag} {fb.value} selects it; --no-kernel-self-check skips "
                                 "this check)")
        overrides |= fb.changes
    return overrides


def _agreed(failed: list[bool]) -> list[bool]:
    """Failures OR-ed over processes: every process must build the same program."""
    import jax
    import numpy as np

    if jax.process_count() == 1:
        return failed
    from jax.experimental import multihost_utils

    every = multihost_utils.process_allgather(np.asarray(failed, np.int32))
    return [bool(x) for x in np.asarray(every).reshape(-1, len(failed)).any(axis=0)]


def checked_trainer(run, trainer, log: Callable[[str], None] | None = None):
    """``trainer`` after :func:`self_check` of what its model is built with at ``run``'s
    shapes, or the run's trainer rebuilt with the fallbacks of the kernels that failed."""
    from mlir_train.families import build_model

    model = build_model(trainer.model_cfg, trainer.options, abstract=True)
    fallbacks = self_check(selected_by(model), Shapes.of_run(run), run.config.flat(), log)
    return run.trainer(trainer.mesh, trainer.options.replace(**fallbacks)) if fallbacks else trainer
