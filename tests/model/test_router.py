"""The router and its load-balancing losses equal megatron-core's own, on the same router logits.

megatron-core 0.16.1's ``TopKRouter`` runs on CPU in this process (``tests/mcore_router.py``)
and routes the same float32 logits as :func:`mlir_train.model.moe.router.route`, for each score
function / pre-softmax / scaling / group-limited / expert-bias variant, with padding tokens in
the batch. Compared, relative 1e-6 (float32): the dense routing weights ``[tokens, experts]``
(the expert choice exactly), Megatron's tracker values of ``aux_loss``, ``global_aux_loss``
(over two micro-batches: the running-average counts) and z-loss against
:func:`mlir_train.model.losses.router_losses`, the routed load that drives the expert bias, and
``get_updated_expert_bias``. ``seq_aux_loss`` on packed rows is compared with Megatron's
``seq_aux_loss`` of each document fed alone (a batch of one unpadded sequence), averaged over
the documents: Megatron itself would treat a packed row as one sequence.

Megatron lays tokens out ``[seq, batch]``; ours are ``[batch, seq]`` flattened, so Megatron's
outputs are transposed back before comparing.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from mlir_train.config import policies
from mlir_train.model import losses
from mlir_train.model.moe.router import route, updated_expert_bias
from mlir_train.config.policies import RouterConfig, RouterConfigError
from tests.mcore_router import megatron, tracked_losses

B, T, E = 3, 8, 8
RTOL = 1e-6


def _logits(seed: int, shape=(B, T, E)) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(shape) * 2.0).astype(np.float32)


def _segments() -> np.ndarray:
    """Rows packed with documents of several lengths, and a padded tail."""
    seg = np.zeros((B, T), np.int32)
    seg[0, :] = 1
    seg[1, :3], seg[1, 3:7] = 1, 2
    seg[2, :2], seg[2, 2:4], seg[2, 4:6] = 1, 2, 3
    return seg


def _to_mcore(x_BT_: np.ndarray):
    torch = megatron()[0]
    return torch.from_numpy(np.ascontiguousarray(np.swapaxes(x_BT_, 0, 1)))


def _from_mcore(y_SE) -> np.ndarray:
    """Megatron's ``[seq * batch, E]`` (seq-major) -> our ``[batch * seq, E]``."""
    y = y_SE.detach().numpy().reshape(T, B, -1)
    return np.swapaxes(y, 0, 1).reshape(B * T, -1)


def _dense(weights_SK, experts_SK) -> np.ndarray:
    w, ex = np.asarray(weights_SK), np.asarray(experts_SK)
    out = np.zeros((w.shape[0], E), np.float32)
    np.put_along_axis(out, ex, w, axis=1)
    return out


# (id, Megatron TransformerConfig fields, our RouterConfig, top-k, norm_topk_prob of the model)
CASES = [
    ("softmax-renormalised", {}, RouterConfig(), 2, True),
    ("softmax-pre", {"moe_router_pre_softmax": True}, RouterConfig(), 2, False),
    ("softmax-pre-flag-scaled", {"moe_router_pre_softmax": True, "moe_router_topk_scaling_factor": 2.5},
     RouterConfig(pre_softmax=True, topk_scaling_factor=2.5), 2, True),
    ("softmax-groups", {"moe_router_num_groups": 4, "moe_router_group_topk": 2},
     RouterConfig(num_groups=4, group_topk=2), 4, True),
    ("softmax-pre-groups", {"moe_router_pre_softmax": True, "moe_router_num_groups": 4, "moe_router_group_topk": 2},
     RouterConfig(pre_softmax=True, num_groups=4, group_topk=2), 4, True),
    ("sigmoid", {"moe_router_score_function": "sigmoid"}, RouterConfig(score_function="sigmoid"), 2, True),
    ("sigmoid-bias-groups-scaled",
     {"moe_router_score_function": "sigmoid", "moe_router_enable_expert_bias": True, "moe_router_num_groups": 4,
      "moe_router_group_topk": 2, "moe_router_topk_scaling_factor": 2.5},
     RouterConfig(score_function="sigmoid", enable_expert_bias=True, num_groups=4, group_topk=2,
                  topk_scaling_factor=2.5), 4, True),
]


@pytest.mark.parametrize("name,fields,cfg,k,norm", CASES, ids=[c[0] for c in CASES])
def test_routing_and_losses_match_megatron(name, fields, cfg, k, norm):
    torch, moe_utils, make_router = megatron()
    seg = _segments()
    pad_TB = _to_mcore(seg == 0)
    coeffs = {"aux_loss": 1e-2, "global_aux_loss": 3e-2}
    r = make_router(num_moe_experts=E, moe_router_topk=k, moe_router_load_balancing_type=list(coeffs),
                    moe_aux_loss_coeff=list(coeffs.values()), moe_z_loss_coeff=1e-3, **fields)
    bias = None
    if cfg.enable_expert_bias:
        bias = np.random.default_rng(7).uniform(-0.3, 0.3, E).astype(np.float32)
        r.expert_bias.copy_(torch.from_numpy(bias))
        # megatron-core 0.16.1's own load counter fails with a padding mask (``routing_map &
        # ~padding_mask`` broadcasts [N, E] against [N]); the routing still reads the bias, and the
        # load it means to count (the routed map without padding) is formed below.
        r.enable_expert_bias = False
    balancing = policies.LoadBalancing(coeffs=tuple(coeffs.items()), z_loss_coeff=1e-3)
    counts = None
    for micro in range(2):  # two micro-batches of one step: global_aux_loss averages their counts
        logits = _logits(micro)
        probs_SE, map_SE = r.routing(_to_mcore(logits), padding_mask=pad_TB)
        got = tracked_losses(moe_utils)
        w, ex, stats = route(jnp.asarray(logits.reshape(B * T, E)), jnp.asarray(seg.reshape(-1) != 0), top_k=k,
                             norm_topk_prob=norm, cfg=cfg, expert_bias_E=None if bias is None else jnp.asarray(bias))
        np.testing.assert_array_equal(_dense(np.ones_like(w), ex) > 0, _from_mcore(map_SE), err_msg="expert choice")
        np.testing.assert_allclose(_dense(w, ex), _from_mcore(probs_SE), rtol=RTOL, atol=1e-7, err_msg="weights")
        _, per_layer, counts = losses.router_losses({k_: v[None] for k_, v in stats.items()}, balancing, k,
                                                    counts, micro)
        for key in ("load_balancing_loss", "global_load_balancing_loss", "z_loss"):
            np.testing.assert_allclose(float(per_layer[key][0]), got[key], rtol=RTOL, err_msg=f"{key}, micro {micro}")
        np.testing.assert_array_equal(np.asarray(stats["tokens_per_expert"]),
                                      (map_SE & ~pad_TB.reshape(-1, 1)).sum(0).numpy(), err_msg="routed load")
    r.reset_global_aux_loss_tracker()


def test_global_aux_loss_over_micro_batches_matches_megatron():
    torch, moe_utils, make_router = megatron()
    seg = _segments()
    r = make_router(num_moe_experts=E, moe_router_topk=2, moe_router_load_balancing_type="global_aux_loss",
                    moe_aux_loss_coeff=1e-2)
    balancing = policies.LoadBalancing(coeffs=(("global_aux_loss", 1e-2),))
    counts, ours = None, []
    for micro in range(3):
        logits = _logits(10 + micro)
        r.routing(_to_mcore(logits), padding_mask=_to_mcore(seg == 0))
        _, _, stats = route(jnp.asarray(logits.reshape(B * T, E)), jnp.asarray(seg.reshape(-1) != 0), top_k=2,
                            norm_topk_prob=True, cfg=RouterConfig())
        _, per_layer, counts = losses.router_losses({k: v[None] for k, v in stats.items()}, balancing, 2, counts, micro)
        ours.append(float(per_layer["global_load_balancing_loss"][0]))
        got = tracked_losses(moe_utils)["global_load_balancing_loss"]
        np.testing.assert_allclose(ours[-1], got, rtol=RTOL, err_msg=f"micro-batch {micro}")
    assert len(set(ours)) == 3  # the running average really changes the counts
    r.reset_global_aux_loss_tracker()


def test_seq_aux_loss_matches_megatron_per_sequence():
    torch, moe_utils, make_router = megatron()
    r = make_router(num_moe_experts=E, moe_router_topk=2, moe_router_load_balancing_type="seq_aux_loss",
                    moe_aux_loss_coeff=1e-2)
    balancing = policies.LoadBalancing(coeffs=(("seq_aux_loss", 1e-2),))
    cfg = RouterConfig(per_sequence_stats=True)

    def ours(logits, seg):
        _, _, stats = route(jnp.asarray(logits.reshape(-1, E)), jnp.asarray(seg.reshape(-1) != 0), top_k=2,
                            norm_topk_prob=True, cfg=cfg, segment_ids_BT=jnp.asarray(seg))
        _, per_layer, _ = losses.router_losses({k: v[None] for k, v in stats.items()}, balancing, 2)
        return float(per_layer["seq_load_balancing_loss"][0])

    # Unpacked, unpadded rows: Megatron's batch of sequences as it is.
    logits = _logits(20)
    r.routing(_to_mcore(logits), padding_mask=None)
    np.testing.assert_allclose(ours(logits, np.ones((B, T), np.int32)), tracked_losses(moe_utils)["seq_load_balancing_loss"],
                               rtol=RTOL)
    # Packed rows with padding: each document is a sequence of its own.
    seg = _segments()
    want = []
    for b in range(B):
        for doc in range(1, seg[b].max() + 1):
            doc_logits = logits[b][seg[b] == doc]
            r.routing(torch.from_numpy(doc_logits[:, None, :].copy()), padding_mask=None)
            want.append(tracked_losses(moe_utils)["seq_load_balancing_loss"])
    assert len(want) == 6
    np.testing.assert_allclose(ours(logits, seg), np.mean(want), rtol=RTOL)
    # ... which is not the loss of the packed rows taken as sequences.
    assert abs(ours(logits, seg) - ours(logits, (seg > 0).astype(np.int32))) > 1e-3


def test_expert_bias_update_matches_megatron():
    torch, moe_utils, _ = megatron()
    rng = np.random.default_rng(3)
    tokens = rng.integers(0, 40, (3, E)).astype(np.float32)
    tokens[1] = 5.0  # a perfectly balanced layer: no change
    bias = rng.uniform(-0.1, 0.1, (3, E)).astype(np.float32)
    want = moe_utils.get_updated_expert_bias(torch.from_numpy(tokens.copy()), torch.from_numpy(bias), 1e-3)
    got = updated_expert_bias(jnp.asarray(bias), jnp.asarray(tokens), 1e-3)
    np.testing.assert_allclose(np.asarray(got), want.numpy(), rtol=RTOL)
    np.testing.assert_array_equal(np.asarray(got)[1], bias[1])


def test_megatron_checks_refuse_by_flag():
    with pytest.raises(RouterConfigError, match="--moe-router-score-function sigmoid"):
        RouterConfig(enable_expert_bias=True).check(E, 2, True)
    with pytest.raises(RouterConfigError, match="--moe-router-pre-softmax"):
        RouterConfig().check(E, 1, True)
    with pytest.raises(RouterConfigError, match="--moe-router-num-groups"):
        RouterConfig(group_topk=2).check(E, 2, True)
    with pytest.raises(RouterConfigError, match="must divide"):
        RouterConfig(num_groups=3, group_topk=2).check(E, 2, True)
    with pytest.raises(policies.LoadBalancingError, match="one per type"):
        policies.LoadBalancing.from_flags(["aux_loss", "seq_aux_loss"], [1e-2])
    lb = policies.LoadBalancing.from_flags(["aux_loss", "seq_aux_loss", "none"], [1e-2, 1e-3, 5.0], 1e-3)
    assert lb.coeff("aux_loss") == 1e-2 and lb.coeff("seq_aux_loss") == 1e-3 and lb.per_sequence
    assert policies.LoadBalancing.from_flags("none", 1e-2).coeffs == ()  # Megatron: no aux loss for "none"


@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_sinkhorn_routing_matches_megatron(k, training):
    """Megatron's ``sinkhorn_load_balancing``: top-k of the balanced matrix in training (top-k of
    the plain scores in evaluation), weighted by sigmoid (k = 1) or softmax scores."""
    torch, _, make_router = megatron()
    logits = _logits(11)
    r = make_router(num_moe_experts=E, moe_router_topk=k, moe_router_load_balancing_type="sinkhorn",
                    moe_aux_loss_coeff=0.0)
    r.train(training)
    with torch.no_grad():
        probs_SE, _ = r.routing(_to_mcore(logits), padding_mask=None)
    cfg = RouterConfig(sinkhorn=True, training=training)
    cfg.check(E, k, True)
    w, ex, stats = route(jnp.asarray(logits.reshape(B * T, E)), jnp.ones(B * T, bool), top_k=k, norm_topk_prob=True,
                         cfg=cfg)
    want = _from_mcore(probs_SE)
    np.testing.assert_array_equal(_dense(w, ex) > 0, want > 0)  # the same experts
    np.testing.assert_allclose(_dense(w, ex), want, rtol=RTOL, atol=1e-7)
    if training:  # the balancing changes the choice (else this test could not tell the modes apart)
        plain = route(jnp.asarray(logits.reshape(B * T, E)), jnp.ones(B * T, bool), top_k=k, norm_topk_prob=True,
                      cfg=RouterConfig(sinkhorn=True, training=False))
        assert np.any(np.asarray(plain[1]) != np.asarray(ex))


def test_sinkhorn_balancing_matches_megatron_per_data_parallel_rank():
    """Megatron balances the tokens one data-parallel rank holds, padding included: each balancing
    group (a run of rows) alone, as Megatron's ``sinkhorn`` fed that rank's tokens."""
    from mlir_train.model.moe.router import sinkhorn

    _, moe_utils, _ = megatron()
    torch = megatron()[0]
    logits = _logits(12).reshape(B * T, E)
    np.testing.assert_allclose(np.asarray(sinkhorn(jnp.asarray(logits))),
                               moe_utils.sinkhorn(torch.from_numpy(logits)).numpy(), rtol=1e-5, atol=1e-9)
    got = np.asarray(sinkhorn(jnp.asarray(logits), B)).reshape(B, T, E)  # one row per rank
    for row in range(B):
        np.testing.assert_allclose(got[row], moe_utils.sinkhorn(torch.from_numpy(logits.reshape(B, T, E)[row])).numpy(),
                                   rtol=1e-5, atol=1e-9, err_msg=f"rank {row}")
    assert not np.allclose(got.reshape(B * T, E), np.asarray(sinkhorn(jnp.asarray(logits))), rtol=1e-3)


def test_sinkhorn_flag_checks():
    lb = policies.LoadBalancing.from_flags("sinkhorn", 0.0)
    assert lb.sinkhorn and lb.coeffs == ()
    with pytest.raises(policies.LoadBalancingError, match="takes no aux loss"):
        policies.LoadBalancing.from_flags("sinkhorn", 1e-2)
    with pytest.raises(policies.LoadBalancingError, match="give it alone"):
        policies.LoadBalancing.from_flags(["sinkhorn", "aux_loss"], [0.0, 1e-2])
    with pytest.raises(RouterConfigError, match="sinkhorn"):
        RouterConfig(sinkhorn=True, score_function="sigmoid").check(E, 2, True)


@pytest.mark.parametrize("name,fields,cfg,k,norm", [CASES[0], CASES[5]], ids=[CASES[0][0], CASES[5][0]])
def test_fp64_routing_matches_megatron_fp64(name, fields, cfg, k, norm):
    """``--moe-router-dtype fp64``: float64 logits routed in an x64 region equal Megatron's
    fp64 routing to float64 precision, and the weights leave as float32."""
    import dataclasses

    import jax

    from mlir_train.model.moe.router import route_in

    torch, _, make_router = megatron()
    rng = np.random.default_rng(5)
    x = rng.standard_normal((B * T, 16))
    w = rng.standard_normal((16, E)) * 0.5
    r = make_router(num_moe_experts=E, moe_router_topk=k, moe_router_dtype="fp64", moe_aux_loss_coeff=0.0, **fields)
    with torch.no_grad():
        logits = (torch.from_numpy(x) @ torch.from_numpy(w)).reshape(B, T, E).transpose(0, 1).contiguous()
        probs_SE, _ = r.routing(logits, padding_mask=None)
    assert probs_SE.dtype == torch.float64
    fp64 = dataclasses.replace(cfg, dtype="fp64")
    weights, experts, stats = jax.jit(lambda x, w: route_in(fp64, x, w, jnp.ones(B * T, bool), top_k=k,
                                                           norm_topk_prob=norm))(x.astype(np.float32), w.astype(np.float32))
    assert weights.dtype == jnp.float32 and stats["probs_per_expert"].dtype == jnp.float32
    # Our inputs arrive as float32 (the model's activations), so feed Megatron the same values.
    with torch.no_grad():
        logits32 = (torch.from_numpy(x.astype(np.float32).astype(np.float64))
                    @ torch.from_numpy(w.astype(np.float32).astype(np.float64)))
        probs32, _ = r.routing(logits32.reshape(B, T, E).transpose(0, 1).contiguous(), padding_mask=None)
    np.testing.assert_allclose(_dense(weights, experts), _from_mcore(probs32).astype(np.float32), rtol=3e-7, atol=1e-8)  # 2 float32 ulps
    hlo = jax.jit(lambda x, w: route_in(fp64, x, w, jnp.ones(B * T, bool), top_k=k, norm_topk_prob=norm)[0]).lower(
        x.astype(np.float32), w.astype(np.float32)).as_text()
    assert "f64" in hlo and "f32" in hlo


def test_fp64_router_gradients_match_fp32():
    """The x64 region's own backward: the router's gradients (through the weights, the aux
    scores and the z-loss sums) equal the fp32 router's to float32 precision."""
    import jax

    from mlir_train.model.moe.router import route_in

    rng = np.random.default_rng(6)
    x = jnp.asarray(rng.standard_normal((B * T, 16)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((16, E)) * 0.5, jnp.float32)
    valid = jnp.asarray((_segments() != 0).reshape(-1))

    def objective(dtype):
        def f(x, w):
            weights, _, stats = route_in(RouterConfig(dtype=dtype, per_sequence_stats=True), x, w, valid, top_k=2,
                                         norm_topk_prob=True, segment_ids_BT=jnp.asarray(_segments()))
            return (jnp.sum(weights * jnp.arange(2.0)) + jnp.sum(stats["probs_per_expert"] * jnp.arange(E))
                    + 1e-2 * jnp.sum(stats["z_loss_sum"]) + jnp.sum(stats["seq_aux_sum"]))
        return jax.jit(jax.value_and_grad(f, argnums=(0, 1)))(x, w)

    (v32, (gx32, gw32)), (v64, (gx64, gw64)) = objective("fp32"), objective("fp64")
    assert gx64.dtype == jnp.float32 and gw64.dtype == jnp.float32
    np.testing.assert_allclose(v64, v32, rtol=1e-6)
    np.testing.assert_allclose(gx64, gx32, rtol=1e-4, atol=1e-6 * float(jnp.abs(gx32).max()))
    np.testing.assert_allclose(gw64, gw32, rtol=1e-4, atol=1e-6 * float(jnp.abs(gw32).max()))
