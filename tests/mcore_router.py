"""megatron-core's own router on CPU, as the oracle for ``mlir_train.model.moe.router`` and the
router losses (``tests/model/test_router.py``).

megatron-core 0.16.1's ``TopKRouter`` runs in this process once (measured 2026-12-01, torch 2.13
CPU): ``torch.cuda.current_device`` returns ``"cpu"``, ``moe_utils.te_general_gemm = None``
(without Transformer Engine it is an unbound name), and a one-rank gloo process group with
``parallel_state.initialize_model_parallel()`` gives it the TP / CP / DP groups it reduces over
(all of size 1) and ``get_updated_expert_bias`` its all-reduce.
"""

from __future__ import annotations

import functools
import socket


@functools.cache
def megatron():
    """Shim once, initialise a one-rank gloo world, and return ``(torch, moe_utils, make_router)``;
    ``make_router(**config)`` builds a ``TopKRouter`` from ``TransformerConfig`` fields. Skips the
    calling test where torch or megatron-core is absent (the newest-jax lane: the default lane runs it)."""
    import pytest

    pytest.importorskip("torch", reason="megatron-core's router is the reference: needs torch (the default lane)")
    pytest.importorskip("megatron.core", reason="megatron-core's router is the reference (the default lane)")
    import torch
    import torch.distributed as dist

    torch.cuda.current_device = lambda: "cpu"
    if not dist.is_initialized():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel()
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.moe import moe_utils
    from megatron.core.transformer.moe.router import TopKRouter
    from megatron.core.transformer.transformer_config import TransformerConfig

    moe_utils.te_general_gemm = None
    pg = ProcessGroupCollection.use_mpu_process_groups()

    def make_router(**fields):
        base = dict(num_layers=1, hidden_size=16, num_attention_heads=2, use_cpu_initialization=True,
                    moe_router_dtype="fp32", moe_ffn_hidden_size=16)
        router = TopKRouter(TransformerConfig(**(base | fields)), pg_collection=pg)
        router.set_layer_number(1)
        return router

    return torch, moe_utils, make_router


def tracked_losses(moe_utils) -> dict[str, float]:
    """Layer 1's raw values in Megatron's aux-loss tracker (summed over the calls since the
    last clear), then clear it."""
    tracker = moe_utils.get_moe_layer_wise_logging_tracker()
    out = {name: float(v["values"][0]) for name, v in tracker.items()}
    moe_utils.clear_aux_losses_tracker()
    return out
