"""The causal LM every family builds on, written once, in Flax NNX: :class:`CausalLM`
(embedding, decoder layer stacks, final norm, LM head) and the scan that runs a stack.

A family (:mod:`mlir_train.families`) subclasses :class:`CausalLM` with its decoder layer
(:meth:`CausalLM.make_layer`). Decoder layers are built stacked (every layer parameter has a
leading ``"layers"`` axis): one :class:`~mlir_train.model.periods.Stack` per
:class:`~mlir_train.config.models.LayerKind` (dense MLP or MoE, per HF's ``decoder_sparse_step``
/ ``mlp_only_layers``; Qwen3.5's DeltaNet or attention), its rows the layers of that kind in layer
order; the released Qwen3 models are a single stack. They run with ``jax.lax.scan``
(:func:`run_layers`): a repeating pattern of kinds is one scan over its periods
(:mod:`mlir_train.model.periods`), so compile time does not grow with depth, and the stacks can
be split into pipeline stages along the layer axis.

Calling convention::

    logits_BTV = model(input_ids_BT)                         # plain causal LM
    logits_BTV, stats = model(input_ids_BT, segment_ids=seg_BT, positions=pos_BT,
                              return_router_stats=True)

``segment_ids`` (int, 1, 2, ... per packed document, 0 = padding) restrict attention to the
same document; ``positions`` restart RoPE per document (default ``0..T-1``). Under a table that
splits ``"act_seq"`` (context parallelism) every per-token input is in the load-balanced order
of :func:`sharding.context.sequence_order` (``Trainer.shard_batch`` lays it out), and attention
is causal in the original order. ``stats`` maps
names to arrays with a leading MoE-layer axis: ``tokens_per_expert [L, E]`` (routed),
``aux_tokens_per_expert [L, E]`` and ``probs_per_expert [L, E]`` (what the aux losses count
and sum), ``num_tokens [L]``, ``z_loss_sum [L]``, ``dropped_tokens [L]`` (and per-document
sums for ``seq_aux_loss``), all excluding padding tokens (segment id 0), and
``ep_overflow_rows [L]`` (rows, padding included, that overflowed the expert-parallel exchange
buffer into a further round) and ``ep_further_rounds [L]`` (the rounds after the first, the
most of any rank; :mod:`mlir_train.model.moe.parallel`); see
``mlir_train.model.moe.router`` for their definitions and ``mlir_train.model.losses`` for the aux / z
losses formed from them.
"""

from __future__ import annotations

from typing import Any

import numpy as np

import jax
import jax.numpy as jnp
from flax import nnx

from mlir_train.config.models import LayerKind, ModelConfig
from mlir_train.config.policies import LEGACY, RecomputePolicy
from mlir_train.model.attention import SEGMENT_ID_IMPLS, attention_mask
from mlir_train.model.layers import RMSNorm, param, rope_tables
from mlir_train.model.losses import linear_cross_entropy_sum, weighted_linear_cross_entropy
from mlir_train.model.options import ModelOptions
from mlir_train.model.periods import PeriodScan, Run, decoder_plan, layer_stacks
from mlir_train.model.recompute import checkpointed
from sharding import constrain
from sharding.context import context_parallel_size, sequence_order

REMAT_POLICIES = LEGACY  # the strings ``remat=`` still takes besides a RecomputePolicy


def call_checkpointed(module: nnx.Module, recompute: bool, *args):
    """``module(*args)``, as a normal checkpoint (its input kept, its insides recomputed in the
    backward) when ``recompute``."""
    if not recompute:
        return module(*args)
    graphdef, state = nnx.split(module)
    arrays = [i for i, a in enumerate(args) if isinstance(a, jax.Array)]
    rest = list(args)  # modules and flags pass through as they are

    def run(state, *values):
        for i, v in zip(arrays, values):
            rest[i] = v
        return nnx.merge(graphdef, state)(*rest)

    return checkpointed(run, True)(state, *(args[i] for i in arrays))


def stacked(make, n: int, rngs: nnx.Rngs, axis: str = "layers"):
    """Build ``n`` layers as one module whose params have a leading ``axis`` (logical axis name:
    "layers" for the decoder's, which pipeline stages split)."""

    @nnx.split_rngs(splits=n)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def build(r):
        return make(r)

    stack = build(rngs)
    for _, var in nnx.iter_graph(stack):
        if isinstance(var, nnx.Param):
            var.set_metadata("logical_axes", (axis,) + tuple(var.get_metadata()["logical_axes"]))
    return stack


class CausalLM(nnx.Module):
    """Embedding, the decoder layer stacks, the final norm and the LM head of ``cfg``, built as
    ``options`` (:class:`~mlir_train.model.options.ModelOptions`) say. A family supplies its
    decoder layer by overriding :meth:`make_layer`."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, options: ModelOptions = ModelOptions()):
        self.cfg = cfg
        self.options = options
        # What the backward recomputes (mlir_train.model.recompute): the submodules' checkpoints
        # are built into the layers, the layer-level ones are run_stack's.
        options.remat.check_chunks([cfg.num_layers], "model")
        d, v, dtype = cfg.hidden_size, cfg.vocab_size, options.param_dtype
        self.embed = param(rngs, (v, d), ("vocab", "embed"), cfg.init_std, dtype)
        self.stack_kinds = layer_stacks(cfg)
        self.layers = nnx.List([stacked(lambda r, kind=s.kind: self.make_layer(kind, r), s.count, rngs)
                                for s in self.stack_kinds])
        self.final_norm = self.make_norm(d)
        self.lm_head = None if cfg.tie_word_embeddings else param(rngs, (d, v), ("embed", "vocab"), cfg.init_std, dtype)
        # Megatron's --mtp-num-layers: one MultiTokenPredictionLayer per depth (mlir_train.model.mtp).
        self.mtp = nnx.List([MTPDepth(self, kind, rngs) for kind in cfg.mtp_kinds()]) if cfg.mtp_num_layers else None

    def make_layer(self, kind: LayerKind, rngs: nnx.Rngs) -> nnx.Module:
        """One decoder layer of ``kind``: ``layer(x_BTD, *self.layer_context(...)) -> (x_BTD, stats)``."""
        raise NotImplementedError(f"{type(self).__name__} builds no decoder layers")

    def make_norm(self, dim: int) -> nnx.Module:
        """The family's RMSNorm over ``dim`` (the final norm's; its layers build theirs)."""
        return RMSNorm(dim, self.cfg.rms_norm_eps, dtype=self.options.param_dtype)

    @property
    def remat(self) -> RecomputePolicy:
        return self.options.remat

    @property
    def attention_impl(self) -> str:
        return self.options.attention_impl

    # ----- pieces, exposed for the trainer's loss and for pipeline stages ----------------------
    def embed_tokens(self, input_ids_BT: jax.Array) -> jax.Array:
        x_BTD = jnp.take(self.embed[...], input_ids_BT, axis=0)
        return constrain(x_BTD, ("act_batch", "act_res_seq", "act_embed"))

    def unembed_matrix(self) -> jax.Array:
        """``[D, V]`` LM head (the transposed embedding when tied)."""
        return self.embed[...].T if self.lm_head is None else self.lm_head[...]

    def logits(self, h_BTD: jax.Array) -> jax.Array:
        w_DV = self.unembed_matrix().astype(h_BTD.dtype)
        return _constrain_logits(jnp.einsum("btd,dv->btv", h_BTD, w_DV, preferred_element_type=jnp.float32))

    def loss_sums(self, h_BTD: jax.Array, labels_BT: jax.Array, loss_mask_BT: jax.Array) -> tuple[jax.Array, jax.Array]:
        """(sum of masked token cross-entropies, number of loss tokens) of the LM head on
        ``h``: :func:`losses.linear_cross_entropy_sum`, the same numbers as
        ``cross_entropy_sum(self.logits(h), ...)`` without keeping the logits for the backward."""
        w_DV = self.unembed_matrix().astype(h_BTD.dtype)
        return linear_cross_entropy_sum(h_BTD, w_DV, labels_BT, loss_mask_BT, _constrain_logits)

    def weighted_loss_sums(self, h_BTD: jax.Array, labels_BT: jax.Array, loss_mask_BT: jax.Array,
                           weight_BT: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """(training objective ``sum(weight * ce)``, CE sum, loss tokens) of the LM head on ``h``
        in one fused pass (:func:`losses.weighted_linear_cross_entropy`); only the objective
        carries gradients."""
        w_DV = self.unembed_matrix().astype(h_BTD.dtype)
        return weighted_linear_cross_entropy(h_BTD, w_DV, labels_BT, loss_mask_BT, weight_BT, _constrain_logits)

    def layer_context(self, segment_ids_BT, positions_BT) -> tuple[jax.Array, ...]:
        """What every decoder layer needs besides ``x``: RoPE tables, packed-document causal
        mask (the segment ids themselves for the flash kernel, which masks as it goes) and the
        segment ids (0 = padding; the router counts per document), all derived from one
        micro-batch's ids and positions."""
        cos_BTH, sin_BTH = rope_tables(positions_BT, self.cfg.rotary_dim, self.cfg.rope_theta, self.cfg.rope_scaling_factor)
        # Under context parallelism the sequence arrives in the layout's load-balanced order
        # (sharding.context) and attention masks block by block from the segment ids and
        # original indices (layers.context_parallel_attention).
        if self.attention_impl in SEGMENT_ID_IMPLS or context_parallel_size() > 1:
            mask = segment_ids_BT
        else:
            mask = attention_mask(segment_ids_BT)
        return cos_BTH, sin_BTH, mask, segment_ids_BT

    def hidden_states(self, input_ids_BT, *, segment_ids=None, positions=None):
        """Final-normed hidden states ``[B, T, D]`` and router stats (dict of ``[L_moe, ...]``)."""
        b, t = input_ids_BT.shape
        if segment_ids is None:
            segment_ids = jnp.ones((b, t), jnp.int32)
        if positions is None:
            positions = jnp.broadcast_to(sequence_order(t), (b, t))
        context = self.layer_context(segment_ids, positions)
        x_BTD = self.embed_tokens(input_ids_BT)
        x_BTD, router_stats = run_layers(list(self.layers), self.stack_kinds, x_BTD, context, self.remat)
        return self.final_norm(x_BTD), router_stats

    def mtp_hidden_states(self, h_BTD, mtp_ids, *, segment_ids, positions) -> tuple[list[jax.Array], dict[str, Any]]:
        """Each multi-token-prediction depth's final-normed hidden states (``[B, T, D]`` each, in
        depth order; the shared LM head turns them into logits), from the decoder's final-normed
        ``h`` and each depth's input ids (``mtp_ids[k]``: the ids ``k + 1`` ahead in the same
        document, :func:`mlir_train.model.mtp.shifted`); and the depths' router stats, stacked
        on the leading MoE-layer axis after the decoder's ({} without MoE)."""
        context = self.layer_context(segment_ids, positions)
        out, parts = [], []
        for depth, ids in zip(self.mtp, mtp_ids):
            h_BTD, stats = depth(h_BTD, self.embed_tokens(ids), context, self.remat)
            out.append(h_BTD)
            if stats:
                parts.append(stats)
        return out, (jax.tree.map(lambda *a: jnp.concatenate(a), *parts) if parts else {})

    def __call__(self, input_ids_BT, *, segment_ids=None, positions=None, return_router_stats: bool = False):
        h_BTD, stats = self.hidden_states(input_ids_BT, segment_ids=segment_ids, positions=positions)
        logits_BTV = self.logits(h_BTD)
        return (logits_BTV, stats) if return_router_stats else logits_BTV


class MTPDepth(nnx.Module):
    """One multi-token-prediction depth, megatron-core's ``MultiTokenPredictionLayer`` (HF's
    ``mtp.*``, which vLLM's ``Qwen3NextMultiTokenPredictor`` reads):

        x = fc([embed_norm(embed(ids shifted k + 1)); hidden_norm(h)])   the embedding first
        h' = norm(layer(x))                                              one decoder layer of ``kind``

    ``h`` is the decoder's final-normed output for the first depth, the previous depth's ``h'``
    after it. Its layer is a one-layer stack on its own leading axis ("mtp_layers", never split
    over pipeline stages), so it runs and loads as a decoder layer does."""

    def __init__(self, model: CausalLM, kind, rngs: nnx.Rngs):
        cfg, dtype, d = model.cfg, model.options.param_dtype, model.cfg.hidden_size
        self.embed_norm = model.make_norm(d)    # Megatron's enorm, HF's pre_fc_norm_embedding
        self.hidden_norm = model.make_norm(d)   # hnorm, pre_fc_norm_hidden
        self.fc = param(rngs, (2 * d, d), ("mtp_concat", "embed"), cfg.init_std, dtype)  # eh_proj, fc
        self.layer = stacked(lambda r: model.make_layer(kind, r), 1, rngs, axis="mtp_layers")
        self.norm = model.make_norm(d)          # final_layernorm, norm

    def __call__(self, h_BTD, emb_BTD, context: tuple, remat: RecomputePolicy | str = "none"):
        x_BTC = jnp.concatenate([self.embed_norm(emb_BTD), self.hidden_norm(h_BTD)], axis=-1)
        x_BTD = constrain(jnp.einsum("btc,cd->btd", x_BTC, self.fc[...].astype(x_BTC.dtype)),
                          ("act_batch", "act_res_seq", "act_embed"))
        x_BTD, stats = run_stack(self.layer, x_BTD, context, mtp_recompute(remat))
        return self.norm(x_BTD), stats


def mtp_recompute(remat: RecomputePolicy | str) -> RecomputePolicy:
    """What megatron-core recomputes of an MTP depth's layer: the layer under full recompute
    (its ``uniform`` method; ``block`` is skipped there, with a warning); selective recompute's
    submodules are inside the layer already."""
    policy = RecomputePolicy.of(remat)
    if policy.granularity == "full" and policy.method != "block":
        return RecomputePolicy("full")
    return RecomputePolicy()


def _constrain_logits(logits_BTV: jax.Array) -> jax.Array:
    return constrain(logits_BTV, ("act_batch", "act_seq", "act_vocab"))


def run_layers(stacks: list[nnx.Module], stack_kinds, x_BTD, context: tuple,
               remat: RecomputePolicy | str = "none") -> tuple[jax.Array, dict[str, Any]]:
    """``x`` through every decoder layer, in layer order, as :func:`periods.decoder_plan` scans
    them (``stacks``: the stacked modules, one per :class:`~mlir_train.model.periods.Stack` of
    ``stack_kinds``); router stats with a leading MoE-layer axis in layer order."""
    split = [nnx.split(s) for s in stacks]
    parts: list[tuple[np.ndarray, dict]] = []  # (global layer of each row, stats [rows, ...])

    def run(run: Run, state, x):
        return run_pieces(split[run.stack][0], stack_pieces(state, None, remat, (run.first,)), x, context)

    for item in decoder_plan(stack_kinds, remat):
        if isinstance(item, Run):
            state = jax.tree.map(lambda a: a[item.row:item.row + item.count], split[item.stack][1])
            x_BTD, s = run(item, state, x_BTD)
            parts.append((np.arange(item.first, item.first + item.count), s))
            continue
        x_BTD, got = _period_scan(item, [st for _, st in split], run, x_BTD)
        for r, s in zip(item.runs, got):  # s: [reps, count, ...]
            layers = r.first + item.layers * np.arange(item.reps)[:, None] + np.arange(r.count)
            parts.append((layers.reshape(-1), jax.tree.map(lambda a: a.reshape(-1, *a.shape[2:]), s)))
    parts = [(l, s) for l, s in parts if s]
    if not parts:
        return x_BTD, {}
    order = np.argsort(np.concatenate([l for l, _ in parts]), kind="stable")
    stats = jax.tree.map(lambda *a: jnp.concatenate(a)[order], *[s for _, s in parts])
    return x_BTD, stats


def _period_scan(item: PeriodScan, states: list, run, x_BTD):
    """One ``lax.scan`` over ``item``'s periods: its xs are each stack's rows of these periods,
    ``[reps, rows per period, ...]`` (a reshape when the stack's rows are all here); the body runs
    one period's runs in order. Returns ``x`` and each run's stats ``[reps, count, ...]``."""
    per, first = item.per_stack(), item.first_row()
    xs = {k: jax.tree.map(lambda a: a[first[k]:first[k] + item.reps * n].reshape(item.reps, n, *a.shape[1:]),
                          states[k]) for k, n in per.items()}

    def body(x, xs):
        out = []
        for r in item.runs:
            at = r.row - first[r.stack]
            x, s = run(r, jax.tree.map(lambda a: a[at:at + r.count], xs[r.stack]), x)
            out.append(s)
        return x, out

    return jax.lax.scan(body, x_BTD, xs)


def run_stack(stack: DecoderLayer, x_BTD, context: tuple, remat: RecomputePolicy | str = "none",
              active_V: jax.Array | None = None, offsets: tuple[int, ...] = (0,)) -> tuple[jax.Array, dict[str, Any]]:
    """Scan ``x`` through a stacked layer module; stats come back with a leading layer axis.

    ``remat`` (a :class:`~mlir_train.config.policies.RecomputePolicy` or its legacy string)
    decides the layer-level checkpoints: full recompute per layer, per group of layers
    (uniform) or for the first layers of the chunk (block), whose first layer this stack's
    sits at ``offsets`` (one per pipeline stage that disagrees; the layer index without a
    pipeline); selective recompute's submodule checkpoints are inside the layers.

    ``active_V`` (bool per stacked layer) turns layers into the identity where it is False:
    padding of an uneven pipeline stage, which then contributes nothing to ``x`` nor, through
    ``where``'s gradient, to its own weights' gradients (its stats are the caller's to mask)."""
    graphdef, state = nnx.split(stack)
    return run_pieces(graphdef, stack_pieces(state, active_V, remat, offsets), x_BTD, context)


def stack_pieces(state, active_V: jax.Array | None, remat: RecomputePolicy | str = "none",
                 offsets: tuple[int, ...] = (0,), lead: int = 0) -> list[tuple[Any, jax.Array | None, int]]:
    """A stacked layer state cut into the pieces ``remat`` scans separately:
    ``(state, active, group)`` each, the leaves ``[length, ...]``, or ``[length / group, group,
    ...]`` where ``group`` layers are checkpointed together (0: none, 1: each layer); after
    ``lead`` leading axes that are kept (1: a pipeline segment's periods, ``[periods, layers,
    ...]``, each period cut alike). Kept apart
    from :func:`run_pieces` so a caller that holds the pieces' residuals (the 1F1B pipeline)
    can differentiate with respect to the pieces themselves: then the weights a piece's
    backward needs are the pieces it was given, not slices made inside."""
    count = jax.tree.leaves(state)[0].shape[lead]
    pieces = []
    for start, length, size in RecomputePolicy.of(remat).pieces(count, offsets):
        piece_state, piece_active = state, active_V
        if (start, length) != (0, count):
            piece_state, piece_active = jax.tree.map(
                lambda a: jax.lax.slice_in_dim(a, start, start + length, axis=lead), (state, active_V))
        if size > 1:
            piece_state, piece_active = jax.tree.map(
                lambda a: a.reshape(*a.shape[:lead], length // size, size, *a.shape[lead + 1:]),
                (piece_state, piece_active))
        pieces.append((piece_state, piece_active, size))
    return pieces


def run_pieces(graphdef, pieces, x_BTD, context: tuple) -> tuple[jax.Array, dict[str, Any]]:
    """Scan ``x`` through the layer pieces of :func:`stack_pieces` (``graphdef`` one layer
    stack's); stats with a leading layer axis."""

    def body(x, xs):
        layer_state, on = xs
        layer = nnx.merge(graphdef, layer_state)
        y, stats = layer(x, *context)
        return (y if on is None else jnp.where(on, y, x)), stats

    def group(x, xs):  # several layers recomputed together: one checkpoint around their scan
        return jax.lax.scan(body, x, xs)

    parts = []
    for piece_state, piece_active, size in pieces:
        xs = (piece_state, piece_active)
        if size == 0:
            x_BTD, stats = jax.lax.scan(body, x_BTD, xs)
        elif size == 1:
            x_BTD, stats = jax.lax.scan(checkpointed(body, True), x_BTD, xs)
        else:
            x_BTD, stats = jax.lax.scan(checkpointed(group, True), x_BTD, xs)
            stats = jax.tree.map(lambda a: a.reshape(-1, *a.shape[2:]), stats)
        parts.append(stats)
    stats = parts[0] if len(parts) == 1 else jax.tree.map(lambda *a: jnp.concatenate(a), *parts)
    return x_BTD, stats


def logical_axes(model: nnx.Module) -> Any:
    """The model's state as a tree of logical-axis tuples (same structure as ``nnx.state``)."""
    return jax.tree.map(
        lambda v: v.get_metadata()["logical_axes"], nnx.state(model, nnx.Param),
        is_leaf=lambda x: isinstance(x, nnx.Variable),
    )


def init_model(cfg: ModelConfig, model_class, *, seed: int = 0, shardings: Any = None,
               options: ModelOptions = ModelOptions()) -> CausalLM:
    """Fresh ``model_class`` (a :class:`CausalLM` subclass, e.g.
    :func:`mlir_train.families.model_class` of ``cfg``) with parameters created by one compiled
    program, born in ``shardings``.

    ``shardings`` is a tree like ``nnx.state(model)`` of ``jax.sharding.Sharding`` (or None
    for the default device). Building eagerly would run thousands of tiny ops one at a time
    and, with a mesh, place every full parameter on one device first.
    """
    def build() -> CausalLM:
        return model_class(cfg, rngs=nnx.Rngs(seed), options=options)

    graphdef, _ = nnx.split(nnx.eval_shape(build))
    state = jax.jit(lambda: nnx.split(build())[1], out_shardings=shardings)()
    return nnx.merge(graphdef, state)
