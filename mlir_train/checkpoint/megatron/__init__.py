"""Megatron-LM / AIAK checkpoints: recognise, read into any layout, write the legacy format."""

from mlir_train.checkpoint.megatron.load import (  # noqa: F401
    MegatronCheckpoint,
    MegatronCheckpointError,
    find,
    identify,
    is_megatron_dir,
    layer_stacks,
    load_params,
    looks_like_megatron,
    megatron_args,
    MegatronLayout,
    model_config,
    padded_vocab,
    resume_notes,
    save_legacy,
    unpadded_vocab,
)
