"""The kernels the model's layers call, one folder below them: nothing here imports a layer.

* :mod:`.blocks`: the block-grouped MoE experts' matmuls as one value (``BlockKernels``) and
  their ``ragged_dot`` reference;
* :mod:`.mosaic_moe`: our Pallas Mosaic-GPU block kernels (Hopper), ``--moe-gemm-backend mosaic``;
* :mod:`.tokamax_ops`: tokamax's ragged-dot and flash attention as backends
  (``--moe-gemm-backend tokamax``, ``--attention-kernel tokamax``);
* :mod:`.docs_flash`: our document-skipping Pallas-Triton flash attention
  (``--attention-kernel mlir``).

The layers import these modules at the top; the optional packages behind them (tokamax,
Mosaic GPU) are imported inside, when a kernel is built or traced, so a CPU run needs neither.
"""
