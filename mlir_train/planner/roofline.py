"""A step-time estimate from the compiled program (a roofline), with the device constants it uses
and where each comes from.

Three times per device and step, from the optimized HLO (:mod:`mlir_train.planner.hlo`):

* compute: the matmul FLOPs over the dense bf16 peak (NVIDIA's datasheet figure; the target
  file's matrix-unit rates give the same within 1 %, :func:`targets.spec_bf16_tflops`);
* memory: the HBM bytes (operands and results of every launched instruction, an estimate that
  counts each launch's buffers once and nothing a fusion keeps on chip) over the HBM bandwidth
  of the target file (``gpu_device_info.memory_bandwidth``, XLA's own figure for the part);
* communication: the bytes of the collectives the schedule leaves exposed (no compute between
  their start and done) over the NVLink bandwidth per direction, scaled as NCCL's ring
  algorithms move data ("bus bandwidth": an all-reduce of ``B`` bytes over ``n`` ranks moves
  ``2 (n-1)/n B`` through each link, an all-gather, reduce-scatter or all-to-all ``(n-1)/n B``,
  a permute ``B``). The link count is the target file's
  (``device_interconnect_info.active_links``); the per-link rate is NVIDIA's (NVLink 4: 25 GB/s
  per direction, H100/H200's 900 GB/s total; NVLink 5: 50 GB/s, B200's 1.8 TB/s).

The estimate is ``max(compute, memory) + communication``: compute and memory traffic overlap
within kernels, exposed collectives do not. It is labelled an estimate wherever printed: no
kernel reaches the peak, the HBM figure is a count of buffer sizes, and overlapped collectives
still share the links and SMs.
"""

from __future__ import annotations

import dataclasses
import re

from mlir_train.planner.targets import DeviceKind

# NVLink bandwidth per link and direction by CUDA compute capability major (NVIDIA's datasheets:
# H100 / H200 SXM "NVLink 900GB/s" over 18 NVLink-4 links; B200 "NVLink 1.8TB/s" over 18 NVLink-5).
NVLINK_BYTES_PER_LINK = {9: 25e9, 10: 50e9}
NVLINK_SOURCE = {9: "NVLink 4, 25 GB/s per link and direction (NVIDIA H100/H200 datasheets: 900 GB/s per GPU)",
                 10: "NVLink 5, 50 GB/s per link and direction (NVIDIA HGX B200 datasheet: 1.8 TB/s per GPU)"}

# Megatron-Bridge's published throughput for this model, to print beside the estimate.
MEGATRON_BRIDGE_REFERENCE = {
    "qwen3-30b-a3b": (299.0, "H100", "BF16",
                      "Megatron-Bridge performance summary (docs.nvidia.com/nemo/megatron-bridge/latest/"
                      "performance-summary.html), Qwen3-30B-A3B pre-training on DGX-H100, tuned BF16 recipe, "
                      "as quoted in issue 24"),
}


@dataclasses.dataclass(frozen=True)
class DeviceConstants:
    name: str
    peak_flops: float          # dense bf16, FLOP/s
    hbm_bytes_per_s: float
    link_bytes_per_s: float    # all NVLinks, one direction
    active_links: int
    sources: dict[str, str]


def _field(text: str, name: str) -> str | None:
    m = re.search(rf"\b{name}:\s*([\d.]+)", text)
    return m.group(1) if m else None


def device_constants(kind: DeviceKind) -> DeviceConstants:
    """The roofline's constants for a device kind with an XLA:GPU target file."""
    text = kind.target_config()
    bandwidth = _field(text, "memory_bandwidth")
    links = _field(text, "active_links")
    major = _field(text[text.index("cuda_compute_capability"):], "major")
    if bandwidth is None or links is None or major is None or int(major) not in NVLINK_BYTES_PER_LINK:
        raise ValueError(f"{kind.spec_file}: no memory_bandwidth / active_links / known compute capability")
    per_link = NVLINK_BYTES_PER_LINK[int(major)]
    return DeviceConstants(
        kind.description, kind.bf16_tflops * 1e12, float(bandwidth), per_link * int(links), int(links),
        {"peak": kind.source.split("; ")[-1].removeprefix("peak: "),
         "hbm": f"mlir_train/planner/targets/{kind.spec_file} gpu_device_info.memory_bandwidth",
         "links": f"mlir_train/planner/targets/{kind.spec_file} device_interconnect_info.active_links = {links}; "
                  + NVLINK_SOURCE[int(major)]})


def bus_factor(kind: str, ranks: int) -> float:
    """Bytes through each rank's links per byte of buffer, for NCCL's ring algorithms."""
    if ranks <= 1:
        return 0.0
    if kind == "all-reduce":
        return 2.0 * (ranks - 1) / ranks
    if kind in ("collective-permute", "send", "recv"):
        return 1.0
    return (ranks - 1) / ranks


@dataclasses.dataclass(frozen=True)
class Roofline:
    compute_s: float
    memory_s: float
    comm_s: float
    exposed_bytes: float       # collective buffer bytes with no compute between start and done
    step_s: float              # max(compute, memory) + comm: an estimate
    model_flops_per_device: float
    tokens_per_step: int

    @property
    def model_tflops_per_device(self) -> float:
        return self.model_flops_per_device / self.step_s / 1e12 if self.step_s else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / self.step_s if self.step_s else 0.0

    @property
    def bound(self) -> str:
        return "compute" if self.compute_s >= self.memory_s else "memory"


def roofline(matmul_flops: float, hbm_bytes: float, exposed: list[tuple[str, int, float]], consts: DeviceConstants,
             *, model_flops_per_device: float, tokens_per_step: int) -> Roofline:
    """``exposed``: (kind, ranks in the group, bytes per step) of the collectives the schedule
    does not overlap with compute."""
    compute = matmul_flops / consts.peak_flops
    memory = hbm_bytes / consts.hbm_bytes_per_s
    comm = sum(b * bus_factor(k, n) for k, n, b in exposed) / consts.link_bytes_per_s
    return Roofline(compute, memory, comm, sum(b for _, _, b in exposed), max(compute, memory) + comm,
                    model_flops_per_device, tokens_per_step)


def exposed_collectives(collective_groups) -> list[tuple[str, int, float]]:
    """(kind, group size, bytes) of the collectives of ``Stats.collective_groups`` with no
    compute between their start and done (ragged all-to-alls at their buffer size, an upper
    bound on what they carry)."""
    out = []
    for g, c in collective_groups.items():
        if not g.overlapped and c.bytes:
            n = 2 if g.pairs else max(len(g.group), 1)
            out.append((g.kind, n, float(c.bytes)))
    return out


IMBALANCES = (1.0, 1.25, 1.5, 2.0)  # ep-load-max-over-mean values the planner prices


def at_imbalance(r: Roofline, imbalance: float, expert_flops: float, exposed_all_to_all_s: float,
                 consts: DeviceConstants) -> float:
    """The estimated step time (s) when the most-loaded expert-parallel rank receives
    ``imbalance`` x the mean rank's routed rows (the log's ``ep-load-max-over-mean``; 1.0 is
    ``r``, balanced): every rank waits for it in each MoE layer, so its routed experts' matmul
    FLOPs (``expert_flops`` per device at a balanced routing) and the exposed all-to-all time
    scale by ``imbalance``; the rest of the step does not. Peers measure 0.53-0.67x of their
    forced-balanced throughput with natural routing: this says what that costs here."""
    extra = max(imbalance - 1.0, 0.0)
    compute = r.compute_s + extra * expert_flops / consts.peak_flops
    return max(compute, r.memory_s) + r.comm_s + extra * exposed_all_to_all_s
