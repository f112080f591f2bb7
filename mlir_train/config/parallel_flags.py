"""The model-parallel flag section: how the model splits over the devices (tensor, pipeline,
expert, expert-tensor, context and data parallelism; one of the run's sections,
:mod:`mlir_train.config.sections`). The layout it describes is built and checked by
:func:`mlir_train.train.build.layout_of`."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from mlir_train.config.fields import flag, switch
from mlir_train.runtime.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class ParallelFlags:
    GROUP: ClassVar[str] = "model-parallel"
    tensor_model_parallel_size: int = flag("--tensor-model-parallel-size", default=1, type=int)
    pipeline_model_parallel_size: int = flag("--pipeline-model-parallel-size", default=1, type=int)
    expert_model_parallel_size: int = flag("--expert-model-parallel-size", default=1, type=int)
    expert_tensor_parallel_size: int | None = flag(
        "--expert-tensor-parallel-size", type=int,
        help="the routed experts' width split over its own ranks, independent of TP (Megatron's MoE parallel "
             "folding: e.g. attention TP4, experts ETP1 x EP8 on the same 8 ranks) (default: "
             "--tensor-model-parallel-size)")
    context_parallel_size: int = flag(
        "--context-parallel-size", default=1, type=int,
        help="split each row's sequence over N ranks (Megatron's load-balanced 2N-chunk layout; K/V all-gathered "
             "in attention); --seq-length must be divisible by 2N (and by N x TP with --sequence-parallel)")
    sequence_parallel: bool = switch("--sequence-parallel")
    use_distributed_optimizer: bool = switch("--use-distributed-optimizer",
                                             help="shard optimizer state over data-parallel ranks (ZeRO-1)")
    use_torch_fsdp2: bool = switch(
        "--use-torch-fsdp2", help="FSDP: shard the parameters too over the data-parallel ranks, gathered for "
                                  "compute (same as --data-parallel-sharding-strategy optim_grads_params)")
    data_parallel_sharding_strategy: str = flag(
        "--data-parallel-sharding-strategy", default="no_shard",
        choices=["no_shard", "optim", "optim_grads", "optim_grads_params"],
        help="Megatron-FSDP's ZeRO stage: optim / optim_grads shard the optimizer state "
             "(= --use-distributed-optimizer), optim_grads_params the parameters too (FSDP)")
    use_megatron_fsdp: bool = switch(
        "--use-megatron-fsdp", "--use-custom-fsdp",
        help="accepted for Megatron-FSDP scripts; the sharding follows --data-parallel-sharding-strategy")
    num_layers_per_virtual_pipeline_stage: int | None = flag("--num-layers-per-virtual-pipeline-stage", type=int)
    num_virtual_stages_per_pipeline_rank: int | None = flag(
        "--num-virtual-stages-per-pipeline-rank", type=int,
        help="interleaved 1F1B with this many model chunks per stage (the other spelling of "
             "--num-layers-per-virtual-pipeline-stage = layers / (PP x this))")
    decoder_first_pipeline_num_layers: int | None = flag("--decoder-first-pipeline-num-layers", type=int)
    decoder_last_pipeline_num_layers: int | None = flag("--decoder-last-pipeline-num-layers", type=int)
    pipeline_schedule: str | None = flag(
        "--pipeline-schedule", group="mlir-train", choices=["1f1b", "gpipe", "circular"],
        help="with --pipeline-model-parallel-size > 1: 1f1b (default, as Megatron; interleaved with "
             "--num-layers-per-virtual-pipeline-stage; activations of at most ~2 x stages micro-batches), "
             "gpipe, or circular (needs --num-layers-per-virtual-pipeline-stage; both keep every "
             "micro-batch's activations)")

    def layers_per_virtual_stage(self, num_layers: int) -> int | None:
        """Layers per virtual pipeline stage, from either of Megatron's two spellings."""
        v, per = self.num_virtual_stages_per_pipeline_rank, self.num_layers_per_virtual_pipeline_stage
        if v is None:
            return per
        if per is not None:
            raise ConfigError("--num-layers-per-virtual-pipeline-stage and --num-virtual-stages-per-pipeline-rank "
                              "are mutually exclusive (as in Megatron): give one")
        pp = self.pipeline_model_parallel_size
        if v < 1 or num_layers % (pp * v):
            raise ConfigError(f"--num-virtual-stages-per-pipeline-rank {v}: the {num_layers} layers do not split into "
                              f"{pp} stages x {v} chunks of equal size")
        if self.decoder_first_pipeline_num_layers or self.decoder_last_pipeline_num_layers:
            raise ConfigError("--num-virtual-stages-per-pipeline-rank with uneven stages (--decoder-first/last-"
                              "pipeline-num-layers) is not implemented; drop one of them")
        return None if v == 1 else num_layers // (pp * v)

    @property
    def fsdp(self) -> bool:
        return self.use_torch_fsdp2 or self.data_parallel_sharding_strategy == "optim_grads_params"

    @property
    def distributed_optimizer(self) -> bool:
        return self.use_distributed_optimizer or self.data_parallel_sharding_strategy in ("optim", "optim_grads")
