"""The planner's step time for the layout a run trains with, printed in the run's first lines on
a GPU and logged beside the measured one (issue 37): the roofline
(:mod:`mlir_train.planner.roofline`) of the run's own compiled step, the routed experts' block
kernels counted at the rows a balanced routing fills, and the same at natural routings
(:data:`~mlir_train.planner.roofline.IMBALANCES`)."""

from __future__ import annotations

from mlir_train.planner import roofline
from mlir_train.planner.targets import DEVICE_KINDS, DeviceKind


def balanced_expert_flops(stats, layout, model_cfg, buffer_factor: float) -> float:
    """The routed experts' block-kernel FLOPs per device at a balanced routing (0 without them).
    Where the expert-tensor ranks gather their received rows, the rounds hold at most
    ``exchange.GATHER_CHUNK_FACTOR`` x the balanced rows (``ep_grouped_gathered``)."""
    from mlir_train.model.kernels.mosaic_moe import BLOCK_ROWS
    from mlir_train.model.moe.exchange import GATHER_CHUNK_FACTOR
    from mlir_train.planner import comm
    from sharding.rules import expert_rows_gathered

    if expert_rows_gathered(layout):
        buffer_factor = min(buffer_factor, GATHER_CHUNK_FACTOR)

    return sum(k.flops_for_rows(comm.balanced_kernel_rows(
        k.rows, expert_ranks=layout.expert, num_experts=model_cfg.num_experts, top_k=model_cfg.top_k,
        block=BLOCK_ROWS, row_tile=k.row_tile, buffer_factor=buffer_factor)) for k in stats.flops.kernels)


def balanced_matmul_flops(stats, layout, model_cfg, buffer_factor: float) -> float:
    """The compiled matmul FLOPs with the block kernels at the rows a balanced routing fills,
    not their static bound."""
    return stats.matmul_flops - stats.flops.kernel_flops_bound + balanced_expert_flops(
        stats, layout, model_cfg, buffer_factor)


def exposed_all_to_all_s(stats, consts: roofline.DeviceConstants) -> float:
    """The exposed (not overlapped) all-to-all time of ``stats`` on ``consts``' links."""
    a2a = [e for e in roofline.exposed_collectives(stats.collective_groups) if "all-to-all" in e[0]]
    return sum(b * roofline.bus_factor(k, n) for k, n, b in a2a) / consts.link_bytes_per_s


def kind_of(device_kind: str) -> DeviceKind | None:
    """The planner's device kind of a ``jax.Device.device_kind`` string (None: none with an
    XLA:GPU target description, e.g. CPU)."""
    name = device_kind.lower()
    return next((k for key, k in DEVICE_KINDS.items() if k.compiles_for_gpu and key in name), None)


def predicted(step, kind: DeviceKind, layout, model_cfg, buffer_factor: float, *, model_flops_per_device: float,
              tokens_per_step: int) -> tuple[roofline.Roofline, dict[float, float]]:
    """The roofline of an audited compiled step (``hlo.audit_compiled``) on ``kind``, and the step
    time at each of :data:`~mlir_train.planner.roofline.IMBALANCES`."""
    stats = step.stats_balanced or step.stats
    consts = roofline.device_constants(kind)
    r = roofline.roofline(balanced_matmul_flops(stats, layout, model_cfg, buffer_factor), step.stats.hbm_bytes,
                          roofline.exposed_collectives(step.stats.collective_groups), consts,
                          model_flops_per_device=model_flops_per_device, tokens_per_step=tokens_per_step)
    experts, a2a_s = balanced_expert_flops(stats, layout, model_cfg, buffer_factor), exposed_all_to_all_s(step.stats, consts)
    return r, {f: roofline.at_imbalance(r, f, experts, a2a_s, consts) for f in roofline.IMBALANCES}


def summary(r: roofline.Roofline, at: dict[float, float], layout_name: str) -> str:
    """The run's first-lines statement of the prediction."""
    natural = ", ".join(f"{f:g}x {t * 1000:.0f} ms" for f, t in at.items() if f != 1.0)
    return (f"planner's predicted step time for {layout_name} (an ESTIMATE, roofline of this compiled step): "
            f"{r.step_s * 1000:.0f} ms balanced ({r.bound}-bound); at ep-load-max-over-mean {natural}")
