"""The Qwen3 family: dense Qwen3 and Qwen3-MoE (``model_type`` ``qwen3`` / ``qwen3_moe``)."""

from mlir_train.config.models import ModelConfig
from mlir_train.families.family import Family
from mlir_train.families.qwen3.config import HF_MODEL_TYPES, MODELS, from_hf, to_hf
from mlir_train.families.qwen3.megatron import from_megatron, to_megatron
from mlir_train.families.qwen3.model import DecoderLayer, Qwen3
from mlir_train.families.qwen3.params import TABLE

FAMILY = Family(name="qwen3", config=ModelConfig, models=MODELS, hf_model_types=HF_MODEL_TYPES,
                from_hf=from_hf, to_hf=to_hf, model=Qwen3, params=TABLE,
                from_megatron=from_megatron, to_megatron=to_megatron)

__all__ = ["FAMILY", "DecoderLayer", "MODELS", "Qwen3"]
