"""Qwen3-MoE sparse block: float32 top-k router, SwiGLU experts, dropless by default.

Shape suffixes: S flat tokens (batch*seq), D hidden, E experts, K top-k slots, F expert
width, C per-expert capacity (token slots in the padded dispatch buffer), A = S*K assignments,
L local experts (E / EP), M rows of a ragged receive buffer.

Three ways to run the experts, all computing the same function (tests compare them):

* ``"dense"``   reference: every expert on every token, combined by the routing weights.
                Plain and obviously right; costs E/K times the routed work.
* ``"padded"``  sort assignments by expert into statically shaped buffers, one batched
                matmul per weight; the fast path on CPU. Dropless on one rank it is a
                block-grouped matmul (MegaBlocks' layout, :meth:`MoE._blocked`): each
                expert's rows start on a block boundary, each block runs with its expert's
                weights, and the block count is bounded for any routing, so nothing is
                dropped and no branch is taken. With a capacity (or under EP) it scatters
                into a ``[E, C, D]`` buffer; see below.
* ``"ragged"``  sort assignments by expert and run ``jax.lax.ragged_dot`` on the groups:
                dropless by construction; the fast path on GPU/TPU.

With ``capacity_factor`` set (Megatron's ``--moe-expert-capacity-factor``) the padded buffer
has C = ceil(capacity_factor * S*K/E) and overflowing assignments are dropped, by position
(later tokens first) or by probability (``--moe-token-drop-policy probs``); drops are counted.

Data parallelism without expert ranks
-------------------------------------
When the tokens are split over data ranks (``"act_tokens"``) but the experts are not, each
rank runs its own S_r tokens through all E experts in a region manual over the token axes
(:meth:`MoE._data_parallel`), with the weights whole on every rank ("tensor" may still split
F; under FSDP they are gathered on entry) and their gradients summed over the ranks by the
region's transpose. The router's ``top_k`` runs manual over the tokens too. Left to XLA, the
sort by expert over the global batch all-gathered every rank's tokens and routing to every
rank. Capacity (``capacity_factor`` set) is then per rank, C = ceil(cf * S_r*K/E), as under
expert parallelism and in Megatron.

Expert parallelism
------------------
When the active sharding rules split ``"exp"`` over mesh axes of total size EP > 1, the
``"padded"`` and ``"ragged"`` paths run inside :func:`sharding.logical_shard_map`, manual over
the token axes (``"act_tokens"``, which include the expert axes: EP is carved out of DP) and
automatic over the rest (``"tensor"`` may still split the expert width F). The router and
its stats run before the manual region, partitioned by XLA (``top_k`` manual over the
tokens), so the stats are reduced over the global batch and are the single-device arrays.
Each rank then dispatches its own S_r = S / (token ranks) tokens to the ranks holding their
experts, runs its L = E / EP local experts, and sends the results back; the combine (weights, scatter-add) happens at the token's home rank.
``"dense"`` stays the plain reference under every layout (XLA partitions it).

* Padded dispatcher (any backend; the one used on CPU, where XLA has no ragged all-to-all):
  the local padded path's ``[E, C, D]`` buffer, built from the rank's own tokens, *is* the
  send buffer: a tiled ``all_to_all`` over the expert axes sends expert block r to rank r,
  the receiver runs its experts on ``[L, EP*C, D]`` with the same batched matmul, and a second
  ``all_to_all`` returns the ``[E, C, D]`` outputs. Per (rank, expert) the buffer has C slots:
  dropless guesses C = 2 * S_r*K/E (rounded up to 8) and, when any rank's expert overflows it
  (a ``pmax`` over the ranks so all take the same branch of the ``lax.cond``), falls back to
  C = S_r, the most one rank can send one expert. Memory and compute per rank: E*C*D for each
  of the send and receive buffers and an expert matmul over E*C rows, i.e. 2x the routed
  work (S_r*K rows) on the guess, E/K x in the rare fallback step (as the dense reference),
  and the all-to-all moves the padding too. The fallback compiles a second copy of the
  block; it costs nothing when not taken.
* Capacity (``capacity_factor`` set): C = ceil(capacity_factor * S_r*K/E) per rank, so each
  rank keeps at most C of *its own* tokens per expert and drops the rest by its own policy.
  This is Megatron's semantics (its router drops per rank, before the dispatch), not a global
  capacity over the whole batch; ``dropped_tokens`` is summed over all ranks.
* Ragged dispatcher (``impl="ragged"``, dropless, on backends with ``ragged_all_to_all``:
  GPU, TPU): the rank's assignments, sorted by expert, go as one slice per (destination,
  local expert) with ``jax.lax.ragged_all_to_all``; slices land grouped by local expert, so
  ``ragged_dot`` runs on the receive buffer directly and only real rows move. The receive
  buffer is static and sized for the worst case, EP * S_r * min(K, L) rows (every token of
  every source sends to this rank's experts), EP times the balanced S_r*K rows when L >= K,
  in memory only: the traffic carries no padding. On CPU ``impl="ragged"`` uses the padded
  dispatcher; :func:`ragged_all_to_all_dense` emulates the collective so tests can check the
  ragged bookkeeping there.
"""

from __future__ import annotations

import math
from functools import partial

import jax
import jax.numpy as jnp
from flax import nnx

from mlir_train.model.layers import param
from mlir_train.model.router import RouterConfig, route, router_logits
from sharding import constrain, logical_shard_map, mesh_axes_of

MOE_IMPLS = ("dense", "padded", "ragged")


class MoE(nnx.Module):
    def __init__(
        self,
        cfg,
        rngs: nnx.Rngs,
        out_std: float,
        *,
        impl: str = "padded",
        capacity_factor: float | None = None,
        drop_policy: str = "probs",
        dtype=jnp.float32,
        router: RouterConfig | None = None,
    ):
        if impl not in MOE_IMPLS:
            raise ValueError(f"unknown MoE implementation {impl!r}; choose one of {MOE_IMPLS}")
        if drop_policy not in ("probs", "position"):
            raise ValueError(f"--moe-token-drop-policy must be 'probs' or 'position', got {drop_policy!r}")
        d, e, f = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
        self.router = param(rngs, (d, e), ("embed", "router_exp"), cfg.init_std, dtype)
        self.gate_proj = param(rngs, (e, d, f), ("exp", "embed", "moe_mlp"), cfg.init_std, dtype)
        self.up_proj = param(rngs, (e, d, f), ("exp", "embed", "moe_mlp"), cfg.init_std, dtype)
        self.down_proj = param(rngs, (e, f, d), ("exp", "moe_mlp", "embed"), out_std, dtype)
        self.num_experts = e
        self.top_k = cfg.top_k
        self.norm_topk_prob = cfg.norm_topk_prob
        self.impl = impl
        self.capacity_factor = capacity_factor
        self.drop_policy = drop_policy
        self.router_cfg = router or RouterConfig()
        self.router_cfg.check(e, cfg.top_k, cfg.norm_topk_prob)
        if self.router_cfg.enable_expert_bias:
            # Aux-loss-free balancing state: float32, no gradient (the router stops it), moved by
            # the trainer from each step's load (``mlir_train.losses.updated_expert_bias``).
            self.expert_bias = nnx.Param(jnp.zeros((e,), jnp.float32), logical_axes=("router_exp",))

    # ----- routing (mlir_train.model.router) ------------------------------------------------
    def route(self, x_SD: jax.Array, valid_S: jax.Array, segment_ids_BT: jax.Array | None = None):
        """Router in float32 (Megatron and HF both softmax in fp32; we also matmul in fp32)."""
        logits_SE = router_logits(x_SD, self.router[...])
        bias = self.expert_bias[...] if self.router_cfg.enable_expert_bias else None
        return route(logits_SE, valid_S, top_k=self.top_k, norm_topk_prob=self.norm_topk_prob, cfg=self.router_cfg,
                     expert_bias_E=bias, segment_ids_BT=segment_ids_BT)

    # ----- experts -------------------------------------------------------------------------
    def __call__(self, x_BTD: jax.Array, valid_BT: jax.Array, segment_ids_BT: jax.Array | None = None):
        b, t, d = x_BTD.shape
        x_SD = constrain(x_BTD.reshape(b * t, d), ("act_tokens", "act_embed"))
        valid_S = valid_BT.reshape(-1)
        # Routing stays outside any manual region: XLA reduces the stats over the whole batch,
        # so they are the single-device arrays under every layout (Megatron's aux loss is
        # computed over the global batch too).
        weights_SK, experts_SK, stats = self.route(x_SD, valid_S, segment_ids_BT)
        weights_SK = weights_SK.astype(x_SD.dtype)
        if self.impl == "dense":
            # The reference stays plain under every layout; XLA partitions it as it likes.
            y_SD, dropped = self._dense(x_SD, weights_SK, experts_SK), jnp.zeros((), jnp.float32)
        elif mesh_axes_of("exp")[1] > 1:
            y_SD, dropped = self._expert_parallel(x_SD, weights_SK, experts_SK, valid_S)
        elif mesh_axes_of("act_tokens")[1] > 1:
            y_SD, dropped = self._data_parallel(x_SD, weights_SK, experts_SK, valid_S)
        else:
            y_SD, dropped = self._local(x_SD, weights_SK, experts_SK, valid_S, self._weights(x_SD.dtype), self._local_experts)
        stats["dropped_tokens"] = dropped
        return y_SD.reshape(b, t, d), stats

    def _weights(self, dt):
        return self.gate_proj[...].astype(dt), self.up_proj[...].astype(dt), self.down_proj[...].astype(dt)

    def _dense(self, x_SD, weights_SK, experts_SK):
        wg, wu, wd = self._weights(x_SD.dtype)
        combine_SE = jnp.sum(jax.nn.one_hot(experts_SK, self.num_experts, dtype=x_SD.dtype) * weights_SK[..., None], axis=1)
        g_SEF = jnp.einsum("sd,edf->sef", x_SD, wg)
        u_SEF = jnp.einsum("sd,edf->sef", x_SD, wu)
        y_SED = jnp.einsum("sef,efd->sed", jax.nn.silu(g_SEF) * u_SEF, wd)
        return jnp.einsum("sed,se->sd", y_SED, combine_SE)

    def _sort(self, weights_SK, experts_SK):
        """Assignments ordered by expert; within an expert by token (or by weight for 'probs')."""
        s, k = experts_SK.shape
        experts_A = experts_SK.reshape(-1)
        weights_A = weights_SK.reshape(-1)
        if self.capacity_factor is not None and self.drop_policy == "probs":
            order_A = jnp.lexsort((-weights_A.astype(jnp.float32), experts_A))
        else:
            order_A = jnp.argsort(experts_A, stable=True)
        return order_A // k, experts_A[order_A], weights_A[order_A]

    def _local(self, x_SD, weights_SK, experts_SK, valid_S, weights, experts_fn=None):
        """The experts on this rank's tokens, all experts here (one device, or each data rank
        of a pure data-parallel layout). ``experts_fn`` runs the padded ``[E, C, D]`` buffer
        (default: the plain batched SwiGLU with ``weights``)."""
        if self.impl == "ragged" and self.capacity_factor is None:
            return self._ragged(x_SD, weights_SK, experts_SK, weights), jnp.zeros((), jnp.float32)
        s, k = experts_SK.shape
        e = self.num_experts
        b, n_blocks = block_layout(s * k, e)
        if self.capacity_factor is None and n_blocks * b < e * s:
            return self._blocked(x_SD, weights_SK, experts_SK, weights), jnp.zeros((), jnp.float32)
        # Capacity runs, and so few tokens (decoding) that the [E, S, D] buffer, which can
        # never overflow, is smaller than the blocked layout's bound.
        experts_fn = experts_fn or (lambda buf_ECD: _swiglu_experts(buf_ECD, *weights))
        return self._dispatch_padded(x_SD, weights_SK, experts_SK, valid_S, experts_fn, lambda n: n)

    def _data_parallel(self, x_SD, weights_SK, experts_SK, valid_S):
        """Pure data parallelism (no expert ranks): each data rank runs *its own* tokens through
        every expert, in a region manual over the token axes, with the expert weights whole on
        every rank (gathered first under FSDP; "tensor" may still split F). Left to XLA, the
        sort-by-expert over the whole batch would gather every rank's tokens and routing to
        every rank. Capacity drops are per rank, as under EP and in Megatron."""
        token_axes = _token_axes(x_SD.shape[0])

        def body(x_SD, weights_SK, experts_SK, valid_S, *weights):
            # The weights are the same on every rank, their per-rank gradients are not: mark
            # them varying over the token axes, whose transpose sums the gradients over the
            # ranks (the custom VJPs inside must see one type for a weight and its gradient).
            weights = jax.lax.pcast(weights, token_axes, to="varying")
            y_SD, dropped = self._local(x_SD, weights_SK, experts_SK, valid_S, weights)
            return y_SD, jax.lax.psum(dropped, token_axes)

        tokens = ("act_tokens", None)
        w_in, w_out = (None, None, "moe_mlp"), (None, "moe_mlp", None)
        run = logical_shard_map(
            body,
            in_names=(tokens, tokens, tokens, ("act_tokens",), w_in, w_in, w_out),
            out_names=(tokens, ()),
            manual=("act_tokens",),
        )
        return run(x_SD, weights_SK, experts_SK, valid_S, *self._weights(x_SD.dtype))

    def _ragged(self, x_SD, weights_SK, experts_SK, weights):
        token_A, expert_A, weight_A = self._sort(weights_SK, experts_SK)
        group_sizes_E = jnp.bincount(expert_A, length=self.num_experts).astype(jnp.int32)
        return _ragged_experts(x_SD, weight_A, *weights, token_A.astype(jnp.int32), group_sizes_E)

    def _blocked(self, x_SD, weights_SK, experts_SK, weights):
        """Dropless experts on one rank as a block-grouped matmul (MegaBlocks' layout).

        Assignments sorted by expert fill rows of a ``[N*b, D]`` buffer in which each
        expert's group starts on a block boundary, so every block of ``b`` rows belongs to
        one expert. ``N`` = ceil(A/b) + E bounds the blocks any routing can need (each
        expert wastes less than one block), so the shape is static, nothing is dropped and
        no branch is needed; padding is at most ``E*(b-1)`` rows, which the choice of ``b``
        (:func:`block_rows`) keeps under half the routed ``A = S*K`` rows (unless the batch
        is tiny). Each block runs with its expert's weights (:func:`_blocked_experts`). One
        gather brings tokens in and one scatter-add takes the weighted outputs home; unused
        rows read a zero row and add into a discarded one.
        """
        s, k = experts_SK.shape
        e, a = self.num_experts, s * k
        b, n_blocks = block_layout(a, e)
        token_A, expert_A, weight_A = self._sort(weights_SK, experts_SK)
        sizes_E = jnp.bincount(expert_A, length=e)
        blocks_E = (sizes_E + b - 1) // b
        block_end_E = jnp.cumsum(blocks_E)
        first_row_E = (block_end_E - blocks_E) * b
        first_assignment_E = jnp.cumsum(sizes_E) - sizes_E
        row_A = first_row_E[expert_A] + jnp.arange(a) - first_assignment_E[expert_A]
        rows = n_blocks * b
        # Row -> token (s, a zero row, for padding) and row -> routing weight (0 for padding).
        token_R = jnp.full((rows,), s, jnp.int32).at[row_A].set(token_A.astype(jnp.int32), unique_indices=True)
        weight_R = jnp.zeros((rows,), x_SD.dtype).at[row_A].set(weight_A, unique_indices=True)
        # Block n belongs to the first expert whose blocks end after it (unused blocks: the last).
        expert_N = jnp.minimum(jnp.sum(block_end_E[None, :] <= jnp.arange(n_blocks)[:, None], axis=1), e - 1)
        return _blocked_experts(x_SD, weight_R, *weights, token_R, expert_N, block_end_E[-1])

    def _local_experts(self, buf_ECD):
        buf_ECD = constrain(buf_ECD, ("act_exp", "act_capacity", "act_embed"))
        out_ECD = _swiglu_experts(buf_ECD, *self._weights(buf_ECD.dtype))
        return constrain(out_ECD, ("act_exp", "act_capacity", "act_embed"))

    def _dispatch_padded(self, x_SD, weights_SK, experts_SK, valid_S, experts_fn, global_max):
        """Scatter assignments into an ``[E, C, D]`` buffer, run ``experts_fn`` on it, combine.

        ``experts_fn`` maps the buffer to the experts' outputs in the same layout: the local
        batched matmul, or all-to-all -> local experts -> all-to-all under expert parallelism.
        ``global_max`` makes the dropless overflow test agree across every rank that takes
        part in ``experts_fn``'s collectives (identity on one device).
        """
        s, k = experts_SK.shape
        e = self.num_experts
        token_A, expert_A, weight_A = self._sort(weights_SK, experts_SK)
        group_sizes_E = jnp.bincount(expert_A, length=e)
        starts_E = jnp.cumsum(group_sizes_E) - group_sizes_E
        slot_A = jnp.arange(s * k) - starts_E[expert_A]

        def run(capacity: int):
            keep_A = slot_A < capacity
            # Dropped assignments go to an out-of-range slot, which scatter mode="drop" ignores.
            safe_slot_A = jnp.where(keep_A, slot_A, capacity)
            buf_ECD = jnp.zeros((e, capacity, x_SD.shape[1]), x_SD.dtype)
            buf_ECD = buf_ECD.at[expert_A, safe_slot_A].set(x_SD[token_A], mode="drop")
            out_ECD = experts_fn(buf_ECD)
            y_AD = out_ECD.at[expert_A, safe_slot_A].get(mode="fill", fill_value=0)
            y_SD = jnp.zeros_like(x_SD).at[token_A].add(y_AD * (weight_A * keep_A)[:, None])
            dropped = jnp.sum((~keep_A) & valid_S[token_A].astype(bool)).astype(jnp.float32)
            return y_SD, dropped

        if self.capacity_factor is not None:
            return run(max(1, math.ceil(self.capacity_factor * s * k / e)))
        # Dropless: an expert receives at most one assignment per token, so C = S never drops.
        guess = min(s, _round_up(max(1, math.ceil(2 * s * k / e)), 8))
        if guess >= s:
            return run(s)
        return jax.lax.cond(global_max(jnp.max(group_sizes_E)) <= guess, lambda: run(guess), lambda: run(s))

    # ----- expert parallelism ------------------------------------------------------------------
    def _expert_parallel(self, x_SD, weights_SK, experts_SK, valid_S):
        """Experts split over the mesh axes "exp" maps to; tokens travel by all-to-all.

        Each rank of the manual region holds its tokens (``act_tokens`` is split over the
        data-like axes, the expert axes among them) and ``E / EP`` experts. See the module
        docstring for the two dispatchers and their buffers.
        """
        ep_axes, ep = mesh_axes_of("exp")
        token_axes = _token_axes(x_SD.shape[0])
        e = self.num_experts
        if e % ep:
            raise ValueError(f"{e} experts cannot be split over {ep} expert-parallel ranks")
        if not set(ep_axes) <= set(token_axes):
            raise ValueError(
                f"expert parallelism needs the tokens split over the expert ranks too (the rules map "
                f"'exp' to {ep_axes} but 'act_tokens' to {token_axes}): EP is carved out of DP"
            )
        manual_axes = tuple(token_axes)
        ragged_a2a = _ep_ragged_collective() if self.impl == "ragged" and self.capacity_factor is None else None

        def body(x_SD, weights_SK, experts_SK, valid_S, wg, wu, wd):
            if ragged_a2a is not None:
                y_SD = self._ep_ragged(x_SD, weights_SK, experts_SK, (wg, wu, wd), ep_axes, ep, ragged_a2a)
                return y_SD, jnp.zeros((), jnp.float32)

            def experts_fn(buf_ECD):
                _, c, d = buf_ECD.shape
                el = e // ep
                # Tiled all-to-all: block r of the expert axis (rank r's experts) goes to rank
                # r; what arrives is indexed (source rank, local expert).
                recv = jax.lax.all_to_all(buf_ECD, ep_axes, 0, 0, tiled=True)
                recv_LCD = recv.reshape(ep, el, c, d).swapaxes(0, 1).reshape(el, ep * c, d)
                out_LCD = _swiglu_experts(recv_LCD, wg, wu, wd)
                out = out_LCD.reshape(el, ep, c, d).swapaxes(0, 1).reshape(e, c, d)
                return jax.lax.all_to_all(out, ep_axes, 0, 0, tiled=True)

            y_SD, dropped = self._dispatch_padded(
                x_SD, weights_SK, experts_SK, valid_S, experts_fn, lambda n: jax.lax.pmax(n, manual_axes)
            )
            return y_SD, jax.lax.psum(dropped, manual_axes)

        tokens = ("act_tokens", None)
        w_in, w_out = ("exp", "embed", "moe_mlp"), ("exp", "moe_mlp", "embed")
        run = logical_shard_map(
            body,
            in_names=(tokens, tokens, tokens, ("act_tokens",), w_in, w_in, w_out),
            out_names=(tokens, ()),
            manual=("act_tokens", "exp"),
        )
        return run(x_SD, weights_SK, experts_SK, valid_S, *self._weights(x_SD.dtype))

    def _ep_ragged(self, x_SD, weights_SK, experts_SK, weights, ep_axes, ep, ragged_a2a):
        """Dropless dispatch with ``ragged_all_to_all``: one slice per (destination, expert).

        Slices arrive grouped by local expert, then by source rank, so ``ragged_dot`` runs on
        the receive buffer as it is; the return trip swaps the offsets.
        """
        wg, wu, wd = weights
        s, k = experts_SK.shape
        e, d = self.num_experts, x_SD.shape[1]
        el = e // ep
        token_A, expert_A, weight_A = self._sort(weights_SK, experts_SK)

        def a2a(v):
            return jax.lax.all_to_all(v, ep_axes, 0, 0, tiled=True)

        send_sizes_E = jnp.bincount(expert_A, length=e).astype(jnp.int32)  # slice (dest, local expert)
        send_offsets_E = jnp.cumsum(send_sizes_E) - send_sizes_E
        recv_sizes_E = a2a(send_sizes_E)  # slice (source, local expert)
        recv_RL = recv_sizes_E.reshape(ep, el)
        by_expert = recv_RL.T.reshape(-1)
        recv_offsets_E = (jnp.cumsum(by_expert) - by_expert).reshape(el, ep).T.reshape(-1)
        # The most a rank can receive: every token of every source, once per local expert.
        max_rows = ep * s * min(k, el)
        recv_MD = ragged_a2a(
            x_SD[token_A], jnp.zeros((max_rows, d), x_SD.dtype), send_offsets_E, send_sizes_E,
            a2a(recv_offsets_E), recv_sizes_E, axis_name=ep_axes,
        )
        group_sizes_L = jnp.sum(recv_RL, axis=0)
        g_MF = jax.lax.ragged_dot(recv_MD, wg, group_sizes_L)
        h_MF = jax.nn.silu(g_MF) * jax.lax.ragged_dot(recv_MD, wu, group_sizes_L)
        out_MD = jax.lax.ragged_dot(h_MF, wd, group_sizes_L)
        y_AD = ragged_a2a(
            out_MD, jnp.zeros((s * k, d), x_SD.dtype), recv_offsets_E, recv_sizes_E,
            a2a(send_offsets_E), send_sizes_E, axis_name=ep_axes,
        )
        return jnp.zeros_like(x_SD).at[token_A].add(y_AD * weight_A[:, None])


def _swiglu_experts(x_ECD, wg_EDF, wu_EDF, wd_EFD):
    h_ECF = jax.nn.silu(jnp.einsum("ecd,edf->ecf", x_ECD, wg_EDF)) * jnp.einsum("ecd,edf->ecf", x_ECD, wu_EDF)
    return jnp.einsum("ecf,efd->ecd", h_ECF, wd_EFD)


def _swiglu_fwd(x_BD, wg_DF, wu_DF, wd_FD):
    g_BF = x_BD @ wg_DF
    u_BF = x_BD @ wu_DF
    return g_BF, u_BF, (jax.nn.silu(g_BF) * u_BF) @ wd_FD


def _swiglu_grads(g_BF, u_BF, dh_BF, r_B):
    """For rows scaled by ``r`` after ``h = silu(g) * u``, from ``dh`` (the cotangent of ``h``
    before the scale: ``dy wd^T``): the gradients of ``r``, ``g`` and ``u``. ``d r = dy . y =
    (dy wd^T) . h`` comes from the product the rest needs anyway, so ``y`` is neither kept nor
    recomputed."""
    sig_BF = jax.nn.sigmoid(g_BF)
    silu_BF = g_BF * sig_BF
    dr_B = jnp.sum(dh_BF * silu_BF * u_BF, axis=-1)
    dh_BF = dh_BF * r_B[:, None]
    return dr_B, dh_BF * u_BF * sig_BF * (1 + g_BF * (1 - sig_BF)), dh_BF * silu_BF


def _swiglu_bwd(x_BD, g_BF, u_BF, dy_BD, r_B, wg_DF, wu_DF, wd_FD):
    """Gradients of ``r * y`` for ``y = (silu(x wg) * (x wu)) wd`` scaled per row by ``r``:
    for the input, the row scales and the three weights."""
    dr_B, dg_BF, du_BF = _swiglu_grads(g_BF, u_BF, dy_BD @ wd_FD.T, r_B)
    dx_BD = dg_BF @ wg_DF.T + du_BF @ wu_DF.T
    rh_BF = jax.nn.silu(g_BF) * u_BF * r_B[:, None]
    return dx_BD, dr_B, x_BD.T @ dg_BF, x_BD.T @ du_BF, rh_BF.T @ dy_BD


def _gather_rows(v_SD, token_R, n_blocks):
    """Rows of ``v`` in block layout ``[N, b, D]``; row index ``S`` (padding) reads zeros."""
    return v_SD.at[token_R].get(mode="fill", fill_value=0).reshape(n_blocks, -1, v_SD.shape[-1])


def _blocked_fwd(x_SD, weight_R, wg_EDF, wu_EDF, wd_EFD, token_R, expert_N, used, loop):
    weights = (wg_EDF, wu_EDF, wd_EFD)
    x_NBD = _gather_rows(x_SD, token_R, expert_N.shape[0])
    if loop:
        # Only the ``used`` blocks that hold rows run: the static block count is a bound.
        def block(n, carry):
            out = _swiglu_fwd(x_NBD[n], *(w[expert_N[n]] for w in weights))
            return tuple(c.at[n].set(o) for c, o in zip(carry, out))

        f = wg_EDF.shape[-1]
        zeros = (jnp.zeros_like(x_NBD, shape=x_NBD.shape[:2] + (f,)),) * 2 + (jnp.zeros_like(x_NBD),)
        g_NBF, u_NBF, y_NBD = jax.lax.fori_loop(0, used, block, zeros)
    else:
        g_NBF, u_NBF, y_NBD = jax.vmap(_swiglu_fwd)(x_NBD, *(w[expert_N] for w in weights))
    out_RD = y_NBD.reshape(-1, x_SD.shape[-1]) * weight_R[:, None]
    y_SD = jnp.zeros_like(x_SD).at[token_R].add(out_RD, mode="drop")
    return y_SD, (x_SD, g_NBF, u_NBF, weight_R, wg_EDF, wu_EDF, wd_EFD, token_R, expert_N, used)


def _blocked_bwd(loop, res, dy_SD):
    x_SD, g_NBF, u_NBF, weight_R, wg_EDF, wu_EDF, wd_EFD, token_R, expert_N, used = res
    weights = (wg_EDF, wu_EDF, wd_EFD)
    n_blocks = expert_N.shape[0]
    x_NBD = _gather_rows(x_SD, token_R, n_blocks)
    dy_NBD = _gather_rows(dy_SD, token_R, n_blocks)
    weight_NB = weight_R.reshape(n_blocks, -1)
    per_block = (x_NBD, g_NBF, u_NBF, dy_NBD, weight_NB)
    if loop:
        def block(n, carry):
            dx_NBD, dweight_NB, *acc = carry
            e = expert_N[n]
            dx_BD, dweight_B, *dw = _swiglu_bwd(*(v[n] for v in per_block), *(w[e] for w in weights))
            return (dx_NBD.at[n].set(dx_BD), dweight_NB.at[n].set(dweight_B),
                    *(a.at[e].add(d) for a, d in zip(acc, dw)))

        zeros = tuple(jnp.zeros_like(w, jnp.float32) for w in weights)  # same varying-ness as w
        init = (jnp.zeros_like(x_NBD), jnp.zeros_like(weight_NB), *zeros)
        dx_NBD, dweight_NB, *dws = jax.lax.fori_loop(0, used, block, init)
    else:
        dx_NBD, dweight_NB, *dw_N = jax.vmap(_swiglu_bwd)(*per_block, *(w[expert_N] for w in weights))
        dws = [jax.ops.segment_sum(d, expert_N, num_segments=wg_EDF.shape[0], indices_are_sorted=True) for d in dw_N]
    dx_SD = jnp.zeros_like(x_SD).at[token_R].add(dx_NBD.reshape(-1, x_SD.shape[-1]), mode="drop")
    return (dx_SD, dweight_NB.reshape(-1), *(d.astype(w.dtype) for d, w in zip(dws, weights)), None, None, None)


@partial(jax.custom_vjp, nondiff_argnums=(8,))
def _blocked_vjp(x_SD, weight_R, wg_EDF, wu_EDF, wd_EFD, token_R, expert_N, used, loop):
    return _blocked_fwd(x_SD, weight_R, wg_EDF, wu_EDF, wd_EFD, token_R, expert_N, used, loop)[0]


_blocked_vjp.defvjp(_blocked_fwd, _blocked_bwd)


def _ragged_fwd(x_SD, weight_A, wg_EDF, wu_EDF, wd_EFD, token_A, group_sizes_E):
    x_AD = x_SD[token_A]
    g_AF = jax.lax.ragged_dot(x_AD, wg_EDF, group_sizes_E)
    u_AF = jax.lax.ragged_dot(x_AD, wu_EDF, group_sizes_E)
    y_AD = jax.lax.ragged_dot(jax.nn.silu(g_AF) * u_AF, wd_EFD, group_sizes_E)
    y_SD = jnp.zeros_like(x_SD).at[token_A].add(y_AD * weight_A[:, None])
    return y_SD, (x_SD, g_AF, u_AF, weight_A, wg_EDF, wu_EDF, wd_EFD, token_A, group_sizes_E)


def _ragged_bwd(res, dy_SD):
    x_SD, g_AF, u_AF, weight_A, wg_EDF, wu_EDF, wd_EFD, token_A, group_sizes_E = res

    def grouped(lhs, rhs):
        return jax.lax.ragged_dot(lhs, rhs, group_sizes_E)

    # out = (r * h) wd: the cotangent of (r * h) is dy wd^T, the unweighted dh that
    # :func:`_swiglu_grads` takes.
    _, down_vjp = jax.vjp(grouped, jax.nn.silu(g_AF) * u_AF * weight_A[:, None], wd_EFD)
    dh_AF, dwd = down_vjp(dy_SD[token_A])
    dweight_A, dg_AF, du_AF = _swiglu_grads(g_AF, u_AF, dh_AF, weight_A)
    x_AD = x_SD[token_A]
    _, gate_vjp = jax.vjp(grouped, x_AD, wg_EDF)
    dx_g, dwg = gate_vjp(dg_AF)
    _, up_vjp = jax.vjp(grouped, x_AD, wu_EDF)
    dx_u, dwu = up_vjp(du_AF)
    dx_SD = jnp.zeros_like(x_SD).at[token_A].add(dx_g + dx_u)
    return dx_SD, dweight_A, dwg, dwu, dwd, None, None


@jax.custom_vjp
def _ragged_experts(x_SD, weight_A, wg_EDF, wu_EDF, wd_EFD, token_A, group_sizes_E):
    """``sum over assignments a of token s: weight_A[a] * SwiGLU_{expert}(x_SD[s])`` with the
    assignments sorted by expert (``group_sizes_E`` of them each) and run as
    ``jax.lax.ragged_dot`` groups. The custom gradient keeps the tokens, the gate and up
    activations and the routing, not the gathered rows or the expert outputs (two ``[S*K, D]``
    buffers per layer that autodiff would keep); the backward gathers the rows again and
    takes the routing weights' gradient from the ``dy wd^T`` product it needs anyway. The
    matmuls' transposes are ``ragged_dot``'s own (``jax.vjp``; their forward products are
    unused and removed by XLA)."""
    return _ragged_fwd(x_SD, weight_A, wg_EDF, wu_EDF, wd_EFD, token_A, group_sizes_E)[0]


_ragged_experts.defvjp(_ragged_fwd, _ragged_bwd)


# Which form the blocked experts take: None picks by size (below); True / False force the
# block loop / the batched form (tests and benchmarks).
BLOCK_LOOP: bool | None = None


def _blocked_experts(x_SD, weight_R, wg_EDF, wu_EDF, wd_EFD, token_R, expert_N, used):
    """``sum over rows r of token s: weight_R[r] * SwiGLU_{expert of r}(x_SD[s])``, with the
    rows in blocks of ``b``: block n runs expert ``expert_N[n]``'s weights, row ``r`` reads token
    ``token_R[r]`` (``S`` for padding: a zero row, added nowhere), and only the first ``used``
    blocks hold rows (the rest are padding of the static bound).

    Two forms of the same function. *Batched*: gather each block's weights (``[N, D, F]``)
    and run one batched matmul per weight over all ``N`` blocks. *Loop*: a ``fori_loop``
    over the ``used`` blocks only, each reading its expert's weights in place, with the
    weight gradients accumulated per expert in the backward loop. The loop avoids the ``N``-fold weight copies and wins once a
    block's matmul is big enough to hide the per-iteration cost: measured on 2 CPU cores,
    the vs_hf "small" MoE layer (b*D*F = 128*512*256) ran fwd+bwd 15-25% faster as a loop,
    the tiny one (128*128*64) ran as fast either way.

    The custom gradient keeps only the tokens ``x_SD``, the gate and up activations
    ``[N, b, F]``, the routing rows and the expert weights. The backward gathers the rows
    again; the routing weights' gradient comes from the ``dy wd^T`` product
    (:func:`_swiglu_bwd`). Autodiff would keep the gathered rows and the expert outputs
    (two ``[N*b, D]`` buffers per layer) and, in the batched form, ``[N, D, F]`` copies
    of all three weights.
    """
    b, d = token_R.shape[0] // expert_N.shape[0], x_SD.shape[-1]
    loop = BLOCK_LOOP if BLOCK_LOOP is not None else b * d * wg_EDF.shape[-1] >= 4 * 2**20
    return _blocked_vjp(x_SD, weight_R, wg_EDF, wu_EDF, wd_EFD, token_R, expert_N, used, loop)


def _ep_ragged_collective():
    """``jax.lax.ragged_all_to_all`` where the backend implements it (GPU, TPU), else None:
    XLA:CPU has no ragged all-to-all, so there the padded dispatcher runs instead."""
    return jax.lax.ragged_all_to_all if jax.default_backend() in ("gpu", "tpu") else None


def ragged_all_to_all_dense(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *, axis_name):
    """``jax.lax.ragged_all_to_all``'s documented semantics from a dense ``all_to_all``.

    Every slice is padded to the operand's full length, so this moves N times the operand:
    a reference for tests of the ragged dispatcher's bookkeeping on CPU, not a fast path.
    """
    n, length = input_offsets.shape[0], operand.shape[0]
    j_L = jnp.arange(length)
    rows_NL = input_offsets[:, None] + j_L
    send = operand.at[rows_NL].get(mode="fill", fill_value=0)
    send = jnp.where((j_L < send_sizes[:, None]).reshape((n, length) + (1,) * (operand.ndim - 1)), send, 0)
    recv = jax.lax.all_to_all(send, axis_name, 0, 0, tiled=True)
    offsets_N = jax.lax.all_to_all(output_offsets, axis_name, 0, 0, tiled=True)
    dest_NL = jnp.where(j_L < recv_sizes[:, None], offsets_N[:, None] + j_L, output.shape[0])
    return output.at[dest_NL].set(recv, mode="drop")


def block_layout(assignments: int, experts: int) -> tuple[int, int]:
    """(rows per block, static block count) of the dropless blocked layout: each expert's
    rows fill whole blocks and waste less than one, so ceil(A/b) + E blocks hold any routing."""
    b = block_rows(assignments, experts)
    return b, -(-assignments // b) + experts


def _token_axes(num_tokens: int) -> tuple[str, ...]:
    """The mesh axes the MoE's tokens are split over; the token count must divide evenly."""
    token_axes, n_token_ranks = mesh_axes_of("act_tokens")
    if num_tokens % n_token_ranks:
        raise ValueError(f"{num_tokens} tokens (batch x sequence) cannot be split over {n_token_ranks} data-parallel ranks")
    return token_axes


def block_rows(assignments: int, experts: int) -> int:
    """Rows per block of the dropless grouped matmul: the largest power of two from 8 to 128
    with ``experts * b <= assignments / 2``, so block padding stays under half the routed
    rows. Larger blocks mean fewer per-block weight copies and bigger matmuls (on 2 CPU cores
    b = 128 beat 64 and 256 for the vs_hf sizes)."""
    b = 8
    while b < 128 and experts * b * 2 * 2 <= assignments:
        b *= 2
    return b


def _round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m
