"""Mesh layout (Megatron rank order) and up-front validation of the parallel flags."""

import warnings

import jax
import numpy as np
import pytest
from jax.sharding import AxisType

from sharding import MESH_AXES, Layout, LayoutError, kv_heads_replicated, make_mesh, validate

# Qwen3-30B-A3B's sizes: 32 q heads, 4 kv heads, 128 experts.
QWEN3_30B_A3B = dict(
    num_heads=32, num_kv_heads=4, num_experts=128, intermediate_size=6144,
    moe_intermediate_size=768, num_layers=48, vocab_size=151936, hidden_size=2048,
)

# (name, config, expected (stage, data, expert, tensor))
LAYOUTS = [
    ("DP8", Layout(num_devices=8), (1, 8, 1, 1)),
    ("TP2xDP4", Layout(tensor=2, num_devices=8), (1, 4, 1, 2)),
    ("TP2+SP", Layout(tensor=2, sequence_parallel=True, num_devices=8), (1, 4, 1, 2)),
    ("EP2xDP4", Layout(expert=2, num_devices=8), (1, 4, 2, 1)),
    ("EP4xTP2", Layout(tensor=2, expert=4, num_devices=8), (1, 1, 4, 2)),
    ("TP2xEP2xDP2", Layout(tensor=2, expert=2, distributed_optimizer=True, num_devices=8), (1, 2, 2, 2)),
    # Megatron: DP = 8 / (TP2 x PP2) = 2, and EP2 is carved out of those 2 ranks.
    ("TP2xPP2xEP2", Layout(tensor=2, pipeline=2, expert=2, num_devices=8), (2, 1, 2, 2)),
    ("PP4xTP2", Layout(tensor=2, pipeline=4, num_devices=8), (4, 1, 1, 2)),
]


@pytest.mark.parametrize("name,cfg,shape", LAYOUTS, ids=[l[0] for l in LAYOUTS])
def test_mesh_shapes(name, cfg, shape):
    validate(cfg, QWEN3_30B_A3B, global_batch_size=64, micro_batch_size=1)
    mesh = make_mesh(cfg)
    assert mesh.axis_names == MESH_AXES
    assert tuple(mesh.devices.shape) == shape
    assert mesh.size == 8
    assert all(t == AxisType.Auto for t in mesh.axis_types)
    assert cfg.data_parallel == 8 // (cfg.tensor * cfg.pipeline)


def test_rank_order_matches_megatron():
    """tp-cp-ep-dp-pp: device i is Megatron rank i = tp + TP*(ep + EP*(dp + DP*pp))."""
    tp, ep, dp, pp = 2, 2, 1, 2
    mesh = make_mesh(Layout(tensor=tp, pipeline=pp, expert=ep, num_devices=8))
    ids = np.vectorize(lambda d: d.id)(mesh.devices)
    for s in range(pp):
        for d in range(dp):
            for e in range(ep):
                for t in range(tp):
                    assert ids[s, d, e, t] == t + tp * (e + ep * (d + dp * s))
    # Tensor-parallel peers are adjacent devices.
    assert list(ids[0, 0, 0]) == [0, 1]


def test_explicit_devices_and_default_count():
    devices = jax.devices()[::-1]
    mesh = make_mesh(Layout(tensor=2), devices)
    assert mesh.devices[0, 0, 0, 0] is devices[0]
    assert make_mesh(Layout()).size == jax.device_count()
    with pytest.raises(LayoutError, match="only 8 are visible"):
        make_mesh(Layout(num_devices=16))
    with pytest.raises(LayoutError, match="num_devices=4"):
        make_mesh(Layout(num_devices=4), jax.devices())


@pytest.mark.parametrize(
    "cfg,dims,kwargs,flag",
    [
        (Layout(tensor=3, num_devices=8), {}, {}, "--tensor-model-parallel-size"),
        (Layout(pipeline=3, num_devices=8), {}, {}, "--pipeline-model-parallel-size"),
        (Layout(tensor=0, num_devices=8), {}, {}, "--tensor-model-parallel-size"),
        (Layout(tensor=2, pipeline=2, expert=4, num_devices=8), {}, {}, "--expert-model-parallel-size"),
        (Layout(tensor=4, num_devices=8), {"num_heads": 6}, {}, "--tensor-model-parallel-size"),
        (Layout(tensor=2, num_devices=8), {"num_kv_heads": 3}, {}, "--tensor-model-parallel-size"),
        (Layout(tensor=8, num_devices=8), {"num_kv_heads": 3}, {}, "--tensor-model-parallel-size"),
        (Layout(tensor=2, num_devices=8), {"vocab_size": 151935}, {}, "--tensor-model-parallel-size"),
        (Layout(tensor=4, num_devices=8), {"intermediate_size": 6}, {}, "--tensor-model-parallel-size"),
        (Layout(tensor=2, num_devices=8), {"num_experts": 8, "moe_intermediate_size": 3}, {}, "--tensor-model-parallel-size"),
        (Layout(expert=4, num_devices=8), {"num_experts": 6}, {}, "--expert-model-parallel-size"),
        (Layout(expert=2, num_devices=8), {"num_experts": 0}, {}, "--expert-model-parallel-size"),
        (Layout(pipeline=4, num_devices=8), {"num_layers": 6}, {}, "--pipeline-model-parallel-size"),
        (Layout(tensor=2, sequence_parallel=True, num_devices=8), {}, {"seq_length": 7}, "--sequence-parallel"),
        (Layout(tensor=2, num_devices=8), {}, {"global_batch_size": 6, "micro_batch_size": 1}, "--global-batch-size"),
        (Layout(num_devices=8), {}, {"global_batch_size": 8, "micro_batch_size": 2}, "--micro-batch-size"),
        (Layout(num_devices=8), {}, {"global_batch_size": 8, "micro_batch_size": 0}, "--micro-batch-size"),
    ],
)
def test_validation_errors_name_the_flag(cfg, dims, kwargs, flag):
    with pytest.raises(LayoutError, match=flag):
        validate(cfg, dims, **kwargs)


def test_validation_error_comes_before_mesh_building():
    with pytest.raises(LayoutError, match="8 devices are not divisible"):
        make_mesh(Layout(tensor=3, num_devices=8))


def test_kv_heads_replicated_when_tp_exceeds_them():
    assert not kv_heads_replicated(2, 4)
    assert not kv_heads_replicated(4, 4)
    assert kv_heads_replicated(8, 4)
    assert not kv_heads_replicated(8, 3)
    # Qwen3-30B-A3B (4 kv heads) at TP 8: kv heads replicated, no error.
    validate(Layout(tensor=8, num_devices=8), QWEN3_30B_A3B)


def test_sequence_parallel_without_tp_is_disabled_with_a_warning():
    with pytest.warns(UserWarning, match="--sequence-parallel"):
        cfg = validate(Layout(sequence_parallel=True, num_devices=8))
    assert not cfg.sequence_parallel
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert validate(Layout(tensor=2, sequence_parallel=True, num_devices=8)).sequence_parallel
