"""What the planner tries: a :class:`Candidate` is a parallel layout (the project's one layout
type, :class:`sharding.layout.Layout`) plus what the backward recomputes
(:class:`~mlir_train.config.policies.RecomputePolicy`); :func:`candidate_layouts` is the
``--search`` space."""

from __future__ import annotations

import dataclasses
import itertools
from typing import TYPE_CHECKING, Any

from mlir_train.config.arch_flags import check_architecture_flags
from mlir_train.config.policies import RecomputePolicy

if TYPE_CHECKING:
    from sharding.layout import Layout


def _layout(**sizes) -> Layout:
    # The sharding package imports jax: not at import time, which python -m mlir_train.plan
    # needs before it sets the platform up (compile-only devices, fake CPU devices).
    from sharding.layout import Layout

    return Layout(**sizes)


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One layout to plan. The layout's sizes read through: ``candidate.tensor`` is
    ``candidate.layout.tensor`` (and ``etp``, ``context``, ...). ``recompute`` may be given as
    one of the policy strings ("none", "selective", "full")."""

    layout: Layout = dataclasses.field(default_factory=_layout)
    recompute: RecomputePolicy = RecomputePolicy()

    def __post_init__(self):
        object.__setattr__(self, "recompute", RecomputePolicy.of(self.recompute))

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name in ("layout", "recompute"):  # unpickling, copying: not there yet
            raise AttributeError(name)
        return getattr(self.layout, name)

    def name(self, num_devices: int) -> str:
        """E.g. ``TP2xPP1xEP4xETP1xDP4+SP+distopt recompute=full``."""
        lay = self.layout
        dp = num_devices // (lay.tensor * lay.pipeline * lay.context)
        parts = [f"TP{lay.tensor}", f"PP{lay.pipeline}", f"EP{lay.expert}"]
        parts += ([f"ETP{lay.etp}"] if lay.etp != lay.tensor else []) + [f"DP{dp}"]
        if lay.context > 1:
            parts.insert(1, f"CP{lay.context}")
        extra = (["SP"] if lay.sequence_parallel else []) + (["distopt"] if lay.distributed_optimizer else [])
        return "x".join(parts) + "".join("+" + e for e in extra) + f" recompute={self.recompute.name}"


def candidate(recompute: RecomputePolicy | str = "none", **sizes) -> Candidate:
    """``Candidate(Layout(**sizes), recompute)``: e.g. ``candidate("full", tensor=2, expert=4)``."""
    return Candidate(_layout(**sizes), recompute)


def candidate_layouts(run_cfg, num_devices: int) -> list[Candidate]:
    """TP (within one 8-device node), EP, PP that divide the model, distributed optimizer on/off,
    recompute none/full, and for long rows (``--seq-length`` >= 8192, what CP is for) context
    parallelism of 1, 2, 4 or 8 ranks; DP is what is left (EP is carved out of CP x DP). A given
    --expert-tensor-parallel-size is kept for every candidate (EP then ranges over what ETP x EP
    leaves of a stage's ranks: folding)."""
    from mlir_train import families  # imports jax: not at the planner's start-up

    cfg = families.from_flags(run_cfg.model, None)
    check_architecture_flags(run_cfg.model, cfg)
    etp = run_cfg.parallel.expert_tensor_parallel_size
    seq = run_cfg.data.seq_length or 0
    divisors = [d for d in range(1, num_devices + 1) if num_devices % d == 0]
    pipelines = [p for p in divisors if cfg.num_layers % p == 0]
    out = []
    for pp in pipelines:
        for tp in (d for d in divisors if d <= 8 and num_devices % (d * pp) == 0):
            dp = num_devices // (tp * pp)
            room = dp if etp is None else num_devices // (pp * etp)
            experts = [e for e in divisors if room % e == 0 and cfg.is_moe and cfg.num_experts % e == 0] or [1]
            sp = run_cfg.parallel.sequence_parallel and tp > 1
            contexts = [c for c in (1, 2, 4, 8) if dp % c == 0 and seq % (2 * c) == 0
                        and (not sp or seq % (c * tp) == 0)] if seq >= 8192 else [1]
            for ep, cp in itertools.product(experts, contexts):
                for distopt in ((True, False) if dp > 1 else (False,)):  # ZeRO needs data ranks
                    for recompute in ("none", "full"):
                        out.append(candidate(recompute, tensor=tp, expert=ep, pipeline=pp, distributed_optimizer=distopt,
                                             sequence_parallel=sp, expert_tensor=etp, context=cp))
    return out
