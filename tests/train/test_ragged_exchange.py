"""The expert-parallel exchange as GPUs run it (issue 35 item 1).

``jax.lax.ragged_all_to_all`` types its result like its output buffer (JAX_NOTES 2026-12-02): a
plain buffer makes what each rank received the same on every rank in the program's eyes, and
the gradient then sums it over the ranks (stop 30's wrong-EP-gradient bug). XLA:CPU cannot run
the op, so two checks stand in for a GPU run: the stand-in ``ragged_all_to_all_dense`` refuses
such a buffer, and the EP train step *lowered* with the real op has no all-reduce of a receive
buffer. Each check also has the old bug (a plain receive buffer) planted and sees it caught.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from helpers import MODELS, moe_block, moe_block_inputs, packed_batch, run_moe_block
from mlir_train.model import ModelOptions
from mlir_train.model.moe import dispatch, exchange
from mlir_train.model.moe import block as moe_lib
from mlir_train.train.build import build_trainer
from mlir_train.train.step import StepConfig
from sharding.layout import Layout
from sharding.mesh import make_mesh


def _plant_plain_buffer(monkeypatch):
    """The old bug: the receive buffers are plain zeros, typed as the same on every rank."""
    monkeypatch.setattr(exchange, "varying_zeros", lambda shape, dtype, *like: jnp.zeros(shape, dtype))


def _exchange(output_varying: bool):
    mesh = jax.make_mesh((4,), ("x",), (jax.sharding.AxisType.Auto,), devices=jax.devices()[:4])

    def body(op):
        out = jnp.zeros((8, 3), op.dtype)
        if output_varying:
            out = jax.lax.pcast(out, ("x",), to="varying")
        sizes = jnp.full((4,), 2, jnp.int32)
        offsets = jnp.arange(4, dtype=jnp.int32) * 2  # slice j for rank j
        into = jnp.full((4,), 2 * jax.lax.axis_index("x"), jnp.int32)  # lands at 2 * this rank there
        offsets, sizes, into = exchange.typed_alike("x", offsets, sizes, into)
        return dispatch.ragged_all_to_all_dense(op, out, offsets, sizes, into, sizes, axis_name="x")

    x = jnp.arange(32 * 3, dtype=jnp.float32).reshape(32, 3)
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x")))(x)


def test_stand_in_types_like_its_buffer_and_refuses_a_plain_one():
    """A varying buffer: the documented semantics (rank r's slice j lands on rank j at r*2). A
    plain one: one ValueError naming the axes and the fix."""
    got = np.asarray(_exchange(True)).reshape(4, 8, 3)
    x = np.arange(32 * 3, dtype=np.float32).reshape(4, 8, 3)
    for dst in range(4):
        for src in range(4):
            np.testing.assert_array_equal(got[dst, 2 * src:2 * src + 2], x[src, 2 * dst:2 * dst + 2])
    with pytest.raises(ValueError, match=r"output buffer is typed as the same on the manual mesh axes \['x'\].*pcast"):
        _exchange(False)


def _strict_exchange(collective, cast_ints: bool, cast_operand: bool = True, cast_output: bool = True):
    """A ragged exchange over 4 ranks whose operand is invariant unless ``cast_operand``, offsets
    and sizes plain unless ``cast_ints``, the buffer plain unless ``cast_output``, traced (not
    run) with ``collective``."""
    mesh = jax.make_mesh((4,), ("x",), (jax.sharding.AxisType.Auto,), devices=jax.devices()[:4])

    def body(op):
        op = jax.lax.pcast(op, ("x",), to="varying") if cast_operand else op
        out = jnp.zeros((8, 3), op.dtype)
        out = jax.lax.pcast(out, ("x",), to="varying") if cast_output else out
        ints = (jnp.arange(4, dtype=jnp.int32) * 2, jnp.full((4,), 2, jnp.int32),
                jnp.full((4,), 2, jnp.int32) * 0, jnp.full((4,), 2, jnp.int32))
        if cast_ints:
            ints = exchange.typed_alike("x", *ints)
        return collective(op, out, *ints, axis_name="x")

    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(), out_specs=P("x"))).trace(
        jnp.zeros((8, 3), jnp.float32))


def _auto_pcast(value: bool):
    """jax's jax_auto_pcast (the wrapper's implicit casts; jax means to turn it off), as a context."""
    from jax._src import config

    return config.auto_pcast(value)


def test_stand_in_applies_jax_0_12s_typing_rule():
    """The rule jax 0.12's primitive applies, on every jax: offsets and sizes typed unlike the
    operand, or an operand not varying over the exchange's axis, are refused by name; typed alike
    (exchange.typed_alike) they trace."""
    with pytest.raises(ValueError, match=r"vary over different manual axes .*'input_offsets': \[\]"):
        _strict_exchange(dispatch.ragged_all_to_all_dense, cast_ints=False)
    with pytest.raises(ValueError, match=r"output buffer is typed|not over the exchange's axes \['x'\]"):
        _strict_exchange(dispatch.ragged_all_to_all_dense, cast_ints=True, cast_operand=False)
    _strict_exchange(dispatch.ragged_all_to_all_dense, cast_ints=True)


def test_real_op_typing_rule_is_what_the_stand_in_checks():
    """jax.lax.ragged_all_to_all itself, traced on this jax with its implicit float casts off (jax
    still casts integer arguments then): on jax 0.12 the primitive refuses a buffer typed unlike
    the operand (the rule the stand-in applies to all six arguments on every jax) and accepts them
    typed alike; jax 0.10 / 0.11 take both (the result typed like the buffer, which the stand-in's
    buffer check refuses)."""
    strict = tuple(int(p) for p in jax.__version__.split(".")[:2]) >= (0, 12)
    with _auto_pcast(False):
        _strict_exchange(jax.lax.ragged_all_to_all, cast_ints=True)
        if strict:
            with pytest.raises(ValueError, match="requires varying manual axes to match"):
                _strict_exchange(jax.lax.ragged_all_to_all, cast_ints=True, cast_output=False)
        else:
            _strict_exchange(jax.lax.ragged_all_to_all, cast_ints=True, cast_output=False)


def test_planted_plain_buffer_is_refused_by_the_stand_in(monkeypatch):
    """The grouped EP dispatcher on the stand-in: fine as it is; with the old plain receive
    buffer planted, the step fails to trace with the stand-in's error."""
    cfg = Layout(expert=4, tensor=2, num_devices=8)
    x, valid = moe_block_inputs()
    block = lambda: moe_block(impl="grouped", platform="cpu", ragged_all_to_all=moe_lib.ragged_all_to_all_dense)
    run_moe_block(block(), x, valid, cfg, grads=True)
    _plant_plain_buffer(monkeypatch)
    with pytest.raises(ValueError, match="output buffer is typed as the same"):
        run_moe_block(block(), x, valid, cfg, grads=True)


_RAGGED = re.compile(r"ragged_all_to_all.*-> (tensor<[^>]*>)")


def _lowered_ep_step(layout: Layout) -> str:
    """The train step of the tiny MoE model on ``layout``, the grouped dispatcher on the real
    ``jax.lax.ragged_all_to_all``, lowered (StableHLO text); XLA:CPU cannot compile it."""
    cfg = MODELS["moe"]
    options = ModelOptions(moe_impl="grouped", moe_platform="cpu", ragged_all_to_all=jax.lax.ragged_all_to_all)
    trainer = build_trainer(cfg, StepConfig(num_micro_batches=2, micro_batch_size=2), None, layout,
                            make_mesh(layout), options=options)
    state = trainer.abstract_state()
    batch = trainer.shard_batch(packed_batch(cfg.vocab_size))
    return trainer.lower_train_step(state, batch).as_text()


def _receive_buffer_sums(text: str) -> tuple[set[str], list[str]]:
    """(the receive buffers' types, the all-reduces of a value of one of those types)."""
    buffers = set(_RAGGED.findall(text))
    reduced = []
    for m in re.finditer(r'"stablehlo\.all_reduce"\((%[^)]*)\)', text):
        tail = text[m.end():m.end() + 4000]
        sig = re.search(r"\}\) : \((tensor<[^>]*>)", tail)
        if sig and sig.group(1) in buffers:
            reduced.append(sig.group(1))
    return buffers, reduced


LOWERED = Layout(expert=2, tensor=2, sequence_parallel=True, num_devices=4)
# The same layout under FSDP: the step takes no data-manual region (``Step.data_manual``), so the
# MoE's own region is a checked one, where the receive buffer's type decides the gradient program.
LOWERED_FSDP = Layout(expert=2, tensor=2, sequence_parallel=True, num_devices=4, fsdp=True)


@pytest.mark.parametrize("layout", [LOWERED, LOWERED_FSDP], ids=["data-manual", "fsdp"])
def test_ep_step_with_real_ragged_all_to_all_sums_no_receive_buffer(layout, monkeypatch):
    """The EP step lowered with the real op: receive buffers, and none of them all-reduced. Each
    call's six arguments are already typed alike when they reach the op (jax 0.12's primitive rule,
    checked on the way in): the exchange does not lean on jax's implicit casts, forward or backward."""
    real, calls = jax.lax.ragged_all_to_all, []

    def checked(operand, output, *ints, axis_name, **kw):
        dispatch.check_ragged_typing(operand, output, ints, axis_name)
        calls.append(axis_name)
        return real(operand, output, *ints, axis_name=axis_name, **kw)

    monkeypatch.setattr(jax.lax, "ragged_all_to_all", checked)
    buffers, reduced = _receive_buffer_sums(_lowered_ep_step(layout))
    assert len(calls) >= 2, calls  # forward and backward exchanges
    assert buffers, "no ragged_all_to_all in the lowered step: the test would prove nothing"
    assert not reduced, f"receive buffers summed over ranks: {reduced}"


def test_planted_plain_buffer_is_caught_in_the_lowered_step(monkeypatch):
    """The old plain receive buffers, planted, with the real op, under FSDP. Before the one-level
    gathered exchange (s12-reduce) the gradient program all-reduced the [128, 128] receive buffer
    over the ranks (3 more all-reduces), which the test above refuses; since, the plain buffer's
    type meets the exchange's custom VJP and the step fails to trace. Either way it is caught. In
    the data-manual step the planted buffer lowers to the same program as the fix (its region is
    unchecked: nothing is typed varying there, the fix's cast is a no-op, the bug cannot arise),
    so it is planted under FSDP. On jax 0.12 the wrapper casts a plain buffer itself (while
    jax_auto_pcast is on: nothing to catch, the step is right) and the primitive refuses it (off)."""
    _plant_plain_buffer(monkeypatch)
    strict = tuple(int(p) for p in jax.__version__.split(".")[:2]) >= (0, 12)
    if strict:
        buffers, reduced = _receive_buffer_sums(_lowered_ep_step(LOWERED_FSDP))
        assert buffers and not reduced, reduced
        with _auto_pcast(False), pytest.raises(ValueError, match="requires varying manual axes to match"):
            _lowered_ep_step(LOWERED_FSDP)
        return
    try:
        text = _lowered_ep_step(LOWERED_FSDP)
    except ValueError as e:
        assert "argument to VJP function" in str(e), e
        return
    buffers, reduced = _receive_buffer_sums(text)
    assert reduced and set(reduced) <= buffers, reduced
