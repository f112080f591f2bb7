"""Registers, spills and wgmma waits of our GPU kernels as ptxas builds them for an H200,
without a GPU (mlir_train.planner.kernel_audit; the same cases as tests/planner/test_gpu_kernels_ptx.py).

    python -m benchmarks.kernel_ptx

Needs jax-cuda12-plugin, jax-cuda12-pjrt and nvidia-cuda-nvcc-cu12 (no driver). Prints one
markdown row per kernel: registers used / limit, spill store + load bytes, and the pipelined
wgmma loops (backward branches whose body issues wgmma.mma_async) that hold a
wgmma.wait_group, over all of them. Then the flash attention's Triton kernels at T 4096 with
the tiles chosen for a pre-Hopper GPU and for Hopper (head_dim 128), and for Hopper at head_dim 256
(Qwen3.5), all compiled for the H200 (ptxas -v on XLA's PTX dump).
"""

from __future__ import annotations

import os
import pathlib
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from mlir_train.planner.kernel_audit import audit_kernel, audit_xla_dump, moe_kernel_cases  # noqa: E402
from mlir_train.planner.targets import compile_only_devices  # noqa: E402


def attention_reports(device, compute_capability: str, t: int = 4096, head_dim: int = 128, kernel: str = "mha"):
    """The attention's Triton kernels (forward, backward; bf16, head_dim 128 as Qwen3's, 256 as
    Qwen3.5's), from XLA's PTX dump: ``kernel`` "mha" JAX's Pallas mha (``--attention-kernel
    pallas-mha``, jax < 0.12) with the tiles :func:`flash_block_sizes` picks for ``compute_capability``,
    "docs_flash" ours (the GPU default) with :meth:`~mlir_train.model.kernels.docs_flash.Tiles.for_head_dim`."""
    import tempfile

    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from mlir_train.model.attention import docs_flash_attention, flash_attention

    mesh = Mesh(np.array([device]), ("d",))
    rep = NamedSharding(mesh, PartitionSpec())
    q = jax.ShapeDtypeStruct((1, t, 4, head_dim), jnp.bfloat16, sharding=rep)
    k = jax.ShapeDtypeStruct((1, t, 2, head_dim), jnp.bfloat16, sharding=rep)
    seg = jax.ShapeDtypeStruct((1, t), jnp.int32, sharding=rep)
    if kernel == "mha":
        attend = lambda q, k, v, s: jnp.sum(flash_attention(q, k, v, s, compute_capability=compute_capability)  # noqa: E731
                                            .astype(jnp.float32))
    else:
        attend = lambda q, k, v, s: jnp.sum(docs_flash_attention(q, k, v, s).astype(jnp.float32))  # noqa: E731
    jax.config.update("jax_enable_compilation_cache", False)
    with tempfile.TemporaryDirectory() as dump, jax.set_mesh(mesh):
        jax.jit(jax.grad(attend, argnums=(0, 1, 2))).lower(q, k, k, seg).compile({"xla_dump_to": dump})
        return [r for r in audit_xla_dump(dump) if r.name.startswith(kernel)]


def main():
    device = compile_only_devices("h200", 1)[0]
    print("| kernel | ptx entry | registers / limit | spill bytes (st + ld) | pipelined loops waiting on wgmma |")
    print("|---|---|---|---|---|")
    for case, fn, args in moe_kernel_cases():
        for r in audit_kernel(fn, *args, device=device):
            print(f"| {case} | {r.name} | {r.registers} / {r.register_limit} | {r.spill_store_bytes} + {r.spill_load_bytes} "
                  f"| {r.pipelined_loops_with_wait} / {r.pipelined_loops} |", flush=True)
    print()
    print("| attention tiles | kernel | registers / limit | spill bytes (st + ld) | wgmma / mma.sync instructions |")
    print("|---|---|---|---|---|")
    from mlir_train.model.attention import pallas_mha_missing

    rows = [("9.0", 128, "docs_flash", "docs-flash (GPU default), head 128: 64x64, 4/4/8 warps"),
            ("9.0", 256, "docs_flash", "docs-flash (GPU default), head 256: 64x64, dK/dV 16x64, 8 warps")]
    if pallas_mha_missing():
        print(f"pallas-mha rows left out: {pallas_mha_missing()}")
    else:
        rows += [("8.0", 128, "mha", "pallas-mha 32x32 backward, 4 warps (pre-Hopper choice)"),
                 ("9.0", 128, "mha", "pallas-mha 64x64 backward, 8 warps (Hopper)"),
                 ("9.0", 256, "mha", "pallas-mha head 256: 64x64 forward, dK/dV 16x64, dQ 64x64, 8 warps (Hopper)")]
    for cc, h, kernel, label in rows:
        for r in attention_reports(device, cc, head_dim=h, kernel=kernel):
            print(f"| {label} | {r.name} | {r.registers} / {r.register_limit} | {r.spill_store_bytes} + "
                  f"{r.spill_load_bytes} | {r.wgmma} / {r.mma_sync} |", flush=True)


if __name__ == "__main__":
    main()
