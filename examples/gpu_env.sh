# The GPU and launch environment the example scripts share (sourced; CPU_SMOKE skips the XLA GPU flags).

export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-"0,1,2,3,4,5,6,7"}

# ---- XLA on GPUs (replaces the seed's kunlun/BKCL/XMLIR block) ----
# Latency-hiding scheduler: overlaps collectives (TP all-gathers, EP all-to-alls, pipeline
# sends) with compute; the analogue of XMLIR_DIST_ASYNC_ISEND_IRECV.
XLA_FLAGS_GPU="--xla_gpu_enable_latency_hiding_scheduler=true"
# Let XLA combine small collectives into larger ones (fewer NCCL launches).
XLA_FLAGS_GPU+=" --xla_gpu_all_gather_combine_threshold_bytes=134217728"
XLA_FLAGS_GPU+=" --xla_gpu_reduce_scatter_combine_threshold_bytes=134217728"
XLA_FLAGS_GPU+=" --xla_gpu_all_reduce_combine_threshold_bytes=134217728"
# cuBLASLt / Triton GEMM fusion: the analogue of XMLIR_ENABLE_LINEAR_FC_FUSION.
XLA_FLAGS_GPU+=" --xla_gpu_enable_triton_gemm=true"
[ -n "${CPU_SMOKE:-}" ] || export XLA_FLAGS="${XLA_FLAGS:-} ${XLA_FLAGS_GPU}"
# Let JAX use most of the GPU memory up front (no fragmentation from on-demand growth).
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.92}
# XMLIR_PARALLEL_SAVE_MEMORY=true (trade speed for memory) becomes --recompute-granularity below.

# ---- multi-node: same variables as the seed; jax.distributed reads them ----
export MASTER_ADDR=${MASTER_ADDR:-"localhost"}
export MASTER_PORT=${MASTER_PORT:-"6000"}
export NNODES=${WORLD_SIZE:-"1"}
export NODE_RANK=${RANK:-"0"}
