"""A run made small enough for a CPU, with the same layout and features: what
``python -m mlir_train.check`` compares when the user's model or batch is large.

A model above :data:`LARGE_PARAMS` parameters becomes a tiny one of the same family that the
same layout splits the same way: the same kinds of decoder layers in the same order (each run of
one kind keeps at least one layer), as many pipeline stages, virtual chunks (at most 2) and
uneven stages as the flags ask; attention heads and kv heads split over TP as before (kv heads
replicated where TP is a multiple of them); experts a multiple of EP (and of the router's groups,
enough for its group-limited top-k), the same top-k, the expert width a multiple of ETP; the
router, balancing and LoRA flags untouched; head dim kept (the kernels' tiles depend on it).
A vocabulary above :data:`VOCAB_LIMIT` shrinks too, and the batches' token ids are folded into
it (the check compares layouts, which the words do not change). The batch keeps its
micro-batch size and data-parallel split, with at most ``max(2, 2 x PP)`` micro-batches, and rows
of at most :data:`SEQ` tokens (still divisible as CP, TP and SP need): the data is built at the
user's ``--seq-length`` and each row cut to its window with the most supervised tokens
(:func:`cut_rows`), so no record the run keeps is lost to the shorter rows. Under ``--code-paths gpu``,
whose MoE kernels are interpreted call by call, smaller still: top-k at most :data:`GPU_TOP_K`, 1 layer
a stage for a model of one layer kind, rows of :data:`GPU_SEQ` tokens and PP micro-batches (1 without a
pipeline); and, shrunk or not, each rank's expert width a whole Mosaic-GPU weight-gradient tile
(:data:`~mlir_train.model.kernels.mosaic_moe.WEIGHT_GRAD_ROWS` rows, which the kernel needs). Every
change is listed.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from mlir_train.config.flags import RunConfig
from mlir_train.config.models import LayerKind, ModelConfig
from mlir_train.config.sections import padded_vocab_size
from mlir_train.model.kernels.mosaic_moe import WEIGHT_GRAD_ROWS
from mlir_train.runtime.errors import ConfigError
from mlir_train.train.build import layout_of

LARGE_PARAMS = 50_000_000   # above this a CPU step takes seconds per device: the model is shrunk
HIDDEN, DENSE_FFN, MOE_FFN = 128, 128, 64
VOCAB_LIMIT, VOCAB = 8192, 2048
SEQ = 128
# Under ``--code-paths gpu`` each MoE kernel call is interpreted, about 70 ms a used 64-row block on
# this CPU, once per device, micro-batch and round: rows of :data:`GPU_SEQ` tokens, at most
# :data:`GPU_TOP_K` experts a token and the fewest micro-batches the layout takes (PP of them with
# a pipeline, else 1) keep a check of the seed layout near a minute with every feature still run.
GPU_SEQ, GPU_TOP_K = 64, 2
WIDENED = (f"each rank's expert width rounded up to the Mosaic-GPU weight-gradient tile ({WEIGHT_GRAD_ROWS} rows) "
           "that --code-paths gpu interprets")


@dataclasses.dataclass(frozen=True)
class Shrunk:
    """The run the check compares: its flags and model, what changed (``"hidden 2048 -> 128"``) and
    why (``model_why``), and the vocabulary the batches' token ids are folded into (None: not folded)."""

    cfg: RunConfig
    model: ModelConfig
    model_changes: tuple[str, ...] = ()
    batch_changes: tuple[str, ...] = ()
    fold_vocab: int | None = None
    model_why: str = ""
    data_seq_length: int | None = None  # rows shortened: the user's --seq-length, at which the data is built


def cut_rows(batch: dict[str, np.ndarray], width: int) -> tuple[dict[str, np.ndarray], int, int]:
    """Each row of ``batch`` (built at the user's ``--seq-length``) cut to the ``width`` tokens
    holding the most supervised ones (the earliest such window), so that the check's short rows
    still train on the user's records, whatever their length. Positions and segments are kept as
    the row had them. Returns the batch and (supervised tokens kept, supervised tokens in all)."""
    supervised = batch["loss_mask"] > 0
    rows, length = supervised.shape
    if length <= width:
        return batch, int(supervised.sum()), int(supervised.sum())
    ends = np.concatenate([np.zeros((rows, 1), np.int64), np.cumsum(supervised, axis=1)], axis=1)
    start = (ends[:, width:] - ends[:, :length - width + 1]).argmax(axis=1)
    take = start[:, None] + np.arange(width)[None, :]
    cut = {k: np.take_along_axis(v, take, axis=1) if v.shape[:2] == (rows, length) else v for k, v in batch.items()}
    return cut, int((cut["loss_mask"] > 0).sum()), int(supervised.sum())


def shrink(cfg: RunConfig, model: ModelConfig, num_devices: int, *, keep_size: bool = False) -> Shrunk:
    """``cfg`` and ``model`` small enough for a CPU (``keep_size``: as they are). Under ``--code-paths
    gpu`` each rank's expert width is a whole Mosaic-GPU weight-gradient tile, shrunk or not (the
    kernel refuses a part of one)."""
    if keep_size:
        if _kernel_widths(cfg, model) != model:
            raise ConfigError(f"--check-full-size --code-paths gpu: {model.name}'s expert width "
                              f"{model.moe_intermediate_size} is not a whole {WEIGHT_GRAD_ROWS}-row Mosaic-GPU "
                              "weight-gradient tile on each expert-tensor rank, which the kernel needs; drop "
                              "--check-full-size (the check widens it) or use --moe-gemm-backend padded")
        return Shrunk(cfg, model)
    small, pattern_changes, fold = model, [], None
    why = WIDENED
    if model.num_params() > LARGE_PARAMS:
        cfg, small, pattern_changes = _shrink_model(cfg, model)
        if small.vocab_size < model.vocab_size:
            fold = small.vocab_size
        why = f"shrunk to a tiny {model.family} of the same layout and features"
    small = _kernel_widths(cfg, small)
    model_changes: list[str] = []
    for field in ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "intermediate_size", "num_experts",
                  "top_k", "moe_intermediate_size", "vocab_size"):
        _change(model_changes, field, getattr(model, field), getattr(small, field))
    seq = cfg.data.seq_length
    cfg, batch_changes = _shrink_batch(cfg, num_devices)
    return Shrunk(cfg, small, tuple(model_changes + pattern_changes), tuple(batch_changes), fold, why,
                  seq if seq != cfg.data.seq_length else None)


def _kernel_widths(cfg: RunConfig, model: ModelConfig) -> ModelConfig:
    """``model`` with each rank's expert FFN width a whole Mosaic-GPU weight-gradient tile
    (:data:`WEIGHT_GRAD_ROWS`) under ``--code-paths gpu``: the kernel's tiles, not the layout, need it."""
    if cfg.extras.code_paths != "gpu" or not model.is_moe:
        return model
    p = cfg.parallel
    etp = p.expert_tensor_parallel_size or p.tensor_model_parallel_size
    ffn = _round_up(model.moe_intermediate_size, etp * WEIGHT_GRAD_ROWS)
    return model if ffn == model.moe_intermediate_size else model.replace(moe_intermediate_size=ffn)


def _change(changes: list[str], what: str, before, after) -> None:
    if before != after:
        changes.append(f"{what} {before} -> {after}")


def _shrink_model(cfg: RunConfig, model: ModelConfig) -> tuple[RunConfig, ModelConfig, list[str]]:
    p = cfg.parallel
    tp = p.tensor_model_parallel_size
    changes: list[str] = []
    # Under --code-paths gpu a model of one layer kind keeps 1 layer a stage: each layer's MoE kernels
    # are interpreted once per device.
    before = model.layer_kinds()
    num_layers, parallel_changes = layer_plan(cfg, model.num_layers,
                                              per_stage=1 if cfg.extras.code_paths == "gpu" and len(set(before)) == 1
                                              else 2)
    kinds = shrunk_kinds(before, num_layers)
    if set(kinds) != set(before):
        raise ConfigError(f"check: {num_layers} layers cannot hold each of {model.name}'s {len(set(before))} layer "
                          "kinds; run it at its own size with --check-full-size")
    sizes = dict(hidden_size=min(model.hidden_size, HIDDEN),
                 intermediate_size=_round_up(min(model.intermediate_size, DENSE_FFN), tp) if model.intermediate_size
                 else 0)
    sizes.update(_heads(model.num_heads, model.num_kv_heads, tp))
    if model.vocab_size > VOCAB_LIMIT:
        sizes["vocab_size"] = padded_vocab_size(VOCAB, cfg.model.make_vocab_size_divisible_by, tp)
    if model.is_moe:
        etp = p.expert_tensor_parallel_size or tp
        if cfg.extras.code_paths == "gpu":
            sizes["top_k"] = min(model.top_k, GPU_TOP_K)
        sizes["num_experts"] = _experts(cfg, model, sizes.get("top_k", model.top_k))
        sizes["moe_intermediate_size"] = _round_up(min(model.moe_intermediate_size, MOE_FFN), etp)
    small = model.replace(name=f"{model.name} (shrunk)", **sizes).with_layer_kinds(kinds)
    if small.layer_kinds() != kinds:
        raise ConfigError(f"check: cannot shrink {model.name} (its layer kinds do not follow from their pattern); "
                          "run it at its own size with --check-full-size")
    changes += _pattern_changes(before, kinds)
    changes += [f"{flag} {before} -> {after}" for flag, before, after in parallel_changes]
    fields = {flag.lstrip("-").replace("-", "_"): after for flag, _, after in parallel_changes}
    training = {k: fields.pop(k) for k in list(fields) if k == "recompute_num_layers"}
    return cfg.replace(parallel=fields, training=training), small, changes


def _pattern_changes(before: tuple[LayerKind, ...], after: tuple[LayerKind, ...]) -> list[str]:
    """The MoE pattern (``M`` / ``D``) and the token mixers' (their initials) where the model mixes them."""
    changes = []
    if len({k.moe for k in before}) > 1:
        changes.append("MoE layers " + "".join("M" if k.moe else "D" for k in before) + " -> "
                       + "".join("M" if k.moe else "D" for k in after))
    if len({k.mixer for k in before}) > 1:
        names = ", ".join(f"{m[0].upper()} {m}" for m in sorted({k.mixer for k in before}))
        changes.append(f"mixers ({names}) " + "".join(k.mixer[0].upper() for k in before) + " -> "
                       + "".join(k.mixer[0].upper() for k in after))
    return changes


def _round_up(n: int, multiple: int) -> int:
    return max(multiple, -(-n // multiple) * multiple)


def _heads(heads: int, kv: int, tp: int) -> dict[str, int]:
    """Query and kv heads that ``tp`` splits as it split the model's: kv heads split (1 per rank,
    or 2 without TP) or replicated as before, a query group of at most 2 per kv head."""
    kv_small = (tp if tp > 1 else min(kv, 2)) if kv % tp == 0 else kv
    group = min(heads // kv, 2)
    while (kv_small * group) % tp:
        group += 1
    return {"num_heads": kv_small * group, "num_kv_heads": kv_small}


def _experts(cfg: RunConfig, model: ModelConfig, top_k: int) -> int:
    """The fewest experts (at least 2 x ``top_k`` and 4) that EP and the router's groups divide, with
    enough experts in the allowed groups for the top-k."""
    m, p = cfg.moe, cfg.parallel
    ep = p.expert_model_parallel_size
    groups = m.moe_router_num_groups or (ep if m.moe_router_topk_limited_devices else 1)
    group_topk = m.moe_router_group_topk or m.moe_router_topk_limited_devices or groups
    step = math.lcm(ep, groups)
    e = _round_up(max(2 * top_k, 4), step)
    while group_topk * (e // groups) < top_k:
        e += step
    return min(e, model.num_experts)  # the model's own count already fits the layout


def layer_plan(cfg: RunConfig, num_layers: int, per_stage: int = 2) -> tuple[int, list[tuple[str, object, object]]]:
    """The shrunk layer count for the pipeline flags, and the pipeline / recompute flags changed
    with it (``(flag, before, after)``): ``per_stage`` layers a stage (1 a chunk with virtual stages, at most 2
    chunks a stage), uneven first / last stages of 1 layer (the last of 2 if both are given at PP 2)."""
    p = cfg.parallel
    pp = p.pipeline_model_parallel_size
    per_virtual = p.layers_per_virtual_stage(num_layers)
    first, last = p.decoder_first_pipeline_num_layers, p.decoder_last_pipeline_num_layers
    changes: list[tuple[str, object, object]] = []
    if first is not None or last is not None:
        new_first = 1 if first is not None else None
        new_last = None if last is None else (2 if first is not None and pp == 2 else 1)
        middle = pp - (first is not None) - (last is not None)
        layers = (new_first or 0) + (new_last or 0) + 2 * middle
        changes += [("--decoder-first-pipeline-num-layers", first, new_first),
                    ("--decoder-last-pipeline-num-layers", last, new_last)]
    elif per_virtual and num_layers // (pp * per_virtual) > 1:
        chunks = min(num_layers // (pp * per_virtual), 2)
        layers = pp * chunks
        changes += [("--num-layers-per-virtual-pipeline-stage", per_virtual, 1),
                    ("--num-virtual-stages-per-pipeline-rank", p.num_virtual_stages_per_pipeline_rank, None)]
    else:
        layers = per_stage * pp
    recompute = cfg.training.recompute_num_layers
    if recompute is not None:
        changes.append(("--recompute-num-layers", recompute, 1))
    return min(layers, num_layers), [c for c in changes if c[1] != c[2]]


def shrunk_kinds(kinds: tuple, layers: int) -> tuple:
    """``kinds`` (one per layer) in ``layers`` layers: each run of one kind keeps at least one layer
    and the rest go to the runs by length; a pattern of more runs than layers (e.g. every other
    layer MoE, or 3 DeltaNet layers to 1 attention) keeps its first layers, and as its last ones
    each kind they lack (in the order the pattern first has them)."""
    runs: list[list] = []
    for kind in kinds:
        if runs and runs[-1][0] == kind:
            runs[-1][1] += 1
        else:
            runs.append([kind, 1])
    if len(runs) > layers:
        first = layers
        while first and first + len(set(kinds) - set(kinds[:first])) > layers:
            first -= 1
        return tuple(kinds[:first]) + tuple(k for k in dict.fromkeys(kinds) if k not in kinds[:first])[:layers - first]
    share = [1] * len(runs)
    for _ in range(layers - len(runs)):  # the next layer to the run furthest below its share
        i = max(range(len(runs)), key=lambda j: runs[j][1] / len(kinds) - share[j] / layers)
        share[i] += 1
    return tuple(kind for (kind, _), n in zip(runs, share) for _ in range(n))


def _shrink_batch(cfg: RunConfig, num_devices: int) -> tuple[RunConfig, list[str]]:
    """Rows of at most :data:`SEQ` tokens and at most ``max(2, 2 x PP)`` micro-batches (under
    ``--code-paths gpu``: :data:`GPU_SEQ` tokens and PP micro-batches, 1 without a pipeline)."""
    t, p, changes = cfg.training, cfg.parallel, []
    gpu = cfg.extras.code_paths == "gpu"
    layout = layout_of(p, num_devices)
    dp = layout.data_parallel
    mbs = t.micro_batch_size or 1
    gbs = t.global_batch_size or mbs * dp
    micro = gbs // (mbs * dp) if gbs % (mbs * dp) == 0 else None  # the layout check names a bad split
    most = layout.pipeline if gpu else max(2, 2 * layout.pipeline)
    training, data = {}, {}
    if micro is not None and micro > most:
        training["global_batch_size"] = most * mbs * dp
        changes.append(f"global batch {gbs} -> {most * mbs * dp} rows ({most} micro-batches of {mbs} x DP{dp})")
    seq = cfg.data.seq_length
    sp = p.sequence_parallel and p.tensor_model_parallel_size > 1
    multiple = math.lcm(2 * p.context_parallel_size, p.tensor_model_parallel_size * p.context_parallel_size
                        if sp else 1, 16)
    longest = GPU_SEQ if gpu else SEQ
    if seq is not None and seq > longest:
        data["seq_length"] = _round_up(longest, multiple)
        changes.append(f"--seq-length {seq} -> {data['seq_length']}")
    return cfg.replace(training=training, data=data), changes
