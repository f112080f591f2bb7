"""The mesh numbers ranks as Megatron does, for dense and expert grids alike (CP, ETP, folding).

Oracle: megatron-core's own ``parallel_state.RankGenerator`` (pure Python, no process group),
built exactly as ``initialize_model_parallel`` builds its decoder and expert generators with
the default order ``tp-cp-ep-dp-pp``. For each role, our group of a device is the devices that
differ from it only along the mesh axes carrying that role (``Layout.role_axes``).
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from sharding import Layout, LayoutError, make_mesh, validate

rank_generator = pytest.importorskip("megatron.core.parallel_state").RankGenerator

# (devices, TP, CP, PP, EP, ETP)
LAYOUTS = [
    (8, 1, 1, 1, 1, None), (8, 2, 1, 1, 2, None), (8, 2, 1, 2, 2, None), (8, 1, 2, 1, 1, None),
    (8, 2, 2, 1, 2, None), (8, 1, 4, 1, 2, None), (8, 1, 2, 1, 4, None), (8, 4, 1, 1, 8, 1), (8, 4, 1, 1, 2, 1),
    (8, 2, 1, 1, 4, 1), (8, 1, 1, 1, 2, 2), (8, 2, 2, 2, 2, 1), (16, 4, 2, 1, 8, 1), (16, 2, 2, 2, 4, 1),
    (16, 2, 4, 1, 2, 2), (16, 1, 2, 2, 2, 2), (16, 4, 1, 2, 2, 2),
]


class FakeDevice:
    def __init__(self, i):
        self.id = i
        self.platform = "cpu"


def _groups(mesh, axes):
    ids = np.vectorize(lambda d: d.id)(mesh.devices)
    names = list(mesh.axis_names)
    keep = [names.index(a) for a in axes]
    rest = [i for i in range(len(names)) if i not in keep]
    moved = np.transpose(ids, rest + keep).reshape(-1, int(np.prod([ids.shape[i] for i in keep]) if keep else 1))
    return sorted(sorted(int(x) for x in row) for row in moved)


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda l: "n{}-tp{}-cp{}-pp{}-ep{}-etp{}".format(*l))
def test_every_role_group_is_megatrons(layout):
    n, tp, cp, pp, ep, etp = layout
    cfg = validate(Layout(tensor=tp, context=cp, pipeline=pp, expert=ep, expert_tensor=etp, num_devices=n))
    mesh = make_mesh(cfg, [FakeDevice(i) for i in range(n)])
    assert int(np.prod(list(mesh.shape.values()))) == n
    dense = rank_generator(tp=tp, ep=1, dp=n // (tp * cp * pp), pp=pp, cp=cp, order="tp-cp-ep-dp-pp")
    e_tp = cfg.etp
    expert = rank_generator(tp=e_tp, ep=ep, dp=n // (e_tp * ep * pp), pp=pp, cp=1, order="tp-cp-ep-dp-pp")
    want = {
        "tensor": dense.get_ranks("tp"), "context": dense.get_ranks("cp"), "data": dense.get_ranks("dp"),
        "stage": dense.get_ranks("pp"), "expert_tensor": expert.get_ranks("tp"), "expert": expert.get_ranks("ep"),
        "expert_data": expert.get_ranks("dp"),
    }
    for role, groups in want.items():
        assert _groups(mesh, cfg.role_axes(role)) == sorted(sorted(g) for g in groups), role
    # The distributed optimizer's groups: dp x cp for dense weights, edp for experts.
    assert _groups(mesh, cfg.data_axes()) == sorted(sorted(g) for g in dense.get_ranks("dp-cp"))
    assert _groups(mesh, cfg.data_axes(expert=True)) == sorted(sorted(g) for g in expert.get_ranks("dp"))
    assert cfg.data_parallel == n // (tp * cp * pp) and cfg.expert_data_parallel == n // (e_tp * ep * pp)


def test_default_layouts_keep_the_four_axes():
    for tp, ep, pp in itertools.product((1, 2), (1, 2), (1, 2)):
        cfg = validate(Layout(tensor=tp, expert=ep, pipeline=pp, num_devices=8))
        assert tuple(make_mesh(cfg, [FakeDevice(i) for i in range(8)]).axis_names) == ("stage", "data", "expert", "tensor")


@pytest.mark.parametrize("kwargs, flag", [
    (dict(tensor=2, expert=3, expert_tensor=1, num_devices=6), "--expert-tensor-parallel-size"),
    (dict(tensor=2, context=3, num_devices=8), "--context-parallel-size"),
    (dict(tensor=2, expert=8, num_devices=8), "--expert-model-parallel-size"),
    (dict(tensor=1, expert=4, expert_tensor=4, num_devices=8), "--expert-tensor-parallel-size"),
    (dict(context=0, num_devices=8), "--context-parallel-size"),
])
def test_bad_grids_are_refused_naming_the_flag(kwargs, flag):
    with pytest.raises(LayoutError, match=flag):
        validate(Layout(**kwargs))


def test_expert_width_must_divide_by_etp():
    with pytest.raises(LayoutError, match="--expert-tensor-parallel-size"):
        validate(Layout(tensor=4, expert=2, expert_tensor=4, num_devices=8),
                 {"num_experts": 4, "moe_intermediate_size": 6})
