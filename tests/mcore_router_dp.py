"""megatron-core's router at data-parallel size > 1, on CPU, as the oracle for the router losses
as a step forms them (``mlir_train.model.losses.router_losses``) and for Sinkhorn's balancing.

:func:`run` starts ``world`` gloo processes (``python tests/mcore_router_dp.py JOB.json``), one
data-parallel rank each (TP = PP = CP = 1). Each rank wraps megatron-core 0.16.1's own
``TopKRouter`` in its ``DistributedDataParallel`` and runs one training step's ``M``
micro-batches through megatron-core's own no-pipeline schedule (``get_forward_backward_func``)
and ``finalize_model_grads``: the per-rank aux / seq / global / z losses, their
``MoEAuxLossAutoScaler`` scaling (``1/M``, or under ``calculate_per_token_loss`` the rank's
router tokens), the data-parallel gradient reduction (an average, or under per-token loss a
sum divided by the global batch's loss tokens) are all megatron-core's. The schedule's loss
function returns a zero LM loss, so the router weight's gradient is the router losses' alone.

Each rank feeds its own rows of every micro-batch (rank ``d`` holds rows ``d*mbs:(d+1)*mbs``,
as our trainer lays them out), with a padding mask, and reports its loss-token count. Rank 0
writes ``<out>/<case>.npz``: the router weight's gradient ``[H, E]`` (our layout), the logged
tracker values reduced as Megatron's training log reduces them (``tracker_<name>``, summed over
micro-batches), and for Sinkhorn the routing probabilities every rank computed
(``probs [M, D, mbs*T, E]`` in our row-major token order).

Shims (see ``tests/mcore_cpu.py``): ``torch.cuda.current_device`` is ``"cpu"``,
``torch.cuda.synchronize`` a no-op, ``moe_utils.te_general_gemm = None``; megatron's code that
names ``device="cuda"`` runs under ``tests/mcore_inproc.CudaToCpu``.
"""

from __future__ import annotations

import json
import os
import sys


def run(job: dict, out_dir: str, world: int, *, timeout: float = 600.0) -> None:
    """Run ``job`` (``inputs``: an npz path; ``cases``: a list of router settings) in ``world``
    gloo processes; raise with a failing rank's output."""
    from tests.mcore_cpu import run_workers

    run_workers(os.path.abspath(__file__), dict(job, kind="router-dp"), out_dir, world, timeout=timeout)


def _case(case: dict, inputs, rank: int, world: int, out: str) -> None:
    import numpy as np
    import torch
    import torch.distributed as dist
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.enums import ModelType
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.moe import moe_utils
    from megatron.core.transformer.moe.router import TopKRouter
    from megatron.core.transformer.transformer_config import TransformerConfig

    x, valid, w, loss_tokens = inputs["x"], inputs["valid"], inputs["w"], inputs["loss_tokens"]
    if not case.get("padding", True):
        valid = np.ones_like(valid)
    m, rows, t, h = x.shape
    mbs, e = rows // world, w.shape[1]
    mine = slice(rank * mbs, (rank + 1) * mbs)
    config = TransformerConfig(
        num_layers=1, hidden_size=h, num_attention_heads=2, num_moe_experts=e, moe_ffn_hidden_size=16,
        moe_router_topk=case["topk"], moe_router_pre_softmax=False, moe_router_load_balancing_type=case["type"],
        moe_aux_loss_coeff=case["coeff"], moe_z_loss_coeff=case.get("z"), moe_token_dispatcher_type="allgather",
        calculate_per_token_loss=case["per_token"], use_cpu_initialization=True, add_bias_linear=False,
        params_dtype=torch.float32, moe_router_dtype="fp32", gradient_accumulation_fusion=False)
    router = TopKRouter(config, pg_collection=ProcessGroupCollection.use_mpu_process_groups())
    router.set_layer_number(1)
    router.model_type = ModelType.encoder_or_decoder  # what the schedule asks of a model
    router.set_input_tensor = lambda tensor: None  # one pipeline stage: no input from a previous one
    with torch.no_grad():
        router.weight.copy_(torch.from_numpy(w.T.copy()))
    moe_utils.clear_aux_losses_tracker()
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), module=router)
    config.finalize_model_grads_func = finalize_model_grads
    config.no_sync_func = ddp.no_sync
    probs_seen = []

    def loss_func(num_tokens, probs):
        # No LM loss: the router weight's gradient is the router losses' alone.
        return (probs * 0).sum(), torch.tensor(num_tokens, dtype=torch.int), {}

    def forward_step(data, model):
        i = next(data)
        xs = torch.from_numpy(x[i, mine].transpose(1, 0, 2).copy())  # Megatron's [seq, batch, hidden]
        padding = torch.from_numpy(~valid[i, mine].T.copy())  # True = padding
        probs, _ = model(xs, padding_mask=padding)
        probs_seen.append(probs.detach().reshape(t, mbs, e).transpose(0, 1).reshape(mbs * t, e).numpy())
        return probs, lambda out: loss_func(int(loss_tokens[i, rank]), out)

    ddp.zero_grad_buffer()
    get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter(range(m)), model=[ddp],
                                num_microbatches=m, seq_length=t, micro_batch_size=mbs, forward_only=False)
    grad = router.weight.main_grad.detach().clone()
    moe_utils.reduce_aux_losses_tracker_across_ranks()
    tracker = {f"tracker_{k}": float(v["values"][0]) for k, v in moe_utils.get_moe_layer_wise_logging_tracker().items()}
    moe_utils.clear_aux_losses_tracker()
    probs = torch.from_numpy(np.stack(probs_seen))
    gathered = [torch.zeros_like(probs) for _ in range(world)]
    dist.all_gather(gathered, probs)
    if rank == 0:
        np.savez(os.path.join(out, f"{case['name']}.npz"), grad=grad.numpy().T,
                 probs=torch.stack(gathered, dim=1).numpy(), **tracker)
    dist.barrier()


def worker(job_path: str) -> None:
    import numpy as np
    import torch
    import torch.distributed as dist

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from tests.mcore_cpu import apply_shims
    from tests.mcore_inproc import CudaToCpu

    torch.set_num_threads(1)
    with open(job_path) as f:
        job = json.load(f)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=world)
    apply_shims()
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel(1, 1)
    inputs = dict(np.load(job["inputs"]))
    with CudaToCpu():
        for case in job["cases"]:
            _case(case, inputs, rank, world, job["out"])
    dist.destroy_process_group()


if __name__ == "__main__":
    worker(sys.argv[1])
