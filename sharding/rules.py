"""Rule tables: which mesh axes each logical axis is split over, one table per layout.

Tables are plain data so they can be printed, diffed and tested for completeness against
``LOGICAL_AXES`` (every name the model uses).
"""

from __future__ import annotations

from sharding.logical import Rules

# Every logical axis name the model may put on a parameter or an activation.
PARAM_AXES = (
    "layers",     # stacked decoder layers (-> stage under pipeline parallelism)
    "vocab",      # embedding rows / LM-head columns
    "embed",      # hidden size of weights
    "norm",       # RMSNorm scale vectors over the hidden size
    "q_heads",    # query heads
    "kv_heads",   # key/value heads
    "head_dim",   # per-head dimension
    "mlp",        # dense SwiGLU intermediate
    "exp",        # routed experts
    "moe_mlp",    # expert SwiGLU intermediate
    "router_exp", # router output columns (one per expert; kept whole, as Megatron does)
)
ACTIVATION_AXES = (
    "act_batch",
    "act_seq",
    "act_embed",
    "act_heads",
    "act_kv_heads",
    "act_head_dim",
    "act_mlp",
    "act_vocab",
    "act_exp",       # expert dimension of dispatched tokens
    "act_capacity",  # per-expert token slots in the padded dispatch buffer
    "act_tokens",    # flattened batch*seq tokens inside the MoE block
)
LOGICAL_AXES = PARAM_AXES + ACTIVATION_AXES

# Pure data parallelism: weights replicated, batch split over every data-like axis.
DATA_PARALLEL: Rules = tuple((name, None) for name in LOGICAL_AXES if name not in ("act_batch", "act_tokens")) + (
    ("act_batch", ("data", "expert")),
    ("act_tokens", ("data", "expert")),
)
