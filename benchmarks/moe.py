"""The MoE layer alone, forward + backward: reference ("dense") vs "padded" vs "ragged" experts.

    python benchmarks/moe.py [--quick] [--dtype float32|bfloat16] [--iters N] [--impls dense,padded,ragged]

For each layer size and each ``mlir_train.model.moe.block.MoE`` implementation, times one jitted
``jax.grad`` of the layer (router, experts, gradients for the parameters and the input) on a
fixed random batch: one warmup call, then the median of ``--iters`` timed calls, each waited for
with ``block_until_ready``. In the same run it times a jitted square matmul of the same dtype as
the machine's achievable matmul peak. All programs are timed round-robin (one call each per
round), so a machine shared with other work slows them alike and the ratios stay meaningful.

Reported per path:

* tokens/s, and its ratio to the dense reference (> 1: faster than the reference);
* achieved routed FLOP/s, counting only the useful expert work, ``6 * T * K * 3 * D * F``
  (forward + backward of the three SwiGLU expert matmuls for the K experts each token chose;
  the router and the dispatch are not counted, as in Megatron's MFU), and its fraction of the
  matmul peak. The reference executes ``E / K`` times that work; "padded" (dropless: the
  blocked grouped matmul) at most ``1 + E * b / (T * K)`` times it for its block size ``b``
  (``mlir_train.model.moe.block.block_rows``), under 1.5x.

Sizes: "tiny" is the ``qwen3-moe-tiny`` layer; "30b-a3b-s" is a Qwen3-30B-A3B MoE layer
(D 2048, F 768, E 128, K 8) with D and F divided by 8 and E and K by 4, which keeps its
sparsity E / K = 16 and its F / D ratio while the reference path still fits a 2-core CPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import statistics
import time

from mlir_train.runtime.platform_setup import configure_platform  # (imports no jax)

configure_platform()  # before jax starts: the platform's XLA settings; a quiet CPU host with a GPU plugin installed

import jax
import jax.numpy as jnp
from flax import nnx

from mlir_train.families import get_model_config
from mlir_train.model import MOE_IMPLS
from mlir_train.model.moe.block import MoE


@dataclasses.dataclass(frozen=True)
class Size:
    name: str
    tokens: int
    hidden: int
    experts: int
    top_k: int
    width: int

    def routed_flops(self) -> float:
        """Forward + backward FLOPs of the routed SwiGLU experts: 6 * T * K * 3 * D * F."""
        return 6.0 * self.tokens * self.top_k * 3 * self.hidden * self.width


SIZES = (
    Size("tiny", tokens=4096, hidden=128, experts=8, top_k=2, width=64),
    Size("30b-a3b-s", tokens=4096, hidden=256, experts=32, top_k=2, width=96),
)
QUICK_SIZES = (Size("tiny", tokens=512, hidden=128, experts=8, top_k=2, width=64),)


def time_interleaved(programs: dict, *, warmup: int, iters: int) -> dict:
    """Median wall seconds of each ``name -> (fn, args)``, waiting for every result.

    After ``warmup`` calls each (which compile), the programs are timed round-robin, one call
    each per round, so load from anything else on the machine falls on all of them alike.
    """
    for fn, args in programs.values():
        for _ in range(warmup):
            jax.block_until_ready(fn(*args))
    times = {name: [] for name in programs}
    for _ in range(iters):
        for name, (fn, args) in programs.items():
            start = time.perf_counter()
            jax.block_until_ready(fn(*args))
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def matmul_program(n: int, dtype):
    """A jitted ``[n, n] @ [n, n]`` in ``dtype`` (2 n^3 FLOPs): the peak the layer is held against."""
    ka, kb = jax.random.split(jax.random.key(1))
    a = jax.random.normal(ka, (n, n), jnp.float32).astype(dtype)
    b = jax.random.normal(kb, (n, n), jnp.float32).astype(dtype)
    return jax.jit(lambda a, b: a @ b), (a, b)


def build_moe(size: Size, impl: str, dtype) -> MoE:
    # Built the way DecoderLayer builds it, from a model config carrying the layer's shape.
    cfg = get_model_config(
        "qwen3-moe-tiny", hidden_size=size.hidden, num_experts=size.experts,
        top_k=size.top_k, moe_intermediate_size=size.width,
    )
    out_std = cfg.init_std / math.sqrt(2.0 * cfg.num_layers)
    return MoE(cfg, nnx.Rngs(0), out_std, impl=impl, dtype=dtype)


def layer_step(size: Size, impl: str, dtype):
    """A jitted fwd+bwd of the layer and its arguments."""
    graphdef, state = nnx.split(build_moe(size, impl, dtype))
    kx, kc = jax.random.split(jax.random.key(2))
    x_BTD = jax.random.normal(kx, (1, size.tokens, size.hidden), jnp.float32).astype(dtype)
    cot_BTD = jax.random.normal(kc, x_BTD.shape, jnp.float32).astype(dtype)
    valid_BT = jnp.ones(x_BTD.shape[:2], jnp.bool_)

    def loss(state, x_BTD):
        y_BTD, _ = nnx.merge(graphdef, state)(x_BTD, valid_BT)
        return jnp.sum((y_BTD * cot_BTD).astype(jnp.float32))

    return jax.jit(jax.grad(loss, argnums=(0, 1))), (state, x_BTD)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="one small size, few iterations (smoke run)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--iters", type=int, default=None, help="timed rounds (default 3, quick 2)")
    parser.add_argument("--impls", default=",".join(MOE_IMPLS), help="comma-separated MoE paths (ratios need dense)")
    args = parser.parse_args(argv)

    dtype = jnp.dtype(args.dtype)
    impls = [i.strip() for i in args.impls.split(",") if i.strip()]
    unknown = set(impls) - set(MOE_IMPLS)
    if unknown:
        parser.error(f"--impls: unknown {sorted(unknown)}; choose from {MOE_IMPLS}")
    sizes = QUICK_SIZES if args.quick else SIZES
    iters = args.iters or (2 if args.quick else 3)
    warmup = 1
    peak_n = 512 if args.quick else 2048

    device = jax.devices()[0]
    print(f"MoE layer forward+backward, {args.dtype}, {device.platform} ({device.device_kind}), "
          f"{len(jax.devices())} device(s), {os.cpu_count()} CPU cores, jax {jax.__version__}")
    programs = {"matmul": matmul_program(peak_n, dtype)}
    for size in sizes:
        for impl in impls:
            programs[(size, impl)] = layer_step(size, impl, dtype)
    seconds = time_interleaved(programs, warmup=warmup, iters=iters)
    peak = 2.0 * peak_n**3 / seconds.pop("matmul")
    print(f"matmul peak: jitted [{peak_n},{peak_n}] @ [{peak_n},{peak_n}] {args.dtype}: {peak / 1e9:.1f} GFLOP/s")
    print(f"routed FLOPs = 6 * T * K * 3 * D * F; median of {iters} interleaved rounds after {warmup} warmup\n")

    header = (f"{'size':<10} {'T':>5} {'D':>4} {'E':>3} {'K':>2} {'F':>4}  {'path':<7} {'ms/iter':>8} "
              f"{'tokens/s':>10} {'GFLOP/s':>8} {'of peak':>7} {'vs dense':>8}")
    print(header)
    print("-" * len(header))
    ratios = []
    for (size, impl), sec in seconds.items():
        reference = seconds.get((size, "dense"))
        vs_dense = reference / sec if reference else float("nan")
        achieved = size.routed_flops() / sec
        print(f"{size.name:<10} {size.tokens:>5} {size.hidden:>4} {size.experts:>3} {size.top_k:>2} {size.width:>4}  "
              f"{impl:<7} {sec * 1e3:>8.1f} {size.tokens / sec:>10,.0f} {achieved / 1e9:>8.2f} "
              f"{achieved / peak:>7.3f} {vs_dense:>7.2f}x")
        ratios.append(f"ratio {size.name} {impl}: {vs_dense:.2f}x dense reference tokens/s, "
                      f"{achieved / peak:.3f} of matmul peak")
    print()
    print("\n".join(ratios))

if __name__ == "__main__":
    main()
