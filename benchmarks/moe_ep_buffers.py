"""The expert-parallel exchange of one Qwen3-30B-A3B MoE layer compiled for 8 x H200 (deviceless
XLA:GPU): receive-buffer bytes next to the traffic routing sends, temp memory and expert FLOPs.

    JAX_PLATFORMS=cpu python benchmarks/moe_ep_buffers.py [--layouts TP2xEP2,EP4,EP8] [--quick]
        [--buffer-factors default,worst]

Per device, forward + backward (``jax.value_and_grad``; float32 parameters, bfloat16 activations,
2048 tokens per token rank, the ``grouped`` dropless dispatcher on the Mosaic-GPU block kernels),
from the compiled program (:func:`mlir_train.planner.moe_audit.ep_exchange_report`):

* ``EP buffers``: bytes of the token ragged all-to-alls' buffers on the no-overflow path (per
  exchange the larger of its send and receive buffers), summed over the forward's dispatch and
  combine and their two transposes in the backward;
* ``traffic``: the rows those four exchanges carry (each rank sends its S*K assignments);
* ``temp``: the compiled program's temp memory; ``resid``: what the compiled forward keeps for
  the backward (``jax.vjp``'s residuals: the per-layer activation memory of a model);
* the expert matmul FLOPs at a uniformly random (balanced) routing over the routed FLOPs
  ``6*S*K*3*D*F/TP`` ("ratio"), and at the static bound (every block of every branch: "bound").

``worst`` sizes the buffers for the worst routing (factor = EP): the program before
``--moe-ep-buffer-factor``.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from mlir_train.families import get_model_config  # noqa: E402
from mlir_train.planner.moe_audit import audit_moe_layer, gpu_topology_devices  # noqa: E402
from mlir_train.planner.targets import DEVICE_KINDS  # noqa: E402
from sharding import Layout  # noqa: E402

LAYOUTS = {
    "TP2xEP2": Layout(tensor=2, expert=2, sequence_parallel=True, num_devices=8),
    "EP4": Layout(expert=4, num_devices=8),
    "EP8": Layout(expert=8, num_devices=8),
}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layouts", default=",".join(LAYOUTS))
    p.add_argument("--quick", action="store_true")
    p.add_argument("--buffer-factors", default="default,worst",
                   help="--moe-ep-buffer-factor values, comma-separated: 'default' (the flag's default), 'worst' "
                        "(EP: the worst routing's buffer, no overflow rounds: the sizing before the flag), or numbers")
    args = p.parse_args(argv)
    try:
        devices = gpu_topology_devices(DEVICE_KINDS["h200"].target_config())
    except Exception as e:  # noqa: BLE001 - the reason is printed
        print(f"no deviceless H200 topology ({type(e).__name__}: {e}): see benchmarks/moe_gpu.py for what to install")
        return 2
    full = get_model_config("qwen3-30b-a3b", num_layers=1)
    cfg, tokens = (full.replace(hidden_size=512, moe_intermediate_size=256, num_experts=32), 1024) if args.quick \
        else (full, 2048)
    print(f"{devices[0].device_kind} x {len(devices)}; one MoE layer (D {cfg.hidden_size}, F {cfg.moe_intermediate_size}, "
          f"E {cfg.num_experts}, K {cfg.top_k}), {tokens} tokens per token rank, grouped, fwd+bwd, per device")
    print(f"{'layout':8} {'factor':>6} {'temp GiB':>8} {'resid GiB':>9} {'EP buffers MiB':>14} {'traffic MiB':>11} "
          f"{'buf/traffic':>11} {'routed TF':>9} {'expert TF':>9} {'ratio':>6} {'bound':>6}")
    for name in args.layouts.split(","):
        parallel = LAYOUTS[name]
        for f in args.buffer_factors.split(","):
            factor = None if f == "default" else float(parallel.expert) if f == "worst" else float(f)
            a = audit_moe_layer(cfg, parallel, devices, impl="grouped", tokens_per_rank=tokens, layout=name,
                                ep_buffer_factor=factor, residuals=True)
            ex = a.ep_exchange
            print(f"{name:8} {f:>6} {a.temp_bytes / 2**30:8.3f} {a.residual_bytes / 2**30:9.3f} "
                  f"{ex.buffer_bytes / 2**20:14.1f} {ex.traffic_bytes / 2**20:11.1f} "
                  f"{ex.buffer_bytes / ex.traffic_bytes:11.2f} {a.routed_flops / 1e12:9.3f} {a.expert_flops / 1e12:9.3f} "
                  f"{a.ratio:6.3f} {a.ratio_bound:6.2f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
