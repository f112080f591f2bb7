"""mlir-train: Megatron/AIAK-style SFT of Qwen3 / Qwen3-MoE in JAX + Flax NNX."""

__version__ = "0.1.0"
