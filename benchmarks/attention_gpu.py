"""Compiled XLA:GPU matmul FLOPs of a dense Qwen3 forward+backward against Megatron's count,
flash attention vs the XLA attention, on one H200, without a GPU.

    JAX_PLATFORMS=cpu python benchmarks/attention_gpu.py [--model qwen3-0.6b] [--layers 4] [--seq-length 8192]

Needs jax-cuda12-plugin, jax-cuda12-pjrt and nvidia-cuda-nvcc-cu12. Compiles ``jax.grad`` of the
LM loss (bf16 parameters, one sequence, recompute off) for ``mlir_train/targets/h200.txtpb``
and counts, from the optimized HLO (``mlir_train.hlo_flops``; layer-scan bodies times their trip
count), every dot plus the flash attention kernels' work, against
``mlir_train.flops.num_floating_point_operations`` (Megatron's count: causal attention halved,
backward = 2 x forward). The XLA attention computes the whole [T, S] score matrix; the flash
kernel skips the key tiles above the diagonal (its backward recomputes the scores twice: 9
half-matmuls against Megatron's 6).
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec  # noqa: E402

from mlir_train.targets import DEVICE_KINDS
from mlir_train.config import get_model_config  # noqa: E402
from mlir_train.flops import num_floating_point_operations  # noqa: E402
from mlir_train.hlo_flops import matmul_flops  # noqa: E402
from mlir_train.model import Qwen3  # noqa: E402
from mlir_train.moe_audit import gpu_topology_devices  # noqa: E402

H200 = DEVICE_KINDS["h200"]  # mlir_train/targets/h200.txtpb


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="qwen3-0.6b")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq-length", type=int, default=8192)
    args = p.parse_args(argv)
    try:
        devices = gpu_topology_devices(H200.target_config())
    except Exception as e:  # noqa: BLE001 - the reason is printed
        print(f"cannot build the deviceless H200 topology ({type(e).__name__}: {e})")
        return 2
    rep = NamedSharding(Mesh(np.array(devices[:1]), ("d",)), PartitionSpec())
    cfg = get_model_config(args.model, num_layers=args.layers)
    seq = args.seq_length
    megatron = num_floating_point_operations(cfg, seq, 1)
    print(f"{devices[0].device_kind}; {cfg.name} x {cfg.num_layers} layers, seq {seq}, batch 1, bf16, recompute off; "
          f"Megatron's count {megatron / 1e12:.3f} TFLOP")
    for impl in ("flash", "xla"):
        abstract = nnx.eval_shape(lambda impl=impl: Qwen3(cfg, rngs=nnx.Rngs(0), attention_impl=impl))
        graphdef, state = nnx.split(abstract)
        params = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, jnp.bfloat16, sharding=rep), nnx.to_pure_dict(state))
        ids = jax.ShapeDtypeStruct((1, seq), jnp.int32, sharding=rep)

        def loss(params, ids, graphdef=graphdef):
            model = nnx.merge(graphdef, params)
            h, _ = model.hidden_states(ids, segment_ids=jnp.ones_like(ids))
            total, count = model.loss_sums(h, ids, jnp.ones(ids.shape, jnp.float32))
            return total / count

        f = matmul_flops(jax.jit(jax.grad(loss)).lower(params, ids).compile().as_text())
        total = f.dot_flops + f.attention_flops
        print(f"attention {impl:5}: dots {f.dot_flops / 1e12:7.3f} + attention kernels {f.attention_flops / 1e12:6.3f} "
              f"= {total / 1e12:7.3f} TFLOP; vs Megatron {total / megatron:.3f}x; loops of unknown trip count "
              f"{f.unknown_trip_count_loops}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
