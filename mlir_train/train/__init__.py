"""Training: the one builder from a configuration to a run (``build``), the compiled step
(``trainer``), optimizer, LR schedule, the loop's hooks (metrics, evaluation, exits, the kernel
self-check) and pipeline parallelism (``pipeline/``)."""
