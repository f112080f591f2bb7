"""megatron-core (PyPI 0.16.1) on CPU, in this process, as a reference implementation for tests.

megatron-core is written for CUDA; with torch's CPU build it builds, runs forward/backward and
steps its optimizer under a one-rank gloo group after a few shims (measured 2026-12-01, torch
2.13 CPU, see /work/shared/JAX_NOTES.md):

* ``torch.cuda.current_device`` answers ``"cpu"`` (buffers are created on "the current device")
  and ``torch.cuda.synchronize`` does nothing; code that says ``device="cuda"`` outright (the
  optimizer wrappers, the default causal mask) runs under :class:`CudaToCpu`;
* the CUDA RNG tracker's ``fork()`` is a null context (dropout is 0 in the tests);
* ``moe_utils.te_general_gemm`` is defined as None (a NameError without Transformer Engine);
* the MoE token dispatcher must be ``"allgather"`` (``alltoall`` creates a CUDA stream), the
  layer spec the "local" one (no Transformer Engine), ``use_cpu_initialization=True``.

Everything here is for tests only: it changes torch's CUDA entry points process-wide, so import
it only from the tests that use megatron-core, and :func:`initialize` before building modules.
"""

from __future__ import annotations

import contextlib
import os
import socket

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core")


class _NullRngTracker:
    """Stands in for megatron's CUDA RNG tracker: forking it changes nothing (no dropout)."""

    def fork(self, *args, **kwargs):
        return contextlib.nullcontext()

    def add(self, *args, **kwargs):
        pass

    def reset(self):
        pass

    def get_states(self):
        return {}

    def set_states(self, states):
        pass

    def is_initialized(self):
        return True


def _is_cuda(device) -> bool:
    return (isinstance(device, str) and device.startswith("cuda")) or (
        isinstance(device, torch.device) and device.type == "cuda")


class CudaToCpu(torch.overrides.TorchFunctionMode):
    """Runs code that names ``device="cuda"`` (megatron's optimizer wrappers, causal masks,
    grad scalers) on the CPU: factory calls get ``device="cpu"``, ``.cuda()`` and
    ``.to("cuda")`` return the tensor where it is, and ``tensor.type()`` answers with the CUDA
    type name megatron's grad clipping asserts."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = "cpu"
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            # clip_grads asserts grads are 'torch.cuda.FloatTensor': name CPU tensors so.
            name = func(*args)
            return name if ".cuda." in name else name.replace("torch.", "torch.cuda.", 1)
        if func is torch.Tensor.to:
            if args[1:] and _is_cuda(args[1]):
                args = (args[0], "cpu", *args[2:])
        return func(*args, **kwargs)


_TRACKER = _NullRngTracker()
_initialized = False


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def initialize(seed: int = 0) -> None:
    """Shims, a one-rank gloo process group and megatron's model-parallel state (all sizes 1).
    Idempotent within a process."""
    global _initialized
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *a, **k: None
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.tensor_parallel import random as tp_random
    from megatron.core.transformer.moe import moe_utils

    tp_random.get_cuda_rng_tracker = lambda *a, **k: _TRACKER
    tensor_parallel.get_cuda_rng_tracker = tp_random.get_cuda_rng_tracker
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    if not torch.distributed.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ["MASTER_PORT"] = str(_free_port())
        torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    if not _initialized:
        # One rank, TP = PP = 1; the router oracle (tests/mcore_router.py) may have set up the
        # same groups first in this process.
        if not parallel_state.model_parallel_is_initialized():
            parallel_state.initialize_model_parallel(1, 1)
        _initialized = True
    torch.manual_seed(seed)
