"""Rule tables are complete for every layout, specs are sane, ZeRO-1/FSDP really split state.

Shape suffix key for the fake model: V vocab, D hidden, L layers, N q heads, K kv heads,
H head dim, F dense FFN, E experts, M expert FFN.
"""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from sharding import (
    ACTIVATION_AXES,
    DATA_PARALLEL,
    EXPERT_PARALLEL,
    LOGICAL_AXES,
    MESH_AXES,
    PARAM_AXES,
    PIPELINE_PARALLEL,
    TENSOR_PARALLEL,
    TENSOR_SEQUENCE_PARALLEL,
    Layout,
    logical_to_spec,
    make_mesh,
    optimizer_state_specs,
    rules_for,
    sharding_rows,
    sharding_table,
    state_specs,
    tree_shardings,
    tree_specs,
    zero_spec,
)

V, D, L, N, K, H, F, E, M = 256, 64, 4, 8, 4, 16, 128, 8, 32
DIMS = dict(num_heads=N, num_kv_heads=K, num_experts=E, intermediate_size=F,
            moe_intermediate_size=M, num_layers=L, vocab_size=V, hidden_size=D)

# The model's parameters, as the lead's model annotates them (stacked layers lead with "layers").
PARAMS = {
    "embed": ((V, D), ("vocab", "embed")),
    "lm_head": ((D, V), ("embed", "vocab")),
    "final_norm": ((D,), ("norm",)),
    "layers": {
        "input_norm": ((L, D), ("layers", "norm")),
        "post_attn_norm": ((L, D), ("layers", "norm")),
        "q_proj": ((L, D, N, H), ("layers", "embed", "q_heads", "head_dim")),
        "k_proj": ((L, D, K, H), ("layers", "embed", "kv_heads", "head_dim")),
        "v_proj": ((L, D, K, H), ("layers", "embed", "kv_heads", "head_dim")),
        "o_proj": ((L, N, H, D), ("layers", "q_heads", "head_dim", "embed")),
        "q_norm": ((L, H), ("layers", "head_dim")),
        "k_norm": ((L, H), ("layers", "head_dim")),
        "mlp_gate": ((L, D, F), ("layers", "embed", "mlp")),
        "mlp_up": ((L, D, F), ("layers", "embed", "mlp")),
        "mlp_down": ((L, F, D), ("layers", "mlp", "embed")),
        "router": ((L, D, E), ("layers", "embed", "router_exp")),
        "experts_gate": ((L, E, D, M), ("layers", "exp", "embed", "moe_mlp")),
        "experts_up": ((L, E, D, M), ("layers", "exp", "embed", "moe_mlp")),
        "experts_down": ((L, E, M, D), ("layers", "exp", "moe_mlp", "embed")),
    },
}
ACTIVATIONS = [
    ("act_batch", "act_res_seq", "act_embed"),
    ("act_batch", "act_seq", "act_embed"),
    ("act_batch", "act_seq", "act_heads", "act_head_dim"),
    ("act_batch", "act_seq", "act_kv_heads", "act_head_dim"),
    ("act_batch", "act_seq", "act_mlp"),
    ("act_batch", "act_seq", "act_vocab"),
    ("act_exp", "act_capacity", "act_embed"),
    ("act_tokens", "act_embed"),
]
_is_pair = lambda x: isinstance(x, tuple) and len(x) == 2 and isinstance(x[1], tuple)
SHAPES = jax.tree.map(lambda p: jax.ShapeDtypeStruct(p[0], jnp.float32), PARAMS, is_leaf=_is_pair)
LOGICAL = jax.tree.map(lambda p: p[1], PARAMS, is_leaf=_is_pair)
PARAM_LOGICAL = jax.tree.leaves(LOGICAL, is_leaf=lambda x: isinstance(x, tuple))

ALL_CONFIGS = [
    Layout(tensor=t, pipeline=p, expert=e, sequence_parallel=sp, num_devices=8)
    for t, p, e, sp in itertools.product((1, 2, 4, 8), (1, 2, 4), (1, 2, 4), (False, True))
    if 8 % (t * p) == 0 and (8 // (t * p)) % e == 0
]


def _axes(entry):
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


@pytest.mark.parametrize("rules", [DATA_PARALLEL, TENSOR_PARALLEL, TENSOR_SEQUENCE_PARALLEL, EXPERT_PARALLEL, PIPELINE_PARALLEL])
def test_named_tables_are_complete(rules):
    assert [name for name, _ in rules] == list(LOGICAL_AXES)
    assert all(set(_axes(axes)) <= set(MESH_AXES) for _, axes in rules)


@pytest.mark.parametrize("cfg", ALL_CONFIGS, ids=str)
def test_rules_for_every_combination_is_complete_and_specs_are_valid(cfg):
    for dims in (None, DIMS):
        rules = rules_for(cfg, dims)
        names = [name for name, _ in rules]
        assert sorted(names) == sorted(LOGICAL_AXES) and len(names) == len(set(names))
        assert all(set(_axes(axes)) <= set(MESH_AXES) for _, axes in rules)
        for logical in PARAM_LOGICAL + ACTIVATIONS:
            spec = logical_to_spec(logical, rules, MESH_AXES)
            used = [a for e in spec for a in _axes(e)]
            assert len(used) == len(set(used)), (logical, spec)


def test_every_name_the_model_uses_is_declared():
    used = {n for l in PARAM_LOGICAL for n in l}
    assert used <= set(PARAM_AXES)
    assert {n for a in ACTIVATIONS for n in a} <= set(ACTIVATION_AXES)


def _spec(cfg, logical, dims=DIMS):
    return logical_to_spec(logical, rules_for(cfg, dims), MESH_AXES)


def test_megatron_tensor_parallel_splits():
    tp = Layout(tensor=2, num_devices=8)
    assert _spec(tp, ("embed", "q_heads", "head_dim")) == P(None, "tensor")           # column-parallel
    assert _spec(tp, ("embed", "kv_heads", "head_dim")) == P(None, "tensor")
    assert _spec(tp, ("q_heads", "head_dim", "embed")) == P("tensor")                # row-parallel
    assert _spec(tp, ("embed", "mlp")) == P(None, "tensor")
    assert _spec(tp, ("mlp", "embed")) == P("tensor")
    assert _spec(tp, ("vocab", "embed")) == P("tensor")                              # vocab-parallel
    assert _spec(tp, ("embed", "vocab")) == P(None, "tensor")
    assert _spec(tp, ("embed", "router_exp")) == P()
    assert _spec(tp, ("act_batch", "act_seq", "act_vocab")) == P(("data", "expert"), None, "tensor")
    assert _spec(tp, ("act_batch", "act_res_seq", "act_embed")) == P(("data", "expert"))


def test_sequence_parallel_splits_only_the_residual_stream():
    sp = Layout(tensor=2, sequence_parallel=True, num_devices=8)
    assert _spec(sp, ("act_batch", "act_res_seq", "act_embed")) == P(("data", "expert"), "tensor")
    # Inside the TP regions heads / FFN columns keep the tensor axis.
    assert _spec(sp, ("act_batch", "act_seq", "act_heads", "act_head_dim")) == P(("data", "expert"), None, "tensor")
    assert _spec(sp, ("act_batch", "act_seq", "act_mlp")) == P(("data", "expert"), None, "tensor")


def test_expert_and_pipeline_splits():
    ep_tp = Layout(tensor=2, expert=4, num_devices=8)
    assert _spec(ep_tp, ("exp", "embed", "moe_mlp")) == P("expert", None, "tensor")
    assert _spec(ep_tp, ("exp", "moe_mlp", "embed")) == P("expert", "tensor")
    assert _spec(ep_tp, ("act_exp", "act_capacity", "act_embed")) == P("expert", "data")
    assert _spec(ep_tp, ("act_tokens", "act_embed")) == P(("data", "expert"))
    pp = Layout(tensor=2, pipeline=2, expert=2, num_devices=8)
    assert _spec(pp, ("layers", "exp", "embed", "moe_mlp")) == P("stage", "expert", None, "tensor")
    assert _spec(pp, ("layers", "norm")) == P("stage")


def test_kv_heads_replicated_when_tp_exceeds_them():
    tp8 = Layout(tensor=8, num_devices=8)
    assert _spec(tp8, ("embed", "kv_heads", "head_dim")) == P()
    assert _spec(tp8, ("act_batch", "act_seq", "act_kv_heads", "act_head_dim")) == P(("data", "expert"))
    assert _spec(tp8, ("embed", "q_heads", "head_dim")) == P(None, "tensor")
    assert _spec(tp8, ("embed", "kv_heads", "head_dim"), dims=None) == P(None, "tensor")


# ----- ZeRO-1 / FSDP --------------------------------------------------------------------


def test_zero_spec_choices():
    mesh = make_mesh(Layout(tensor=2, expert=2, num_devices=8))  # data 2, expert 2, tensor 2
    # Largest free dim that the whole data-parallel group divides.
    assert zero_spec((4, 64, 16), P(), mesh) == P(None, ("data", "expert"))
    assert zero_spec((64, 256), P(None, "tensor"), mesh) == P(("data", "expert"), "tensor")
    # Expert weights already use "expert": only "data" is left.
    assert zero_spec((8, 64, 32), P("expert", None, "tensor"), mesh) == P("expert", "data", "tensor")
    # Nothing free divides by 4: fall back to one axis, then to an already-split dim.
    assert zero_spec((6, 3), P(), mesh) == P("data")
    assert zero_spec((3, 8), P(None, "tensor"), mesh) == P(None, ("tensor", "data", "expert"))
    # Scalars and odd sizes stay replicated.
    assert zero_spec((), P(), mesh) == P()
    assert zero_spec((3, 5), P(), mesh) == P()


def _bytes(shapes, specs, mesh):
    rows = sharding_rows(shapes, None, specs, mesh)
    return sum(r["bytes"] for r in rows), sum(r["device_bytes"] for r in rows)


@pytest.mark.parametrize(
    "cfg",
    [
        Layout(distributed_optimizer=True, num_devices=8),
        Layout(tensor=2, distributed_optimizer=True, num_devices=8),
        Layout(expert=2, distributed_optimizer=True, num_devices=8),
        Layout(tensor=2, expert=2, distributed_optimizer=True, num_devices=8),
        Layout(tensor=2, expert=4, distributed_optimizer=True, num_devices=8),
    ],
    ids=["DP8", "TP2xDP4", "EP2xDP4", "TP2xEP2xDP2", "EP4xTP2"],
)
def test_zero1_shards_optimizer_state_over_each_arrays_data_parallel_group(cfg):
    """Megatron's distributed optimizer: each array's state is split over the ranks that
    replicate it in compute, i.e. data x expert for dense weights and data for experts."""
    mesh = make_mesh(cfg)
    plan = state_specs(cfg, SHAPES, LOGICAL, mesh, DIMS)
    assert plan.params == plan.compute  # ZeRO-1 leaves the parameters alone
    compute_rows = sharding_rows(SHAPES, LOGICAL, plan.compute, mesh)
    opt_rows = sharding_rows(SHAPES, LOGICAL, plan.optimizer, mesh)
    for c, o in zip(compute_rows, opt_rows, strict=True):
        used = {a for e in c["spec"] for a in _axes(e)}
        group = int(np.prod([mesh.shape[a] for a in ("data", "expert") if a not in used]))
        assert o["device_bytes"] * group == c["device_bytes"], (c["path"], c["spec"], o["spec"])
    dp = cfg.data_parallel
    total, compute = _bytes(SHAPES, plan.compute, mesh)
    _, opt = _bytes(SHAPES, plan.optimizer, mesh)
    assert opt < compute
    # Dense weights shrink by the full data-parallel size.
    assert opt_rows[0]["path"] == "embed" and opt_rows[0]["device_bytes"] * dp == compute_rows[0]["device_bytes"]
    if cfg.tensor == 1 and cfg.expert == 1:
        assert opt == total // 8


def test_no_distributed_optimizer_keeps_state_replicated_and_fsdp_splits_params():
    cfg = Layout(tensor=2, num_devices=8)
    mesh = make_mesh(cfg)
    plan = state_specs(cfg, SHAPES, LOGICAL, mesh, DIMS)
    assert plan.optimizer == plan.compute == plan.params
    fsdp = Layout(tensor=2, fsdp=True, num_devices=8)
    plan = state_specs(fsdp, SHAPES, LOGICAL, mesh, DIMS)
    assert plan.optimizer == plan.params
    # TP-split weights are split 8 ways (tensor x data); the split avoids the stacked-layers axis.
    assert plan.params["layers"]["mlp_gate"] == P(None, "data", "tensor")
    rows = {r["path"]: r for r in sharding_rows(SHAPES, LOGICAL, plan.params, mesh)}
    assert rows["layers/mlp_gate"]["device_bytes"] * 8 == rows["layers/mlp_gate"]["bytes"]
    assert rows["layers/router"]["device_bytes"] * 4 == rows["layers/router"]["bytes"]
    total, per_device = _bytes(SHAPES, plan.params, mesh)
    assert per_device < total / 7


def test_optimizer_state_specs_falls_back_for_odd_shapes():
    mesh = make_mesh(Layout(num_devices=8))
    shapes = {"odd": jax.ShapeDtypeStruct((3, 5), jnp.float32), "count": jax.ShapeDtypeStruct((), jnp.int32),
              "w": jax.ShapeDtypeStruct((16, 12), jnp.float32)}
    specs = optimizer_state_specs(shapes, {"odd": P(), "count": P(), "w": P()}, mesh)
    assert specs == {"odd": P(), "count": P(), "w": P("data")}  # the expert axis has size 1 here


def test_sharding_table_lists_every_parameter():
    cfg = Layout(tensor=2, expert=2, distributed_optimizer=True, num_devices=8)
    mesh = make_mesh(cfg)
    plan = state_specs(cfg, SHAPES, LOGICAL, mesh, DIMS)
    text = sharding_table(SHAPES, LOGICAL, plan.optimizer, mesh)
    lines = text.splitlines()
    assert len(lines) == 3 + len(jax.tree.leaves(SHAPES)) + 1
    assert "layers/experts_gate" in text and "(layers, exp, embed, moe_mlp)" in text
    assert "P(None, 'expert', 'data', 'tensor')" in text
    assert lines[-1].startswith("total: 18 arrays") and "per device" in lines[-1]


# ----- end to end: jit on the 8-device CPU mesh -----------------------------------------


@pytest.mark.parametrize(
    "cfg",
    [
        Layout(num_devices=8),
        Layout(tensor=2, sequence_parallel=True, num_devices=8),
        Layout(tensor=2, expert=2, distributed_optimizer=True, num_devices=8),
    ],
    ids=["DP8", "TP2+SP", "TP2xEP2xDP2"],
)
def test_jit_mlp_and_expert_matmuls_with_these_specs(cfg):
    mesh = make_mesh(cfg)
    rules = rules_for(cfg, DIMS)
    rng = np.random.default_rng(0)
    x_BSD = rng.standard_normal((8, 16, D), dtype=np.float32)
    w = {
        "gate_DF": rng.standard_normal((D, F), dtype=np.float32) / 8,
        "down_FD": rng.standard_normal((F, D), dtype=np.float32) / 8,
        "experts_EDM": rng.standard_normal((E, D, M), dtype=np.float32) / 8,
    }
    logical = {"gate_DF": ("embed", "mlp"), "down_FD": ("mlp", "embed"), "experts_EDM": ("exp", "embed", "moe_mlp")}
    w_shardings = tree_shardings(logical, rules, mesh)
    x_sharding = NamedSharding(mesh, logical_to_spec(("act_batch", "act_res_seq", "act_embed"), rules, mesh.axis_names))
    buf_sharding = NamedSharding(mesh, logical_to_spec(("act_exp", "act_capacity", "act_embed"), rules, mesh.axis_names))

    def f(x_BSD, w):
        h_BSF = jax.nn.silu(x_BSD @ w["gate_DF"])
        y_BSD = x_BSD + h_BSF @ w["down_FD"]
        y_BSD = jax.lax.with_sharding_constraint(y_BSD, x_sharding)
        buf_ECD = jax.lax.with_sharding_constraint(y_BSD.reshape(E, -1, D), buf_sharding)
        return y_BSD, jnp.einsum("ecd,edm->ecm", buf_ECD, w["experts_EDM"])

    sharded = jax.jit(f, in_shardings=(x_sharding, w_shardings), out_shardings=(x_sharding, None))
    y, z = sharded(jax.device_put(x_BSD, x_sharding), jax.device_put(w, w_shardings))
    h = x_BSD @ w["gate_DF"]
    y_ref = x_BSD + (h / (1 + np.exp(-h))) @ w["down_FD"]
    z_ref = np.einsum("ecd,edm->ecm", y_ref.reshape(E, -1, D), w["experts_EDM"])
    np.testing.assert_allclose(np.asarray(y), y_ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(z), z_ref, rtol=1e-5, atol=1e-4)
    assert y.sharding.spec == x_sharding.spec


def test_tree_specs_of_the_fake_model_under_tp2_ep2():
    cfg = Layout(tensor=2, expert=2, num_devices=8)
    specs = tree_specs(LOGICAL, rules_for(cfg, DIMS), MESH_AXES)
    assert specs["layers"]["experts_down"] == P(None, "expert", "tensor")
    assert specs["layers"]["o_proj"] == P(None, "tensor")
    assert specs["final_norm"] == P()
