"""Megatron's optimizer semantics: AdamW/SGD steps, the no-decay mask, clipping, loss scaling."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from mlir_train.config import cli
from mlir_train.train import build
from mlir_train.train.optim import (
    LossScaler,
    all_finite,
    global_norm,
    make_optimizer,
    select_tree,
    weight_decay_mask,
)

L, H, D, E, F, V = 3, 8, 4, 2, 6, 16


def _params():
    """A pytree shaped like our stacked NNX model's pure state."""
    z = jnp.zeros
    return {
        "embed": z((V, H)),
        "layers": {
            0: {
                "input_norm": {"scale": z((L, H))},
                "attn": {"q_proj": z((L, H, 2, D)), "q_norm": {"scale": z((L, D))}, "o_bias": {"bias": z((L, H))}},
                "mlp": {"router": z((L, H, E)), "gate_proj": z((L, E, H, F))},
                "gain": z((L, H)),  # an unnamed per-layer vector: 1-D per layer -> no decay
            }
        },
        "final_norm": {"scale": z((H,))},
        "lm_head": z((H, V)),
        "vector": z((H,)),
    }


def test_weight_decay_mask_by_role():
    mask = weight_decay_mask(_params())
    layer = mask["layers"][0]
    assert mask["embed"] and mask["lm_head"]
    assert layer["attn"]["q_proj"] and layer["mlp"]["router"] and layer["mlp"]["gate_proj"]
    assert not layer["input_norm"]["scale"] and not layer["attn"]["q_norm"]["scale"]
    assert not layer["attn"]["o_bias"]["bias"] and not layer["gain"]
    assert not mask["final_norm"]["scale"] and not mask["vector"]


def test_mask_works_through_nnx_optimizer():
    """nnx.Optimizer hands optax Variables at init and plain arrays at update: the mask must
    follow whichever tree it gets. With zero grads Adam's step is zero, so only decay moves."""

    class Tiny(nnx.Module):
        def __init__(self, rngs):
            self.proj = nnx.Linear(4, 4, rngs=rngs)
            self.norm = nnx.RMSNorm(4, rngs=rngs)
            self.proj.bias[...] = jnp.ones(4)

    model = Tiny(nnx.Rngs(0))
    before = jax.tree_util.tree_map(np.asarray, nnx.as_pure(nnx.state(model, nnx.Param)))
    tx = make_optimizer(lr_schedule=0.1, weight_decay=0.5, clip_grad=1.0)
    opt = nnx.Optimizer(model, tx, wrt=nnx.Param)
    grads = jax.tree_util.tree_map(jnp.zeros_like, nnx.state(model, nnx.Param))
    opt.update(model, grads)
    after = nnx.as_pure(nnx.state(model, nnx.Param))
    np.testing.assert_allclose(after["proj"]["kernel"], before["proj"]["kernel"] * (1 - 0.1 * 0.5), rtol=1e-6)
    np.testing.assert_array_equal(after["proj"]["bias"], before["proj"]["bias"])
    np.testing.assert_array_equal(after["norm"]["scale"], before["norm"]["scale"])


def _adamw_reference(p, grads, lr, wd, b1, b2, eps, clip):
    """Megatron (apex/TE FusedAdam, adam_w_mode): clip, moments, bias correction, decoupled decay."""
    m = {k: np.zeros_like(v) for k, v in p.items()}
    v = {k: np.zeros_like(x) for k, x in p.items()}
    p = {k: x.copy() for k, x in p.items()}
    decay = {"w": wd, "norm_scale": 0.0}
    for t, g in enumerate(grads, start=1):
        norm = np.sqrt(sum(np.sum(x.astype(np.float64) ** 2) for x in g.values()))
        coeff = min(1.0, clip / (norm + 1e-6))
        for k in p:
            gk = g[k] * coeff
            m[k] = b1 * m[k] + (1 - b1) * gk
            v[k] = b2 * v[k] + (1 - b2) * gk**2
            update = (m[k] / (1 - b1**t)) / (np.sqrt(v[k] / (1 - b2**t)) + eps)
            p[k] = p[k] - lr * (update + decay[k] * p[k])
    return p


def test_adamw_steps_match_hand_computation():
    rng = np.random.default_rng(0)
    p0 = {"w": rng.normal(size=(5, 3)).astype(np.float32), "norm_scale": rng.normal(size=(3,)).astype(np.float32)}
    grads = [{k: rng.normal(size=x.shape).astype(np.float32) * s for k, x in p0.items()} for s in (0.1, 3.0, 0.5)]
    kw = dict(lr=0.01, wd=0.1, b1=0.9, b2=0.95, eps=1e-8, clip=1.0)  # the seed's values
    tx = make_optimizer(lr_schedule=kw["lr"], weight_decay=kw["wd"], beta1=kw["b1"], beta2=kw["b2"],
                        eps=kw["eps"], clip_grad=kw["clip"])
    params = jax.tree_util.tree_map(jnp.asarray, p0)
    state = tx.init(params)
    step = jax.jit(lambda g, s, p: tx.update(g, s, p))
    for g in grads:
        upd, state = step(jax.tree_util.tree_map(jnp.asarray, g), state, params)
        params = optax.apply_updates(params, upd)
    expected = _adamw_reference(p0, grads, **kw)
    for k in p0:
        np.testing.assert_allclose(np.asarray(params[k]), expected[k], rtol=1e-5, atol=1e-7)


def test_clipping_is_megatrons_global_norm():
    g = {"a": jnp.full((4,), 3.0), "b": jnp.full((2, 2), 4.0)}  # norm = sqrt(36 + 64) = 10
    assert float(global_norm(g)) == pytest.approx(10.0)
    tx = make_optimizer(lr_schedule=1.0, weight_decay=0.0, clip_grad=2.0, optimizer="sgd", sgd_momentum=0.0)
    upd, _ = tx.update(g, tx.init(g), g)
    coeff = 2.0 / (10.0 + 1e-6)
    np.testing.assert_allclose(upd["a"], -3.0 * coeff, rtol=1e-6)
    np.testing.assert_allclose(upd["b"], -4.0 * coeff, rtol=1e-6)
    small = jax.tree_util.tree_map(lambda x: x / 100, g)  # norm 0.1 < 2: untouched
    upd, _ = tx.update(small, tx.init(g), g)
    np.testing.assert_allclose(upd["a"], -0.03, rtol=1e-6)
    no_clip = make_optimizer(lr_schedule=1.0, weight_decay=0.0, clip_grad=0.0, optimizer="sgd", sgd_momentum=0.0)
    upd, _ = no_clip.update(g, no_clip.init(g), g)
    np.testing.assert_allclose(upd["a"], -3.0, rtol=1e-6)


def test_sgd_is_torch_sgd_with_coupled_decay_and_momentum():
    p = {"w": jnp.array([[1.0, -2.0]]), "norm": {"scale": jnp.array([1.0, 1.0])}}
    grads = [{"w": jnp.array([[0.1, 0.2]]), "norm": {"scale": jnp.array([0.3, -0.1])}},
             {"w": jnp.array([[-0.2, 0.1]]), "norm": {"scale": jnp.array([0.1, 0.1])}}]
    lr, wd, mu = 0.5, 0.1, 0.9
    tx = make_optimizer(lr_schedule=lr, weight_decay=wd, clip_grad=0.0, optimizer="sgd", sgd_momentum=mu)
    state, params = tx.init(p), p
    ref = {k: np.asarray(v) for k, v in {"w": p["w"], "s": p["norm"]["scale"]}.items()}
    buf = {k: None for k in ref}
    for g in grads:
        upd, state = tx.update(g, state, params)
        params = optax.apply_updates(params, upd)
        for k, gk, decay in (("w", g["w"], wd), ("s", g["norm"]["scale"], 0.0)):
            d = np.asarray(gk) + decay * ref[k]
            buf[k] = d if buf[k] is None else mu * buf[k] + d
            ref[k] = ref[k] - lr * buf[k]
    np.testing.assert_allclose(params["w"], ref["w"], rtol=1e-6)
    np.testing.assert_allclose(params["norm"]["scale"], ref["s"], rtol=1e-6)


def test_dynamic_loss_scale_hysteresis_backoff_growth():
    s = LossScaler(initial_scale=1024.0, min_scale=200.0, growth_interval=3, hysteresis=2)
    update = jax.jit(s.update)
    st = s.init()
    trace = []
    for found_inf in [True, True, True, False, False, False, False, True, True, True]:
        st = update(st, jnp.asarray(found_inf))
        trace.append((float(st.scale), int(st.growth_tracker), int(st.hysteresis_tracker)))
    assert trace == [
        (1024.0, 0, 1),  # first overflow: skipped, hysteresis absorbs it
        (512.0, 0, 0),  # second: back off
        (256.0, 0, -1),  # and again (hysteresis is only reset by growth)
        (256.0, 1, -1),
        (256.0, 2, -1),
        (512.0, 0, 2),  # 3 clean steps: grow, reset hysteresis
        (512.0, 1, 2),
        (512.0, 0, 1),
        (256.0, 0, 0),
        (200.0, 0, -1),  # clamped at --min-loss-scale
    ]


def test_fp16_step_skips_on_overflow_and_keeps_schedule():
    scaler = LossScaler(initial_scale=1024.0, growth_interval=1000, hysteresis=1)
    tx = make_optimizer(lr_schedule=lambda c: 0.1 * (c + 1), weight_decay=0.0, clip_grad=1.0)

    @jax.jit
    def step(params, opt_state, ls_state, x):
        def loss_fn(p):
            return jnp.sum(p["w"] * x).astype(jnp.float16) * ls_state.scale.astype(jnp.float16)

        # As the trainer does: the gradient of the scaled loss, unscaled in float32.
        grads = jax.tree.map(lambda g: g.astype(jnp.float32) / ls_state.scale, jax.grad(loss_fn)(params))
        finite = all_finite(grads)
        upd, new_opt = tx.update(grads, opt_state, params)
        new_params = optax.apply_updates(params, upd)
        params, opt_state = select_tree(finite, (new_params, new_opt), (params, opt_state))
        return params, opt_state, scaler.update(ls_state, ~finite), finite

    params = {"w": jnp.ones((3,), jnp.float16)}
    opt_state, ls = tx.init(params), scaler.init()
    params, opt_state, ls, ok = step(params, opt_state, ls, jnp.array([1.0, 2.0, 3.0], jnp.float16))
    assert bool(ok) and not np.allclose(params["w"], 1.0)
    snapshot = params
    opt_snapshot = opt_state
    # 65504 is float16's max: the scaled gradient overflows -> skip, halve.
    params, opt_state, ls, ok = step(params, opt_state, ls, jnp.array([65504.0, 1.0, 1.0], jnp.float16))
    assert not bool(ok)
    np.testing.assert_array_equal(params["w"], snapshot["w"])
    # The whole optimizer state is kept, including the step counts the LR schedule reads.
    jax.tree_util.tree_map(np.testing.assert_array_equal, opt_state, opt_snapshot)
    assert float(ls.scale) == 512.0


def test_constant_scaler_and_from_args():
    const = LossScaler(initial_scale=128.0, dynamic=False)
    st = const.update(const.init(), jnp.asarray(True))
    assert float(st.scale) == 128.0
    scaler = lambda argv: build.loss_scaler_of(cli.parse(argv).training)
    assert scaler(["--bf16", "--initial-loss-scale", "65536"]) is None  # Megatron: no scaler for bf16
    s = scaler(["--fp16", "--initial-loss-scale", "65536", "--loss-scale-window", "50"])
    assert s.dynamic and s.initial_scale == 65536.0 and s.growth_interval == 50 and s.hysteresis == 2
    assert not scaler(["--fp16", "--loss-scale", "4096"]).dynamic
