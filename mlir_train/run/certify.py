"""A layout certificate: a few iterations of the user's layout next to one device, on the same
batches, and what each program ran (``python -m mlir_train.check``).

Both runs come from the one builder (:func:`mlir_train.train.build.resolve`, :meth:`Run.trainer`)
with the user's flags; the reference differs only in its layout (one device, no pipeline, no
sequence parallelism, no optimizer sharding) and its kernels (the platform's plain XLA paths:
``--attention-kernel`` and ``--moe-gemm-backend`` back to ``auto``, and any ``--code-paths``
back to its default), so a wrong sharding rule, dispatcher or kernel shows as a difference. Its
router is the layout's (``--moe-router-topk-limited-devices`` groups by the layout's EP). Both
start from the same seed's weights (checked identical) and take the same global batches from the
user's data; each step is traced, read for its code paths (:mod:`mlir_train.planner.code_paths`),
compiled and run. Dropless: with ``--moe-expert-capacity-factor`` each rank drops its own tokens
(Megatron's per-rank capacity), so which tokens drop depends on the layout; the check compares
without dropping and says so.

Every iteration starts both runs from the same state (the one device's after the iteration
before), so each compares one step of the two programs (:func:`_train_in_step` says why). What
must agree (:data:`TOLERANCES`): each iteration's ``lm loss`` and grad norm (relative
difference), the loss tokens (exactly: the same batches), every trained parameter's update,
``|dp_layout - dp_one| / |dp_one|`` in L2 over each tensor (``dp``: the iteration's end minus its
start), so a wrong gradient shows however small the learning rate is, and the optimizer state.
"""

from __future__ import annotations

import dataclasses
import time
import traceback
from typing import Any

import jax
import numpy as np
import optax

from mlir_train.checkpoint import agree, sources
from mlir_train.config.flags import RunConfig
from mlir_train.config.sections import section_fields
from mlir_train.data import BatchLoader, DataConfig, build_datasets, load_tokenizer
from mlir_train.planner.code_paths import PATH_ROWS, CodePaths
from mlir_train.run.shrink import Shrunk, cut_rows, shrink
from mlir_train.runtime.errors import ConfigError, user_errors
from mlir_train.train.build import Run, resolve

# LLVM -O0 for the CPU code: the programs only run a few tiny steps, compiling is most of the time,
# and the optimized HLO (what the code paths and collectives are read from) is the same.
COMPILER_OPTIONS = {"xla_backend_optimization_level": 0}
# The flags that pick kernels and code paths: the reference takes their defaults (the plain paths).
KERNEL_FLAGS = ("attention_kernel", "moe_gemm_backend", "code_paths")


@dataclasses.dataclass(frozen=True)
class Tolerance:
    loss: float       # relative, per iteration's lm loss
    grad_norm: float  # relative, per iteration's grad norm
    moments: float    # relative L2 difference of each optimizer-state tensor (Adam's moments) after it
    params: float     # relative L2 difference of each tensor's update after the last iteration
    why: str


# float32: the programs sum the same terms in other orders (partial sums per rank, all-reduces);
# unit roundoff 6e-8 over reductions thousands deep leaves ~1e-6 in a loss or a norm, and Adam's
# normalised update turns gradients near the rounding noise into steps of any sign, a few
# elements per tensor (a ~1e-4 share of a tensor's update norm). A small tensor whose gradient
# nearly cancels keeps that noise in its moments too: qwen3.5-tiny's per-head DeltaNet a_log
# under CP2 EP2 differs by 1.1e-4 on one machine's XLA:CPU and less on another's, so the moments
# allow 1e-3. A wrong split is O(1), a bfloat16 cast where float32 belongs 4e-3.
# bfloat16: 8 mantissa bits, 4e-3 per rounding, and every matmul rounds its output.
TOLERANCES = {
    "float32": Tolerance(1e-4, 1e-4, 1e-3, 1e-2, "float32 compute: reordered sums of unit roundoff 6e-8"),
    "bfloat16": Tolerance(2e-2, 5e-2, 5e-2, 2.5e-1, "bfloat16 compute: 8 mantissa bits, 4e-3 per rounding"),
}


@dataclasses.dataclass
class Side:
    """One of the two runs: what it is, what it ran and what it computed."""

    name: str
    run: Run
    paths: CodePaths | None = None
    metrics: list[dict[str, float]] = dataclasses.field(default_factory=list)
    init: Any = None

    def series(self, key: str) -> list[float]:
        return [m.get(key, float("nan")) for m in self.metrics]


@dataclasses.dataclass
class Certificate:
    shrunk: Shrunk
    layout: Side
    reference: Side
    dtype: str
    notes: list[str]
    tolerance: Tolerance
    initial: str = ""                     # "" when the initial weights are identical, else where they differ
    worst: tuple[float, str] = (0.0, "")  # the largest relative update difference and its tensor
    worst_moments: tuple[float, str] = (0.0, "")  # the same of the optimizer state (Adam's moments)
    # the largest update difference over tol.params that Adam's direction from each run's own
    # moments shows too (:func:`_compare_iteration`): (update difference, direction difference, tensor)
    explained: tuple[float, float, str] = (0.0, 0.0, "")
    moved: bool = False   # whether any iteration moved a parameter of the one device
    compared: int = 0     # the iterations compared
    failures: list[str] = dataclasses.field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not self.failures


def model_config(cfg: RunConfig, tokenizer_size: int):
    """The run's model: ``--load``'s (read for its shape, never its weights) or ``--model-name``'s."""
    source = sources.detect(cfg.checkpoint.load, step=cfg.checkpoint.ckpt_step)
    base = sources.lora_sources(cfg, source)[0] if cfg.training.lora is not None else source
    return agree.run_model_config(cfg, base, tokenizer_size)


def reference_config(cfg: RunConfig) -> RunConfig:
    """``cfg`` on one device with the platform's plain kernels: no TP, PP, EP, CP, SP, ZeRO or FSDP."""
    return cfg.replace(
        parallel=dict(tensor_model_parallel_size=1, pipeline_model_parallel_size=1, expert_model_parallel_size=1,
                      expert_tensor_parallel_size=None, context_parallel_size=1, sequence_parallel=False,
                      use_distributed_optimizer=False, use_torch_fsdp2=False,
                      data_parallel_sharding_strategy="no_shard", num_layers_per_virtual_pipeline_stage=None,
                      num_virtual_stages_per_pipeline_rank=None, decoder_first_pipeline_num_layers=None,
                      decoder_last_pipeline_num_layers=None, pipeline_schedule=None),
    ).replace(**kernel_defaults())


def kernel_defaults() -> dict[str, dict[str, Any]]:
    """Section -> {field: default} of the :data:`KERNEL_FLAGS` this build's flags have, wherever they live."""
    out: dict[str, dict[str, Any]] = {}
    for section, _, f, _ in section_fields():
        if f.name in KERNEL_FLAGS:
            out.setdefault(section, {})[f.name] = f.default
    return out


def code_paths_of(cfg: RunConfig) -> str:
    """The run's ``--code-paths`` ("default" where this build's flags have none)."""
    for section, _, f, _ in section_fields():
        if f.name == "code_paths":
            return str(getattr(getattr(cfg, section), f.name))
    return "default (this build has no --code-paths)"


def precision_config(cfg: RunConfig, precision: str) -> tuple[RunConfig, list[str]]:
    """``cfg`` computing in ``precision`` ("fp32" or "bf16"); what changed, said once."""
    t, notes = cfg.training, []
    want = "bfloat16" if precision == "bf16" else "float32"
    if t.compute_dtype != want:
        notes.append(f"compute {want} for the comparison (the run's {t.compute_dtype} replaced; "
                     f"--check-precision {'fp32' if precision == 'bf16' else 'bf16'} asks for the other)")
    return cfg.replace(training=dict(bf16=precision == "bf16", fp16=False)), notes


def dropless_config(cfg: RunConfig) -> tuple[RunConfig, list[str]]:
    m = cfg.moe
    if m.moe_expert_capacity_factor is None:
        return cfg, []
    return cfg.replace(moe=dict(moe_expert_capacity_factor=None, moe_pad_expert_input_to_capacity=False)), [
        f"--moe-expert-capacity-factor {m.moe_expert_capacity_factor} left out: each rank drops its own tokens "
        "(Megatron's per-rank capacity), so which tokens drop depends on the layout; compared dropless"]


def certify(cfg: RunConfig, *, num_devices: int, iters: int = 3, precision: str = "fp32",
            keep_size: bool = False, log=print) -> Certificate:
    """Run ``cfg``'s layout on ``num_devices`` devices and one device for ``iters`` iterations on
    the same batches and compare them. Raises the :mod:`mlir_train.runtime.errors` family."""
    if iters < 1:
        raise ConfigError(f"--check-iters {iters}: needs at least 1 iteration")
    tokenizer = load_tokenizer(cfg.data.tokenizer_path)
    cfg, notes = precision_config(cfg, precision)
    cfg, dropless = dropless_config(cfg)
    notes += dropless
    small = shrink(cfg, model_config(cfg, len(tokenizer)), num_devices, keep_size=keep_size)
    cfg = small.cfg
    layout = Side("layout", resolve(cfg, small.model, num_devices=num_devices, platform="cpu"))
    cfg = cfg.replace(training=dict(global_batch_size=layout.run.global_batch_size))  # both take the same rows
    ref_run = resolve(reference_config(cfg), small.model, num_devices=1, platform="cpu")
    # The router is the layout's: device-limited routing groups the experts by the layout's EP.
    ref_run = dataclasses.replace(ref_run, options=ref_run.options.replace(router=layout.run.options.router))
    reference = Side("one device", ref_run)
    batches, cut_notes = _batches(cfg, tokenizer, layout.run.global_batch_size, iters, small)
    dtype = cfg.training.compute_dtype
    c = Certificate(small, layout, reference, dtype, notes + cut_notes, TOLERANCES[dtype])
    steps, side = [], layout
    try:
        for side in (layout, reference):
            steps.append(_compile(side, batches[0], log))
        _train_in_step(c, steps, batches, log)
    except user_errors():
        raise
    except Exception as e:  # noqa: BLE001 - a program that cannot be built or run is a failed layout
        traceback.print_exc()
        name = side.name if len(steps) < 2 else "layout or the one device"
        c.failures.append(f"the {name}'s step raised {type(e).__name__}: {(str(e).splitlines() or [''])[0][:300]}")
        return c
    return _compare(c)


def _batches(cfg: RunConfig, tokenizer, global_batch_size: int, iters: int, small: Shrunk) -> tuple[list[dict], list]:
    """The check's batches: the user's data at the user's ``--seq-length``, rows cut to the shrunk
    length (:func:`~mlir_train.run.shrink.cut_rows`, said in the returned notes), token ids folded
    into a shrunk vocabulary."""
    built = cfg.replace(data={"seq_length": small.data_seq_length}) if small.data_seq_length else cfg
    data = build_datasets(DataConfig.from_flags(built.data, cfg.training.seed), tokenizer)
    loader = BatchLoader(data.train, global_batch_size, seed=cfg.training.seed)
    batches, notes = [next(loader) for _ in range(iters)], []
    if small.data_seq_length:
        width, kept, total = cfg.data.seq_length, 0, 0
        for i, b in enumerate(batches):
            batches[i], k, t = cut_rows(b, width)
            kept, total = kept + k, total + t
        notes.append(f"rows: built at --seq-length {small.data_seq_length} from your records, each cut to its "
                     f"{width}-token window with the most supervised tokens ({kept} of {total} supervised tokens "
                     "kept)")
    if small.fold_vocab:  # the shrunk vocabulary: the same rows, token ids folded into it
        batches = [dict(b, input_ids=b["input_ids"] % small.fold_vocab, labels=b["labels"] % small.fold_vocab)
                   for b in batches]
    return batches, notes


def _compile(side: Side, rows: dict, log) -> tuple:
    """Trace, read and compile ``side``'s train step: ``(trainer, compiled step, initial state)``."""
    start = time.perf_counter()
    trainer = side.run.trainer()
    state = trainer.init_state(side.run.config.training.seed)
    side.init = {"params": jax.device_get(state["params"])}
    traced, lowered = trainer.trace_train_step(state, trainer.global_batch(rows))
    compiled = lowered.compile(COMPILER_OPTIONS)
    side.paths = CodePaths.of(traced.jaxpr, compiled.as_text())
    log(f"{side.name}: traced and compiled in {time.perf_counter() - start:.1f}s")
    return trainer, compiled, state


def _train_in_step(c: Certificate, steps: list[tuple], batches: list[dict], log) -> None:
    """Both steps on every batch, each iteration from the same state: the one device's after the
    iteration before (the initial weights, checked identical, for the first), placed in the
    layout's shardings. So each iteration compares one step of the two programs, and float32's
    reordered-sum noise of one step cannot grow over the next ones into a different top-k choice
    of the router (a token whose k-th and (k+1)-th expert scores differ by less than the noise)
    and, through Adam's normalised update, into differences of any size. Each iteration's update
    (its end state minus the start) and optimizer state are compared; the worst is kept."""
    start_time, start = time.perf_counter(), None
    for i, rows in enumerate(batches):
        ends = []
        for side, (trainer, compiled, state) in zip((c.layout, c.reference), steps):
            if start is not None:
                state = jax.device_put(start, jax.tree.map(lambda a: a.sharding, state))
            with jax.set_mesh(trainer.mesh):
                state, metrics = compiled(state, trainer.global_batch(rows))
            side.metrics.append({k: float(v) for k, v in jax.device_get(metrics).items() if np.ndim(v) == 0})
            ends.append(jax.device_get(state))
            steps[len(ends) - 1] = (trainer, compiled, state)
        before = c.layout.init if start is None else {"params": start["params"]}
        _compare_iteration(c, i + 1, before, *ends)
        start = ends[1]
    log(f"both: {len(batches)} iteration(s) in {time.perf_counter() - start_time:.1f}s, each from the same state")


def _leaves(tree) -> list[tuple[str, np.ndarray]]:
    return [(jax.tree_util.keystr(p, simple=True, separator="/"), np.asarray(x, np.float64))
            for p, x in jax.tree_util.tree_flatten_with_path(tree)[0] if np.ndim(x) > 0]


def relative_difference(a: float, b: float) -> float:
    """|a - b| / |b|."""
    return abs(a - b) / max(abs(b), 1e-30)


def worst_difference(got: Any, want: Any) -> tuple[float, str]:
    """The largest ``|got - want| / |want|`` (L2 over each tensor; 0 where both are 0) and its path."""
    worst = (0.0, "")
    for (path, a), (_, b) in zip(_leaves(got), _leaves(want)):
        diff = _relative_l2(a, b)
        if not diff <= worst[0]:
            worst = (diff, path)
    return worst


def adam_directions(state: dict, training) -> dict[str, np.ndarray]:
    """Adam's normalised direction ``m_hat / (sqrt(v_hat) + eps)`` of each trained tensor, from
    ``state``'s own moments (path -> array, the parameters' paths); ``{}`` without Adam."""
    found = [s for s in jax.tree.leaves(state["opt_state"], is_leaf=lambda x: isinstance(x, optax.ScaleByAdamState))
             if isinstance(s, optax.ScaleByAdamState)]
    if training is None or training.optimizer != "adam" or len(found) != 1:
        return {}
    t = float(np.asarray(found[0].count))
    nu = dict(_leaves(found[0].nu))
    return {path: (m / (1 - training.adam_beta1 ** t))
            / (np.sqrt(nu[path] / (1 - training.adam_beta2 ** t)) + training.adam_eps)
            for path, m in _leaves(found[0].mu)}


def _relative_l2(a: np.ndarray, b: np.ndarray) -> float:
    norm = float(np.linalg.norm(b))
    return float(np.linalg.norm(a - b)) / norm if norm else (0.0 if not np.any(a) else np.inf)


def _compare_iteration(c: Certificate, i: int, before: dict, lay_end: dict, ref_end: dict) -> None:
    """Iteration ``i``'s update (end minus ``before``, the state both started from) and optimizer
    state, layout against one device; the worst of each over the iterations is kept.

    Adam's update is ``-lr (d + wd p)`` with ``d = m_hat / (sqrt(v_hat) + eps)``: an element whose
    gradient is within float32's reordering noise of zero has a ``d`` of any size in [-1, 1], so a
    small tensor (the DeltaNet's per-head ``a_log``) can differ by percents in its update while its
    moments agree to 1e-6. Such a difference is *explained* (kept apart, reported, not failed) when
    ``d`` computed from each run's own moments differs as much (at least half as much, relative):
    ``p`` is the same before, so the updates differ by ``lr`` times the directions' difference. The
    moments are still compared (:attr:`Tolerance.moments`), and an update the optimizer applied
    wrongly differs without its directions differing."""
    step = lambda end: jax.tree.map(lambda a, a0: a - a0, end["params"], before["params"])
    ref_step = step(ref_end)
    c.moved = c.moved or any(np.any(x) for _, x in _leaves(ref_step))
    training = c.shrunk.cfg.training if c.shrunk is not None else None
    dirs = None  # computed once, only when an update differs beyond the tolerance
    for (path, a), (_, b) in zip(_leaves(step(lay_end)), _leaves(ref_step)):
        diff = _relative_l2(a, b)
        if diff > c.tolerance.params and dirs is None:
            dirs = [adam_directions(end, training) for end in (lay_end, ref_end)]
        if diff > c.tolerance.params and path in dirs[1]:
            moved = _relative_l2(dirs[0][path], dirs[1][path])
            if diff <= c.tolerance.params + 2 * moved:
                if diff > c.explained[0]:
                    c.explained = (diff, moved, f"{path}, iteration {i}")
                continue
        if not diff <= c.worst[0]:
            c.worst = (diff, f"{path}, iteration {i}")
    diff, path = worst_difference(lay_end["opt_state"], ref_end["opt_state"])
    if not diff <= c.worst_moments[0]:
        c.worst_moments = (diff, f"{path}, iteration {i}")
    c.compared = i


def _compare(c: Certificate) -> Certificate:
    tol, lay, ref = c.tolerance, c.layout, c.reference
    for (path, a), (_, b) in zip(_leaves(lay.init["params"]), _leaves(ref.init["params"])):
        if not np.array_equal(a, b):
            c.initial = f"{path} (max |difference| {np.max(np.abs(a - b)):.1e})"
            c.failures.append(f"the initial weights differ at {c.initial}")
            break
    for i, (m, r) in enumerate(zip(lay.metrics, ref.metrics), start=1):
        if m.get("loss tokens") != r.get("loss tokens"):
            c.failures.append(f"iteration {i}: {m.get('loss tokens')} loss tokens against {r.get('loss tokens')}")
        for key, limit in (("lm loss", tol.loss), ("grad-norm", tol.grad_norm)):
            diff = relative_difference(m.get(key, np.nan), r.get(key, np.nan))
            if not diff <= limit:  # NaN fails too
                c.failures.append(f"iteration {i}: {key} differs by {diff:.1e} (tolerance {limit:.0e})")
    if not c.moved:
        raise ConfigError(f"check: no parameter moved in {len(ref.metrics)} iteration(s) (a learning rate of 0 "
                          "then, e.g. warm-up from --lr-warmup-init 0): raise --check-iters")
    for (diff, path), limit, what in ((c.worst, tol.params, "the update of"),
                                      (c.worst_moments, tol.moments, "the optimizer state (gradient moments)")):
        if not diff <= limit:
            c.failures.append(f"{what} {path} differs by {diff:.1e} (tolerance {limit:.0e})")
    return c


# ----- the report ------------------------------------------------------------------------------------
def describe_layout(run: Run) -> str:
    """``TP2 PP2 (1f1b x2 chunks) EP2 ETP2 CP1 SP ZeRO-1 LoRA``: the layout and features of a run."""
    p, s = run.parallel, run.schedule
    parts = [f"TP{p.tensor}", f"PP{p.pipeline}"]
    if s is not None:
        parts[-1] += f" ({s.kind}" + (f", {s.virtual} chunks a stage" if s.virtual > 1 else "") + \
            (f", stages of {'/'.join(map(str, s.stage_layers))} layers" if s.stage_layers else "") + ")"
    parts += [f"EP{p.expert}", f"ETP{p.etp}", f"CP{p.context}", f"DP{p.data_parallel}"]
    parts += [name for name, on in (("SP", p.sequence_parallel), ("FSDP", p.fsdp),
                                    ("ZeRO-1", p.distributed_optimizer and not p.fsdp),
                                    (f"LoRA r{run.options.lora.dim}" if run.options.lora else "", run.options.lora))
              if on]
    return " ".join(parts)


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(str(r[i])) for r in [header] + rows) for i in range(len(header))]
    line = lambda r: "  ".join(str(x).ljust(w) for x, w in zip(r, widths)).rstrip()
    return [line(header)] + [line(r) for r in rows]


def report(c: Certificate) -> list[str]:
    """The certificate as the lines ``python -m mlir_train.check`` prints; the last is ``PASS ...``
    or ``FAIL ...``."""
    lay, ref, tol, model = c.layout, c.reference, c.tolerance, c.shrunk.model
    layout = describe_layout(lay.run)
    code_paths = code_paths_of(lay.run.config)
    out = [f"layout: {layout} on {lay.run.parallel.device_count()} CPU devices, against one CPU device; "
           f"{len(lay.metrics)} iteration(s) on the same batches, each from the same state; --code-paths {code_paths}"]
    if c.shrunk.model_changes:
        out.append(f"model: {c.shrunk.model_why}: " + ", ".join(c.shrunk.model_changes))
    out.append(f"model: {model.name}, {model.num_layers} layers, hidden {model.hidden_size}, heads "
               f"{model.num_heads}/{model.num_kv_heads} x {model.head_dim}"
               + (f", {model.num_experts} experts top-{model.top_k} of width {model.moe_intermediate_size}"
                  if model.is_moe else f", FFN {model.intermediate_size}")
               + f", vocab {model.vocab_size} ({model.num_params() / 1e6:.2f}M params)")
    batch = f"batch: {lay.run.global_batch_size} rows of {lay.run.seq_length} tokens, {lay.run.num_micro_batches} " \
            f"micro-batch(es) of {lay.run.micro_batch_size} x DP{lay.run.parallel.data_parallel}"
    out.append(batch + (f" (shrunk: {', '.join(c.shrunk.batch_changes)})" if c.shrunk.batch_changes else ""))
    if c.shrunk.fold_vocab:
        out.append(f"batches: token ids folded modulo {c.shrunk.fold_vocab} (the shrunk vocabulary)")
    out.append(f"compute: {c.dtype}; tolerances: lm loss {tol.loss:.0e}, grad norm {tol.grad_norm:.0e} relative, "
               f"parameter updates {tol.params:.0e} ({tol.why})")
    out += [f"note: {n}" for n in c.notes]
    out += ["", "code paths, read from each traced step (ops in the program; collectives also from the compiled HLO, "
                "executions per step):"]
    cells = [dict(side.paths.rows()) if side.paths else {} for side in (lay, ref)]
    for what in PATH_ROWS:
        a, b = (cell.get(what, "not read: the step failed") for cell in cells)
        out += [f"  {what:<15} layout:     {a}", f"  {'':<15} one device: {b}"]
    out += ["", *_iteration_table(c), ""]
    if c.compared:
        out.append("initial weights: identical" if not c.initial else f"initial weights: DIFFER at {c.initial}")
        out.append(f"each iteration from the same state (the one device's): parameters' largest relative update "
                   f"difference {c.worst[0]:.1e} ({c.worst[1]}); optimizer state's (gradient moments) "
                   f"{c.worst_moments[0]:.1e} ({c.worst_moments[1]})")
        if c.explained[2]:
            out.append(f"explained, not failed: the update of {c.explained[2]} differs by {c.explained[0]:.1e}, as "
                       f"Adam's direction m/(sqrt(v)+eps) from each run's own moments does ({c.explained[1]:.1e}): "
                       f"gradients within float32 noise of zero, amplified by Adam's normalisation")
    if c.passed:
        out.append(f"PASS {layout}: trains as one device over {len(lay.metrics)} iteration(s) ({c.dtype}; largest "
                   f"relative difference {_worst(c):.1e})")
    else:
        out.append(f"FAIL {layout}: " + "; ".join(c.failures))
    return out


def _worst(c: Certificate) -> float:
    diffs = [c.worst[0], c.worst_moments[0]]
    for m, r in zip(c.layout.metrics, c.reference.metrics):
        diffs += [relative_difference(m["lm loss"], r["lm loss"]), relative_difference(m["grad-norm"], r["grad-norm"])]
    return max(diffs)


def _iteration_table(c: Certificate) -> list[str]:
    lay, ref = c.layout, c.reference
    overflow = lay.run.parallel.expert > 1 and any("ep_overflow_rows" in m for m in lay.metrics)
    header = ["iteration", "lm loss layout", "one device", "rel diff", "grad norm layout", "one device", "rel diff"]
    header += ["ep overflow rows"] if overflow else []
    rows = []
    for i, (m, r) in enumerate(zip(lay.metrics, ref.metrics), start=1):
        row = [str(i), f"{m['lm loss']:.6f}", f"{r['lm loss']:.6f}", f"{relative_difference(m['lm loss'], r['lm loss']):.1e}",
               f"{m['grad-norm']:.6f}", f"{r['grad-norm']:.6f}", f"{relative_difference(m['grad-norm'], r['grad-norm']):.1e}"]
        rows.append(row + ([f"{m.get('ep_overflow_rows', 0):.0f}"] if overflow else []))
    return _table(header, rows)
