"""Configuration, the bottom layer: the model registry, every flag as a typed field, the parser.

Nothing here imports jax, the model or the trainer, so an entry point reads its flags (and
fails on a bad one) before any accelerator runtime starts."""
