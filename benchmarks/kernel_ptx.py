"""Registers, spills and wgmma waits of our GPU kernels as ptxas builds them for an H200,
without a GPU (mlir_train.kernel_audit; the same cases as tests/test_gpu_kernels_ptx.py).

    python -m benchmarks.kernel_ptx

Needs jax-cuda12-plugin, jax-cuda12-pjrt and nvidia-cuda-nvcc-cu12 (no driver). Prints one
markdown row per kernel: registers used / limit, spill store + load bytes, and the pipelined
wgmma loops (backward branches whose body issues wgmma.mma_async) that hold a
wgmma.wait_group, over all of them.
"""

from __future__ import annotations

import os
import pathlib
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from mlir_train.kernel_audit import audit_kernel, moe_kernel_cases  # noqa: E402
from mlir_train.targets import compile_only_devices  # noqa: E402


def main():
    device = compile_only_devices("h200", 1)[0]
    print("| kernel | ptx entry | registers / limit | spill bytes (st + ld) | pipelined loops waiting on wgmma |")
    print("|---|---|---|---|---|")
    for case, fn, args in moe_kernel_cases():
        for r in audit_kernel(fn, *args, device=device):
            print(f"| {case} | {r.name} | {r.registers} / {r.register_limit} | {r.spill_store_bytes} + {r.spill_load_bytes} "
                  f"| {r.pipelined_loops_with_wait} / {r.pipelined_loops} |", flush=True)


if __name__ == "__main__":
    main()
