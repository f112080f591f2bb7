"""The Qwen3-MoE block: routing (``router``), dispatch on one rank (``dispatch``), the expert
kernels (``experts``; GPU block kernels ``gpu``), their parallel regions (``parallel``) and
the block that ties them (``block``)."""
