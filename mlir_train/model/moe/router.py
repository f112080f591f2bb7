"""MoE routing as Megatron-Core's ``TopKRouter`` does it (``transformer/moe/router.py`` and
``moe_utils.py`` of megatron-core 0.16.1), in float32 (or float64, ``--moe-router-dtype fp64``), plus the statistics the trainer forms
the load-balancing losses from (:mod:`mlir_train.model.losses`).

Shape suffixes: S flat tokens (batch*seq), B rows, T sequence, E experts, K top-k slots,
G expert groups.

Score functions (``--moe-router-score-function``):

* ``softmax`` with renormalised top-k (Qwen3's ``norm_topk_prob=True``, Megatron's default,
  which takes the top-k of the logits and a softmax over the k chosen): softmax over all
  experts, top-k, divide by the k weights' sum. The same numbers as Megatron's up to float32
  rounding (softmax is monotonic, and the softmax of the k chosen logits is the renormalised
  top-k of the full softmax). With expert groups Megatron's group scores are sums of *logits*,
  so that path takes the top-k of the logits as Megatron does.
* ``softmax`` without renormalising (Qwen3's ``norm_topk_prob=False``, Megatron's
  ``--moe-router-pre-softmax``): softmax, then the top-k weights as they are.
* ``sigmoid`` (DeepSeek-V3): sigmoid scores; top-k of ``scores + expert_bias`` when the
  aux-loss-free bias is on (the bias picks the experts, it never weighs them); the k scores
  divided by their sum (plus 1e-20) when k > 1.

Then ``--moe-router-topk-scaling-factor`` multiplies the weights (Megatron applies it whatever
the score function). Group-limited routing (``--moe-router-num-groups`` G,
``--moe-router-group-topk``): experts fall into G equal groups, each group scores the sum of
its top ``k / group_topk`` scores, each token keeps its ``group_topk`` best groups and picks
its k experts among them (Megatron's ``group_limited_topk``; device-limited routing with G = EP).

Load-balancing statistics, all over non-padding tokens only (segment id 0 is padding: it is
counted nowhere, Megatron's ``padding_mask``), and each formed per *balancing group*: the rows
one data-parallel rank holds in a micro-batch (``RouterConfig.balancing_rows``, i.e.
``--micro-batch-size``), because Megatron forms its load-balancing losses on each data-parallel
rank from that rank's tokens. The grouping is by rows, never by mesh axis, so every layout (and
one device) forms the same groups. As Megatron's ``compute_routing_scores_for_aux_loss``, the
aux losses see the *unbiased, ungrouped* top-k of the normalised scores (softmax, or sigmoid
divided by its sum), which is the routing itself in Qwen3's default configuration;
``tokens_per_expert`` is what the tokens were actually routed to (the load that is logged and
that drives the expert bias):

* ``tokens_per_expert [E]``: routed assignments per expert, over all groups;
* ``aux_tokens_per_expert [G, E]``, ``probs_per_expert [G, E]``: the aux losses' assignments
  and summed scores per expert, per group;
* ``num_tokens [G]``, ``z_loss_sum [G]``: token count and ``sum logsumexp(logits)^2``;
* with ``per_sequence_stats`` (``seq_aux_loss``): ``seq_aux_sum [G]``, the sum over the packed
  documents of each document's own switch loss (its counts, scores and token count), and
  ``num_sequences [G]``, how many documents there were. A document is a run of one segment id in
  a row, so several packed documents in a row are several sequences, as when Megatron is fed
  them unpacked.

Sinkhorn balancing (``--moe-router-load-balancing-type sinkhorn``, S-BASE), as Megatron's
``sinkhorn_load_balancing``: in training the experts are the top-k of the Sinkhorn-balanced
``exp(logits)`` (no gradient through the balancing), weighted by the plain scores of the chosen
experts (sigmoid for k = 1, softmax over all experts otherwise; not renormalised, not scaled);
in evaluation (``RouterConfig.training=False``) the top-k of those scores. The balancing runs
over each balancing group's tokens, padding included, as Megatron balances the tokens one
data-parallel rank's router holds. (Under sequence or context parallelism Megatron's router on
a rank holds only a chunk of each sequence and balances that chunk; we balance the rank's whole
micro-batch, which keeps the result independent of the layout.)

``--moe-router-dtype fp64`` (:func:`route_in`): the gating matmul, scores, top-k, Sinkhorn and
the statistics' sums run in float64 inside a ``jax.enable_x64`` region of the otherwise 32-bit
program (CPU and GPU; TPUs have no float64); the weights and statistics leave it as float32,
where the losses are formed.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from mlir_train.config.policies import SCORE_FUNCTIONS, RouterConfig, RouterConfigError
from mlir_train.model.recompute import checkpointed
from sharding import constrain, logical_shard_map, mesh_axes_of

ROUTER_DTYPES = {"fp32": jnp.float32, "fp64": jnp.float64}  # --moe-router-dtype names: config.policies.ROUTER_DTYPES


def router_logits(x_SD: jax.Array, w_DE: jax.Array, dtype=jnp.float32) -> jax.Array:
    """The gating linear in float32 (``--moe-router-dtype fp32``; HF also takes it in fp32),
    or float64 inside :func:`route_in`'s x64 region. A weight ``[R, D, E]`` is the trainer's
    broadcast over the ``R`` token ranks (``mlir_train.train.reduction.token_partial``): each
    rank's tokens (``x_SD``'s rows split ``[R, S/R]``, as ``"act_tokens"`` splits them) meet their
    own row, so the weight's gradient stays per rank, summed once per step by the trainer."""
    # A checkpoint: the backward recomputes the upcast from the tokens it keeps (already kept by
    # the experts) instead of keeping a float32 copy of them (the seed: 8 MiB per layer and
    # micro-batch on a device). The same values.
    return checkpointed(functools.partial(_logits, dtype=dtype), True)(x_SD, w_DE)


def _logits(x_SD: jax.Array, w_DE: jax.Array, dtype) -> jax.Array:
    hi = jax.lax.Precision.HIGHEST
    if w_DE.ndim == 2:
        return jnp.einsum("sd,de->se", x_SD.astype(dtype), w_DE.astype(dtype), precision=hi)
    (s, d), r = x_SD.shape, w_DE.shape[0]
    x_RSD = constrain(x_SD.reshape(r, s // r, d), ("token_ranks", None, "act_embed"))
    w_RDE = constrain(w_DE, ("token_ranks", None, None))
    logits = jnp.einsum("rsd,rde->rse", x_RSD.astype(dtype), w_RDE.astype(dtype), precision=hi)
    return logits.reshape(s, -1)


def route_in(cfg: "RouterConfig", x_SD: jax.Array, w_DE: jax.Array, valid_S: jax.Array, *, top_k: int,
             norm_topk_prob: bool, expert_bias_E: jax.Array | None = None, segment_ids_BT: jax.Array | None = None,
             balancing_groups: int = 1):
    """Gating linear + :func:`route` in ``cfg.dtype``; returns float32 weights and statistics."""
    extras = {k: v for k, v in (("expert_bias_E", expert_bias_E), ("segment_ids_BT", segment_ids_BT)) if v is not None}
    if cfg.dtype == "fp32":
        return route(router_logits(x_SD, w_DE), valid_S, cfg=cfg, top_k=top_k, norm_topk_prob=norm_topk_prob,
                     balancing_groups=balancing_groups, **extras)
    return _route_x64((cfg, top_k, norm_topk_prob, balancing_groups), x_SD, w_DE, valid_S, extras)


def _x64_forward(static, x_SD, w_DE, valid_S, extras):
    cfg, top_k, norm_topk_prob, balancing_groups = static
    with jax.enable_x64(True):
        weights_SK, experts_SK, stats = route(router_logits(x_SD, w_DE, ROUTER_DTYPES[cfg.dtype]), valid_S, cfg=cfg,
                                              top_k=top_k, norm_topk_prob=norm_topk_prob,
                                              balancing_groups=balancing_groups, **extras)
        return (weights_SK.astype(jnp.float32), experts_SK.astype(jnp.int32),
                {k: v.astype(jnp.float32) for k, v in stats.items()})


# The x64 region must hold the backward too: left to autodiff, the transpose of the float64 ops
# is traced after the region has closed, where its constants come out 32-bit.
@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _route_x64(static, x_SD, w_DE, valid_S, extras):
    return _x64_forward(static, x_SD, w_DE, valid_S, extras)


def _route_x64_fwd(static, x_SD, w_DE, valid_S, extras):
    return _x64_forward(static, x_SD, w_DE, valid_S, extras), (x_SD, w_DE, valid_S, extras)


def _route_x64_bwd(static, res, cotangents):
    x_SD, w_DE, valid_S, extras = res
    ct_weights, _, ct_stats = cotangents
    with jax.enable_x64(True):
        def differentiable(x, w):
            weights_SK, _, stats = _x64_forward(static, x, w, valid_S, extras)
            return weights_SK, stats

        _, vjp = jax.vjp(differentiable, x_SD, w_DE)
        dx, dw = vjp((ct_weights, ct_stats))
    return dx, dw, None, None


_route_x64.defvjp(_route_x64_fwd, _route_x64_bwd)


def route(logits_SE: jax.Array, valid_S: jax.Array, *, top_k: int, norm_topk_prob: bool, cfg: RouterConfig,
          expert_bias_E: jax.Array | None = None, segment_ids_BT: jax.Array | None = None, balancing_groups: int = 1):
    """``(weights [S, K], experts [S, K] int32, stats)`` for router logits, all in the logits'
    floating dtype (float32; float64 in :func:`route_in`'s x64 region). The tokens are
    ``balancing_groups`` equal consecutive runs (the data-parallel ranks' micro-batches): the balancing
    statistics have a leading group axis and Sinkhorn balances each run on its own."""
    if logits_SE.shape[0] % balancing_groups:
        raise ValueError(f"{logits_SE.shape[0]} tokens do not split into {balancing_groups} balancing groups")
    valid = valid_S.astype(logits_SE.dtype)
    groups = (cfg.num_groups, cfg.group_topk) if cfg.group_topk else None
    if cfg.sinkhorn:
        routed = _route_sinkhorn(logits_SE, top_k, groups, cfg.training, balancing_groups)
    elif cfg.score_function == "softmax":
        routed = _route_softmax(logits_SE, top_k, groups, cfg.renormalises(norm_topk_prob))
    elif cfg.score_function == "sigmoid":
        routed = _route_sigmoid(logits_SE, top_k, groups, expert_bias_E)
    else:
        raise RouterConfigError(f"--moe-router-score-function {cfg.score_function}: choose one of {SCORE_FUNCTIONS}")
    weights_SK, experts_SK, aux_scores_SE, aux_experts_SK = routed
    if cfg.topk_scaling_factor and not cfg.sinkhorn:  # Megatron's sinkhorn path does not scale
        weights_SK = weights_SK * cfg.topk_scaling_factor
    stats = _balancing_stats(logits_SE, valid, experts_SK, aux_scores_SE, aux_experts_SK, cfg, top_k,
                             segment_ids_BT, balancing_groups)
    return weights_SK, experts_SK, stats


# Each score function returns (weights [S, K], experts [S, K], the aux losses' scores [S, E] and
# their experts [S, K]: the unbiased, ungrouped top-k of the normalised scores, the routing's own
# experts array where the two agree).

def _route_sinkhorn(logits_SE, top_k, groups, training: bool, balancing_groups: int):
    """Training: the top-k of the Sinkhorn-balanced ``exp(logits)``, weighted by the plain scores;
    evaluation: the top-k of the plain scores."""
    # Megatron's _sinkhorn_activation: sigmoid for top-1, softmax over all experts otherwise.
    scores_SE = jax.nn.sigmoid(logits_SE) if top_k == 1 else jax.nn.softmax(logits_SE, axis=-1)
    if training:
        balanced_SE = jax.lax.stop_gradient(sinkhorn(logits_SE, balancing_groups))
        _, experts_SK = _select(balanced_SE, top_k, groups)
        weights_SK = jnp.take_along_axis(scores_SE, experts_SK, axis=-1)
    else:
        weights_SK, experts_SK = _select(scores_SE, top_k, groups)
    return weights_SK, experts_SK, scores_SE, experts_SK


def _route_softmax(logits_SE, top_k, groups, renorm: bool):
    """Softmax over all experts, then the top-k weights, renormalised to sum to 1 or as they are."""
    probs_SE = jax.nn.softmax(logits_SE, axis=-1)
    if groups and renorm:
        # Megatron's group scores are sums of the top logits here (top-k before softmax).
        top_logits_SK, experts_SK = _select(logits_SE, top_k, groups)
        weights_SK = jax.nn.softmax(top_logits_SK, axis=-1)
    else:
        weights_SK, experts_SK = _select(probs_SE, top_k, groups)
        if renorm:
            weights_SK = weights_SK / jnp.sum(weights_SK, axis=-1, keepdims=True)
    aux_experts_SK = experts_SK if not groups else _select(probs_SE, top_k, None)[1]
    return weights_SK, experts_SK, probs_SE, aux_experts_SK


def _route_sigmoid(logits_SE, top_k, groups, expert_bias_E):
    """Sigmoid scores; the experts the top-k of ``scores + expert_bias`` (when given), the weights
    the chosen scores over their sum for k > 1."""
    scores_SE = jax.nn.sigmoid(logits_SE)
    if expert_bias_E is not None:
        # The bias chooses, the scores weigh; it is state updated outside the gradient.
        bias_E = jax.lax.stop_gradient(expert_bias_E.astype(logits_SE.dtype))
        _, experts_SK = _select(scores_SE + bias_E, top_k, groups)
        weights_SK = jnp.take_along_axis(scores_SE, experts_SK, axis=-1)
    else:
        weights_SK, experts_SK = _select(scores_SE, top_k, groups)
    if top_k > 1:
        weights_SK = weights_SK / (jnp.sum(weights_SK, axis=-1, keepdims=True) + 1e-20)
    aux_scores_SE = scores_SE / (jnp.sum(scores_SE, axis=-1, keepdims=True) + 1e-20)
    plain = expert_bias_E is None and not groups  # top-k of s and of s / sum(s) agree
    aux_experts_SK = experts_SK if plain else _select(aux_scores_SE, top_k, None)[1]
    return weights_SK, experts_SK, aux_scores_SE, aux_experts_SK


def _balancing_stats(logits_SE, valid, experts_SK, aux_scores_SE, aux_experts_SK, cfg: RouterConfig, top_k: int,
                     segment_ids_BT, balancing_groups: int) -> dict[str, jax.Array]:
    """The load-balancing statistics of the module docstring, over the valid tokens, per
    balancing group (``tokens_per_expert`` over all of them)."""
    e = logits_SE.shape[-1]
    in_groups = lambda x: x.reshape((balancing_groups, x.shape[0] // balancing_groups) + x.shape[1:])
    aux_counts_GE = jnp.sum(in_groups(_assignments(aux_experts_SK, e, valid)), axis=1)
    counts_E = (jnp.sum(aux_counts_GE, axis=0) if aux_experts_SK is experts_SK
                else jnp.sum(_assignments(experts_SK, e, valid), axis=0))
    lse_S = jax.nn.logsumexp(logits_SE, axis=-1)
    stats = {
        "tokens_per_expert": counts_E,
        "aux_tokens_per_expert": aux_counts_GE,
        "probs_per_expert": jnp.sum(in_groups(aux_scores_SE * valid[:, None]), axis=1),
        "num_tokens": jnp.sum(in_groups(valid), axis=1),
        "z_loss_sum": jnp.sum(in_groups(jnp.square(lse_S) * valid), axis=1),
    }
    if cfg.per_sequence_stats:
        if segment_ids_BT is None:
            raise ValueError("seq_aux_loss needs the segment ids of the tokens")
        per_row = _per_sequence(aux_experts_SK, aux_scores_SE, valid, segment_ids_BT, top_k)
        stats.update({k: jnp.sum(in_groups(v), axis=1) for k, v in per_row.items()})
    return stats


def sinkhorn(logits_SE: jax.Array, groups: int = 1, tol: float = 1e-4) -> jax.Array:
    """Megatron's ``moe_utils.sinkhorn``, on each of ``groups`` equal consecutive runs of tokens
    (one data-parallel rank's micro-batch each, padding included, as Megatron balances the tokens
    a rank holds): alternately rescale the rows (tokens) and columns (experts) of
    ``exp(logits)`` towards uniform marginals until the column scales move by less than ``tol``
    on average; returns the balanced matrix."""
    s, e = logits_SE.shape
    return jax.vmap(functools.partial(_sinkhorn, tol=tol))(logits_SE.reshape(groups, s // groups, e)).reshape(s, e)


def _sinkhorn(logits_NE: jax.Array, tol: float) -> jax.Array:
    dt = logits_NE.dtype
    cost_NE = jnp.exp(logits_NE)
    n, e = cost_NE.shape
    eps = 1e-8

    def step(carry):
        _, d1_E, _ = carry
        d0_N = (1.0 / n) / (jnp.sum(d1_E * cost_NE, axis=1) + eps)
        new_d1_E = (1.0 / e) / (jnp.sum(d0_N[:, None] * cost_NE, axis=0) + eps)
        return d0_N, new_d1_E, jnp.mean(jnp.abs(d1_E - new_d1_E))

    init = (jnp.ones((n,), dt), jnp.ones((e,), dt), jnp.asarray(1e9, dt))
    d0_N, d1_E, _ = jax.lax.while_loop(lambda c: c[2] > tol, step, init)
    return d1_E * cost_NE * d0_N[:, None]


def _assignments(experts_SK, e, valid_S):
    """``[S, E]``: whether each valid token's top-k sent it to each expert (0 or 1)."""
    return jnp.sum(jax.nn.one_hot(experts_SK, e, dtype=valid_S.dtype), axis=1) * valid_S[:, None]


def _per_sequence(experts_SK, scores_SE, valid_S, segment_ids_BT, top_k):
    """Per row ``[B]``: the sum over its packed documents of each one's switch loss
    ``E / (k n^2) sum_e P_e c_e``, and its number of documents. Segment sums per row, so the
    rows (split over data ranks) stay independent."""
    b, t = segment_ids_BT.shape
    e = scores_SE.shape[-1]
    map_BTE = (jnp.sum(jax.nn.one_hot(experts_SK, e, dtype=valid_S.dtype), axis=1) * valid_S[:, None]).reshape(b, t, e)
    scores_BTE = (scores_SE * valid_S[:, None]).reshape(b, t, e)
    valid_BT = valid_S.reshape(b, t)
    seg_BT = segment_ids_BT.astype(jnp.int32)

    def row(m_TE, p_TE, v_T, s_T):
        total = lambda x: jax.ops.segment_sum(x, s_T, num_segments=t + 1)
        return total(m_TE), total(p_TE), total(v_T)

    c_BDE, p_BDE, n_BD = jax.vmap(row)(map_BTE, scores_BTE, valid_BT, seg_BT)
    is_doc_BD = (n_BD > 0) & (jnp.arange(t + 1) > 0)
    n_BD = jnp.maximum(n_BD, 1.0)
    aux_BD = e * jnp.sum(c_BDE * p_BDE, axis=-1) / (top_k * n_BD * n_BD)
    return {"seq_aux_sum": jnp.sum(jnp.where(is_doc_BD, aux_BD, 0.0), axis=1),
            "num_sequences": jnp.sum(is_doc_BD.astype(valid_S.dtype), axis=1)}


def _select(scores_SE, k, groups):
    """Top-k per token, plain or group-limited (Megatron's ``group_limited_topk``). With the
    tokens split over ranks it runs in a region manual over them: left to XLA, the partitioner
    all-gathers every token's scores to every rank for the TopK."""
    fn = (lambda s: tuple(jax.lax.top_k(s, k))) if groups is None else (lambda s: _group_limited_top_k(s, k, *groups))
    if mesh_axes_of("act_tokens")[1] == 1:
        return fn(scores_SE)
    tokens = ("act_tokens", None)
    return logical_shard_map(fn, in_names=(tokens,), out_names=(tokens, tokens), manual=("act_tokens",))(scores_SE)


def _group_limited_top_k(scores_SE, k, num_groups, group_topk):
    s, e = scores_SE.shape
    grouped_SGX = scores_SE.reshape(s, num_groups, e // num_groups)
    group_scores_SG = jnp.sum(jax.lax.top_k(grouped_SGX, k // group_topk)[0], axis=-1)
    _, groups_SK = jax.lax.top_k(group_scores_SG, group_topk)
    keep_SG = jnp.sum(jax.nn.one_hot(groups_SK, num_groups, dtype=jnp.int32), axis=1) > 0
    keep_SE = jnp.repeat(keep_SG, e // num_groups, axis=1)
    return tuple(jax.lax.top_k(jnp.where(keep_SE, scores_SE, -jnp.inf), k))


def updated_expert_bias(bias_LE: jax.Array, tokens_LE: jax.Array, rate: float) -> jax.Array:
    """Megatron's ``get_updated_expert_bias`` (DeepSeek-V3's aux-loss-free balancing): each
    layer's bias rises by ``rate`` for the experts that got fewer than the mean number of
    assignments in the global batch and falls for those that got more (a tie stays)."""
    tokens_LE = jax.lax.stop_gradient(tokens_LE.astype(jnp.float32))
    mean_L1 = jnp.sum(tokens_LE, axis=-1, keepdims=True) / tokens_LE.shape[-1]
    return bias_LE + jnp.sign(mean_L1 - tokens_LE) * rate
