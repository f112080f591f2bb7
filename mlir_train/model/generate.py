"""Greedy and sampled text generation for the notebooks and the trainer's before/after answers.

The model has no KV cache, so every step recomputes the full forward over a fixed-size buffer:
``steps * L`` token-forwards where a cache would need about ``L``. That is fine for the tiny and
small models this serves (a few prompts, a few hundred tokens); it is not a serving path.

The whole loop is one ``jax.jit`` program (a ``lax.while_loop`` over steps). Prompts are
left-aligned in a ``[B, L]`` buffer, ``L = longest prompt + max_new_tokens`` rounded up to a
multiple of 16; at step ``t`` row ``b`` reads the logits at position ``len_b + t - 1`` and writes
its next token at ``len_b + t``. Filled positions carry segment id 1 and the rest segment id 0
(padding, also to the MoE router), so with the causal mask a row's next token depends only on
its own tokens: a batch gives each prompt the same answer it gets alone. A row stops at its
first eos token; the loop ends when every row has stopped or after ``max_new_tokens`` steps.

Shape suffixes: B rows (prompts), L buffer length, N new tokens, V vocab, D hidden.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

_BUFFER_MULTIPLE = 16


@dataclasses.dataclass(frozen=True)
class Generation:
    """One prompt's continuation: the new tokens (without the eos that ended them, if any)."""

    tokens: list[int]
    text: str | None  # decoded ``tokens`` when a tokenizer was given
    stopped_at_eos: bool


def generate(
    model,
    tokenizer,
    prompts: Sequence[str] | Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int = 0,
    eos_token_id: int | Sequence[int] | None = None,
) -> list[Generation]:
    """Continue each prompt by up to ``max_new_tokens`` tokens.

    ``model`` is a :class:`mlir_train.model.CausalLM` (any family's). ``prompts`` are strings (encoded with
    ``tokenizer``, no special tokens added: apply a chat template first if wanted) or lists of
    token ids. ``temperature == 0`` is greedy (argmax); otherwise tokens are sampled from
    ``softmax(logits / temperature)`` restricted to the ``top_k`` most likely tokens and/or the
    smallest set whose probability reaches ``top_p`` (nucleus), with a fixed ``seed``.
    ``eos_token_id`` (one id or several) defaults to the tokenizer's eos; with neither, rows run
    the full ``max_new_tokens``. Each step recomputes the full forward over the whole buffer
    (there is no KV cache): meant for small models and short answers, not for serving.
    """
    _check_sampling(model.cfg.vocab_size, max_new_tokens, temperature, top_k, top_p)
    token_lists = [_encode(p, tokenizer) for p in prompts]
    if not token_lists:
        return []
    if any(len(t) == 0 for t in token_lists):
        raise ValueError("every prompt needs at least one token")
    eos_ids = _eos_ids(eos_token_id, tokenizer)
    ids_BL, lengths = _prompt_buffer(token_lists, max_new_tokens, model.cfg.max_position_embeddings)

    graphdef, state = nnx.split(model)
    new_BN, num_new_B, stopped_B = _generate_ids(
        graphdef, state, jnp.asarray(ids_BL), jnp.asarray(lengths),
        jnp.asarray(eos_ids, jnp.int32), jax.random.key(seed), jnp.float32(temperature),
        jnp.int32(top_k or model.cfg.vocab_size), jnp.float32(1.0 if top_p is None else top_p),
        max_new_tokens=max_new_tokens,
    )
    new_BN, num_new_B, stopped_B = jax.device_get((new_BN, num_new_B, stopped_B))
    out = []
    for row in range(len(token_lists)):
        toks = [int(t) for t in new_BN[row, : num_new_B[row]]]
        text = tokenizer.decode(toks, skip_special_tokens=True) if tokenizer is not None else None
        out.append(Generation(tokens=toks, text=text, stopped_at_eos=bool(stopped_B[row])))
    return out


def _check_sampling(vocab_size: int, max_new_tokens: int, temperature: float, top_k: int | None,
                    top_p: float | None) -> None:
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if top_k is not None and not 1 <= top_k <= vocab_size:
        raise ValueError(f"top_k must be in [1, vocab_size={vocab_size}], got {top_k}")
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")


def _eos_ids(eos_token_id: int | Sequence[int] | None, tokenizer) -> list[int]:
    """The ids that end a row (the tokenizer's eos by default), padded to at least 4."""
    if eos_token_id is None and tokenizer is not None:
        eos_token_id = tokenizer.eos_token_id
    if eos_token_id is None:
        eos_ids = []
    elif np.isscalar(eos_token_id):
        eos_ids = [int(eos_token_id)]
    else:
        eos_ids = [int(i) for i in eos_token_id]
    eos_ids += [-1] * max(0, 4 - len(eos_ids))  # pad with an id no token has: fewer recompiles
    return eos_ids


def _prompt_buffer(token_lists: list[list[int]], max_new_tokens: int, limit: int) -> tuple[np.ndarray, np.ndarray]:
    """``(ids [B, L], prompt lengths [B])``: the prompts left-aligned in a buffer with room for
    ``max_new_tokens`` more, its length rounded up to a multiple of 16 (at most ``limit``, the
    model's max_position_embeddings)."""
    lengths = np.array([len(t) for t in token_lists], np.int32)
    needed = int(lengths.max()) + max_new_tokens
    if needed > limit:
        raise ValueError(f"longest prompt + max_new_tokens = {needed} exceeds the model's "
                         f"max_position_embeddings ({limit})")
    # Round the buffer up so nearby prompt lengths reuse one compiled program.
    buffer_len = min(limit, -(-needed // _BUFFER_MULTIPLE) * _BUFFER_MULTIPLE)
    ids_BL = np.zeros((len(token_lists), buffer_len), np.int32)
    for row, toks in enumerate(token_lists):
        ids_BL[row, : len(toks)] = toks
    return ids_BL, lengths


def _encode(prompt, tokenizer) -> list[int]:
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError("string prompts need a tokenizer; pass token id lists otherwise")
        return list(tokenizer(prompt, add_special_tokens=False)["input_ids"])
    return [int(t) for t in prompt]


def _sample(logits_BV, key, temperature, top_k, top_p):
    """Argmax when ``temperature == 0``, else a draw from the top-k / nucleus-filtered softmax.

    All four knobs are traced, so greedy and every sampling setting share one compiled program.
    """
    greedy_B = jnp.argmax(logits_BV, axis=-1)
    scaled_BV = logits_BV / jnp.maximum(temperature, 1e-6)
    sorted_BV = -jnp.sort(-scaled_BV, axis=-1)
    kth_B1 = jax.lax.dynamic_index_in_dim(sorted_BV, top_k - 1, axis=1)
    probs_BV = jax.nn.softmax(sorted_BV, axis=-1)
    # Nucleus: keep a token if the probability mass strictly before it is below top_p (so the
    # most likely token always survives); top_p == 1 keeps everything, rounding aside.
    kept_BV = ((jnp.cumsum(probs_BV, axis=-1) - probs_BV) < top_p) | (top_p >= 1.0)
    nucleus_B1 = jnp.min(jnp.where(kept_BV, sorted_BV, jnp.inf), axis=-1, keepdims=True)
    cutoff_B1 = jnp.maximum(kth_B1, nucleus_B1)
    filtered_BV = jnp.where(scaled_BV < cutoff_B1, -jnp.inf, scaled_BV)
    sampled_B = jax.random.categorical(key, filtered_BV, axis=-1)
    return jnp.where(temperature == 0.0, greedy_B, sampled_B).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("graphdef", "max_new_tokens"))
def _generate_ids(graphdef, state, ids_BL, lengths_B, eos_ids, key, temperature, top_k, top_p, *,
                  max_new_tokens: int):
    model = nnx.merge(graphdef, state)
    b, buffer_len = ids_BL.shape
    rows_B = jnp.arange(b)
    positions_L = jnp.arange(buffer_len, dtype=jnp.int32)

    def step(carry):
        t, ids_BL, new_BN, num_new_B, done_B = carry
        cur_len_B = lengths_B + num_new_B  # stopped rows stop growing
        segment_ids_BL = (positions_L[None, :] < cur_len_B[:, None]).astype(jnp.int32)
        h_BLD, _ = model.hidden_states(ids_BL, segment_ids=segment_ids_BL)
        # Only the last filled position of each row needs the LM head.
        h_B1D = h_BLD[rows_B, cur_len_B - 1][:, None, :]
        logits_BV = model.logits(h_B1D)[:, 0, :].astype(jnp.float32)
        next_B = _sample(logits_BV, jax.random.fold_in(key, t), temperature, top_k, top_p)
        is_eos_B = jnp.any(next_B[:, None] == eos_ids[None, :], axis=-1)
        write_B = ~done_B & ~is_eos_B
        # Rows that are done or hit eos write nowhere (out-of-range index, dropped).
        ids_BL = ids_BL.at[rows_B, jnp.where(write_B, cur_len_B, buffer_len)].set(next_B, mode="drop")
        new_BN = new_BN.at[rows_B, jnp.where(write_B, num_new_B, max_new_tokens)].set(next_B, mode="drop")
        return t + 1, ids_BL, new_BN, num_new_B + write_B, done_B | is_eos_B

    def not_finished(carry):
        t, *_, done_B = carry
        return (t < max_new_tokens) & ~jnp.all(done_B)

    init = (jnp.int32(0), ids_BL, jnp.zeros((b, max_new_tokens), jnp.int32),
            jnp.zeros((b,), jnp.int32), jnp.zeros((b,), jnp.bool_))
    _, _, new_BN, num_new_B, done_B = jax.lax.while_loop(not_finished, step, init)
    return new_BN, num_new_B, done_B
