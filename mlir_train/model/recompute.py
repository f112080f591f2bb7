"""What the backward pass recomputes instead of keeping: megatron-core 0.16's recompute controls.

One frozen :class:`RecomputePolicy` is built from the flags (``--recompute-granularity``,
``--recompute-method``, ``--recompute-num-layers``, ``--recompute-modules``,
``--moe-layer-recompute``) and handed to the model; nothing else changes the numbers, only
what the compiled step saves for its backward (``tests/model/test_recompute.py`` checks both).

* **full** granularity checkpoints whole decoder layers (``jax.checkpoint`` that saves nothing
  but its inputs). ``method="uniform"`` with ``num_layers=N`` splits each pipeline chunk's
  layers (the whole stack without a pipeline) into groups of N and checkpoints each group's
  input: the group is recomputed at once in the backward. ``method="block"`` checkpoints only
  the first N layers of each chunk, one by one; the others keep their activations.
  ``method=None`` (megatron-core requires a method) is every layer on its own, the same as
  uniform with N = 1.
* **selective** granularity recomputes submodules (:data:`MODULES`, default ``core_attn``):
  ``core_attn``, ``mlp`` and ``moe`` are normal checkpoints (a nested ``jax.checkpoint``
  around the submodule: its input is kept, its insides recomputed); ``layernorm`` and
  ``moe_act`` are megatron-core's *output-discarding* checkpoints: the module and the matmuls
  that consume its output form one checkpoint, whose backward reruns only the module (a
  matmul's output is not needed to differentiate it), so the module's output is not kept for
  those matmuls' weight gradients: the norms keep only the residual stream they read (in MoE
  layers the dropless experts still keep the normed tokens), the expert activation only its
  two fc1 outputs. (A name-based ``jax.checkpoint`` policy cannot do this: a value not saved
  under its name is saved as its producer's output, and a checkpoint nested in one with a
  policy takes the outer policy.)

Where a group of ``uniform`` would cross from a dense into an MoE stack (layers of one kind
are scanned as one stack), it is checkpointed as two pieces; in a pipeline whose stages
start a stack at different chunk positions, the pieces are split at every stage's group
boundary, and ``block`` recomputes a slot on every stage if it is among the first N layers on
any stage (one SPMD program runs on all stages).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable

import jax

GRANULARITIES = ("full", "selective")
METHODS = ("uniform", "block")
# megatron-core 0.16's TransformerConfig.recompute_modules choices.
MODULES = ("core_attn", "moe_act", "layernorm", "mla_up_proj", "mlp", "moe", "shared_experts")
# Modules Qwen3 / Qwen3-MoE have no counterpart for.
ABSENT_MODULES = {
    "mla_up_proj": "Qwen3 has no multi-latent attention (megatron-core accepts mla_up_proj only with "
                   "--multi-latent-attention)",
    "shared_experts": "Qwen3-MoE has no shared experts (megatron-core's --moe-shared-expert-intermediate-size)",
}
LEGACY = ("none", "full", "selective")  # the remat strings of earlier callers


@dataclasses.dataclass(frozen=True)
class RecomputePolicy:
    """What the backward recomputes (module docstring); built once from the flags
    (``TrainingFlags.recompute``), read by the layers (submodule checkpoints, fixed when the
    model is built) and :func:`~mlir_train.model.transformer.run_stack` (layer checkpoints)."""

    granularity: str | None = None   # None | "full" | "selective"
    method: str | None = None        # None | "uniform" | "block" (full only)
    num_layers: int | None = None    # with method
    modules: tuple[str, ...] = ()    # selective only

    def __post_init__(self):
        if self.granularity not in (None,) + GRANULARITIES:
            raise ValueError(f"recompute granularity {self.granularity!r}: choose one of {GRANULARITIES}")
        if self.method not in (None,) + METHODS:
            raise ValueError(f"recompute method {self.method!r}: choose one of {METHODS}")
        if self.method is not None and self.granularity != "full":
            raise ValueError(f"recompute method {self.method} needs granularity full")
        if (self.method is None) != (self.num_layers is None):
            raise ValueError("a recompute method and its number of layers go together")
        if self.num_layers is not None and self.num_layers < 1:
            raise ValueError(f"recompute num_layers must be at least 1, got {self.num_layers}")
        if self.modules and self.granularity != "selective":
            raise ValueError("recompute modules apply to granularity selective only")
        unknown = set(self.modules) - set(MODULES)
        if unknown:
            raise ValueError(f"unknown recompute modules {sorted(unknown)}; choose from {MODULES}")
        absent = [m for m in self.modules if m in ABSENT_MODULES]
        if absent:
            raise ValueError(f"recompute module {absent[0]}: {ABSENT_MODULES[absent[0]]}")

    @classmethod
    def of(cls, policy: RecomputePolicy | str | None) -> RecomputePolicy:
        """A policy, or one of the older strings: "none", "full" (every layer) and "selective"
        (megatron-core's default selective recompute, ``core_attn``)."""
        if isinstance(policy, RecomputePolicy):
            return policy
        if policy in (None, "none"):
            return cls()
        if policy == "full":
            return cls("full")
        if policy == "selective":
            return cls("selective", modules=("core_attn",))
        raise ValueError(f"unknown recompute policy {policy!r}; choose one of {LEGACY} or a RecomputePolicy")

    @property
    def kind(self) -> str:
        """"none" | "full" | "selective"."""
        return self.granularity or "none"

    @property
    def name(self) -> str:
        if self.granularity == "full":
            return "full" if self.method is None else f"full-{self.method}{self.num_layers}"
        if self.granularity == "selective":
            return "selective" if self.modules == ("core_attn",) else f"selective({','.join(self.modules)})"
        return "none"

    def recomputes(self, module: str) -> bool:
        """Whether the selective submodule ``module`` (:data:`MODULES`) is recomputed."""
        return self.granularity == "selective" and module in self.modules

    def check_chunks(self, layers_per_chunk: Iterable[int], what: str = "pipeline stage") -> None:
        """megatron-core's uniform method runs ``layers[i:i + N]`` for i = 0, N, 2N, ... of each
        chunk and fails indexing past the last layer unless N divides the chunk: refused here."""
        if self.method == "uniform":
            bad = sorted({n for n in layers_per_chunk if n % self.num_layers})
            if bad:
                raise ValueError(
                    f"--recompute-method uniform --recompute-num-layers {self.num_layers} must divide the layers of "
                    f"each {what} ({', '.join(map(str, bad))}); megatron-core would index past the last layer")

    def recomputed_fraction(self, layers_per_chunk: int) -> float:
        """Fraction of the decoder layers whose forward the backward runs again (full only)."""
        if self.granularity != "full":
            return 0.0
        if self.method == "block":
            return min(self.num_layers, layers_per_chunk) / max(layers_per_chunk, 1)
        return 1.0

    def pieces(self, count: int, offsets: Iterable[int] = (0,)) -> list[tuple[int, int, int]]:
        """How a run of ``count`` stacked layers is scanned: ``(start, length, group)`` pieces,
        ``group`` layers checkpointed together (``length`` a multiple of it), 0 for none. The
        run's first layer sits at each of ``offsets`` in its chunk (one offset without a
        pipeline or where every stage agrees)."""
        offsets = sorted(set(offsets))
        if self.granularity != "full":
            return [(0, count, 0)]
        if self.method is None:
            return [(0, count, 1)]
        n = self.num_layers
        if self.method == "block":
            k = max(0, min(count, n - offsets[0]))
            return [p for p in ((0, k, 1), (k, count - k, 0)) if p[1]]
        cuts = {0, count}
        for o in offsets:
            cuts |= {b - o for b in range(0, o + count, n) if 0 < b - o < count}
        cuts = sorted(cuts)
        out: list[tuple[int, int, int]] = []
        for a, b in zip(cuts, cuts[1:]):
            if out and out[-1][2] == b - a == n:
                out[-1] = (out[-1][0], out[-1][1] + n, n)
            else:
                out.append((a, b - a, b - a))
        return out


def checkpointed(fn: Callable, on: bool) -> Callable:
    """``fn`` as a normal checkpoint (inputs kept, insides recomputed in the backward) if ``on``."""
    return jax.checkpoint(fn, policy=jax.checkpoint_policies.nothing_saveable) if on else fn
