"""Our per-step FLOPs (``mlir_train.model.flops``, Megatron's formula) vs XLA's count of the compiled step.

    python benchmarks/flops_check.py [--quick] [--rows N] [--seq N]

For a dense and an MoE one-layer model, compiles the training step (forward, backward, AdamW)
ahead of time on one CPU device and reads ``compiled.cost_analysis()["flops"]``. Prints:

* ``ours``: :func:`mlir_train.model.flops.num_floating_point_operations`, the *model* FLOPs MFU is
  computed from (matmuls only, causal attention halved, the routed experts only);
* ``XLA``: what the compiled program executes by XLA's count;
* ``predicted``: ours plus the matmul work the program really does on top of the model
  FLOPs, for the program as built: the full ``s x s`` attention square (the causal mask does
  not skip work; Megatron counts half), the score matmul the attention's backward recomputes,
  and the expert rows beyond the routed ``S * K`` (the dense reference runs every expert on
  every token; the padded path runs its blocked layout's static row count when dropless and
  ``E * C`` buffer rows with a capacity; ``ragged_dot`` is counted as a dense matmul per
  expert). XLA / predicted is then within
  a few percent of 1: the rest is the router, norms, softmax, loss and the optimizer update.

One layer and one micro-batch, because XLA's cost analysis counts a while-loop body once, not
once per trip: the scanned layer stack and the micro-batch accumulation loop would otherwise be
under-counted by their trip counts. For a conditional (the expert-parallel dropless path's
``lax.cond`` between the capacity guess and its fallback) it would count the larger branch.
"""

from __future__ import annotations

import os

# One real CPU device: drop a fake-device count inherited from the environment (the test suite's).
os.environ["XLA_FLAGS"] = " ".join(f for f in os.environ.get("XLA_FLAGS", "").split()
                                   if not f.startswith("--xla_force_host_platform_device_count"))

import argparse  # noqa: E402
import math  # noqa: E402

from mlir_train.model import ModelOptions  # noqa: E402
from mlir_train.runtime.platform_setup import configure_platform  # noqa: E402

configure_platform(cpu_devices=1)  # before jax starts: the platform's XLA settings; a quiet CPU host with a GPU plugin installed

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from mlir_train.model import flops  # noqa: E402
from mlir_train.config.models import ModelConfig
from mlir_train.families import get_model_config  # noqa: E402
from mlir_train.train.optim import make_optimizer  # noqa: E402
from mlir_train.config.policies import LoadBalancing  # noqa: E402
from mlir_train.train.trainer import BATCH_KEYS, StepConfig  # noqa: E402
from mlir_train.train.build import build_trainer  # noqa: E402
from mlir_train.model.moe.block import block_layout  # noqa: E402
from sharding.mesh import make_mesh
from sharding.layout import Layout  # noqa: E402

DENSE = get_model_config("qwen3-tiny", vocab_size=512, num_layers=1, hidden_size=256, intermediate_size=1024,
                         num_heads=4, num_kv_heads=2, head_dim=64)
MOE = get_model_config("qwen3-moe-tiny", vocab_size=512, num_layers=1, hidden_size=256, num_heads=4,
                       num_kv_heads=2, head_dim=64, num_experts=8, top_k=2, moe_intermediate_size=256)
# (name, model, model kwargs); the padded path is the CPU default, the others show the padding's effect.
CASES = (
    ("dense", DENSE, ModelOptions()),
    ("moe padded (dropless)", MOE, ModelOptions(moe_impl="padded")),
    ("moe padded, cf 1.0", MOE, ModelOptions(moe_impl="padded", capacity_factor=1.0)),
    ("moe dense reference", MOE, ModelOptions(moe_impl="dense")),
    ("moe ragged_dot", MOE, ModelOptions(moe_impl="ragged")),
)
QUICK_CASES = CASES[:3]


def xla_flops(cfg: ModelConfig, rows: int, seq: int, options: ModelOptions) -> float:
    parallel = Layout(num_devices=1)
    mesh = make_mesh(parallel, devices=jax.devices()[:1])
    # The dropless experts' block loop (the form wide experts take) is a while loop, which XLA
    # counts once: count the batched form of the same blocks instead.
    options = options.replace(moe_block_loop=False)
    trainer = build_trainer(cfg, StepConfig(num_micro_batches=1, balancing=LoadBalancing.from_flags("aux_loss", 1e-2)),
                      make_optimizer(lr_schedule=1e-3, weight_decay=0.1), parallel, mesh, options=options)
    batch = {k: jax.ShapeDtypeStruct((1, rows, seq), jnp.float32 if k == "loss_mask" else jnp.int32,
                                     sharding=trainer.batch_sharding) for k in BATCH_KEYS}
    cost = trainer.lower_train_step(trainer.abstract_state(), batch).compile().cost_analysis()
    return float((cost[0] if isinstance(cost, list) else cost)["flops"])


def expert_rows_executed(cfg: ModelConfig, tokens: int, options: ModelOptions) -> int:
    """Rows the expert matmuls run over, per MoE layer, in the program XLA counts."""
    e, k = cfg.num_experts, cfg.top_k
    impl, cf = options.moe_impl, options.capacity_factor
    if impl == "dense":
        return e * tokens                          # every expert on every token
    if impl == "ragged" and cf is None:
        return e * tokens * k                      # ragged_dot costed as a dense matmul per group
    if cf is not None:
        return e * max(1, math.ceil(cf * tokens * k / e))  # E * C buffer rows
    a = tokens * k                                 # dropless: the blocked grouped matmul's static rows
    b, n_blocks = block_layout(a, e)
    blocked = n_blocks * b
    return blocked if blocked < e * tokens else e * tokens


def predicted_flops(cfg: ModelConfig, rows: int, seq: int, options: ModelOptions) -> float:
    full_square = flops.num_floating_point_operations(cfg, seq, rows, causal=False)
    # The attention's backward recomputes q k^T (FlashAttention-style): one more score matmul.
    full_square += 2.0 * rows * seq * seq * cfg.num_heads * cfg.head_dim * cfg.num_layers
    if not cfg.is_moe:
        return full_square
    tokens = rows * seq
    extra_rows = expert_rows_executed(cfg, tokens, options) - tokens * cfg.top_k
    # fwd + bwd (3) x multiply-add (2) x the three SwiGLU matmuls of D x F, per MoE layer.
    return full_square + 6.0 * 3 * cfg.hidden_size * cfg.moe_intermediate_size * extra_rows * sum(cfg.moe_layers())


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="dense and padded MoE only, short rows (smoke run)")
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--seq", type=int, default=None, help="tokens per row (default 128, quick 64)")
    args = parser.parse_args(argv)
    rows, seq = args.rows, args.seq or (64 if args.quick else 128)
    cases = QUICK_CASES if args.quick else CASES

    print(f"train step FLOPs, 1 layer, 1 micro-batch of {rows} x {seq} tokens, float32, "
          f"jax {jax.__version__} on {jax.devices()[0].platform}")
    for name, cfg in (("dense", DENSE), ("moe", MOE)):
        print(f"  {name}: hidden {cfg.hidden_size}, heads {cfg.num_heads}/{cfg.num_kv_heads} x {cfg.head_dim}, vocab {cfg.vocab_size}, "
              + (f"{cfg.num_experts} experts top-{cfg.top_k} of width {cfg.moe_intermediate_size}" if cfg.is_moe
                 else f"MLP width {cfg.intermediate_size}"))
    header = f"{'case':<22} {'ours GFLOP':>10} {'XLA GFLOP':>10} {'XLA/ours':>9} {'predicted':>10} {'XLA/pred':>9}"
    print("\n" + header + "\n" + "-" * len(header))
    lines = []
    for name, cfg, kwargs in cases:
        ours = flops.num_floating_point_operations(cfg, seq, rows)
        xla = xla_flops(cfg, rows, seq, kwargs)
        pred = predicted_flops(cfg, rows, seq, kwargs)
        print(f"{name:<22} {ours / 1e9:>10.4f} {xla / 1e9:>10.4f} {xla / ours:>8.3f}x {pred / 1e9:>10.4f} {xla / pred:>8.3f}x")
        lines.append(f"ratio {name}: XLA counts {xla / ours:.3f}x our model FLOPs, {xla / pred:.3f}x the predicted executed FLOPs")
    print()
    print("\n".join(lines))


if __name__ == "__main__":
    main()
