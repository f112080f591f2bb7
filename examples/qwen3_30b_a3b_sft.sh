#!/bin/bash
# Qwen3-30B-A3B SFT: the Megatron/AIAK seed script, ported to mlir-train.
# Same variables and flags; `python -m mlir_train.sft` replaces `torchrun .../train.py`, and the
# Kunlun/BKCL/XMLIR environment is replaced by the XLA settings that matter on GPUs.
# CPU smoke variant (tiny model, bundled data): CPU_SMOKE=1 bash examples/qwen3_30b_a3b_sft.sh
set -euo pipefail
set -x

MODEL_NAME=qwen3-30b-a3b; TOPK=8; SEQ_LENGTH=2048; GLOBAL_BATCH=128; TRAIN_ITERS=50; PP=2; PRECISION=--bf16
if [ -n "${CPU_SMOKE:-}" ]; then
    # Same flags, sized for a laptop CPU: tiny model, bundled data and tokenizer, 8 fake devices,
    # fresh weights (or SMOKE_BASE's: the LoRA example's trained base), float32, no pipeline split.
    ASSETS=$(python -c "import mlir_train.data.config as c; print(c.ASSETS)")
    MODEL_NAME=qwen3-moe-tiny; TOPK=2; SEQ_LENGTH=128; GLOBAL_BATCH=8; TRAIN_ITERS=${SMOKE_ITERS:-4}; PP=1; PRECISION=
    SMOKE_DIR=${SMOKE_DIR:-$(mktemp -d)}
    DATA_PATH="$ASSETS/alpaca_tasks.json"; TOKENIZER_PATH="$ASSETS/tokenizer"
    DATA_CACHE_PATH="$SMOKE_DIR/cache"; CHECKPOINT_LOAD_PATH="${SMOKE_BASE:-}"; CHECKPOINT_SAVE_PATH="$SMOKE_DIR/save"
    TENSORBOARD_PATH="$SMOKE_DIR/tb"
    unset XLA_FLAGS
fi

DATA_PATH=${DATA_PATH:-"/data/dataset/alpaca_data_en_52k.json"}
DATA_CACHE_PATH=${DATA_CACHE_PATH:-"/data/qwen3/dataset/sft_aplaca_en_data_cache"}
DATASET_CONFIG_PATH=${DATASET_CONFIG_PATH:-""}   # optional: maps dataset names to formats/columns

TOKENIZER_PATH=${TOKENIZER_PATH:-"/data/Qwen3-30B-A3B/"}
# An HF directory (config.json + safetensors) loads directly: no offline mcore conversion and no
# layout-specific checkpoint (the seed's *_mcore_tp2pp2ep2 directories).
CHECKPOINT_LOAD_PATH=${CHECKPOINT_LOAD_PATH-"/data/Qwen3-30B-A3B/"}
CHECKPOINT_SAVE_PATH=${CHECKPOINT_SAVE_PATH:-"/data/Qwen3_30B_mlir_train_save"}
TENSORBOARD_PATH=${TENSORBOARD_PATH:-"/data/tensorboard-log/qwen3-30b.sft.xla"}
mkdir -p "${TENSORBOARD_PATH}"

# XLA on GPUs (replaces the seed's kunlun/BKCL/XMLIR block) and the multi-node variables.
source "$(dirname "$0")/gpu_env.sh"

MODEL_ARGS=(
    --model-name "$MODEL_NAME"
    --rotary-base 1000000
    --rotary-seq-len-interpolation-factor 1
)

DATA_ARGS=(
    --tokenizer-type HFTokenizer
    --hf-tokenizer-path "$TOKENIZER_PATH"
    --data-path "$DATA_PATH"
    --split 100,0,0
)

SFT_ARGS=(
    --chat-template alpaca
    --sft-num-preprocess-workers ${PREPROCESS_WORKERS:-8}
    --no-check-for-nan-in-loss-and-grad
    --packing-sft-data
)

TRAINING_ARGS=(
    --training-phase sft
    --seq-length "$SEQ_LENGTH"
    --max-position-embeddings "$SEQ_LENGTH"
    --init-method-std 0.006
    --micro-batch-size 1
    --global-batch-size "$GLOBAL_BATCH"
    --lr 1.0e-5
    --min-lr 1.0e-6
    --clip-grad 1.0
    --weight-decay 0.1
    --optimizer adam
    --adam-beta1 0.9
    --adam-beta2 0.95
    --adam-eps 1e-08
    --norm-epsilon 1e-6
    --train-iters "$TRAIN_ITERS"
    --lr-decay-iters 5000
    --lr-decay-style cosine
    --lr-warmup-fraction 0.002
    --initial-loss-scale 65536
    $PRECISION
    --save "$CHECKPOINT_SAVE_PATH"
    --save-interval 500
    --eval-interval 100
    --eval-iters 10
    --no-load-optim
    --no-load-rng
    --data-cache-path "$DATA_CACHE_PATH"
)
if [ -n "$CHECKPOINT_LOAD_PATH" ]; then TRAINING_ARGS+=(--load "$CHECKPOINT_LOAD_PATH"); fi
if [ -n "$DATASET_CONFIG_PATH" ]; then TRAINING_ARGS+=(--sft-dataset-config "$DATASET_CONFIG_PATH"); fi

MOE_ARGS=(
    --moe-router-load-balancing-type aux_loss
    --moe-router-topk "$TOPK"
    --moe-aux-loss-coeff 1e-2
)

MODEL_PARALLEL_ARGS=(
    --tensor-model-parallel-size 2
    --pipeline-model-parallel-size "$PP"
    --expert-model-parallel-size 2
    --sequence-parallel
    --use-distributed-optimizer
    --distributed-backend nccl          # accepted and ignored: XLA picks NCCL itself
)

LOGGING_ARGS=(
    --log-interval 1
    --tensorboard-dir "${TENSORBOARD_PATH}"
    --log-timers-to-tensorboard
)

if [ -n "${WANDB_API_KEY:-}" ]; then
    LOGGING_ARGS+=(--wandb-project "${WANDB_PROJECT}" --wandb-exp-name "${WANDB_NAME}")
fi

python -m mlir_train.sft \
    "${MODEL_ARGS[@]}" \
    "${DATA_ARGS[@]}" \
    "${TRAINING_ARGS[@]}" \
    "${SFT_ARGS[@]}" \
    "${MOE_ARGS[@]}" \
    "${MODEL_PARALLEL_ARGS[@]}" \
    "${LOGGING_ARGS[@]}" \
    ${EXTRA_FLAGS:-}   # more flags, word-split (examples/qwen3_30b_a3b_lora.sh adds LoRA's); later ones win
