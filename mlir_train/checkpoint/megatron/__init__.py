"""Megatron-LM / AIAK checkpoints: recognise them (``find``), open their files (``read``), lay them
into our parameters from any layout (``load``), write the legacy format (``save``). Import from here."""

from mlir_train.checkpoint.megatron.find import (
    TRACKER,
    find,
    identify,
    is_megatron_dir,
    looks_like_megatron,
    model_config,
    padded_vocab,
    resume_notes,
    unpadded_vocab,
)
from mlir_train.checkpoint.megatron.load import layer_stacks, load_params
from mlir_train.checkpoint.megatron.read import MegatronCheckpoint, MegatronCheckpointError
from mlir_train.checkpoint.megatron.save import megatron_args, save_legacy, save_params

__all__ = [
    "TRACKER", "MegatronCheckpoint", "MegatronCheckpointError", "find", "identify",
    "is_megatron_dir", "layer_stacks", "load_params", "looks_like_megatron", "megatron_args", "model_config",
    "padded_vocab", "resume_notes", "save_legacy", "save_params", "unpadded_vocab",
]
