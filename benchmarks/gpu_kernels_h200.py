"""Every GPU kernel backend on one H200: error against float32, determinism, TFLOP/s, one table.

    python benchmarks/gpu_kernels_h200.py                  # the GPU machine: under six minutes
    python benchmarks/gpu_kernels_h200.py --cpu-rehearsal  # tiny shapes on one CPU device, the kernels interpreted

At Qwen3-30B-A3B's shapes, per device, forward + backward (``jax.vjp``: the output and every
input's gradient for a random cotangent), bf16 operands:

* MoE experts (SwiGLU of the rows sorted by expert, hidden 2048, 128 experts, 8192 tokens routed
  top-8 uniformly at random = 65536 rows; expert width 768, and 384 as one of two expert-tensor
  ranks sees it): our Mosaic-GPU block kernels (``kernels.mosaic_moe.mosaic_block_kernels`` through
  ``grouped_experts``, rows scattered into the block layout and back), ``tokamax.ragged_dot`` if
  tokamax imports, ``jax.lax.ragged_dot`` (XLA), and the capacity-padded ``[E, C, D]`` einsum
  (C = the largest group, rounded up to 8). Reference: the padded einsum in float32 at HIGHEST.
* Attention (causal, 4 rows of 2048 tokens, 32 query / 4 kv heads of 128): the Pallas-Triton
  mha kernel (``attention.flash_attention``), our document-skipping Pallas-Triton kernel
  (``attention.docs_flash_attention``, ``--attention-kernel mlir``; one document per row here),
  ``tokamax.dot_product_attention`` if tokamax imports, and XLA's ``attention.masked_attention``.
  Reference: ``masked_attention`` in float32 at HIGHEST.

For each: the max abs and relative (over the reference's max abs) error of the forward output
and the worst of the gradients; whether ten repeats are bit-identical; the median fwd+bwd time and
TFLOP/s of the analytic FLOPs (routed MoE: ``3 x 2 x rows x 3 x D x F``; causal attention:
``3 x 2 x B x N x T^2 x H``, half of QK^T and PV, backward = 2 x forward as Megatron counts).
A backend that fails prints its error in the table; one whose package is missing is skipped with
the reason. Uses public JAX APIs only (jax 0.10 / CUDA 12 and 0.11 / CUDA 13); ``--budget-s``
(default 300) skips what is left once it is spent, so the script ends inside six minutes.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import gpu_common  # noqa: E402  (imports no jax)

SMOKE, SETUP = gpu_common.setup(sys.argv)  # SMOKE: a CPU rehearsal
DEVICE = None if SMOKE else gpu_common.the_gpu()  # no GPU: one error line, exit status 2

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402


@dataclasses.dataclass(frozen=True)
class MoECase:
    name: str
    tokens: int
    top_k: int
    experts: int
    hidden: int
    width: int

    @property
    def rows(self) -> int:
        return self.tokens * self.top_k

    def flops(self) -> float:  # fwd 3 matmuls of 2*A*D*F, bwd twice that
        return 3 * 2 * self.rows * 3 * self.hidden * self.width


@dataclasses.dataclass(frozen=True)
class AttentionCase:
    name: str
    batch: int
    seq: int
    heads: int
    kv_heads: int
    head_dim: int

    def flops(self) -> float:  # causal: half of QK^T and PV (2 * 2*T*T*H per head), bwd twice the fwd
        return 3 * 2 * self.batch * self.heads * self.seq ** 2 * self.head_dim


H200_MOE = [MoECase("moe F768", 8192, 8, 128, 2048, 768), MoECase("moe F384 (ETP2)", 8192, 8, 128, 2048, 384)]
H200_ATTENTION = [AttentionCase("attn T2048", 4, 2048, 32, 4, 128)]
SMOKE_MOE = [MoECase("moe smoke", 64, 2, 4, 64, 64)]
SMOKE_ATTENTION = [AttentionCase("attn smoke", 1, 64, 4, 2, 32)]


def _highest():
    ctx = getattr(jax, "default_matmul_precision", None)
    return ctx("highest") if ctx is not None else contextlib.nullcontext()


def _tokamax():
    try:
        import tokamax
    except Exception as e:  # noqa: BLE001 - any import failure is a reason to skip
        return None, f"tokamax not importable ({type(e).__name__}: {e})"
    try:  # tokamax reads absl flags at its first call, which would parse this script's argv
        from absl import flags

        if not flags.FLAGS.is_parsed():
            flags.FLAGS.mark_as_parsed()
    except ImportError:
        pass
    return tokamax, None


# ----- MoE backends: fn(x_AD, wg_EDF, wu_EDF, wd_EFD) -> y_AD, rows sorted by expert -------------
def _expert_rows(sizes_E, a):
    e = sizes_E.shape[0]
    expert_A = jnp.repeat(jnp.arange(e), sizes_E, total_repeat_length=a)
    first_E = jnp.cumsum(sizes_E) - sizes_E
    return expert_A, jnp.arange(a) - first_E[expert_A]


def moe_padded(sizes_E, capacity):
    from mlir_train.model.moe.experts import swiglu_experts

    def fn(x, wg, wu, wd):
        e, a, d = wg.shape[0], x.shape[0], x.shape[1]
        expert_A, slot_A = _expert_rows(sizes_E, a)
        buf_ECD = jnp.zeros((e, capacity, d), x.dtype).at[expert_A, slot_A].set(x)
        return swiglu_experts(buf_ECD, wg, wu, wd)[expert_A, slot_A]

    return fn


def moe_ragged(ragged_dot, sizes_E):
    def fn(x, wg, wu, wd):
        g, u = ragged_dot(x, wg, sizes_E), ragged_dot(x, wu, sizes_E)
        return ragged_dot(jax.nn.silu(g) * u, wd, sizes_E)

    return fn


def moe_blocks(kernels, sizes_E):
    from mlir_train.model.moe.dispatch import block_grouping
    from mlir_train.model.moe.experts import grouped_experts

    def fn(x, wg, wu, wd):
        e, a, d = wg.shape[0], x.shape[0], x.shape[1]
        b = kernels.block_rows
        n_blocks = -(-a // b) + e
        layout = block_grouping(sizes_E, b, n_blocks)
        expert_A, slot_A = _expert_rows(sizes_E, a)
        row_A = layout[2][expert_A] * b + slot_A
        x_RD = jnp.zeros((n_blocks * b, d), x.dtype).at[row_A].set(x)
        y_RD = grouped_experts(kernels, x_RD, jnp.ones((n_blocks * b,), x.dtype), wg, wu, wd, *layout)
        return y_RD[row_A]

    return fn


def moe_backends(sizes_E, capacity):
    """(name, fn or None, why skipped) per MoE backend."""
    from mlir_train.model.kernels.mosaic_moe import mosaic_block_kernels

    out = []
    if SMOKE:
        try:
            from mlir_train.model.kernels.mosaic_moe import interpret_params  # CPU only
            out.append(("mosaic blocks", moe_blocks(mosaic_block_kernels(interpret_params()), sizes_E), None))
        except ImportError as e:
            out.append(("mosaic blocks", None, f"no Mosaic-GPU interpreter in this jax ({e})"))
    else:
        out.append(("mosaic blocks", moe_blocks(mosaic_block_kernels(), sizes_E), None))
    tokamax, why = _tokamax()
    out.append(("tokamax ragged_dot", moe_ragged(tokamax.ragged_dot, sizes_E) if tokamax else None, why))
    out.append(("xla ragged_dot", moe_ragged(jax.lax.ragged_dot, sizes_E), None))
    out.append(("padded einsum", moe_padded(sizes_E, capacity), None))
    return out


def moe_inputs(case: MoECase, seed=0):
    rng = np.random.default_rng(seed)
    # Uniform top-k routing: each token to k distinct experts.
    experts = np.argsort(rng.random((case.tokens, case.experts)), axis=1)[:, :case.top_k]
    sizes = np.bincount(experts.reshape(-1), minlength=case.experts).astype(np.int32)
    key = jax.random.split(jax.random.key(seed), 5)
    e, d, f, a = case.experts, case.hidden, case.width, case.rows
    x = jax.random.normal(key[0], (a, d), jnp.float32)
    wg, wu = (jax.random.normal(k, (e, d, f), jnp.float32) / d ** 0.5 for k in key[1:3])
    wd = jax.random.normal(key[3], (e, f, d), jnp.float32) / f ** 0.5
    dy = jax.random.normal(key[4], (a, d), jnp.float32)
    capacity = int(-(-sizes.max() // 8) * 8)
    return jnp.asarray(sizes), capacity, (x, wg, wu, wd), dy


# ----- attention backends: fn(q_BTNH, k_BSKH, v_BSKH) -> o_BTNH, causal -------------------------
def attention_backends():
    from mlir_train.model.attention import docs_flash_attention, flash_attention, pallas_mha_missing

    def pallas(q, k, v):
        return flash_attention(q, k, v, jnp.ones(q.shape[:2], jnp.int32), interpret=SMOKE)

    def docs(q, k, v):
        return docs_flash_attention(q, k, v, jnp.ones(q.shape[:2], jnp.int32), interpret=SMOKE)

    tokamax, why = _tokamax()
    tk = (lambda q, k, v: tokamax.dot_product_attention(q, k, v, is_causal=True)) if tokamax else None
    missing = pallas_mha_missing()
    return [("pallas mha", None if missing else pallas, missing), ("mlir docs-flash (default)", docs, None), ("tokamax dot_product_attention", tk, why),
            ("xla masked", xla_attention, None)]


def xla_attention(q, k, v):
    from mlir_train.model.attention import attention_mask, masked_attention

    b, t, n, h = q.shape
    kv = k.shape[2]
    mask = attention_mask(jnp.ones((b, t), jnp.int32))
    return masked_attention(q.reshape(b, t, kv, n // kv, h), k, v, mask).reshape(b, t, n, h)


def attention_inputs(case: AttentionCase, seed=0):
    key = jax.random.split(jax.random.key(seed), 4)
    b, t, n, kv, h = case.batch, case.seq, case.heads, case.kv_heads, case.head_dim
    q = jax.random.normal(key[0], (b, t, n, h), jnp.float32)
    k, v = (jax.random.normal(kk, (b, t, kv, h), jnp.float32) for kk in key[1:3])
    return (q, k, v), jax.random.normal(key[3], (b, t, n, h), jnp.float32)


# ----- measuring ---------------------------------------------------------------------------------
def fwd_bwd(fn):
    """jit of (output, gradients of every input) for a cotangent ``ct``."""
    def run(args, ct):
        out, vjp = jax.vjp(fn, *args)
        return out, vjp(ct.astype(out.dtype))
    return jax.jit(run)


@jax.jit
def _bit_equal(a, b):
    def same(x, y):
        bits = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}[x.dtype.itemsize]
        return jnp.all(jax.lax.bitcast_convert_type(x, bits) == jax.lax.bitcast_convert_type(y, bits))
    return jnp.all(jnp.stack([same(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))]))


def _errors(got, want):
    """(max abs, relative) of the output and of the worst gradient."""
    def err(g, w):
        g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
        if not np.all(np.isfinite(g)):
            return float("inf"), float("inf")
        abs_err = float(np.max(np.abs(g - w)))
        return abs_err, abs_err / max(float(np.max(np.abs(w))), 1e-30)

    fwd = err(got[0], want[0])
    bwd = max((err(g, w) for g, w in zip(got[1], want[1])), key=lambda e: e[1])
    return fwd, bwd


def measure(fn, args, ct, reference, flops, repeats, min_time):
    low = tuple(a.astype(jnp.bfloat16) for a in args)
    step = fwd_bwd(fn)
    got = jax.block_until_ready(step(low, ct))
    fwd, bwd = _errors(got, reference)
    times, same = [], True
    for _ in range(repeats):
        t = time.perf_counter()
        again = jax.block_until_ready(step(low, ct))
        times.append(time.perf_counter() - t)
        same &= bool(_bit_equal(got, again))
        del again
    n = max(1, min(50, int(min_time / max(statistics.median(times), 1e-6))))
    t = time.perf_counter()
    for _ in range(n):
        out = step(low, ct)
    jax.block_until_ready(out)
    per = min((time.perf_counter() - t) / n, statistics.median(times))
    return dict(fwd=fwd, bwd=bwd, same=f"yes ({repeats}x)" if same else f"NO ({repeats}x)",
                ms=per * 1e3, tflops=flops / per / 1e12)


def reference_of(fn, args, ct):
    with _highest():
        return jax.block_until_ready(fwd_bwd(fn)(args, ct))


def kernel_rows(budget_s: float, started: float, repeats: int, min_time: float) -> list:
    """Every (case, backend) of this platform's cases: ``(case, backend, result dict or None, note)``;
    what is left once ``budget_s`` seconds since ``started`` are spent is skipped, and said so."""
    rows = []

    def run(case, name, fn, why, inputs, ref, flops):
        if fn is None:
            rows.append((case, name, None, f"skipped: {why}"))
        elif time.perf_counter() - started > budget_s:
            rows.append((case, name, None, f"skipped: --budget-s {budget_s:.0f} spent"))
        else:
            try:
                rows.append((case, name, measure(fn, *inputs, ref, flops, repeats, min_time), ""))
            except Exception as e:  # noqa: BLE001 - the table reports it
                rows.append((case, name, None, f"FAILED: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:160]))
        print(f"  {case.name} / {name}: {_row_text(rows[-1])}", flush=True)

    for case in SMOKE_MOE if SMOKE else H200_MOE:
        sizes, capacity, weights, dy = moe_inputs(case)
        print(f"{case.name}: {case.rows} rows ({case.tokens} tokens x top-{case.top_k}) over {case.experts} experts "
              f"(group sizes {int(sizes.min())}..{int(sizes.max())}), D {case.hidden}, F {case.width}", flush=True)
        ref = reference_of(moe_padded(sizes, capacity), weights, dy)
        for name, fn, why in moe_backends(sizes, capacity):
            run(case, name, fn, why, (weights, dy), ref, case.flops())
        del ref
    for case in SMOKE_ATTENTION if SMOKE else H200_ATTENTION:
        qkv, do = attention_inputs(case)
        print(f"{case.name}: {case.batch} x {case.seq} tokens, {case.heads} q / {case.kv_heads} kv heads of "
              f"{case.head_dim}, causal", flush=True)
        ref = reference_of(xla_attention, qkv, do)
        for name, fn, why in attention_backends():
            run(case, name, fn, why, (qkv, do), ref, case.flops())
        del ref
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(gpu_common.REHEARSAL, action="store_true", help=gpu_common.REHEARSAL_HELP)
    p.add_argument("--repeats", type=int, default=None, help="bit-identical repeats (default 10; rehearsal 2)")
    p.add_argument("--min-time", type=float, default=None, help="seconds of timed calls per backend (default 1)")
    p.add_argument("--budget-s", type=float, default=300.0, help="skip what is left after this many seconds")
    args = p.parse_args(argv)
    started = time.perf_counter()
    dev = DEVICE or jax.devices()[0]
    tokamax, _ = _tokamax()
    print(f"jax {jax.__version__}, {dev.platform} {dev.device_kind}, tokamax "
          f"{getattr(tokamax, '__version__', '?') if tokamax else 'absent'}; {SETUP.describe()}"
          + ("; CPU REHEARSAL: no figure below is a GPU's" if SMOKE else ""), flush=True)
    rows = kernel_rows(args.budget_s, started, args.repeats or (2 if SMOKE else 10),
                       args.min_time if args.min_time is not None else (0.0 if SMOKE else 1.0))
    print()
    _print_table(rows)
    print(f"\ntotal {time.perf_counter() - started:.0f}s (bf16 operands; errors against float32 at HIGHEST; "
          f"TFLOP/s of the analytic routed / causal FLOPs)")
    return 0


def _print_table(rows) -> None:
    print("| case | backend | fwd max abs | fwd rel | bwd max abs | bwd rel | bit-identical | fwd+bwd ms | TFLOP/s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for case, name, r, note in rows:
        if r is None:
            print(f"| {case.name} | {name} | {note} | | | | | | |")
        else:
            print(f"| {case.name} | {name} | {r['fwd'][0]:.2e} | {r['fwd'][1]:.2e} | {r['bwd'][0]:.2e} | "
                  f"{r['bwd'][1]:.2e} | {r['same']} | {r['ms']:.2f} | {r['tflops']:.3g} |")


def _row_text(row) -> str:
    _, _, r, note = row
    if r is None:
        return note
    return (f"fwd rel {r['fwd'][1]:.1e}, bwd rel {r['bwd'][1]:.1e}, bit-identical {r['same']}, "
            f"{r['ms']:.2f} ms, {r['tflops']:.3g} TFLOP/s")


if __name__ == "__main__":
    sys.exit(main())
