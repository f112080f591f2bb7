"""Checkpoints: ours (Orbax, ``orbax``), Hugging Face directories (``hf``) and Megatron-LM / AIAK
ones (``megatron/``), their integrity manifests (``integrity``)."""
