"""Before renting the machines: will a layout fit and how fast would it run, read from what XLA
compiled for the target (``plan``, ``targets``, ``hlo``), plus Megatron's FLOP formula."""
