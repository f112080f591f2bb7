"""Training-step throughput: mlir-train vs Hugging Face transformers' PyTorch Qwen3-MoE.

    python benchmarks/vs_hf.py [--quick] [--rounds N] [--steps-per-round N] [--sizes tiny,small]
                               [--hf-experts eager]

For each size, one process builds the same Qwen3-MoE twice, with the *same weights*: ours is
initialised (``Trainer.init_state``), written with ``mlir_train.checkpoint.hf.save_pretrained`` and read by
``transformers.Qwen3MoeForCausalLM.from_pretrained``. Both then train on the same random
token batch (``rows x seq`` tokens, every token a loss token), float32, with AdamW, gradient
clipping at 1.0 and the MoE aux loss at 1e-2:

* mlir-train: :class:`mlir_train.train.trainer.Trainer` on a 1-device mesh, one jitted step (forward,
  backward, clipping, AdamW update; the state donated), the CPU fast MoE path ("padded");
* HF: the eager PyTorch training step, ``model(input_ids, labels=...)`` with
  ``output_router_logits=True`` (its loss includes the aux loss), ``loss.backward()``,
  ``clip_grad_norm_``, ``torch.optim.AdamW.step()``, ``zero_grad``; PyTorch eager mode (no
  ``torch.compile``), transformers' default attention (SDPA) and default experts implementation
  (``grouped_mm`` in transformers 5.24; ``--hf-experts eager`` picks the per-expert Python loop).

Both use every core of the machine (``torch.set_num_threads(os.cpu_count())``; XLA:CPU's
thread pool uses them all). After warm-up steps (which include our compile), the two are timed
in interleaved rounds (``--steps-per-round`` steps of one, then of the other), so load from
anything else on the machine falls on both alike; tokens/s is the median over rounds. The first
step's loss of each is printed as a check that both train the same model on the same data.

Then the *GEMM floor*: every matrix product of the step (forward and both backward products,
experts as exactly balanced groups, no recompute, no padding; :func:`step_gemms`) timed alone,
XLA and torch, one pass in each timing round. Its XLA sum is a time no XLA:CPU implementation of the step can beat,
so ``HF step / XLA GEMMs`` bounds the ratio this benchmark can show; ``XLA/torch speed`` is how
fast XLA's matmul kernels run against PyTorch's on the same shapes.
"""

from __future__ import annotations

import os

# PyTorch's OpenMP threads spin while waiting for work by default. On a machine with other load
# (or with XLA's threads in the same process) spinning threads fight for the cores: measured here,
# a tiny HF step took 2 s instead of 45 ms. Passive waiting gives the peer its best numbers.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# One real CPU device: drop a fake-device count inherited from the environment (the test suite's).
os.environ["XLA_FLAGS"] = " ".join(f for f in os.environ.get("XLA_FLAGS", "").split()
                                   if not f.startswith("--xla_force_host_platform_device_count"))

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import math  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

from mlir_train.model import ModelOptions  # noqa: E402
from mlir_train.runtime.platform_setup import configure_platform  # noqa: E402

configure_platform(cpu_devices=1)  # before jax starts: the platform's XLA settings; a quiet CPU host with a GPU plugin installed

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from mlir_train.config.models import ModelConfig
from mlir_train.families import get_model_config  # noqa: E402
from mlir_train.checkpoint.hf import save_pretrained  # noqa: E402
from mlir_train.train.optim import make_optimizer  # noqa: E402
from mlir_train.config.policies import LoadBalancing  # noqa: E402
from mlir_train.train.trainer import StepConfig  # noqa: E402
from mlir_train.train.build import build_trainer  # noqa: E402
from sharding.mesh import make_mesh
from sharding.layout import Layout  # noqa: E402

LR, WEIGHT_DECAY, BETA2, CLIP, AUX_COEFF = 1e-4, 0.1, 0.95, 1.0, 1e-2


@dataclasses.dataclass(frozen=True)
class Size:
    name: str
    cfg: ModelConfig
    rows: int
    seq: int


SIZES = {
    "tiny": Size("tiny", get_model_config("qwen3-moe-tiny"), rows=8, seq=256),
    "small": Size("small", get_model_config(
        "qwen3-moe-tiny", hidden_size=512, num_layers=4, num_heads=8, num_kv_heads=4, head_dim=64,
        num_experts=16, top_k=4, moe_intermediate_size=256, vocab_size=2048), rows=4, seq=256),
}
QUICK = {"tiny": Size("tiny", get_model_config("qwen3-moe-tiny", num_layers=2), rows=2, seq=64)}


def ours(size: Size, batch_np: dict[str, np.ndarray]):
    """(step callable running one training step and waiting for it, first-step loss, HF dir)."""
    parallel = Layout(num_devices=1)
    mesh = make_mesh(parallel, devices=jax.devices()[:1])
    optimizer = make_optimizer(lr_schedule=LR, weight_decay=WEIGHT_DECAY, beta2=BETA2, clip_grad=CLIP)
    step_cfg = StepConfig(num_micro_batches=1, balancing=LoadBalancing.from_flags("aux_loss", AUX_COEFF))
    trainer = build_trainer(size.cfg, step_cfg, optimizer, parallel, mesh,
                      options=ModelOptions(moe_impl="padded"))
    state = trainer.init_state(seed=0)
    hf_dir = tempfile.mkdtemp(prefix=f"vs_hf_{size.name}_")
    save_pretrained(trainer.model(jax.device_get(state["params"])), hf_dir)
    batch = trainer.shard_batch({k: v[None] for k, v in batch_np.items()})
    holder = {"state": state}

    def step():
        holder["state"], metrics = trainer.train_step(holder["state"], batch)
        return float(jax.block_until_ready(metrics["lm loss"]))

    return step, hf_dir


def hf(hf_dir: str, batch_np: dict[str, np.ndarray], experts_impl: str | None):
    """(step callable running one HF training step, the experts implementation in use)."""
    import torch
    from transformers import Qwen3MoeForCausalLM

    kwargs = {} if experts_impl is None else {"experts_implementation": experts_impl}
    model = Qwen3MoeForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, output_router_logits=True,
                                                router_aux_loss_coef=AUX_COEFF, **kwargs)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, BETA2), eps=1e-8, weight_decay=WEIGHT_DECAY)
    input_ids = torch.from_numpy(batch_np["input_ids"].astype(np.int64))
    # Our labels are the next tokens already; HF shifts ``labels`` itself, so it gets the inputs.
    def step():
        out = model(input_ids=input_ids, labels=input_ids)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float((out.loss - AUX_COEFF * out.aux_loss).detach())

    return step, model.config._experts_implementation


def step_gemms(size: Size) -> list[tuple[str, int, int, int, int, int]]:
    """The matrix products of one training step, ``(name, batch, M, K, N, count)`` for
    ``[batch, M, K] @ [batch, K, N]`` run ``count`` times: forward and the two backward products
    of every projection, of attention's two products per (row, head), of the router, of the
    experts as exactly balanced groups (``S*K / E`` rows each, no padding) and of the LM head.
    This is the least GEMM work any implementation of the step does (no recompute, no padding)."""
    c, t = size.cfg, size.rows * size.seq
    layers, hq, hkv = c.num_layers, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    group = t * c.top_k // c.num_experts
    forward = [
        ("q", 1, t, c.hidden_size, hq, layers),
        ("k, v", 1, t, c.hidden_size, hkv, 2 * layers),
        ("o", 1, t, hq, c.hidden_size, layers),
        ("q k^T", size.rows * c.num_heads, size.seq, c.head_dim, size.seq, layers),
        ("p v", size.rows * c.num_heads, size.seq, size.seq, c.head_dim, layers),
        ("router", 1, t, c.hidden_size, c.num_experts, layers),
        ("experts gate, up", c.num_experts, group, c.hidden_size, c.moe_intermediate_size, 2 * layers),
        ("experts down", c.num_experts, group, c.moe_intermediate_size, c.hidden_size, layers),
        ("lm head", 1, t, c.hidden_size, c.vocab_size, 1),
    ]
    # C[M,N] = A[M,K] B[K,N]: dA = dC B^T is (M, N) x (N, K), dB = A^T dC is (K, M) x (M, N).
    return [g for name, b, m, k, n, count in forward
            for g in ((name, b, m, k, n, count), (name + " dA", b, m, n, k, count), (name + " dB", b, k, m, n, count))]


_MATMUL = jax.jit(jnp.matmul)
_MATMUL_PAIR = jax.jit(lambda a, b, c, d: (a @ b, c @ d))


def gemm_floor(size: Size):
    """(one_pass, GFLOP) for the step's GEMMs (:func:`step_gemms`): ``one_pass()`` times each
    distinct product alone as a row-major matmul (best of 3 calls in a row; for XLA also as two
    independent products in one program, per product, if that is faster), XLA (jitted) then
    torch, and returns the (XLA seconds, torch seconds) of the whole step's products. Called once
    per timing round, so its medians see the same machine load as the steps'."""
    import torch

    shapes = {}
    for _, b, m, k, n, count in step_gemms(size):
        shapes[(b, m, k, n)] = shapes.get((b, m, k, n), 0) + count
    rng = np.random.default_rng(0)
    programs = []
    for (b, m, k, n), count in shapes.items():
        a_np, b_np = (rng.standard_normal(s, dtype=np.float32) for s in ((b, m, k), (b, k, n)))
        xa, xb, ya, yb = jnp.asarray(a_np), jnp.asarray(b_np), jnp.asarray(-a_np), jnp.asarray(b_np[..., ::-1])
        ta, tb = torch.from_numpy(a_np), torch.from_numpy(b_np)
        programs.append((count, (
            (1, lambda xa=xa, xb=xb: _MATMUL(xa, xb).block_until_ready()),
            # Two independent products in one program, which XLA:CPU may run side by side: a
            # step has such pairs (q/k/v, gate/up, both gradients of each product).
            (2, lambda xa=xa, xb=xb, ya=ya, yb=yb: jax.block_until_ready(_MATMUL_PAIR(xa, xb, ya, yb))),
        ), ((1, lambda ta=ta, tb=tb: torch.matmul(ta, tb)),)))

    def one_pass(reps: int = 3) -> tuple[float, float]:
        total = [0.0, 0.0]
        for count, *sides in programs:
            for i, variants in enumerate(sides):
                best = math.inf  # per product, the fastest way, warm (back to back, as in a step)
                for products, fn in variants:
                    for _ in range(reps):
                        start = time.perf_counter()
                        fn()
                        best = min(best, (time.perf_counter() - start) / products)
                total[i] += count * best
        return total[0], total[1]

    one_pass()  # compiles XLA's programs, warms both
    return one_pass, sum(c * 2 * b * m * k * n for (b, m, k, n), c in shapes.items()) / 1e9


def make_batch(size: Size, seed: int = 0) -> dict[str, np.ndarray]:
    """Random tokens; ``labels`` are the next tokens, the last position is masked out, as HF's shift drops it."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, size.cfg.vocab_size, (size.rows, size.seq), dtype=np.int32)
    labels = np.concatenate([ids[:, 1:], np.zeros((size.rows, 1), np.int32)], axis=1)
    mask = np.ones((size.rows, size.seq), np.float32)
    mask[:, -1] = 0.0
    return {"input_ids": ids, "labels": labels, "loss_mask": mask,
            "segment_ids": np.ones_like(ids), "positions": np.broadcast_to(np.arange(size.seq, dtype=np.int32), ids.shape).copy()}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a 2-layer tiny model, few steps (smoke run)")
    parser.add_argument("--sizes", default="tiny,small")
    parser.add_argument("--rounds", type=int, default=None, help="interleaved timing rounds (default 5, quick 2)")
    parser.add_argument("--steps-per-round", type=int, default=None, help="steps of each per round (default 3, quick 1)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps of each first (ours compiles in the first)")
    parser.add_argument("--hf-experts", default=None,
                        help="transformers experts_implementation (eager, batched_mm, grouped_mm); default: transformers' own")
    args = parser.parse_args(argv)

    import torch
    import transformers

    torch.set_num_threads(os.cpu_count())
    rounds = args.rounds or (2 if args.quick else 5)
    per_round = args.steps_per_round or (1 if args.quick else 3)
    sizes = list(QUICK.values()) if args.quick else [SIZES[s.strip()] for s in args.sizes.split(",") if s.strip()]
    print(f"train step, float32, AdamW, {os.cpu_count()} CPU cores; jax {jax.__version__} on 1 {jax.devices()[0].platform} "
          f"device vs torch {torch.__version__} ({torch.get_num_threads()} threads), transformers {transformers.__version__}, "
          f"OMP_WAIT_POLICY={os.environ['OMP_WAIT_POLICY']}; median of {rounds} interleaved rounds x {per_round} steps "
          f"after {args.warmup} warm-up steps\n")
    header = (f"{'size':<6} {'hidden':>6} {'layers':>6} {'experts':>8} {'vocab':>6} {'tokens':>7}  "
              f"{'first loss ours / HF':>20}  {'ours ms':>8} {'HF ms':>8} {'ours tok/s':>10} {'HF tok/s':>9} {'ratio':>6}")
    print(header)
    print("-" * len(header))
    results, floors = [], []
    for size in sizes:
        batch = make_batch(size)
        ours_step, hf_dir = ours(size, batch)
        hf_step, experts_impl = hf(hf_dir, batch, args.hf_experts)
        first = (ours_step(), hf_step())
        for _ in range(args.warmup - 1):
            ours_step(), hf_step()
        gemm_pass, gflop = gemm_floor(size)
        times = {"ours": [], "hf": [], "xla gemms": [], "torch gemms": []}
        for _ in range(rounds):
            for name, step in (("ours", ours_step), ("hf", hf_step)):
                start = time.perf_counter()
                for _ in range(per_round):
                    step()
                times[name].append((time.perf_counter() - start) / per_round)
            for name, t in zip(("xla gemms", "torch gemms"), gemm_pass()):
                times[name].append(t)
        sec = {k: statistics.median(v) for k, v in times.items()}
        tokens = size.rows * size.seq
        ratio = sec["hf"] / sec["ours"]
        c = size.cfg
        print(f"{size.name:<6} {c.hidden_size:>6} {c.num_layers:>6} {f'{c.num_experts} top{c.top_k}':>8} {c.vocab_size:>6} "
              f"{tokens:>7}  {f'{first[0]:.4f} / {first[1]:.4f}':>20}  {sec['ours'] * 1e3:>8.1f} {sec['hf'] * 1e3:>8.1f} "
              f"{tokens / sec['ours']:>10,.0f} {tokens / sec['hf']:>9,.0f} {ratio:>5.2f}x   (HF experts: {experts_impl})")
        results.append(f"ratio {size.name}: mlir-train {ratio:.2f}x HF transformers train-step tokens/s "
                       f"({tokens / sec['ours']:,.0f} vs {tokens / sec['hf']:,.0f})")
        floors.append((size, sec, gflop))
    print()
    results += _gemm_floor_table(floors)
    print()
    print("\n".join(results))


def _gemm_floor_table(floors) -> list[str]:
    """Print the GEMM floor of each size against both steps; its result lines."""
    print("GEMM floor: the step's matrix products alone (forward and backward, experts as exactly balanced groups,")
    print("no recompute, no padding), each timed as a row-major matmul (XLA: alone or two at once, the faster per product),")
    print("XLA vs torch, one pass per timing round")
    header = (f"{'size':<6} {'GFLOP':>7} {'XLA GEMMs ms':>12} {'torch GEMMs ms':>14} {'XLA/torch speed':>15} "
              f"{'ours step ms':>12} {'HF step ms':>10} {'HF step / XLA GEMMs':>19}")
    print(header)
    print("-" * len(header))
    results = []
    for size, sec, gflop in floors:
        xla, tch = sec["xla gemms"], sec["torch gemms"]
        print(f"{size.name:<6} {gflop:>7.2f} {xla * 1e3:>12.1f} {tch * 1e3:>14.1f} {tch / xla:>14.2f}x "
              f"{sec['ours'] * 1e3:>12.1f} {sec['hf'] * 1e3:>10.1f} {sec['hf'] / xla:>18.2f}x")
        results.append(f"ratio {size.name} GEMM bound: at most {sec['hf'] / xla:.2f}x HF if the step were nothing but "
                       f"its GEMMs on XLA:CPU ({xla * 1e3:.0f} ms vs HF's step {sec['hf'] * 1e3:.0f} ms); XLA's GEMMs run "
                       f"at {tch / xla:.2f}x torch's on these shapes")
    return results


if __name__ == "__main__":
    main()
