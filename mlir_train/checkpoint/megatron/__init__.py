"""Megatron-LM / AIAK checkpoints."""
