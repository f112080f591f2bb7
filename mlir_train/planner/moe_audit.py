"""Compile one MoE layer's forward and backward for a device mesh and count its expert matmuls.

Used by ``benchmarks/moe_gpu.py`` and the tests with the compile-only devices of a deviceless
XLA:GPU topology (``jax.experimental.topologies``), so the figures are XLA:GPU's program for,
say, 8 x H200, built on a CPU-only host. Expert FLOPs per device are read from the optimized
HLO (:mod:`mlir_train.planner.hlo`): every dot and GEMM except the router's (traced under
``jax.named_scope(moe.ROUTER_SCOPE)``) plus the block kernels' work. The kernels skip spare blocks, so their
work depends on the routing; it is given for a sampled routing (``used_rows``: every token
picks ``top_k`` distinct experts uniformly at random, as an untrained router does, seeded)
and as the static bound (every block of the buffer used, which no routing reaches).
The router's matmuls are not expert matmuls and are reported apart (``router_flops``).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding

import sharding
from mlir_train.planner.hlo import analyze
from mlir_train.model import logical_axes
from mlir_train.model.moe.block import ROUTER_SCOPE, MoE
from mlir_train.model.moe.gpu import BLOCK_ROWS
from mlir_train.runtime.platform_setup import compile_target


@dataclasses.dataclass(frozen=True)
class MoELayerAudit:
    layout: str
    impl: str
    capacity_factor: float | None
    routed_flops: float  # per device: 6 x tokens x top_k x 3 x D x F / tensor ranks
    expert_flops: float  # per device, compiled (kernel work for the sampled routing)
    expert_flops_bound: float  # per device, compiled (kernels: every block of the buffer)
    router_flops: float  # per device, compiled
    temp_bytes: int
    while_loops: int
    kernel_calls: int
    collectives: dict[str, int] = dataclasses.field(default_factory=dict)  # kind -> bytes per device

    @property
    def ratio(self) -> float:
        return self.expert_flops / self.routed_flops

    @property
    def ratio_bound(self) -> float:
        return self.expert_flops_bound / self.routed_flops


def used_block_rows(num_experts: int, top_k: int, tokens_per_rank: int, token_ranks: int, expert_ranks: int,
                    seed: int = 0, tile: int = BLOCK_ROWS) -> float:
    """Mean over the expert ranks of the block rows their kernels compute for a uniform random
    routing: per local expert, its rows (from every token rank of its group) rounded up to
    whole blocks."""
    rng = np.random.default_rng(seed)
    per_rank = []
    groups = token_ranks // expert_ranks  # EP groups (data-parallel replicas of the experts)
    for _ in range(groups):
        s = tokens_per_rank * expert_ranks
        experts_SK = np.argsort(rng.random((s, num_experts)), axis=1)[:, :top_k]
        sizes_E = np.bincount(experts_SK.reshape(-1), minlength=num_experts)
        # Each expert's rows fill whole blocks; a kernel with larger row tiles rounds those up again.
        rows_E = -(-sizes_E // BLOCK_ROWS) * BLOCK_ROWS
        rows_E = -(-rows_E // tile) * tile
        per_rank += list(rows_E.reshape(expert_ranks, -1).sum(axis=1))
    return float(np.mean(per_rank))


def audit_moe_layer(cfg, parallel: sharding.Layout, devices, *, impl: str, capacity_factor: float | None = None,
                    tokens_per_rank: int = 2048, layout: str = "", seed: int = 0,
                    block_kernels: str | None = None) -> MoELayerAudit:
    """Compile ``value_and_grad`` of one MoE block (float32 parameters, bfloat16 activations) on
    ``devices`` laid out by ``parallel`` and audit its expert matmuls per device. ``block_kernels``:
    ``impl="grouped"``'s kernels ("mosaic", the default on GPU, or "tokamax")."""
    mesh, rules = sharding.make_mesh(parallel, devices=devices), sharding.rules_for(parallel)
    platform = devices[0].platform
    with jax.set_mesh(mesh), sharding.use_rules(rules), compile_target(mesh):
        abstract = nnx.eval_shape(lambda: MoE(cfg, nnx.Rngs(0), cfg.init_std, impl=impl, capacity_factor=capacity_factor,
                                              platform=platform, block_kernels=block_kernels))
        graphdef, state = nnx.split(abstract)
        shardings = sharding.tree_shardings(nnx.to_pure_dict(logical_axes(abstract)), rules, mesh)
        params = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, jnp.float32, sharding=sh),
                              nnx.to_pure_dict(state), shardings)
        token_ranks = sharding.mesh_axes_of("act_tokens")[1]
        tensor_ranks = sharding.mesh_axes_of("moe_mlp")[1]
        expert_ranks = sharding.mesh_axes_of("exp")[1]
        spec = sharding.logical_to_spec(("act_batch", None, None), rules, mesh.axis_names)
        x = jax.ShapeDtypeStruct((token_ranks, tokens_per_rank, cfg.hidden_size), jnp.bfloat16,
                                 sharding=NamedSharding(mesh, spec))

        def step(params, x, ct):
            def loss(params, x):
                y, _ = nnx.merge(graphdef, params)(x, jnp.ones(x.shape[:2], bool))
                return jnp.sum(y.astype(jnp.float32) * ct)

            return jax.value_and_grad(loss, argnums=(0, 1))(params, x)

        compiled = compile_without_cache(jax.jit(step).lower(params, x, x))
    stats = analyze(compiled.as_text(), exclude_scope=ROUTER_SCOPE)
    flops = stats.flops
    routed = 6.0 * tokens_per_rank * cfg.top_k * 3 * cfg.hidden_size * cfg.moe_intermediate_size / tensor_ranks
    rows = {tile: used_block_rows(cfg.num_experts, cfg.top_k, tokens_per_rank, token_ranks, expert_ranks, seed, tile)
            for tile in {max(k.row_tile, BLOCK_ROWS) for k in flops.kernels}}
    return MoELayerAudit(
        layout=layout, impl=impl if block_kernels is None else f"{impl}:{block_kernels}",
        capacity_factor=capacity_factor, routed_flops=routed,
        expert_flops=flops.dot_flops + sum(k.flops_for_rows(rows[max(k.row_tile, BLOCK_ROWS)]) for k in flops.kernels),
        expert_flops_bound=flops.dot_flops + flops.kernel_flops_bound, router_flops=flops.excluded_flops,
        temp_bytes=compiled.memory_analysis().temp_size_in_bytes, while_loops=flops.while_loops,
        kernel_calls=len(flops.kernels), collectives={k: c.bytes for k, c in stats.collectives.items()},
    )


def compile_without_cache(lowered, compiler_options: dict | None = None):
    """``lowered.compile(compiler_options)`` bypassing the persistent compilation cache: an
    executable for compile-only devices cannot be loaded back from it (jax warns on every read).
    ``compiler_options`` e.g. ``{"xla_dump_to": DIR}`` for the per-kernel PTX."""
    saved = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    try:
        return lowered.compile(compiler_options)
    finally:
        jax.config.update("jax_enable_compilation_cache", saved)


def gpu_topology_devices(target_config: str, num_devices: int = 8):
    """Compile-only devices of ``num_devices`` GPUs described by ``target_config`` (a text
    ``GpuTargetConfigProto``); needs jax-cuda12-plugin and ``JAX_PLATFORMS=cpu`` without a GPU."""
    from jax.experimental import topologies

    topo = topologies.get_topology_desc(platform="cuda", target_config=target_config, topology=f"1x1x{num_devices}")
    return list(topo.devices)
