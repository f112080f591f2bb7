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

The dropless expert-parallel dispatchers exchange rows through bounded buffers and run a
further round only when a routing overflows them (a ``conditional`` in the HLO): the figures
"at the sampled routing" read the no-overflow branch (the sampled routing never overflows the
default buffers), the ``_bound`` ones the costliest. :func:`ep_exchange_report` puts the bytes
the exchange's buffers take next to the bytes the routing sends.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding

import sharding
from mlir_train.planner.hlo import _Reader, analyze, matmul_flops
from mlir_train.planner.hlo_text import arrays_of, bytes_of, computations, parse_module
from mlir_train.model import logical_axes
from mlir_train.model.moe.block import ROUTER_SCOPE, MoE
from mlir_train.model.kernels.mosaic_moe import BLOCK_ROWS
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
    residual_bytes: int | None = None  # what the compiled forward keeps for the backward (jax.vjp's residuals)
    ep_exchange: "EPExchange | None" = None

    @property
    def ratio(self) -> float:
        return self.expert_flops / self.routed_flops

    @property
    def ratio_bound(self) -> float:
        return self.expert_flops_bound / self.routed_flops


@dataclasses.dataclass(frozen=True)
class EPExchange:
    """The expert-parallel all-to-alls of one MoE layer's forward and backward, per device, on
    the no-overflow path: ``buffer_bytes`` the buffers the compiled program exchanges through
    (per collective, the larger of what it reads and writes: a ragged exchange's receive buffer,
    or a dense all-to-all's padded buffer), ``traffic_bytes`` the rows a routing actually sends
    (``rows_sent`` per exchange, this rank's assignments), ``exchanges`` how many there are."""
    kind: str  # "ragged-all-to-all" or "all-to-all"
    exchanges: int
    buffer_bytes: int
    traffic_bytes: int
    rows_sent: int

    def __str__(self):
        return (f"{self.exchanges} x {self.kind}: buffers {self.buffer_bytes / 2**20:.1f} MiB, traffic "
                f"{self.traffic_bytes / 2**20:.1f} MiB ({self.buffer_bytes / max(self.traffic_bytes, 1):.2f}x)")


def ep_exchange_report(hlo_text: str, rows_sent: int, row_bytes: int) -> EPExchange | None:
    """Traffic next to buffer size for the expert-parallel exchange of a compiled MoE layer:
    the token all-to-alls of its no-overflow path (``analyze(..., branch="min")``: the rounds an
    overflow adds are a conditional) against ``rows_sent`` rows of ``row_bytes`` per exchange.
    None where the program has no token all-to-all (no expert parallelism)."""
    colls = analyze(hlo_text, branch="min").collectives
    for kind in ("ragged-all-to-all", "all-to-all"):
        c = colls.get(kind)
        # The dense path's small all-to-alls (counts, offsets) are not token exchanges.
        if c is not None and c.count and c.bytes / c.count >= row_bytes:
            big = c.count if kind == "ragged-all-to-all" else _token_all_to_alls(hlo_text, row_bytes)
            if not big:
                continue
            return EPExchange(kind, big, _token_bytes(hlo_text, kind, row_bytes), big * rows_sent * row_bytes, rows_sent)
    return None


def _token_all_to_alls(hlo_text: str, row_bytes: int) -> int:
    return sum(1 for b in _exchange_sizes(hlo_text, "all-to-all") if b >= row_bytes)


def _token_bytes(hlo_text: str, kind: str, row_bytes: int) -> int:
    return int(sum(b for b in _exchange_sizes(hlo_text, kind) if b >= row_bytes))


def _cheapest_path(hlo_text: str):
    """The instructions (with their computation's types) on the path :func:`analyze` counts with
    ``branch="min"``: each conditional's cheapest branch (the no-overflow one)."""
    comps, entry = parse_module(hlo_text)
    reader = _Reader(comps, entry, "min", None)
    seen = set()

    def visit(comp):
        if comp in seen:
            return
        seen.add(comp)
        types = {i.name: i.result_type for i in comps.get(comp, [])}
        for ins in comps.get(comp, []):
            yield ins, types
            if ins.opcode == "conditional":
                branches = computations(ins.attrs, "branch_computations") or (
                    computations(ins.attrs, "true_computation") + computations(ins.attrs, "false_computation"))
                if branches:  # ties (a loop whose body is itself a branch) go to the shorter branch
                    yield from visit(min(branches, key=lambda b: (reader.tally(b).cost(), _size(comps, b))))
            else:
                for key in ("calls", "to_apply", "body"):
                    for called in computations(ins.attrs, key):
                        yield from visit(called)

    yield from visit(entry)


def _size(comps, comp, depth: int = 0) -> int:
    """Instructions in ``comp`` and everything it calls."""
    if depth > 32:
        return 0
    return sum(1 + sum(_size(comps, c, depth + 1) for key in ("calls", "to_apply", "body", "branch_computations",
                                                               "true_computation", "false_computation")
                       for c in computations(i.attrs, key)) for i in comps.get(comp, []))


def loops_on_cheapest_path(hlo_text: str) -> int:
    """``while`` loops on the no-overflow path (the overflow rounds' loops sit in a branch)."""
    return sum(1 for ins, _ in _cheapest_path(hlo_text) if ins.opcode == "while")


def _exchange_sizes(hlo_text: str, kind: str) -> list[int]:
    """Bytes of each ``kind`` collective on the no-overflow path: the larger of what it sends
    (its first operand) and what it receives (its result; a ragged exchange also takes its
    output buffer as an operand, not counted twice)."""
    per = []
    for ins, types in _cheapest_path(hlo_text):
        op = ins.opcode
        base = op[:-6] if op.endswith("-start") else op
        if base == kind and not op.endswith(("-done", "-update")):
            sent = bytes_of(arrays_of(types.get(ins.operands[0], ""))) if ins.operands else 0
            outs = arrays_of(ins.result_type)
            if op.endswith("-start"):
                outs = [a for a in outs[len(ins.operands):] if a[1]]
            per.append(max(sent, bytes_of(outs)))
    return per


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
                    block_kernels: str | None = None, ep_buffer_factor: float | None = None,
                    residuals: bool = False) -> MoELayerAudit:
    """Compile ``value_and_grad`` of one MoE block (float32 parameters, bfloat16 activations) on
    ``devices`` laid out by ``parallel`` and audit its expert matmuls per device. ``block_kernels``:
    ``impl="grouped"``'s kernels ("mosaic", the default on GPU, or "tokamax");
    ``ep_buffer_factor``: ``--moe-ep-buffer-factor`` (None: its default). ``residuals``: also
    compile the forward alone (``jax.vjp``) and read the bytes it keeps for the backward.
    Expert FLOPs, loops and kernel calls are the no-overflow path's (what the sampled routing
    runs: checked, else the costliest path's); ``expert_flops_bound`` the costliest path's."""
    layer = _compile_layer(cfg, parallel, devices, impl, capacity_factor, tokens_per_rank, block_kernels,
                           ep_buffer_factor, residuals)
    token_ranks, tensor_ranks, expert_ranks = layer.token_ranks, layer.tensor_ranks, layer.expert_ranks
    text = layer.compiled.as_text()
    stats = analyze(text, exclude_scope=ROUTER_SCOPE)  # its collectives
    worst = matmul_flops(text, exclude_scope=ROUTER_SCOPE)
    flops, loops = _sampled_routing_path(text, worst, layer, cfg, tokens_per_rank, seed)
    s_sent = tokens_per_rank * cfg.top_k
    routed = 6.0 * tokens_per_rank * cfg.top_k * 3 * cfg.hidden_size * cfg.moe_intermediate_size / tensor_ranks
    rows = {tile: used_block_rows(cfg.num_experts, cfg.top_k, tokens_per_rank, token_ranks, expert_ranks, seed, tile)
            for tile in {max(k.row_tile, BLOCK_ROWS) for k in flops.kernels}}
    return MoELayerAudit(
        layout=layout, impl=impl if block_kernels is None else f"{impl}:{block_kernels}",
        capacity_factor=capacity_factor, routed_flops=routed,
        expert_flops=flops.dot_flops + sum(k.flops_for_rows(rows[max(k.row_tile, BLOCK_ROWS)]) for k in flops.kernels),
        expert_flops_bound=worst.dot_flops + worst.kernel_flops_bound, router_flops=flops.excluded_flops,
        temp_bytes=layer.compiled.memory_analysis().temp_size_in_bytes, while_loops=loops,
        kernel_calls=len(flops.kernels), collectives={k: c.bytes for k, c in stats.collectives.items()},
        residual_bytes=layer.residual_bytes,
        ep_exchange=ep_exchange_report(text, s_sent, cfg.hidden_size * 2) if expert_ranks > 1 else None,
    )


@dataclasses.dataclass(frozen=True)
class _CompiledLayer:
    compiled: object  # jax.stages.Compiled of the layer's value_and_grad
    residual_bytes: int | None
    plan: object  # the block's MoE plan (its dispatcher, kernels, exchange)
    token_ranks: int
    tensor_ranks: int
    expert_ranks: int
    gathered: bool = False  # the expert-tensor ranks gather their received rows (exchange.ep_grouped_gathered)


def _compile_layer(cfg, parallel: sharding.Layout, devices, impl: str, capacity_factor: float | None,
                   tokens_per_rank: int, block_kernels: str | None, ep_buffer_factor: float | None,
                   residuals: bool) -> _CompiledLayer:
    """:func:`audit_moe_layer`'s compile: the abstract block's parameters and a bfloat16 input
    sharded by ``parallel``'s rules, ``value_and_grad`` of a cotangent-weighted sum of its output."""
    mesh, rules = sharding.make_mesh(parallel, devices=devices), sharding.rules_for(parallel)
    platform = devices[0].platform
    with jax.set_mesh(mesh), sharding.use_rules(rules), compile_target(mesh):
        extra = {} if ep_buffer_factor is None else {"ep_buffer_factor": ep_buffer_factor}
        abstract = nnx.eval_shape(lambda: MoE(cfg, nnx.Rngs(0), cfg.init_std, impl=impl, capacity_factor=capacity_factor,
                                              platform=platform, block_kernels=block_kernels, **extra))
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
        residual_bytes = _residual_bytes(graphdef, params, x) if residuals else None
        return _CompiledLayer(compiled, residual_bytes, abstract.plan, token_ranks, tensor_ranks, expert_ranks,
                              sharding.rules.expert_rows_gathered(parallel))


def _residual_bytes(graphdef, params, x) -> int:
    """Bytes the compiled forward alone keeps for the backward (the leaves of ``jax.vjp``'s
    residuals, less what aliases its arguments)."""
    def forward(params, x):
        def f(params, x):
            return nnx.merge(graphdef, params)(x, jnp.ones(x.shape[:2], bool))[0]
        y, vjp = jax.vjp(f, params, x)
        return vjp  # its leaves: what the backward needs from the forward
    fwd = compile_without_cache(jax.jit(forward).lower(params, x)).memory_analysis()
    return fwd.output_size_in_bytes - fwd.alias_size_in_bytes


def _sampled_routing_path(text: str, worst, layer: _CompiledLayer, cfg, tokens_per_rank: int, seed: int):
    """(FLOPs, while loops) of the path the sampled routing runs: a dropless expert-parallel
    dispatcher's no-overflow path where no expert rank receives more rows than its exchange
    buffer holds, else ``worst`` (the costliest path)."""
    plan, expert_ranks = layer.plan, layer.expert_ranks
    if plan.dropless_dispatch and plan.ragged_all_to_all is not None and expert_ranks > 1:
        from mlir_train.model.moe.exchange import GATHER_CHUNK_FACTOR, exchange_capacity

        gathered = layer.gathered and plan.dropless_dispatch == "grouped"
        align = plan.block_kernels.block_rows if plan.dropless_dispatch == "grouped" and not gathered else 8
        factor = min(plan.ep_buffer_factor, GATHER_CHUNK_FACTOR) if gathered else None
        capacity = exchange_capacity(plan, tokens_per_rank, cfg.top_k, expert_ranks, align, factor)[0]
        if max_received_rows(cfg.num_experts, cfg.top_k, tokens_per_rank, layer.token_ranks, expert_ranks,
                             seed) <= capacity:
            return analyze(text, branch="min", exclude_scope=ROUTER_SCOPE).flops, loops_on_cheapest_path(text)
    return worst, worst.while_loops


def max_received_rows(num_experts: int, top_k: int, tokens_per_rank: int, token_ranks: int, expert_ranks: int,
                      seed: int = 0) -> int:
    """The most rows any expert rank receives for the routing :func:`used_block_rows` samples."""
    rng = np.random.default_rng(seed)
    most = 0
    for _ in range(token_ranks // expert_ranks):
        s = tokens_per_rank * expert_ranks
        experts_SK = np.argsort(rng.random((s, num_experts)), axis=1)[:, :top_k]
        sizes_E = np.bincount(experts_SK.reshape(-1), minlength=num_experts)
        most = max(most, int(sizes_E.reshape(expert_ranks, -1).sum(axis=1).max()))
    return most


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
    ``GpuTargetConfigProto``); needs a jax CUDA plugin (cuda12 or cuda13) and ``JAX_PLATFORMS=cpu`` without a GPU."""
    from jax.experimental import topologies

    topo = topologies.get_topology_desc(platform="cuda", target_config=target_config, topology=f"1x1x{num_devices}")
    return list(topo.devices)
