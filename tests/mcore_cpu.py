"""Real megatron-core on CPU, as an oracle for the Megatron checkpoint tests.

megatron-core (PyPI 0.16.1: torch, numpy and packaging only) builds, runs and saves a
Qwen3-MoE-shaped ``GPTModel`` on CPU under gloo once a few CUDA assumptions are shimmed
(:func:`apply_shims`, measured 2026-12-01 with torch 2.13 CPU):

* ``torch.cuda.current_device`` returns ``"cpu"``, ``torch.cuda.synchronize`` is a no-op;
* ``tensor_parallel.random.get_cuda_rng_tracker`` returns a tracker whose ``fork()`` is a null
  context (every dropout here is 0, so no RNG state is needed);
* ``moe_utils.te_general_gemm = None`` (without Transformer Engine it is an unbound name);
* ``moe_token_dispatcher_type="allgather"`` (alltoall creates a CUDA stream),
  ``get_gpt_layer_local_spec(num_experts=..., qk_layernorm=True)`` (no TE),
  ``use_cpu_initialization=True``; ``psutil`` must be installed for ``dist_checkpointing.save``;
* the causal attention mask is passed in (the default one is built on ``device="cuda"``);
* ``sequence_parallel=False``: the local spec's torch norms refuse it (megatron-core itself runs
  TP + EP MoE without it; Megatron-LM's argument checks are what ask for it).

Each job runs ``python tests/mcore_cpu.py JOB.json`` in ``world`` processes (gloo, one thread
each) started by :func:`run_job`. Jobs:

``save``   build the model for a TP/PP/EP/ETP (and virtual pipeline) layout, give every
           parameter shard deterministic random values (replicated parameters equal on all
           ranks), write it as Megatron-LM does in *both* formats: legacy ``torch``
           (``<out>/torch``: ``latest_checkpointed_iteration.txt`` + ``iter_*/mp_rank_*/
           model_optim_rng.pt`` from ``state_dict_for_save_checkpoint()``, written by the ranks
           Megatron-LM's ``save_checkpoint`` picks) and ``torch_dist`` (``<out>/torch_dist``,
           ``dist_checkpointing.save`` of ``sharded_state_dict()``), then run megatron-core's own
           forward on fixed tokens and store the gathered logits (``logits.npy``, padded vocab).
           ``"formats": ["torch_dist"]`` skips the legacy files (with ETP > TP two ranks would
           write the same ``mp_rank_*`` file: that format names files by the dense TP rank).
``load``   build the model for a layout, load a legacy checkpoint as Megatron-LM's
           ``load_checkpoint`` does (each rank reads its own ``mp_rank_*`` file,
           ``load_state_dict(strict=True)``), run the forward, store ``logits.npy``.

The file layout (``get_checkpoint_name``) and the state dict keys (``args``,
``checkpoint_version``, ``iteration``, ``model``/``model0``...) follow Megatron-LM's
``megatron/training/checkpointing.py``, which is not part of the megatron-core package.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import socket
import subprocess
import sys
import time
import zlib

SPEC_FIELDS = dict(
    hidden=64, layers=4, heads=4, groups=2, head_dim=16, experts=8, moe_ffn=32, topk=2,
    vocab=250, divisible_by=64, seq=16, batch=2, rope_theta=1_000_000.0, eps=1e-6, ffn=96,
)


@dataclasses.dataclass(frozen=True)
class Layout:
    tp: int = 1
    pp: int = 1
    ep: int = 1
    etp: int | None = None  # None: = tp, as Megatron's default
    vpp: int | None = None  # virtual pipeline chunks per stage

    @property
    def world(self) -> int:
        import math

        return math.lcm(self.tp, (self.etp or self.tp) * self.ep) * self.pp

    def padded_vocab(self, vocab: int, divisible_by: int) -> int:
        m = divisible_by * self.tp
        return -(-vocab // m) * m


def run_job(job: dict, out_dir: str, *, timeout: float = 900.0) -> None:
    """Run ``job`` in ``Layout(**job['layout']).world`` gloo processes; raise with their stderr."""
    run_workers(os.path.abspath(__file__), job, out_dir, Layout(**job["layout"]).world, timeout=timeout)


def run_workers(script: str, job: dict, out_dir: str, world: int, *, timeout: float = 900.0) -> None:
    """Write ``job`` (with ``out=out_dir``) and run ``python SCRIPT JOB.json`` in ``world`` gloo
    processes (``RANK`` / ``WORLD_SIZE`` / ``MASTER_*`` set, the repository importable); raise
    with a failing rank's output."""
    os.makedirs(out_dir, exist_ok=True)
    job = dict(job, out=out_dir)
    path = os.path.join(out_dir, f"job-{job['kind']}.json")
    with open(path, "w") as f:
        json.dump(job, f)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world),
               OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", CUDA_VISIBLE_DEVICES="",
               PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    env.pop("XLA_FLAGS", None)
    logs = [open(os.path.join(out_dir, f"{job['kind']}-rank{r}.log"), "w+") for r in range(world)]
    procs = [subprocess.Popen([sys.executable, script, path], env=dict(env, RANK=str(r)),
                              stdout=logs[r], stderr=subprocess.STDOUT) for r in range(world)]
    deadline = time.time() + timeout
    try:
        for p in procs:
            p.wait(timeout=max(1.0, deadline - time.time()))
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        raise
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    bad = [r for r, p in enumerate(procs) if p.returncode != 0]
    if bad:
        logs[bad[0]].seek(0)
        raise RuntimeError(f"megatron-core {job['kind']} job, rank {bad[0]} failed:\n{logs[bad[0]].read()[-6000:]}")
    for f in logs:
        f.close()


# ----- inside a worker ---------------------------------------------------------------------------
def apply_shims() -> None:
    import torch
    from megatron.core import tensor_parallel
    from megatron.core.transformer.moe import moe_utils

    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *a, **k: None

    class _NullTracker:
        def fork(self, *a, **k):
            return contextlib.nullcontext()

        def is_initialized(self):
            return False

        def add(self, *a, **k):
            pass

        def get_states(self):
            return {}

        def set_states(self, states):
            pass

    tracker = _NullTracker()
    tensor_parallel.random.get_cuda_rng_tracker = lambda *a, **k: tracker
    tensor_parallel.get_cuda_rng_tracker = tensor_parallel.random.get_cuda_rng_tracker
    moe_utils.te_general_gemm = None


def _config(spec: dict, layout: Layout):
    import torch
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig

    moe = spec["experts"] > 0
    return TransformerConfig(
        num_layers=spec["layers"], hidden_size=spec["hidden"], num_attention_heads=spec["heads"],
        num_query_groups=spec["groups"], kv_channels=spec["head_dim"], ffn_hidden_size=spec["ffn"],
        normalization="RMSNorm", layernorm_epsilon=spec["eps"], gated_linear_unit=True, activation_func=F.silu,
        add_bias_linear=False, add_qkv_bias=False, qk_layernorm=True, hidden_dropout=0.0, attention_dropout=0.0,
        num_moe_experts=spec["experts"] if moe else None, moe_ffn_hidden_size=spec["moe_ffn"] if moe else None,
        moe_router_topk=spec["topk"] if moe else 2, moe_router_pre_softmax=False,
        moe_token_dispatcher_type="allgather", moe_aux_loss_coeff=0.0, moe_grouped_gemm=False,
        moe_router_load_balancing_type="none", moe_layer_freq=spec.get("moe_layer_freq", 1),
        use_cpu_initialization=True, params_dtype=torch.float32, pipeline_dtype=torch.float32,
        tensor_model_parallel_size=layout.tp, pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=layout.vpp, expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=layout.etp or layout.tp, sequence_parallel=False,
        attention_softmax_in_fp32=True, apply_rope_fusion=False, bias_activation_fusion=False,
        gradient_accumulation_fusion=False, masked_softmax_fusion=False, persist_layer_norm=False,
    )


def _megatron_args(spec: dict, layout: Layout, world: int, fmt: str):
    """The argparse Namespace Megatron-LM pickles as ``args`` (the fields a loader reads)."""
    moe = spec["experts"] > 0
    return argparse.Namespace(
        num_layers=spec["layers"], hidden_size=spec["hidden"], ffn_hidden_size=spec["ffn"],
        num_attention_heads=spec["heads"], num_query_groups=spec["groups"], group_query_attention=True,
        kv_channels=spec["head_dim"], num_experts=spec["experts"] if moe else None,
        moe_ffn_hidden_size=spec["moe_ffn"] if moe else None, moe_router_topk=spec["topk"],
        moe_router_pre_softmax=False, moe_router_score_function="softmax", moe_layer_freq=spec.get("moe_layer_freq", 1),
        moe_shared_expert_intermediate_size=None, moe_grouped_gemm=False,
        normalization="RMSNorm", norm_epsilon=spec["eps"], qk_layernorm=True, swiglu=True,
        add_bias_linear=False, add_qkv_bias=False, position_embedding_type="rope",
        rotary_base=int(spec["rope_theta"]), rotary_percent=1.0, rotary_interleaved=False,
        rotary_seq_len_interpolation_factor=None, max_position_embeddings=4096, seq_length=spec["seq"],
        padded_vocab_size=layout.padded_vocab(spec["vocab"], spec["divisible_by"]),
        make_vocab_size_divisible_by=spec["divisible_by"], vocab_size=None,
        untie_embeddings_and_output_weights=True, tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp, expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=layout.etp or layout.tp, virtual_pipeline_model_parallel_size=layout.vpp,
        num_layers_per_virtual_pipeline_stage=(spec["layers"] // (layout.pp * layout.vpp)) if layout.vpp else None,
        context_parallel_size=1, world_size=world, ckpt_format=fmt, transformer_impl="local",
        sequence_parallel=False, bf16=False, fp16=False, params_dtype="torch.float32",
        iteration=10, consumed_train_samples=0,
    )


def _build(spec: dict, layout: Layout):
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    config = _config(spec, layout)
    chunks = []
    for vp in range(layout.vpp or 1):
        vp_stage = vp if layout.vpp else None
        if isinstance(spec.get("moe_layer_freq", 1), list):  # dense and MoE layers mixed, per Megatron's pattern
            from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

            layer_spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm",
                                                    vp_stage=vp_stage)
        else:
            layer_spec = get_gpt_layer_local_spec(num_experts=spec["experts"] or None, qk_layernorm=True)
        chunks.append(GPTModel(
            config=config, transformer_layer_spec=layer_spec,
            vocab_size=layout.padded_vocab(spec["vocab"], spec["divisible_by"]), max_sequence_length=4096,
            pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
            post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
            parallel_output=False, share_embeddings_and_output_weights=False, position_embedding_type="rope",
            rotary_percent=1.0, rotary_base=int(spec["rope_theta"]), vp_stage=vp_stage,
        ))
    return chunks


def _randomise(chunks, layout: Layout) -> None:
    """Deterministic values per parameter *shard*: equal on ranks that hold the same shard."""
    import torch
    from megatron.core import parallel_state as ps

    pp = ps.get_pipeline_model_parallel_rank()
    for vp, chunk in enumerate(chunks):
        for name, p in chunk.named_parameters():
            expert = not getattr(p, "allreduce", True)
            key = [name, f"pp{pp}", f"vp{vp}"]
            if expert:
                key += [f"ep{ps.get_expert_model_parallel_rank()}", f"etp{ps.get_expert_tensor_parallel_rank()}"]
            elif getattr(p, "tensor_model_parallel", False):
                key.append(f"tp{ps.get_tensor_model_parallel_rank()}")
            gen = torch.Generator().manual_seed(zlib.crc32("/".join(key).encode()))
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            with torch.no_grad():
                if p.ndim == 1:  # norm scales: around 1, so a mix-up of two norms shows
                    p.copy_(1.0 + 0.2 * noise)
                elif "router" in name:
                    p.copy_(0.5 * noise)
                else:
                    p.copy_(0.08 * noise)


def _tokens(spec: dict):
    import torch

    gen = torch.Generator().manual_seed(1234)
    return torch.randint(0, spec["vocab"], (spec["batch"], spec["seq"]), generator=gen)


def _forward(chunks, spec: dict, layout: Layout):
    """Megatron-core's forward through the pipeline stages (activations sent with gloo
    send/recv, chunk-major as the interleaved schedule runs one micro-batch); returns the
    gathered logits ``[B, T, V_padded]`` on the last stage, else None."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    tokens = _tokens(spec)
    positions = torch.arange(spec["seq"]).unsqueeze(0).expand_as(tokens)
    # True = masked, as Megatron's; passed in because its default mask is built on "cuda".
    causal = torch.triu(torch.ones(spec["seq"], spec["seq"], dtype=torch.bool), diagonal=1)[None, None]
    pp, rank = ps.get_pipeline_model_parallel_rank(), dist.get_rank()
    prev, nxt = ps.get_pipeline_model_parallel_prev_rank(), ps.get_pipeline_model_parallel_next_rank()
    act_shape = (spec["seq"], spec["batch"], spec["hidden"])
    out = None
    with torch.no_grad():
        for vp, chunk in enumerate(chunks):
            chunk.eval()
            for stage in range(layout.pp):
                if stage != pp:
                    continue
                first = stage == 0 and vp == 0
                if not first:
                    x = torch.empty(act_shape)
                    dist.recv(x, src=prev)
                    chunk.set_input_tensor(x)
                y = chunk(tokens if first else None, positions, causal)
                last = stage == layout.pp - 1 and vp == len(chunks) - 1
                if last:
                    out = y
                else:
                    dist.send(y.contiguous(), dst=nxt)
    return out


def _legacy_path(root: str, iteration: int, layout: Layout) -> str:
    from megatron.core import parallel_state as ps

    name = f"mp_rank_{ps.get_tensor_model_parallel_rank():02d}"
    if layout.pp > 1:
        name += f"_{ps.get_pipeline_model_parallel_rank():03d}"
    if layout.ep > 1:
        name += f"_{ps.get_expert_model_parallel_rank():03d}"
    return os.path.join(root, f"iter_{iteration:07d}", name, "model_optim_rng.pt")


def _save(chunks, spec, layout, out, iteration=10, formats=("torch", "torch_dist")):
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    world = dist.get_world_size()
    keys = ["model"] if len(chunks) == 1 else [f"model{i}" for i in range(len(chunks))]
    # Legacy: the ranks Megatron-LM's save_checkpoint picks (dp rank 0 or expert-dp rank 0).
    root = os.path.join(out, "torch")
    legacy = "torch" in formats
    if legacy and (ps.get_data_parallel_rank() == 0 or ps.get_expert_data_parallel_rank() == 0):
        state = {"args": _megatron_args(spec, layout, world, "torch"), "checkpoint_version": 3.0,
                 "iteration": iteration}
        for k, c in zip(keys, chunks):
            state[k] = c.state_dict_for_save_checkpoint()
        path = _legacy_path(root, iteration, layout)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        torch.save(state, path)
    dist.barrier()
    if legacy and dist.get_rank() == 0:
        with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write(str(iteration))
    # torch_dist
    root = os.path.join(out, "torch_dist")
    sharded = {"args": _megatron_args(spec, layout, world, "torch_dist"), "checkpoint_version": 3.0,
               "iteration": iteration}
    for k, c in zip(keys, chunks):
        sharded[k] = c.sharded_state_dict()
    save_dist(sharded, root, iteration)


def save_dist(sharded: dict, root: str, iteration: int) -> None:
    """``dist_checkpointing.save`` of ``sharded`` into ``root/iter_*`` with Megatron-LM's tracker file."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    d = os.path.join(root, f"iter_{iteration:07d}")
    if dist.get_rank() == 0:
        os.makedirs(d, exist_ok=True)
    dist.barrier()
    dist_checkpointing.save(sharded, d)
    dist.barrier()
    if dist.get_rank() == 0:
        with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write(str(iteration))


def _load_legacy(chunks, layout, root):
    import torch

    with open(os.path.join(root, "latest_checkpointed_iteration.txt")) as f:
        tag = f.read().strip()
    iteration = 0 if tag == "release" else int(tag)
    path = _legacy_path(root, iteration, layout)
    if tag == "release":
        path = path.replace(f"iter_{iteration:07d}", "release")
    state = torch.load(path, map_location="cpu", weights_only=False)
    keys = ["model"] if len(chunks) == 1 else [f"model{i}" for i in range(len(chunks))]
    for k, c in zip(keys, chunks):
        c.load_state_dict(state[k], strict=True)


def start_worker(job_path: str, spec_fields: dict) -> tuple[dict, dict, Layout]:
    """A worker's job, its spec (``spec_fields`` under the job's) and layout, with gloo, the
    shims and megatron-core's model-parallel groups set up."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    with open(job_path) as f:
        job = json.load(f)
    spec = {**spec_fields, **job.get("spec", {})}
    layout = Layout(**job["layout"])
    dist.init_process_group("gloo", rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
    apply_shims()
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel(
        tensor_model_parallel_size=layout.tp, pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=layout.vpp, expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=layout.etp or layout.tp)
    torch.manual_seed(0)
    return job, spec, layout


def finish_worker(chunks, job: dict, spec: dict, layout: Layout) -> None:
    """Megatron-core's forward: the last stage's first TP / DP rank stores ``logits.npy`` and
    ``tokens.npy``; then the process group ends."""
    import numpy as np
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    logits = _forward(chunks, spec, layout)
    if logits is not None and ps.get_tensor_model_parallel_rank() == 0 and ps.get_data_parallel_rank() == 0:
        np.save(os.path.join(job["out"], "logits.npy"), logits.float().numpy())
        np.save(os.path.join(job["out"], "tokens.npy"), _tokens(spec).numpy())
    dist.barrier()
    dist.destroy_process_group()


def worker(job_path: str) -> None:
    job, spec, layout = start_worker(job_path, SPEC_FIELDS)
    chunks = _build(spec, layout)
    if job["kind"] == "save":
        _randomise(chunks, layout)
        _save(chunks, spec, layout, job["out"], formats=tuple(job.get("formats", ("torch", "torch_dist"))))
    elif job["kind"] == "load":
        _load_legacy(chunks, layout, job["checkpoint"])
    else:
        raise ValueError(job["kind"])
    finish_worker(chunks, job, spec, layout)


if __name__ == "__main__":
    worker(sys.argv[1])
