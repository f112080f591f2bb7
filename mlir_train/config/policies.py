"""The run's policies as plain, frozen dataclasses: what the backward recomputes, how the
router routes and which load-balancing losses the objective carries.

Built once from the flags (:mod:`mlir_train.config.flags`), checked as megatron-core checks them
(each error names the flag), and read by the model and the step. Plain data: no jax, so a bad
combination stops the run before any backend starts. How the model carries each out lives
beside the model (:mod:`mlir_train.model.recompute`, :mod:`mlir_train.model.moe.router`,
:mod:`mlir_train.model.losses`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from mlir_train.runtime.errors import ConfigError

ROUTER_DTYPES = ("fp32", "fp64")  # --moe-router-dtype (mlir_train.model.moe.router maps them to jnp types)


# ----- recompute: megatron-core 0.16's recompute controls (mlir_train.model.recompute) ------------
GRANULARITIES = ("full", "selective")

METHODS = ("uniform", "block")

# megatron-core 0.16's TransformerConfig.recompute_modules choices.
MODULES = ("core_attn", "moe_act", "layernorm", "mla_up_proj", "mlp", "moe", "shared_experts")

# Modules no model here has a separate counterpart for.
ABSENT_MODULES = {
    "mla_up_proj": "no model here has multi-latent attention (megatron-core accepts mla_up_proj only with "
                   "--multi-latent-attention)",
    "shared_experts": "the shared expert (of the models that have one) is not recomputed on its own: "
                      "--recompute-modules moe recomputes the whole MoE layer, the shared expert included",
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


# ----- the router: megatron-core's TopKRouter settings (mlir_train.model.moe.router) -------------
SCORE_FUNCTIONS = ("softmax", "sigmoid")

class RouterConfigError(ConfigError):
    """A router setting that cannot run; the message names the Megatron flag."""

@dataclasses.dataclass(frozen=True)
class RouterConfig:
    score_function: str = "softmax"        # --moe-router-score-function
    pre_softmax: bool | None = None        # --moe-router-pre-softmax; None: from norm_topk_prob
    topk_scaling_factor: float | None = None  # --moe-router-topk-scaling-factor
    num_groups: int | None = None          # --moe-router-num-groups
    group_topk: int | None = None          # --moe-router-group-topk
    enable_expert_bias: bool = False       # --moe-router-enable-expert-bias
    dtype: str = "fp32"                    # --moe-router-dtype fp32 | fp64
    per_sequence_stats: bool = False       # seq_aux_loss needs per-document statistics
    sinkhorn: bool = False                 # --moe-router-load-balancing-type sinkhorn
    training: bool = True                  # sinkhorn balances only in training (the eval step's model: False)
    # Rows of a micro-batch one data-parallel rank holds (--micro-batch-size; the Trainer sets it):
    # the load-balancing statistics, and Sinkhorn's balancing, are formed per group of these rows,
    # as Megatron forms them on each data-parallel rank. None: the whole batch is one group.
    balancing_rows: int | None = None

    def balancing_groups(self, rows: int) -> int:
        """How many balancing groups a batch of ``rows`` rows holds: one per data-parallel rank's
        micro-batch; one for a batch that does not split into them (generation, a lone row)."""
        per = self.balancing_rows
        return rows // per if per and rows >= per and rows % per == 0 else 1

    def renormalises(self, norm_topk_prob: bool) -> bool:
        """Whether softmax top-k weights are renormalised over the k chosen."""
        return norm_topk_prob if self.pre_softmax is None else not self.pre_softmax

    def check(self, num_experts: int, top_k: int, norm_topk_prob: bool) -> None:
        """Megatron's own start-up checks (``TransformerConfig.__post_init__``), by flag."""
        if self.score_function not in SCORE_FUNCTIONS:
            raise RouterConfigError(f"--moe-router-score-function {self.score_function}: choose one of {SCORE_FUNCTIONS}")
        if self.dtype not in ROUTER_DTYPES:
            raise RouterConfigError(f"--moe-router-dtype {self.dtype}: choose one of {ROUTER_DTYPES}")
        if self.sinkhorn and (self.enable_expert_bias or self.group_topk or self.score_function != "softmax"):
            raise RouterConfigError(
                "--moe-router-load-balancing-type sinkhorn picks experts by its own balancing and weighs them with "
                "sigmoid (top-1) or softmax scores, as Megatron does: it does not combine with "
                "--moe-router-enable-expert-bias, --moe-router-group-topk or --moe-router-score-function sigmoid")
        if self.enable_expert_bias and self.score_function != "sigmoid":
            raise RouterConfigError(
                "--moe-router-enable-expert-bias: the aux-loss-free expert bias only works with "
                "--moe-router-score-function sigmoid (as in Megatron)")
        if top_k == 1 and not self.sinkhorn and self.score_function == "softmax" and self.renormalises(norm_topk_prob):
            raise RouterConfigError(
                "--moe-router-topk 1 with a softmax over the chosen expert gives every token weight 1 and the "
                "router no gradient: add --moe-router-pre-softmax (as Megatron requires)")
        if self.group_topk:
            g = self.num_groups
            if not g:
                raise RouterConfigError("--moe-router-group-topk needs --moe-router-num-groups (group-limited routing)")
            if num_experts % g:
                raise RouterConfigError(f"--moe-router-num-groups {g} must divide the {num_experts} experts")
            if self.group_topk > g:
                raise RouterConfigError(f"--moe-router-group-topk {self.group_topk} exceeds --moe-router-num-groups {g}")
            if top_k < self.group_topk:
                raise RouterConfigError(
                    f"--moe-router-group-topk {self.group_topk} exceeds --moe-router-topk {top_k}: each chosen group "
                    "scores its top (topk / group_topk) experts, which would be none")
            if self.group_topk * (num_experts // g) < top_k:
                raise RouterConfigError(
                    f"--moe-router-group-topk {self.group_topk} groups of {num_experts // g} experts hold fewer than "
                    f"--moe-router-topk {top_k} experts")


# ----- --moe-router-load-balancing-type (mlir_train.model.losses) ---------------------------------
# ----- --moe-router-load-balancing-type ---------------------------------------------------------
AUX_LOSS_TYPES = ("aux_loss", "seq_aux_loss", "global_aux_loss")

LOAD_BALANCING_TYPES = AUX_LOSS_TYPES + ("sinkhorn", "none")

# Megatron's tracker names, for logging.
TRACKER_NAMES = {"aux_loss": "load_balancing_loss", "seq_aux_loss": "seq_load_balancing_loss",
                 "global_aux_loss": "global_load_balancing_loss"}

class LoadBalancingError(ConfigError):
    """A load-balancing setting that cannot run; the message names the Megatron flag."""

@dataclasses.dataclass(frozen=True)
class LoadBalancing:
    """Which router losses the objective carries, with their coefficients.

    ``coeffs`` pairs each of ``aux_loss`` / ``seq_aux_loss`` / ``global_aux_loss`` the run uses
    with its ``--moe-aux-loss-coeff`` (Megatron's ``get_aux_loss_coeff``: a type that is not
    listed weighs 0). Every loss is formed as megatron-core 0.16.1 forms it on each data-parallel
    rank, from that rank's micro-batch (the router's balancing group: ``--micro-batch-size``
    rows), so the objective does not depend on the layout:

    * ``aux_loss``: the switch loss of the rank's micro-batch;
    * ``seq_aux_loss``: the mean over its packed documents of each document's switch loss;
    * ``global_aux_loss``: the rank's router scores against the expert counts of all ranks,
      averaged over this and the step's earlier micro-batches (Megatron's
      ``global_tokens_per_expert / ga_steps``);
    * z-loss: ``mean logsumexp(logits)^2`` over the rank's tokens.

    Each is summed over the MoE layers, times its coefficient, and weighted as Megatron's
    gradient scaling weighs it (``mlir_train.model.losses.router_losses``): ``1 / (ranks x
    micro-batches)``, or under ``--calculate-per-token-loss`` the rank's router tokens over the
    global batch's loss tokens.
    """

    coeffs: tuple[tuple[str, float], ...] = ()
    z_loss_coeff: float = 0.0
    sinkhorn: bool = False  # the router balances by Sinkhorn (no aux loss)

    @classmethod
    def from_flags(cls, types, coeffs, z_loss_coeff: float | None = None) -> "LoadBalancing":
        """From ``--moe-router-load-balancing-type`` (one type or a list) and
        ``--moe-aux-loss-coeff`` (one coefficient, or one per listed type), as Megatron pairs them."""
        types = [types] if isinstance(types, str) else list(types)
        coeffs = [0.0 if coeffs is None else coeffs] if isinstance(coeffs, (int, float)) or coeffs is None else list(coeffs)
        if len(types) > 1 and len(coeffs) != len(types):
            raise LoadBalancingError(
                f"--moe-router-load-balancing-type lists {len(types)} types ({' '.join(types)}) but "
                f"--moe-aux-loss-coeff gives {len(coeffs)} coefficient(s): give one per type, in the same order")
        if len(types) == 1 and len(coeffs) != 1:
            raise LoadBalancingError(
                f"--moe-aux-loss-coeff gives {len(coeffs)} coefficients for the one --moe-router-load-balancing-type "
                f"{types[0]}")
        for t in types:
            if t not in LOAD_BALANCING_TYPES:
                raise LoadBalancingError(f"--moe-router-load-balancing-type {t}: choose from {LOAD_BALANCING_TYPES}")
        if len(set(types)) != len(types):
            raise LoadBalancingError(f"--moe-router-load-balancing-type {' '.join(types)} names a type twice")
        if "sinkhorn" in types and len(types) > 1:
            raise LoadBalancingError(
                f"--moe-router-load-balancing-type {' '.join(types)}: sinkhorn routes by its own balancing and takes no "
                "aux loss; give it alone (Megatron routes a list by top-k and would silently ignore sinkhorn)")
        if types == ["sinkhorn"] and any(c != 0 for c in coeffs):
            raise LoadBalancingError(
                "--moe-router-load-balancing-type sinkhorn takes no aux loss: drop --moe-aux-loss-coeff or set it to 0 "
                "(Megatron asserts the same)")
        for c in coeffs:
            if c < 0:
                raise LoadBalancingError(f"--moe-aux-loss-coeff {c}: must not be negative")
        pairs = tuple((t, float(c)) for t, c in zip(types, coeffs) if t in AUX_LOSS_TYPES and c > 0)
        return cls(coeffs=pairs, z_loss_coeff=float(z_loss_coeff or 0.0), sinkhorn=types == ["sinkhorn"])

    def coeff(self, kind: str) -> float:
        return dict(self.coeffs).get(kind, 0.0)

    @property
    def per_sequence(self) -> bool:
        """Whether the router must collect per-document statistics (``seq_aux_loss`` on)."""
        return self.coeff("seq_aux_loss") > 0

    @property
    def uses_global(self) -> bool:
        return self.coeff("global_aux_loss") > 0


# ----- LoRA: low-rank adapters on a frozen base (mlir_train.model.lora) --------------------------
# The layers an adapter can wrap are the model family's (its parameter table names them as
# Megatron's "<parent>.<name>" modules, mlir_train.families); the patterns are checked against
# them once the model is known (mlir_train.train.build.resolve).
LORA_ALL = "all-linear"  # ms-swift's name for every linear layer (experts included, never the router)
LORA_ALIASES = {LORA_ALL: ("*",)}
LORA_DEFAULT_TARGETS = (LORA_ALL,)  # Megatron-Bridge's default: every linear layer
EXPERT_ADAPTERS = ("per-expert", "shared")


def matches(module: str, pattern: str) -> bool:
    """A ``--lora-target-modules`` pattern (``fnmatch`` wildcards) matches a module by its full
    name or by its short name (its last component), as Megatron-Bridge's bare names do."""
    import fnmatch

    return fnmatch.fnmatchcase(module, pattern) or fnmatch.fnmatchcase(module.rsplit(".", 1)[-1], pattern)


@dataclasses.dataclass(frozen=True)
class LoRAPolicy:
    """Which layers carry a rank-``dim`` adapter ``W + (alpha / dim) A B`` and how.

    ``targets`` are patterns (``fnmatch`` wildcards, :func:`matches`) over the model's module
    names (Megatron's, from its family's parameter table), ``all-linear`` every one: a pattern
    of a short name adapts every module of that name (the dense MLPs' and the experts' fc1, as
    Megatron-Bridge's bare names do), ``*experts*`` only the experts. ``expert_adapters``:
    ``per-expert`` gives every routed expert its own A and B (peft's ``target_parameters`` on
    fused experts, NeMo AutoModel), ``shared`` one A and B for all experts of a layer
    (Megatron-Bridge's shared-expert-adapter choice): ``E`` times fewer adapter weights."""

    dim: int
    alpha: float = 32.0
    dropout: float = 0.0
    targets: tuple[str, ...] = LORA_DEFAULT_TARGETS
    expert_adapters: str = "per-expert"

    @property
    def scaling(self) -> float:
        return self.alpha / self.dim

    def patterns(self) -> tuple[str, ...]:
        """The targets with the aliases expanded."""
        return tuple(p for t in self.targets for p in LORA_ALIASES.get(t, (t,)))

    def modules(self, available) -> tuple[str, ...]:
        """The modules of ``available`` (a family's, in its order) the targets select."""
        return tuple(m for m in available if any(matches(m, p) for p in self.patterns()))

    def check(self) -> None:
        """The flags' own checks (each error names its flag); the patterns are checked against the
        model's modules where the model is known."""
        if self.dim <= 0:
            raise ConfigError(f"--lora-dim {self.dim}: the adapter rank must be a positive integer")
        if self.dropout:
            raise ConfigError(
                f"--lora-dropout {self.dropout}: LoRA dropout is not implemented (peft refuses it too on fused expert "
                "weights, whose input cannot be dropped per adapter); use --lora-dropout 0")
        if self.expert_adapters not in EXPERT_ADAPTERS:
            raise ConfigError(f"--lora-expert-adapters {self.expert_adapters!r}: choose one of {EXPERT_ADAPTERS}")

    @classmethod
    def from_flags(cls, dim, alpha, dropout, targets, expert_adapters) -> "LoRAPolicy | None":
        """None without ``--lora-dim`` (full fine-tuning); else the checked policy."""
        if dim is None:
            return None
        policy = cls(dim=dim, alpha=float(alpha), dropout=dropout or 0.0,
                     targets=tuple(targets or LORA_DEFAULT_TARGETS), expert_adapters=expert_adapters or "per-expert")
        policy.check()
        return policy
