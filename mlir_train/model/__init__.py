"""The model's shared pieces, written once with logical axis names: the causal LM every family
builds on, attention, MoE, LoRA, losses, recompute, and how a model is built to run
(:class:`ModelOptions`, :func:`kernel_options`). A family's own layers are in
:mod:`mlir_train.families`."""

from mlir_train.model.moe.block import MOE_IMPLS, MoE
from mlir_train.model.options import ModelOptions
from mlir_train.model.platform import kernel_options
from mlir_train.model.periods import Stack, layer_stacks
from mlir_train.model.transformer import REMAT_POLICIES, CausalLM, init_model, logical_axes, run_stack

__all__ = ["MOE_IMPLS", "MoE", "REMAT_POLICIES", "CausalLM", "ModelOptions", "Stack", "init_model", "kernel_options",
           "layer_stacks", "logical_axes", "run_stack"]
