"""Gated DeltaNet (mlir_train/model/gated_deltanet.py) against its oracles.

* the chunked form equals the token-by-token recurrence, and both equal HF's torch fallbacks
  (``torch_chunk_gated_delta_rule``, ``torch_recurrent_gated_delta_rule``), forward and gradient;
* a packed row equals its documents run one by one (outputs, gradients, final state), for the
  chunked and the recurrent form, with boundaries inside chunks and on chunk starts, one-token
  documents, a document id reused after padding, and a row of padding only;
* the recurrent state and the conv window carry across a split of the sequence;
* the whole layer equals HF's ``Qwen3_5GatedDeltaNet`` and ``Qwen3NextGatedDeltaNet`` (fused
  projections), and a packed layer equals HF's layer run on each document (outputs and every
  parameter's gradient);
* the FLOP count matches XLA's cost analysis of the compiled chunked function.

All in float32. ``pytest -s`` prints each comparison's max abs difference and that difference
relative to the largest reference value.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mlir_train.model import gated_deltanet as gdn
from mlir_train.model import linear_attention as la

torch = pytest.importorskip("torch")
from transformers import Qwen3_5TextConfig, Qwen3NextConfig  # noqa: E402
from transformers.models.qwen3_5 import modeling_qwen3_5  # noqa: E402
from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe  # noqa: E402
from transformers.models.qwen3_next import modeling_qwen3_next  # noqa: E402

chunk_rule = jax.jit(gdn.chunk_gated_delta_rule, static_argnames=("chunk_size",))
recurrent_rule = jax.jit(gdn.recurrent_gated_delta_rule)


def close(name, got, want, atol, relative=False):
    """``atol`` bounds the max abs difference; ``relative``: times max(1, max |want|)."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, (name, got.shape, want.shape)
    diff = float(np.abs(got - want).max()) if got.size else 0.0
    scale = float(np.abs(want).max()) if want.size else 0.0
    print(f"{name}: max abs {diff:.2e}, rel to max|ref| {diff / max(scale, 1e-30):.2e}")
    assert diff <= atol * max(1.0, scale if relative else 1.0), f"{name}: max abs diff {diff:.3e} (max|ref| {scale:.2e})"


def rule_inputs(seed, b, t, g, h, k, v):
    """q, k, v standard normal; log decays in [-1, 0) with some close to 0 (long memory); beta in (0, 1);
    an initial state of the size the recurrence produces."""
    rng = np.random.default_rng(seed)
    f = lambda *s: rng.standard_normal(s).astype(np.float32)
    decay = -rng.uniform(0.0, 1.0, (b, t, h)).astype(np.float32) ** 3
    beta = (1.0 / (1.0 + np.exp(-f(b, t, h)))).astype(np.float32)
    return dict(q=f(b, t, g, k), k=f(b, t, g, k), v=f(b, t, h, v), g=decay, beta=beta, s0=0.5 * f(b, h, k, v))


def args(x, keys=("q", "k", "v", "g", "beta")):
    return tuple(x[name] for name in keys)


# ----------------------------------------------------------------------------------------------
# The chunked form against the recurrence and HF


@pytest.mark.parametrize("b,t,g,h,k,v,c", [
    (1, 37, 1, 2, 8, 24, 16),    # T not a multiple of the chunk, V > K, q/k heads repeated 2x
    (2, 100, 2, 4, 16, 8, 64),   # two key heads each repeated 2x; one full and one partial chunk
    (1, 128, 1, 3, 32, 16, 64),  # repeated 3x, K > V, exactly two chunks
    (1, 5, 1, 2, 8, 8, 64),      # shorter than a chunk
])
def test_chunked_equals_recurrent(b, t, g, h, k, v, c):
    x = rule_inputs(0, b, t, g, h, k, v)
    o_c, s_c = chunk_rule(*args(x), None, x["s0"], chunk_size=c)
    o_r, s_r = recurrent_rule(*args(x), None, x["s0"])
    close(f"chunk vs recurrent output T={t} G={g} H={h} K={k} V={v} C={c}", o_c, o_r, 1e-5)
    close(f"chunk vs recurrent state  T={t} G={g} H={h} K={k} V={v} C={c}", s_c, s_r, 1e-5)


def _torch(x):
    return {name: torch.from_numpy(np.array(a)).requires_grad_(True) for name, a in x.items()}


@pytest.mark.parametrize("c", [1, 5, 16, 64])
def test_unit_lower_inverse_is_exact(c):
    """The UT system's inverse by block matmuls equals the float64 inverse (and its product with a
    right-hand side LAPACK's triangular solve) to float32 rounding, for power-of-two and other C,
    on a hard system (every strictly lower entry in [0, 1], as beta k.k exp(..) can be)."""
    a = np.tril(np.random.default_rng(c).uniform(0, 1, (3, c, c)), -1)
    got = np.asarray(gdn.unit_lower_inverse(jnp.asarray(a, jnp.float32)), np.float64)
    ref = np.linalg.inv(np.eye(c) + a)
    assert np.abs(got - ref).max() <= 1e-6 * np.abs(ref).max()
    assert np.all(np.triu(got, 1) == 0) and np.all(np.diagonal(got, axis1=-2, axis2=-1) == 1)


def test_chunked_form_calls_no_lapack():
    """No custom call in the chunked form's CPU program, forward or backward: jaxlib 0.10.2's
    LAPACK trsm (lax.linalg.triangular_solve on XLA:CPU) blocks XLA:CPU's intra-op pool threads
    waiting for its own batch pieces queued on that pool, and a multi-device step whose every
    device ran one at once hung (tests/train/test_qwen3_5_layouts.py)."""
    sd = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)
    loss = lambda *a: gdn.chunk_gated_delta_rule(*a, chunk_size=16)[0].sum()
    args = (sd(2, 40, 1, 8), sd(2, 40, 1, 8), sd(2, 40, 2, 8), sd(2, 40, 2), sd(2, 40, 2))
    hlo = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4))).lower(*args).compile().as_text()
    assert "custom-call" not in hlo and "trsm" not in hlo


@pytest.mark.parametrize("hf", [modeling_qwen3_next, modeling_qwen3_5, modeling_qwen3_5_moe],
                         ids=["qwen3_next", "qwen3_5", "qwen3_5_moe"])
def test_rules_equal_hf_torch_fallbacks(hf):
    x = rule_inputs(1, 2, 100, 2, 4, 16, 8)
    o_c, s_c = chunk_rule(*args(x), None, x["s0"], chunk_size=64)
    o_r, s_r = recurrent_rule(*args(x), None, x["s0"])
    xt = _torch(x)
    kw = dict(initial_state=xt["s0"], output_final_state=True, use_qk_l2norm_in_kernel=True)
    with torch.no_grad():
        o_hc, s_hc = hf.torch_chunk_gated_delta_rule(*args(xt), chunk_size=64, **kw)
        o_hr, s_hr = hf.torch_recurrent_gated_delta_rule(*args(xt), **kw)
    name = hf.__name__.rsplit(".", 1)[-1]
    close(f"{name} chunk output vs torch_chunk", o_c, o_hc.numpy(), 1e-5)
    close(f"{name} chunk state vs torch_chunk", s_c, s_hc.numpy(), 1e-5)
    close(f"{name} recurrent output vs torch_recurrent", o_r, o_hr.numpy(), 1e-5)
    close(f"{name} recurrent state vs torch_recurrent", s_r, s_hr.numpy(), 1e-5)


def test_chunked_gradients_equal_hf():
    """jax.grad of the chunked form against torch autograd through HF's chunked fallback, for
    every input and the initial state, through a loss on both the output and the final state."""
    x = rule_inputs(2, 2, 100, 2, 4, 16, 8)
    rng = np.random.default_rng(3)
    o_cot = rng.standard_normal((2, 100, 4, 8)).astype(np.float32)
    s_cot = rng.standard_normal((2, 4, 16, 8)).astype(np.float32)

    @jax.jit
    def grads(x):
        def loss(x):
            o, s = gdn.chunk_gated_delta_rule(*args(x), None, x["s0"])
            return jnp.sum(o * o_cot) + jnp.sum(s * s_cot)
        return jax.grad(loss)(x)

    got = grads(x)
    xt = _torch(x)
    o, s = modeling_qwen3_next.torch_chunk_gated_delta_rule(
        *args(xt), initial_state=xt["s0"], output_final_state=True, use_qk_l2norm_in_kernel=True)
    ((o * torch.from_numpy(o_cot)).sum() + (s * torch.from_numpy(s_cot)).sum()).backward()
    for name in x:
        close(f"grad {name} vs HF torch_chunk autograd", got[name], xt[name].grad.numpy(), 2e-5)


def test_bfloat16_inputs_run_in_float32_inside():
    x = rule_inputs(4, 1, 70, 1, 2, 16, 8)
    o32, s32 = chunk_rule(*args(x), None, x["s0"], chunk_size=64)
    x16 = {name: jnp.asarray(a, jnp.bfloat16) for name, a in x.items()}
    o16, s16 = chunk_rule(*args(x16), None, x16["s0"], chunk_size=64)
    assert o16.dtype == jnp.bfloat16 and s16.dtype == jnp.float32
    close("bf16 inputs vs float32 (output)", o16.astype(jnp.float32), o32, 5e-2)


# ----------------------------------------------------------------------------------------------
# Packing: a packed row equals its documents one by one

# Row 0: documents of 1, 15, 16, 40, 20 tokens and 8 padding: boundaries at 1, 16, 32, 72, 92
# (16 and 32 are chunk starts for C=16; 72 and 92 fall inside chunks for C=16 and C=64).
# Row 1: id 1 for 50 tokens, 10 padding, id 1 again for 40: a new document (same id, after padding).
# Row 2: padding only.
PACK_T = 100
PACK_ROWS = [[(1, 1), (2, 15), (3, 16), (4, 40), (5, 20), (0, 8)], [(1, 50), (0, 10), (1, 40)], [(0, 100)]]
PACK_DOCS = [(row, start, n) for row, layout in enumerate(PACK_ROWS)
             for start, (sid, n) in zip(np.cumsum([0] + [n for _, n in layout]), layout) if sid]
PACK_H, PACK_G, PACK_K, PACK_V = 4, 2, 16, 8


def pack_segments():
    return np.array([sum(([sid] * n for sid, n in layout), []) for layout in PACK_ROWS], np.int32)


@functools.cache
def separate_documents():
    """Every document alone, by the recurrent form without segment ids: one document per row,
    zero-filled after it (q = k = v = g = beta = 0 leaves the state exactly as it was, so each
    row's final state is its document's), the row's initial state for its first document only.
    Returns the packed inputs, the output cotangent, and per document its outputs, gradients
    (inputs and initial state) and final state."""
    b, t = len(PACK_ROWS), PACK_T
    x = rule_inputs(5, b, t, PACK_G, PACK_H, PACK_K, PACK_V)
    o_cot = np.random.default_rng(6).standard_normal((b, t, PACK_H, PACK_V)).astype(np.float32)
    length = max(n for _, _, n in PACK_DOCS)
    sep = {name: np.zeros((len(PACK_DOCS), length, *a.shape[2:]), np.float32) for name, a in x.items() if name != "s0"}
    sep["s0"] = np.zeros((len(PACK_DOCS), *x["s0"].shape[1:]), np.float32)
    sep_cot = np.zeros((len(PACK_DOCS), length, PACK_H, PACK_V), np.float32)
    for d, (row, start, n) in enumerate(PACK_DOCS):
        for name in sep:
            if name != "s0":
                sep[name][d, :n] = x[name][row, start:start + n]
        sep_cot[d, :n] = o_cot[row, start:start + n]
        if start == 0:
            sep["s0"][d] = x["s0"][row]

    @jax.jit
    def run(sep):
        def loss(sep):
            o, s = gdn.recurrent_gated_delta_rule(*args(sep), None, sep["s0"])
            return jnp.sum(o * sep_cot), (o, s)
        return jax.grad(loss, has_aux=True)(sep)

    grads, (o, s) = run(sep)
    return x, o_cot, o, grads, s


@functools.cache
def packed(form, chunk_size):
    """The packed rows through ``form``: outputs, gradients, final states, and the outputs again
    with every padding input scaled by 7 (one compiled program)."""
    x, o_cot, *_ = separate_documents()
    seg = pack_segments()
    pad = seg == 0
    rule = (functools.partial(gdn.chunk_gated_delta_rule, chunk_size=chunk_size) if form == "chunk"
            else gdn.recurrent_gated_delta_rule)

    @jax.jit
    def run(x):
        def loss(x):
            o, s = rule(*args(x), seg, x["s0"])
            return jnp.sum(o * o_cot), (o, s)
        grads, (o, s) = jax.grad(loss, has_aux=True)(x)
        scaled = {name: jnp.where(pad.reshape(pad.shape + (1,) * (a.ndim - 2)), 7.0 * a, a) for name, a in x.items()
                  if name != "s0"}
        return grads, o, s, rule(*args(scaled), seg, x["s0"])[0]

    return run(x)


PACKED_FORMS = [("chunk", 16), ("chunk", 64), ("recurrent", 0)]


@pytest.mark.parametrize("form,chunk_size", PACKED_FORMS)
def test_packed_row_equals_documents_one_by_one(form, chunk_size):
    _, _, o_sep, g_sep, s_sep = separate_documents()
    grads, o, s, _ = packed(form, chunk_size)
    tag = f"{form}" + (f" C={chunk_size}" if chunk_size else "")
    for d, (row, start, n) in enumerate(PACK_DOCS):
        close(f"packed {tag} doc {d} output", o[row, start:start + n], o_sep[d, :n], 1e-5)
        for name in ("q", "k", "v", "g", "beta"):
            close(f"packed {tag} doc {d} grad {name}", grads[name][row, start:start + n], g_sep[name][d, :n], 2e-5)
        if start == 0:
            close(f"packed {tag} doc {d} grad initial state", grads["s0"][row], g_sep["s0"][d], 2e-5)
    # Row 1 ends with a document: its final state is that document's.
    close(f"packed {tag} final state of row 1", s[1], s_sep[PACK_DOCS.index((1, 60, 40))], 1e-5)


@pytest.mark.parametrize("form,chunk_size", PACKED_FORMS)
def test_padding_is_inert(form, chunk_size):
    """Padding positions (row 0's tail, row 1's middle, all of row 2) output exact zeros and take
    exactly no gradient, row 2's initial state (which only padding could read) gets none either,
    and no output depends on the padding's values."""
    grads, o, _, o_scaled_padding = packed(form, chunk_size)
    pad = pack_segments() == 0
    assert np.all(np.asarray(o)[pad] == 0)
    for name in ("q", "k", "v", "g", "beta"):
        assert np.all(np.asarray(grads[name])[pad] == 0), name
    assert np.all(np.asarray(grads["s0"])[2] == 0)
    close(f"{form} output with the padding's inputs scaled by 7", o_scaled_padding, o, 0.0)


# ----------------------------------------------------------------------------------------------
# States across a split (what context parallelism will pass between ranks)


def _continues(seg, split):
    """1.0 per row where the token after the split continues the document before it, else 0.0:
    the state is passed on only within a document."""
    return (seg[:, split - 1] == seg[:, split]).astype(np.float32)


@pytest.mark.parametrize("form", ["chunk", "recurrent"])
def test_state_carries_across_a_split(form):
    """Split at 50 (not a chunk multiple for C=16): row 0 starts a document there (the state is
    not passed on), row 1 splits one (it is), row 2 is one document whose first part starts from
    an initial state."""
    t, split = 100, 50
    seg = np.array([[1] * 30 + [2] * 20 + [3] * 50, [1] * 20 + [2] * 60 + [3] * 20, [1] * 100], np.int32)
    x = rule_inputs(7, 3, t, 1, 2, 16, 8)
    run = (lambda *a: chunk_rule(*a, chunk_size=16)) if form == "chunk" else recurrent_rule
    o, s = run(*args(x), seg, x["s0"])
    first = {name: a[:, :split] for name, a in x.items() if name != "s0"}
    second = {name: a[:, split:] for name, a in x.items() if name != "s0"}
    o1, s1 = run(*args(first), seg[:, :split], x["s0"])
    o2, s2 = run(*args(second), seg[:, split:], s1 * _continues(seg, split)[:, None, None, None])
    close(f"{form} split at {split}: outputs", np.concatenate([o1, o2], axis=1), o, 1e-5)
    close(f"{form} split at {split}: final state", s2, s, 1e-5)


# ----------------------------------------------------------------------------------------------
# The causal conv


def hf_conv(x_TE, w_WE):
    xt = torch.from_numpy(np.ascontiguousarray(x_TE.T[None]))
    return modeling_qwen3_5.causal_conv1d_fn(xt, torch.from_numpy(np.ascontiguousarray(w_WE.T)), None,
                                             activation="silu")[0].numpy().T


def test_conv_restarts_at_document_boundaries():
    rng = np.random.default_rng(8)
    width, e = 4, 6
    layouts = [[(1, 2), (2, 10), (3, 1), (4, 6), (5, 14), (0, 7)],  # a document starts 1 token before the split
               [(1, 20), (2, 20)],                                   # one starts at the split
               [(1, 40)]]
    seg = np.array([sum(([sid] * n for sid, n in layout), []) for layout in layouts], np.int32)
    x = rng.standard_normal((3, 40, e)).astype(np.float32)
    w = rng.standard_normal((width, e)).astype(np.float32)
    conv = jax.jit(gdn.causal_conv1d)
    y, _ = conv(x, w, seg)
    for row, layout in enumerate(layouts):
        start = 0
        for sid, n in layout:
            close(f"conv row {row} doc of {n} (id {sid}) vs HF causal_conv1d_fn alone", y[row, start:start + n],
                  hf_conv(x[row, start:start + n], w), 1e-6)
            start += n
    # The window carries across a split within a document (only that document's inputs) and
    # restarts at one; splits at 2 (fewer tokens before it than the window) and 20.
    for split in (2, 20):
        y1, c1 = conv(x[:, :split], w, seg[:, :split])
        y2, _ = conv(x[:, split:], w, seg[:, split:], c1 * _continues(seg, split)[:, None, None])
        close(f"conv split at {split}", np.concatenate([y1, y2], axis=1), y, 1e-6)


# ----------------------------------------------------------------------------------------------
# The layer against HF's

D, G, H, K, V, W = 32, 2, 4, 16, 8, 4
HF_KW = dict(hidden_size=D, linear_num_key_heads=G, linear_num_value_heads=H, linear_key_head_dim=K,
             linear_value_head_dim=V, linear_conv_kernel_dim=W, num_hidden_layers=1, layer_types=["linear_attention"],
             num_attention_heads=2, num_key_value_heads=1, head_dim=16)


def hf_layer(cls, config, seed):
    torch.manual_seed(seed)
    layer = cls(config, 0)
    with torch.no_grad():  # every parameter random (weights at 1/sqrt(fan-in)), so that a misplaced one shows
        for p in layer.parameters():
            p.copy_(torch.randn_like(p) / (p.shape[-1] ** 0.5 if p.ndim > 1 else 1.0))
        layer.A_log.copy_(torch.empty(H).uniform_(0.01, 2.0).log())
        layer.norm.weight.add_(1.0)
    return layer


def to_ours(sd):
    """HF Qwen3.5 ``linear_attn.*`` tensors (numpy, torch layout) as our parameters (weights and
    gradients map the same way)."""
    qkv, conv = sd["in_proj_qkv.weight"], sd["conv1d.weight"][:, 0, :]
    return {
        "wq_DGK": qkv[:G * K].T.reshape(D, G, K), "wk_DGK": qkv[G * K:2 * G * K].T.reshape(D, G, K),
        "wv_DHV": qkv[2 * G * K:].T.reshape(D, H, V), "wz_DHV": sd["in_proj_z.weight"].T.reshape(D, H, V),
        "wb_DH": sd["in_proj_b.weight"].T, "wa_DH": sd["in_proj_a.weight"].T,
        "conv_q_WGK": conv[:G * K].T.reshape(W, G, K), "conv_k_WGK": conv[G * K:2 * G * K].T.reshape(W, G, K),
        "conv_v_WHV": conv[2 * G * K:].T.reshape(W, H, V),
        "dt_bias_H": sd["dt_bias"], "a_log_H": sd["A_log"], "norm_V": sd["norm.weight"],
        "wout_HVD": sd["out_proj.weight"].T.reshape(H, V, D),
    }


def our_layer(sd):
    """Our layer holding HF's values (created abstractly: an eager random init of every parameter
    costs seconds of small compiles)."""
    graphdef, state = nnx.split(nnx.eval_shape(lambda: la.GatedDeltaNet(D, G, H, K, V, conv_width=W, rngs=nnx.Rngs(0))))
    nnx.replace_by_pure_dict(state, {name: jnp.asarray(value) for name, value in to_ours(sd).items()})
    return nnx.merge(graphdef, state)


def numpy_sd(module, grads=False):
    return {name: (p.grad if grads else p).detach().numpy().copy() for name, p in module.named_parameters()}


@functools.cache
def layer_with_state():
    return jax.jit(lambda layer, x, seg, state: layer(x, seg, state))


def test_layer_equals_hf_qwen3_5():
    hf = hf_layer(modeling_qwen3_5.Qwen3_5GatedDeltaNet, Qwen3_5TextConfig(**HF_KW), 9)
    x = np.random.default_rng(10).standard_normal((2, 70, D)).astype(np.float32)
    with torch.no_grad():
        want = hf(torch.from_numpy(x)).numpy()
    layer = our_layer(numpy_sd(hf))
    got, _ = layer_with_state()(layer, x, np.ones((2, 70), np.int32), layer.zero_state(2))
    close("layer vs HF Qwen3_5GatedDeltaNet", got, want, 2e-6, relative=True)


def test_layer_equals_hf_qwen3_next_through_the_fused_projection_split():
    hf = hf_layer(modeling_qwen3_next.Qwen3NextGatedDeltaNet, Qwen3NextConfig(**HF_KW), 11)
    sd = numpy_sd(hf)
    qkv, z, b, a = gdn.split_qwen3_next_projections(sd.pop("in_proj_qkvz.weight"), sd.pop("in_proj_ba.weight"), G, H, K, V)
    sd.update({"in_proj_qkv.weight": qkv, "in_proj_z.weight": z, "in_proj_b.weight": b, "in_proj_a.weight": a})
    x = np.random.default_rng(12).standard_normal((2, 70, D)).astype(np.float32)
    with torch.no_grad():
        want = hf(torch.from_numpy(x)).numpy()
    layer = our_layer(sd)
    got, _ = layer_with_state()(layer, x, np.ones((2, 70), np.int32), layer.zero_state(2))
    close("layer vs HF Qwen3NextGatedDeltaNet (fused in_proj_qkvz/ba split)", got, want, 2e-6, relative=True)
    qkvz, ba = gdn.fuse_qwen3_next_projections(qkv, z, b, a, G, H, K, V)
    hf_sd = numpy_sd(hf)
    assert np.array_equal(qkvz, hf_sd["in_proj_qkvz.weight"]) and np.array_equal(ba, hf_sd["in_proj_ba.weight"])


def test_layer_state_carries_across_a_split():
    """The layer's state (conv windows and recurrent state) passed from the first half of a row
    to the second gives the whole row: row 0 is split inside a document, row 1 at a document
    start (where the state is not passed on)."""
    layer = our_layer(numpy_sd(hf_layer(modeling_qwen3_5.Qwen3_5GatedDeltaNet, Qwen3_5TextConfig(**HF_KW), 15)))
    x = np.random.default_rng(16).standard_normal((2, 70, D)).astype(np.float32)
    seg = np.array([[1] * 20 + [2] * 50, [1] * 35 + [2] * 35], np.int32)
    run = layer_with_state()
    y, state = run(layer, x, seg, layer.zero_state(2))
    y1, state1 = run(layer, x[:, :35], seg[:, :35], layer.zero_state(2))
    keep = _continues(seg, 35)
    state1 = la.GatedDeltaNetState(*(s * keep.reshape((2,) + (1,) * (s.ndim - 1)) for s in state1))
    y2, state2 = run(layer, x[:, 35:], seg[:, 35:], state1)
    close("layer split at 35: outputs", np.concatenate([y1, y2], axis=1), y, 2e-6, relative=True)
    for name, got, want in zip(la.GatedDeltaNetState._fields, state2, state):
        close(f"layer split at 35: final {name}", got, want, 2e-6, relative=True)


def test_packed_layer_equals_hf_layer_per_document():
    """One packed row through our layer against HF's layer run on each document alone: outputs,
    the input gradient and every parameter's gradient (summed over the documents)."""
    hf = hf_layer(modeling_qwen3_5.Qwen3_5GatedDeltaNet, Qwen3_5TextConfig(**HF_KW), 13)
    layout = [(1, 7), (2, 1), (3, 70), (4, 13), (0, 5)]  # 96 tokens: boundaries inside and across chunks of 64
    seg = np.array([sum(([sid] * n for sid, n in layout), [])], np.int32)
    rng = np.random.default_rng(14)
    x = rng.standard_normal((1, seg.shape[1], D)).astype(np.float32)
    y_cot = rng.standard_normal(x.shape).astype(np.float32)

    layer = our_layer(numpy_sd(hf))
    graphdef, params = nnx.split(layer)

    @jax.jit
    def run(params, x):
        def loss(params, x):
            y = nnx.merge(graphdef, params)(x, seg)[0]
            return jnp.sum(y * y_cot), y
        return jax.grad(loss, argnums=(0, 1), has_aux=True)(params, x)

    (g_params, g_x), y = run(params, x)
    g_params = {name: np.asarray(v) for name, v in nnx.to_pure_dict(g_params).items()}

    start = 0
    for sid, n in layout:
        xt = torch.from_numpy(x[:, start:start + n].copy()).requires_grad_(True)
        yt = hf(xt)
        if sid:
            close(f"packed layer doc of {n} vs HF alone (output)", y[:, start:start + n], yt.detach().numpy(), 2e-6, relative=True)
            (yt * torch.from_numpy(y_cot[:, start:start + n])).sum().backward()
            close(f"packed layer doc of {n} vs HF alone (input grad)", g_x[:, start:start + n], xt.grad.numpy(), 1e-5, relative=True)
        else:
            assert np.all(np.asarray(y[:, start:start + n]) == 0) and np.all(np.asarray(g_x[:, start:start + n]) == 0)
        start += n
    want = to_ours(numpy_sd(hf, grads=True))
    for name, value in want.items():
        close(f"packed layer grad {name} vs HF summed over documents", g_params[name], value, 1e-5, relative=True)


# ----------------------------------------------------------------------------------------------
# FLOPs


def test_megatron_count_by_hand():
    # Qwen3.5-35B-A3B / Qwen3-Next-80B-A3B linear attention: D=2048, G=16, H=32, K=V=128, W=4.
    # in_proj 2048*(4096+8192+64) = 25,296,896; conv 4*(4096+4096) = 32,768;
    # core 4*32*128^2 = 2,097,152; out_proj 2048*4096 = 8,388,608; sum 35,815,424, times 2.
    assert gdn.megatron_flops_per_token(2048, 16, 32, 128, 128, 4) == 2 * 35_815_424
    # The chunked core at C=64: 32 * (6*128*128 + 4*64*128 + 2*64*128 + 2*64*256 + 2*4095/3)
    # = 32 * (98,304 + 32,768 + 16,384 + 32,768 + 2,730) = 32 * 182,954.
    assert gdn.chunk_flops_per_token(32, 128, 128, 64) == 32 * 182_954


@pytest.mark.parametrize("b,t,g,h,k,v,c", [(1, 256, 1, 2, 128, 128, 64), (2, 200, 2, 4, 64, 32, 32)])
def test_chunk_flops_match_xla_cost_analysis(b, t, g, h, k, v, c):
    """XLA's count of the compiled chunked function (its scan unrolled, or XLA counts the loop
    body once) against the analytic count, every term of it (the UT system is inverted by
    matmuls, which XLA counts); what XLA counts beyond the matmuls is the elementwise work
    (decays, masks, norms)."""
    sd = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)
    fn = jax.jit(functools.partial(gdn.chunk_gated_delta_rule, chunk_size=c, unroll=True))
    cost = fn.lower(sd(b, t, g, k), sd(b, t, g, k), sd(b, t, h, v), sd(b, t, h), sd(b, t, h)).compile().cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    analytic = gdn.chunk_flops(b, t, h, k, v, c)
    ratio = cost["flops"] / analytic
    print(f"XLA flops / analytic at T={t} H={h} K={k} V={v} C={c}: {ratio:.3f}")
    assert 1.0 <= ratio <= 1.2
