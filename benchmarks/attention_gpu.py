"""Compiled XLA:GPU matmul FLOPs of a dense Qwen3 forward+backward against Megatron's count,
flash attention vs the XLA attention, on one H200, without a GPU.

    JAX_PLATFORMS=cpu python benchmarks/attention_gpu.py [--model qwen3-0.6b] [--layers 4] [--seq-length 8192]
        [--kernels mlir,tokamax,pallas-mha,xla] [--documents 1,4]

Needs jax-cuda12-plugin, jax-cuda12-pjrt and nvidia-cuda-nvcc-cu12. Compiles ``jax.grad`` of the
LM loss (bf16 parameters, one sequence, recompute off) for ``mlir_train/targets/h200.txtpb``
and counts, from the optimized HLO (``mlir_train.planner.hlo``; layer-scan bodies times their trip
count), every dot plus the flash attention kernels' work, against
``mlir_train.model.flops.num_floating_point_operations`` (Megatron's count: causal attention halved,
backward = 2 x forward). The XLA attention computes the whole [T, S] score matrix; the flash
kernel skips the key tiles above the diagonal (its backward recomputes the scores twice: 9
half-matmuls against Megatron's 6). ``--documents N`` packs N equal documents per row (segment ids
1..N): tokamax's forward also skips the earlier documents' key tiles (its work is counted for that
packing, :meth:`mlir_train.planner.hlo_kernels.AttentionCall.flops`); ``mlir`` (our docs-flash kernel) skips them
forward and backward (:meth:`mlir_train.planner.hlo_kernels.DocsFlashCall.flops`); pallas-mha's and xla's work
does not change.
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

from mlir_train.planner.targets import DEVICE_KINDS
from mlir_train.families import get_model_config  # noqa: E402
from mlir_train.model.flops import num_floating_point_operations  # noqa: E402
from mlir_train.planner.hlo import matmul_flops  # noqa: E402
from mlir_train.families.qwen3 import Qwen3  # noqa: E402
from mlir_train.model import ModelOptions  # noqa: E402
from mlir_train.planner.moe_audit import gpu_topology_devices  # noqa: E402

H200 = DEVICE_KINDS["h200"]  # mlir_train/targets/h200.txtpb


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="qwen3-0.6b")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq-length", type=int, default=8192)
    p.add_argument("--kernels", default="mlir,tokamax,pallas-mha,xla")
    p.add_argument("--documents", default="1,4")
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
    from mlir_train.model.platform import ATTENTION_BACKENDS
    from mlir_train.model.kernels.tokamax_ops import document_starts
    from mlir_train.runtime.platform_setup import compile_target

    mesh = rep.mesh
    for kernel in args.kernels.split(","):
        impl = ATTENTION_BACKENDS[kernel]
        abstract = nnx.eval_shape(lambda impl=impl: Qwen3(cfg, rngs=nnx.Rngs(0), options=ModelOptions(attention_impl=impl)))
        graphdef, state = nnx.split(abstract)
        params = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, jnp.bfloat16, sharding=rep), nnx.to_pure_dict(state))
        ids = jax.ShapeDtypeStruct((1, seq), jnp.int32, sharding=rep)

        seg = jax.ShapeDtypeStruct((1, seq), jnp.int32, sharding=rep)

        def loss(params, ids, seg, graphdef=graphdef):
            model = nnx.merge(graphdef, params)
            h, _ = model.hidden_states(ids, segment_ids=seg)
            total, count = model.loss_sums(h, ids, jnp.ones(ids.shape, jnp.float32))
            return total / count

        with jax.set_mesh(mesh), compile_target(mesh):
            f = matmul_flops(jax.jit(jax.grad(loss)).lower(params, ids, seg).compile().as_text())
        for docs in (int(d) for d in args.documents.split(",")):
            seg_T = np.repeat(np.arange(1, docs + 1), -(-seq // docs))[:seq]
            starts = np.asarray(document_starts(jnp.asarray(seg_T)[None]))[0]
            attention = f.attention_flops - sum(c.flops() for c in f.attention_calls) + sum(
                c.flops(starts) for c in f.attention_calls)
            total = f.dot_flops + attention
            print(f"{kernel:10} {docs} doc/row: dots {f.dot_flops / 1e12:7.3f} + attention kernels "
                  f"{attention / 1e12:6.3f} = {total / 1e12:7.3f} TFLOP; vs Megatron {total / megatron:.3f}x; "
                  f"loops of unknown trip count {f.unknown_trip_count_loops}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
