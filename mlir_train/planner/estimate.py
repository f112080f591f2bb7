"""The planner's analytic activation estimate (what :mod:`mlir_train.planner.plan`'s docstring
describes): per decoder layer the tensors the backward needs, for the candidate's recompute
policy, plus one layer's working set and the float32 logits."""

from __future__ import annotations

import dataclasses

from mlir_train.planner.candidates import Candidate


@dataclasses.dataclass(frozen=True)
class _LayerBytes:
    """One micro-batch's activation bytes of one decoder layer, by part, on one device."""
    residual: int
    attn_core: int      # the attention output and its float32 log-sum-exp
    attn: int           # q/k/v/o and attn_core
    attn_matrices: int  # the float32 [T, S] scores / probabilities and their gradients (working set)
    moe: int            # router and ragged expert buffers (0 for a dense model)
    expert_act: int     # the expert activation's output (selective moe_act)
    dense: int          # a dense MLP's
    input_rows: int     # a layer input's bytes before the sequence-parallel split
    sp: int             # the sequence-parallel split (TP with --sequence-parallel, else 1)

    @property
    def layer_input(self) -> int:
        return self.input_rows // self.sp


def _layer_bytes(cfg, c: Candidate, *, micro_batch: int, seq: int, dtype_bytes: int) -> _LayerBytes:
    from sharding.mesh import kv_heads_replicated

    lay = c.layout
    a, b, d, tp = dtype_bytes, micro_batch, cfg.hidden_size, lay.tensor
    # Under context parallelism a rank holds T / CP tokens of each row, and its queries' scores
    # against all T keys (the gathered K/V, counted with the working set).
    t, keys = seq // lay.context, seq
    sp = tp if lay.sequence_parallel else 1
    heads = cfg.num_heads // tp
    kv = cfg.num_kv_heads if kv_heads_replicated(tp, cfg.num_kv_heads) else max(1, cfg.num_kv_heads // tp)
    hd = cfg.head_dim
    rows = b * t
    # The attention's custom gradient keeps q, k, v, its output and a float32 log-sum-exp per
    # row; the [T, T] matrices (float32 scores/probabilities, their gradients) exist only
    # while one layer runs, so they count in the working set, not per layer.
    attn_core = a * rows * heads * hd + 4 * b * heads * t  # output + log-sum-exp
    attn = a * rows * (d + (heads + 2 * kv) * hd + (heads + kv) * hd) + attn_core
    if lay.context > 1:  # blocked_attention: one key block of scores, and the gathered K/V
        from mlir_train.model.attention import KEY_BLOCK

        attn_matrices = 3 * 4 * b * heads * t * min(keys, KEY_BLOCK) + 2 * a * b * keys * kv * hd
    else:
        attn_matrices = 3 * 4 * b * heads * t * keys
    moe = expert_act = 0
    if cfg.is_moe:
        s, k = rows // sp, cfg.top_k
        etp = lay.etp
        if etp < tp:  # folding: the tensor ranks that are expert ranks hold their own tokens
            s = rows // (tp // etp)
        local = cfg.num_experts // lay.expert
        # ETP > TP: the expert-tensor ranks that are data ranks gather each other's rows
        m = lay.expert * s * min(k, local) * max(1, etp // tp)
        f = cfg.moe_intermediate_size // etp
        router = a * rows * d + 2 * 4 * s * cfg.num_experts
        experts = 2 * a * s * k * d + (a * m * d if lay.expert > 1 else 0) + 3 * a * m * f + a * m * d
        moe, expert_act = router + experts, a * m * f
    return _LayerBytes(residual=2 * a * rows * d // sp, attn_core=attn_core, attn=attn, attn_matrices=attn_matrices,
                       moe=moe, expert_act=expert_act, dense=a * rows * (d + 3 * cfg.intermediate_size // tp),
                       input_rows=a * rows * d, sp=sp)


def _saved_and_working(policy, kinds: list[bool], per_layer: list[int], x: _LayerBytes) -> tuple[int, int]:
    """(bytes the stage's layers keep for the backward, one layer's working set) under ``policy``."""
    if policy.granularity == "selective":
        # The submodules' kept tensors go: the attention core's output and log-sum-exp, the norms'
        # outputs (2 per layer), the expert activation's output, a dense MLP's or MoE layer's
        # activations but its input.
        saved = 0
        for is_moe, act in zip(kinds, per_layer):
            drop = (x.attn_core if policy.recomputes("core_attn") else 0) + (
                2 * x.layer_input if policy.recomputes("layernorm") else 0)
            if is_moe:
                drop += (x.moe - x.layer_input if policy.recomputes("moe") else
                         x.expert_act if policy.recomputes("moe_act") else 0)
            elif policy.recomputes("mlp"):
                drop += x.dense - x.layer_input
            saved += act - drop
        # one layer's backward, plus a recomputed MoE layer / MLP's forward
        working = max(per_layer) + x.attn_matrices + max(
            (x.moe if policy.recomputes("moe") and is_moe else x.dense if policy.recomputes("mlp") and not is_moe else 0)
            for is_moe in kinds[:len(per_layer)])
    elif policy.granularity == "full":
        # The recomputed layers keep their input (uniform: one per group of N), block's others all
        # of their activations; a group of N is recomputed at once.
        group = policy.num_layers if policy.method == "uniform" else 1
        recomputed = len(per_layer) if policy.method != "block" else min(policy.num_layers, len(per_layer))
        saved = -(-recomputed // group) * x.layer_input + sum(per_layer[recomputed:])
        working = (group + 1) * max(per_layer) + x.attn_matrices
    else:
        saved = sum(per_layer)
        working = max(per_layer) + x.attn_matrices
    return saved, working


def activation_bytes(cfg, candidate: Candidate, *, micro_batch: int, seq: int, dtype_bytes: int, num_micro: int = 1,
                     schedule=None) -> int:
    """Per-device activation memory of the forward/backward (see :mod:`mlir_train.planner.plan`):
    one micro-batch's, or under pipeline parallelism a stage's layers for every micro-batch in
    flight (GPipe / circular keep all of them until their backward), or under 1F1B
    (``schedule``, a :class:`mlir_train.train.pipeline.schedule.Schedule`) the saved activations
    of its ``2 R P - 1`` chunk items in flight (``Schedule.items_in_flight``)."""
    lay = candidate.layout
    x = _layer_bytes(cfg, candidate, micro_batch=micro_batch, seq=seq, dtype_bytes=dtype_bytes)
    kinds = cfg.moe_layers()
    per_layer = [x.residual + x.attn + (x.moe if is_moe else x.dense) for is_moe in kinds]
    chunks = schedule.virtual if schedule is not None else 1
    n = max(schedule.stage_layers) if schedule is not None and schedule.stage_layers else len(per_layer) // (lay.pipeline * chunks)
    per_layer = per_layer[:max(1, n)]  # the (largest) stage's, or one chunk's, layers
    saved, working = _saved_and_working(candidate.recompute, kinds, per_layer, x)
    rows = micro_batch * (seq // lay.context)
    logits = 2 * 4 * rows * (cfg.vocab_size // lay.tensor)
    if lay.pipeline > 1 and schedule is not None and schedule.items_in_flight() is not None:
        return int(schedule.items_in_flight() * saved + working + logits)
    in_flight = num_micro * chunks if lay.pipeline > 1 else 1
    return int(in_flight * saved + working + logits)
