"""Every accepted flag in one of three groups, and README's generated table of them.

* **honoured**: a field of :mod:`mlir_train.config.sections`, doing what Megatron does;
* **no-op under XLA** (:data:`NOOP_FLAGS`, :data:`ARCH_IMPLIED_FLAGS`): accepted with
  Megatron's arity and printed once at start-up as meaning nothing here;
* **not implemented** (:data:`NOT_IMPLEMENTED_FLAGS`) or **refused** beyond some values
  (:data:`REFUSED`): the run stops at start-up naming the flag and saying what to use instead.

``python -m mlir_train.config.flag_table`` prints the Markdown table README.md carries
(``scripts/update_flag_table.py`` rewrites README's copy).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from mlir_train.config.sections import section_fields

# flag -> (number of values Megatron gives it, why it means nothing here)
NOOP_FLAGS: dict[str, tuple[int, str]] = {
    # kernels and fusions: XLA fuses on its own
    **{f: (n, "kernel/fusion choice: XLA fuses and picks kernels itself") for f, n in {
        "--use-flash-attn": 0, "--attention-backend": 1, "--transformer-impl": 1,
        "--no-masked-softmax-fusion": 0, "--masked-softmax-fusion": 0, "--no-bias-gelu-fusion": 0,
        "--no-bias-swiglu-fusion": 0, "--no-bias-dropout-fusion": 0, "--no-rope-fusion": 0,
        "--no-persist-layer-norm": 0, "--no-gradient-accumulation-fusion": 0, "--cross-entropy-loss-fusion": 0,
        "--apply-query-key-layer-scaling": 0, "--moe-grouped-gemm": 0, "--moe-permute-fusion": 0,
        "--moe-use-legacy-grouped-gemm": 0, "--moe-token-dispatcher-type": 1}.items()},
    "--attention-softmax-in-fp32": (0, "the attention softmax is always float32 here"),
    "--cp-comm-type": ("+", "context parallelism exchanges K/V by one all-gather over the context ranks whatever "
                          "the type (p2p, a2a, allgather): the attention computed is the same"),
    "--moe-router-fusion": (0, "Transformer Engine's fused top-k / aux-loss kernels: XLA fuses the same ops"),
    # torch.distributed / NCCL / DDP plumbing: XLA inserts and schedules the collectives
    **{f: (n, "torch.distributed/NCCL plumbing: XLA inserts and schedules the collectives") for f, n in {
        "--distributed-backend": 1, "--distributed-timeout-minutes": 1, "--overlap-grad-reduce": 0,
        "--overlap-param-gather": 0, "--accumulate-allreduce-grads-in-fp32": 0, "--ddp-average-in-collective": 0,
        "--no-async-tensor-model-parallel-allreduce": 0, "--tp-comm-overlap": 0,
        "--num-distributed-optimizer-instances": 1, "--use-precision-aware-optimizer": 0, "--local-rank": 1,
        "--lazy-mpu-init": 0, "--use-mpi": 0, "--use-cpu-initialization": 0, "--empty-unused-memory-level": 1,
        "--manual-gc": 0, "--manual-gc-interval": 1}.items()},
    "--use-mcore-models": (0, "there is one model implementation"),
    "--use-legacy-models": (0, "there is one model implementation"),
    "--num-workers": (1, "the loader reads preprocessed arrays in-process"),
    "--dataloader-type": (1, "the loader reads preprocessed arrays in-process"),
    "--no-create-attention-mask-in-dataloader": (0, "masks are built inside the compiled step"),
    # checkpoint formats (we always write Orbax) and scheduler state (our schedule is a pure
    # function of the iteration: no stored scheduler state to use or override)
    **{f: (n, "checkpoint format/scheduler-state plumbing: we write Orbax; the LR schedule is a pure "
              "function of the iteration") for f, n in {
        "--ckpt-format": 1, "--use-dist-ckpt": 0, "--auto-detect-ckpt-format": 0, "--async-save": 0,
        "--use-checkpoint-args": 0, "--use-checkpoint-opt_param-scheduler": 0,
        "--override-opt_param-scheduler": 0}.items()},
    # logging we always do, or do not have
    **{f: (n, "logging we always do or do not have") for f, n in {
        "--log-throughput": 0, "--log-progress": 0, "--log-params-norm": 0, "--log-num-zeros-in-grad": 0,
        "--log-memory-to-tensorboard": 0, "--log-validation-ppl-to-tensorboard": 0,
        "--log-world-size-to-tensorboard": 0, "--timing-log-level": 1, "--timing-log-option": 1,
        "--tensorboard-queue-size": 1}.items()},
    # Megatron's MoE / parallelism tuning of its own communication and kernels
    **{f: (n, "communication/kernel tuning of Megatron's own collectives and dispatchers: XLA inserts, "
              "fuses and overlaps the collectives (see platform_setup's GPU flags)") for f, n in {
        "--create-all-gather-group": 0, "--ddp-bucket-size": 1, "--ddp-num-buckets": 1,
        "--ddp-pad-buckets-for-high-nccl-busbw": 0, "--disable-symmetric-registration": 0,
        "--distributed-timeout-seconds-after-init": 1, "--fsdp-double-buffer": 0, "--fsdp-manual-registration": 0,
        "--nccl-communicator-config-path": 1, "--no-align-grad-reduce": 0, "--no-align-param-gather": 0,
        "--no-gradient-reduce-div-fusion": 0, "--no-overlap-p2p-communication": 0,
        "--no-scatter-gather-tensors-in-pipeline": 0, "--no-tp-comm-bulk-dgrad": 0, "--disable-tp-comm-bulk-dgrad": 0,
        "--no-tp-comm-bulk-wgrad": 0, "--disable-tp-comm-bulk-wgrad": 0, "--no-tp-comm-overlap-ag": 0,
        "--disable-tp-comm-overlap-ag": 0, "--no-tp-comm-overlap-rs": 0, "--disable-tp-comm-overlap-rs": 0,
        "--no-tp-comm-split-ag": 0, "--disable-tp-comm-split-ag": 0, "--no-tp-comm-split-rs": 0,
        "--disable-tp-comm-split-rs": 0, "--tp-comm-overlap-rs-dgrad": 0, "--tp-comm-bootstrap-backend": 1,
        "--overlap-moe-expert-parallel-comm": 0, "--overlap-p2p-communication-warmup-flush": 0,
        "--overlap-param-gather-with-optimizer-step": 0, "--pipeline-model-parallel-comm-backend": 1,
        "--sharp-enabled-group": 1, "--use-sharp": 0, "--suggested-communication-unit-size": 1, "--use-nccl-ub": 0,
        "--ep-overlap-early-attn-memory-release": 0, "--moe-enable-deepep": 0, "--moe-deepep-num-sms": 1,
        "--moe-flex-dispatcher-backend": 1, "--moe-hybridep-num-sms": 1, "--torch-fsdp2-no-reshard-after-forward": 0,
        "--fake-process-group": 0}.items()},
    "--ddp-reduce-scatter-with-fp32-accumulation": (0, "gradients are reduced in float32 here already"),
    "--microbatch-group-size-per-virtual-pipeline-stage": (
        1, "the interleaved schedule's micro-batch grouping changes Megatron's issue order, not the numbers; "
           "our 1F1B is one compiled program"),
    "--keep-fp8-transpose-cache": (0, "FP8 is not used here"),
    "--moe-router-padding-for-fp8": (0, "FP8 is not used here"),
    "--moe-router-padding-for-quantization": (0, "FP8/FP4 is not used here"),
    "--inference-fuse-tp-communication": (0, "inference only"),
    "--moe-pad-experts-for-cuda-graph-inference": (0, "inference (CUDA graphs) only"),
    "--moe-shared-expert-overlap": (0, "Megatron overlaps the shared expert with the token dispatch on its own "
                                       "streams; XLA schedules the shared expert's matmuls alongside the "
                                       "collectives itself"),
    "--cross-entropy-fusion-impl": (1, "kernel/fusion choice: XLA fuses and picks kernels itself"),
    # LoongForge's SFT data flags that mean nothing here
    "--use-fixed-seq-lengths": (0, "rows are always padded to --seq-length: XLA compiles one shape"),
    "--streaming-buffer-size": (1, "only with --sft-data-streaming, which is refused"),
}


# FP8 / FP4 training is refused as a whole: there is no FP8 path here (peers measure about 1%
# step-time gain on H100 for Qwen3-30B-A3B), and a run that silently trained in BF16 under FP8
# flags would not be the run the user asked for.
FP8_WHY = ("FP8/FP4 training is not implemented (no FP8 path; peers measure about 1% step-time gain on H100 "
           "for this model): drop the FP8 flags and train with --bf16")

# flag -> arity: Megatron-LM's Transformer-Engine low-precision family (--fp8-format sets
# TransformerConfig.fp8; the layers kept in BF16 only mean something under FP8).
FP8_FLAGS: dict[str, int] = {
    "--fp8-format": 1, "--fp8-recipe": 1, "--fp8-param-gather": 0, "--fp8-margin": 1, "--fp8-interval": 1,
    "--fp8-amax-history-len": 1, "--fp8-amax-compute-algo": 1, "--no-fp8-wgrad": 0, "--disable-fp8-wgrad": 0,
    "--fp8-wgrad": 0, "--fp8-quantizer-factory": 1, "--fp8-dot-product-attention": 0,
    "--fp8-multi-head-attention": 0, "--fp8-output-proj": 0, "--fp8-e4m3": 0, "--fp8-hybrid": 0,
    "--first-last-layers-bf16": 0, "--num-layers-at-start-in-bf16": 1, "--num-layers-at-end-in-bf16": 1,
    "--reuse-grad-buf-for-mxfp8-param-ag": 0, "--te-precision-config-file": 1,
    "--fp4-format": 1, "--fp4-recipe": 1, "--fp4-param-gather": 0, "--fp4-quantizer-factory": 1,
}

_LOW_PRECISION_WORDS = ("fp8", "fp4", "mxfp8", "mxfp4", "nvfp4")


def is_low_precision_flag(flag: str) -> bool:
    """A flag of some peer's FP8/FP4 family that no table lists (``--fp8-force-no-requant``,
    ``--pretrain-as-fp8``, ...): refused with :data:`FP8_WHY` like the listed ones."""
    words = flag.lstrip("-").lower().replace("_", "-").split("-")
    return any(w in _LOW_PRECISION_WORDS for w in words)


# Megatron flags of features we do not implement: accepted by the parser only to stop the run
# naming the flag and saying why / what to use. flag -> (arity, why).
NOT_IMPLEMENTED_FLAGS: dict[str, tuple[int | str, str]] = {
    "--account-for-embedding-in-pipeline-split": (0, "not implemented: use --decoder-first-pipeline-num-layers / "
                                                     "--decoder-last-pipeline-num-layers for an uneven split"),
    "--account-for-loss-in-pipeline-split": (0, "not implemented: use --decoder-first-pipeline-num-layers / "
                                                "--decoder-last-pipeline-num-layers for an uneven split"),
    "--pipeline-model-parallel-layout": (1, "custom layout strings are not implemented: use "
                                            "--decoder-first/last-pipeline-num-layers and "
                                            "--num-layers-per-virtual-pipeline-stage"),
    "--use-tp-pp-dp-mapping": (0, "the mesh numbers ranks in Megatron's default tp-cp-ep-dp-pp order only"),
    "--enable-full-sharding-in-hsdp": (0, "hybrid-sharded FSDP (HSDP) is not implemented: use "
                                          "--use-torch-fsdp2 or --use-distributed-optimizer"),
    "--outer-dp-sharding-strategy": (1, "hybrid-sharded FSDP (HSDP) is not implemented: use "
                                        "--use-torch-fsdp2 or --use-distributed-optimizer"),
    "--model-parallel-size": (1, "Megatron's deprecated spelling: use --tensor-model-parallel-size"),
    "--moe-extended-tp": (0, "Megatron's deprecated spelling: use --expert-tensor-parallel-size"),
    "--hierarchical-context-parallel-sizes": ("+", "hierarchical (a2a+p2p) context parallelism is not implemented: "
                                                   "use --context-parallel-size alone"),
    "--hybrid-context-parallel": (0, "hybrid (dynamic) context parallelism is not implemented: use "
                                     "--context-parallel-size"),
    "--max-seqlen-per-dp-cp-rank": (1, "belongs to hybrid context parallelism, which is not implemented"),
    "--moe-apply-probs-on-input": (0, "not implemented: the routing weights scale the expert outputs"),
    "--moe-enable-routing-replay": (0, "routing replay is not implemented"),
    "--moe-input-jitter-eps": (1, "router input jitter is not implemented (it is random noise on the router input; "
                                  "drop the flag)"),
    "--moe-latent-size": (1, "latent MoE projections are not part of Qwen3-MoE"),
    "--moe-router-force-load-balancing": (0, "Megatron's benchmarking mode (random router logits) is not "
                                             "implemented"),
    "--moe-use-upcycling": (0, "dense-to-MoE upcycling is not implemented: start from an MoE checkpoint"),
    "--moe-upcycling-granularity": (1, "dense-to-MoE upcycling is not implemented: start from an MoE checkpoint"),
    "--mtp-standalone": (0, "megatron-core's standalone MTP pipeline stage is not built (the MTP depths do not "
                            "run under pipeline parallelism yet): drop the flag"),
    "--config-file": (1, "LoongForge's model YAML is not read: name the model with --model-name (a registry name "
                         "such as qwen3.5-35b-a3b, or the HF directory's config.json)"),
    "--add-question-in-pretrain": (0, "LoongForge's pretraining data option: mlir-train trains on SFT records "
                                      "(drop it; the SFT templates mask the prompt)"),
    # LoongForge's SFT data flags we do not implement
    **{f: ("+", "separate train/valid/test files (LoongForge's --train-data-path/--valid-data-path/"
                "--test-data-path) are not implemented: use --data-path with --split, and --sft-dataset "
                "to name the --sft-dataset-config entries") for f in
       ("--sft-train-dataset", "--sft-valid-dataset", "--sft-test-dataset")},
    "--is-tokenized-data": (0, "pre-tokenized records are not read: give the text records; the "
                               "preprocessing cache (--data-cache-path) already skips tokenizing on reuse"),
    "--sft-data-streaming": (0, "streaming is not implemented: the data is preprocessed once into a "
                                "memory-mapped cache (--data-cache-path, --sft-num-preprocess-workers), "
                                "which holds no dataset in memory"),
    "--sft-sort-batch": (0, "length-sorted batches are not implemented: rows are visited in a seeded, "
                            "resumable random order each epoch"),
    # Transformer Engine's FP8 / FP4 training (megatron-core 0.16.1 TransformerConfig, older Megatron spellings)
    **{f: (n, FP8_WHY) for f, n in FP8_FLAGS.items()},
}


# --help group of a no-op flag the seed script puts in one of its arrays (default: "ignored").
NOOP_FLAG_GROUPS = {"--distributed-backend": "model-parallel"}


# Flags that restate the Qwen3 architecture: flag -> (arity, accepted values or None).
ARCH_IMPLIED_FLAGS: dict[str, tuple[int, tuple[str, ...] | None]] = {
    "--swiglu": (0, None),
    "--disable-bias-linear": (0, None),
    "--qk-layernorm": (0, None),
    "--group-query-attention": (0, None),
    "--no-position-embedding": (0, None),
    "--use-rotary-position-embeddings": (0, None),
    "--normalization": (1, ("RMSNorm",)),
    "--position-embedding-type": (1, ("rope",)),
}


@dataclasses.dataclass(frozen=True)
class Refusal:
    """A field whose value ``accepted(value, cfg)`` allows; anything else stops the run."""

    accepted: Callable[[Any, Any], bool]  # (value, the RunConfig) -> allowed
    message: str  # what is not implemented and what to use instead


# flag -> Refusal. Each is a feature Megatron has and we do not (yet): the run stops at
# start-up naming the flag instead of silently training without it.
REFUSED: dict[str, Refusal] = {
}


def flag_table() -> list[tuple[str, str, str]]:
    """(flag, group, what it does here) for every accepted flag: "same as Megatron", "no-op under
    XLA: why", or "refused: why" (refused beyond its accepted values)."""
    rows = []
    for _, cls, f, fl in section_fields():
        help_text = fl.kwargs.get("help", "")
        if fl.name in REFUSED:
            what = f"refused beyond its default: {REFUSED[fl.name].message}"
        else:
            own = (fl.group or cls.GROUP) == "mlir-train" or fl.name in ("--save-hf", "--save-retain",
                                                                         "--lora-export-format")
            what = ("mlir-train's own" if own else "as Megatron") + (
                f" ({help_text})" if help_text and "%(" not in help_text else "")
        rows.append((fl.name, fl.group or cls.GROUP, what))
    rows += [(name, "ignored", f"no-op under XLA: {why}") for name, (_, why) in NOOP_FLAGS.items()]
    rows += [(name, "refused", f"refused: {why}") for name, (_, why) in NOT_IMPLEMENTED_FLAGS.items()]
    rows += [(name, "model", "accepted: the Qwen3 architecture implies it"
              + (f" (only {'/'.join(ok)})" if ok else "")) for name, (_, ok) in ARCH_IMPLIED_FLAGS.items()]
    return rows


def flag_table_markdown() -> str:
    """:func:`flag_table` as the Markdown table README.md carries (tests keep the two equal)."""
    rows = ["| flag | group | here |", "|---|---|---|"]
    rows += [f"| `{name}` | {group} | {what.replace('|', '/')} |" for name, group, what in flag_table()]
    return "\n".join(rows)


if __name__ == "__main__":  # python -m mlir_train.config.flag_table: the flag table README.md carries
    print(flag_table_markdown())
