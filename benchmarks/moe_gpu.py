"""Compiled XLA:GPU expert FLOPs of one Qwen3-30B-A3B MoE layer on 8 x H200, without a GPU.

    JAX_PLATFORMS=cpu python benchmarks/moe_gpu.py [--quick] [--impls grouped,tokamax,padded,ragged]

Needs jax-cuda12-plugin, jax-cuda12-pjrt and nvidia-cuda-nvcc-cu12 (0.10.2; no driver). For
each layout (DP8, EP8, TP2xEP4) and each implementation (``--impls``), dropless and with
``--moe-expert-capacity-factor 1.0``, it compiles the layer's forward + backward
(``jax.value_and_grad`` for the parameters and the input; float32 parameters, bfloat16
activations, 2048 tokens per token rank) for the device description in
``mlir_train/targets/h200.txtpb`` and prints per device, from the optimized HLO
(``mlir_train.planner.moe_audit``):

* the expert matmul FLOPs over the routed FLOPs ``6 * S * K * 3 * D * F / TP`` ("ratio");
  for the block kernels of ``grouped`` the work of the blocks a uniformly random routing uses
  (the kernels skip spare blocks), with the static bound (every block of the buffer) beside it;
* the compiled temp memory; while loops in the program (whose bodies are counted once: a
  figure with loops is not a count of the work); the router's matmul FLOPs, not counted above.

``grouped`` is ``--moe-gemm-backend mosaic`` (our block kernels), ``tokamax`` the same layout on
tokamax's ragged-dot kernels (``--moe-gemm-backend tokamax``), ``padded`` the padded / capacity
batched matmul, ``ragged`` XLA's ``ragged_dot`` (dense on GPU: what the kernels replace).

``--quick`` compiles a 1/4-scale layer (D 512, F 256, E 32, K 8, 1024 tokens per rank).
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from mlir_train.planner.targets import DEVICE_KINDS
from mlir_train.families import get_model_config  # noqa: E402
from mlir_train.planner.moe_audit import audit_moe_layer, gpu_topology_devices  # noqa: E402
from sharding import Layout  # noqa: E402

H200 = DEVICE_KINDS["h200"]  # mlir_train/targets/h200.txtpb
LAYOUTS = {
    "DP8": Layout(num_devices=8),
    "EP8": Layout(expert=8, num_devices=8),
    "TP2xEP4": Layout(tensor=2, expert=4, num_devices=8),
}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--impls", default="grouped,tokamax,padded,ragged")
    p.add_argument("--layouts", default=",".join(LAYOUTS))
    args = p.parse_args(argv)
    try:
        devices = gpu_topology_devices(H200.target_config())
    except Exception as e:  # noqa: BLE001 - the reason is printed
        print(f"cannot build the deviceless H200 topology ({type(e).__name__}: {e}); "
              "install jax-cuda12-plugin, jax-cuda12-pjrt and nvidia-cuda-nvcc-cu12 and set JAX_PLATFORMS=cpu")
        return 2
    cfg = get_model_config("qwen3-30b-a3b", num_layers=1)
    tokens = 2048
    if args.quick:
        cfg = cfg.replace(hidden_size=512, moe_intermediate_size=256, num_experts=32)
        tokens = 1024
    print(f"{devices[0].device_kind} x {len(devices)}; MoE layer D {cfg.hidden_size} F {cfg.moe_intermediate_size} "
          f"E {cfg.num_experts} K {cfg.top_k}; {tokens} tokens per token rank; fwd+bwd, per device")
    print(f"{'layout':9} {'impl':8} {'capacity':9} {'routed TF':>9} {'expert TF':>9} {'ratio':>6} {'bound':>6} "
          f"{'temp GiB':>8} {'loops':>5} {'router TF':>9}")
    for layout in args.layouts.split(","):
        for impl in args.impls.split(","):
            for cf in (None, 1.0):
                if impl in ("ragged", "tokamax") and cf is not None:
                    continue  # with a capacity these are the padded path (tokamax: refused by the flag)
                kernels = "tokamax" if impl == "tokamax" else None
                a = audit_moe_layer(cfg, LAYOUTS[layout], devices, impl="grouped" if kernels else impl,
                                    capacity_factor=cf, tokens_per_rank=tokens, layout=layout, block_kernels=kernels)
                print(f"{layout:9} {impl:8} {'dropless' if cf is None else f'cf {cf}':9} {a.routed_flops / 1e12:9.3f} "
                      f"{a.expert_flops / 1e12:9.3f} {a.ratio:6.2f} {a.ratio_bound:6.2f} {a.temp_bytes / 2**30:8.2f} "
                      f"{a.while_loops:5d} {a.router_flops / 1e12:9.4f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
