#!/bin/bash
# Qwen3-30B-A3B LoRA: the seed job (examples/qwen3_30b_a3b_sft.sh, same data, layout and flags) as a
# LoRA fine-tune. Rank-16 adapters (alpha 32) on attention (linear_qkv, linear_proj) and on every
# routed expert's fc1/fc2 (one adapter per expert; --lora-expert-adapters shared for one per layer),
# never the router. The base loads from CHECKPOINT_LOAD_PATH (the HF directory) and stays frozen in
# bf16: no fp32 master, no Adam moments, no gradient buffers for it. LoRA trains at a higher LR than
# full SFT (1e-4 here). Checkpoints in CHECKPOINT_SAVE_PATH hold the adapters and their optimizer
# state only and record the base; PEFT_DIR gets the adapters in HF PEFT format at the end
# (peft.PeftModel.from_pretrained(hf_model, PEFT_DIR)).
# CPU smoke variant (tiny model on the demo's trained base): CPU_SMOKE=1 bash examples/qwen3_30b_a3b_lora.sh
# LoRA adapts a trained model: on a random base its loss would not fall. So the smoke variant first
# trains the demo's base (python -m mlir_train.sft --config demo, BASE_ITERS iterations, saved as an
# HF directory in SMOKE_DIR/base; kept and reused), then fine-tunes LoRA adapters on it for
# SMOKE_ITERS iterations (default 8) at 3e-3 with 30% warm-up (a faster start spikes as Adam's first
# steps move every fresh adapter at once): its lm loss falls within the run.
set -euo pipefail

HERE=$(cd "$(dirname "$0")" && pwd)
export CHECKPOINT_SAVE_PATH=${CHECKPOINT_SAVE_PATH:-"/data/Qwen3_30B_mlir_train_lora_save"}
SMOKE_FLAGS=""
if [ -n "${CPU_SMOKE:-}" ]; then
    export SMOKE_DIR=${SMOKE_DIR:-$(mktemp -d)} SMOKE_ITERS=${SMOKE_ITERS:-8}
    export SMOKE_BASE="$SMOKE_DIR/base"
    if [ ! -f "$SMOKE_BASE/config.json" ]; then
        python -m mlir_train.sft --config demo --train-iters "${BASE_ITERS:-40}" --eval-interval 0 \
            --save-hf "$SMOKE_BASE" --data-cache-path "$SMOKE_DIR/cache" --tensorboard-dir "$SMOKE_DIR/base_tb"
    fi
    SMOKE_FLAGS="--lr ${SMOKE_LR:-3.0e-3} --min-lr 3.0e-4 --lr-decay-iters ${SMOKE_ITERS} --lr-warmup-fraction 0.3"
fi
PEFT_DIR=${PEFT_DIR:-"${SMOKE_DIR:-${CHECKPOINT_SAVE_PATH}}/peft_adapter"}

LORA_FLAGS="--lora-dim 16 --lora-alpha 32 --lora-target-modules linear_qkv linear_proj linear_fc1 linear_fc2"
LORA_FLAGS+=" --lora-expert-adapters per-expert --lr 1.0e-4 --min-lr 1.0e-5 --save-peft ${PEFT_DIR} ${SMOKE_FLAGS}"

EXTRA_FLAGS="${LORA_FLAGS} ${EXTRA_FLAGS:-}" exec bash "${HERE}/qwen3_30b_a3b_sft.sh"
