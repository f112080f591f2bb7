"""The model, written once: Qwen3 dense and MoE decoders in Flax NNX with logical axis names."""

from mlir_train.model.moe.block import MOE_IMPLS, MoE
from mlir_train.model.kernels import platform_model_kwargs
from mlir_train.model.transformer import REMAT_POLICIES, DecoderLayer, Qwen3, init_model, logical_axes, run_stack

__all__ = ["MOE_IMPLS", "MoE", "REMAT_POLICIES",
           "DecoderLayer", "Qwen3", "init_model", "logical_axes", "platform_model_kwargs",
           "run_stack"]
