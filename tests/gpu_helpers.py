"""Shared by the deviceless XLA:GPU tests: one attention's forward and backward compiled for one
compile-only GPU device (conftest's ``h200_devices``)."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from mlir_train.planner.moe_audit import compile_without_cache


def one_device_mesh(devices) -> Mesh:
    return Mesh(np.array(devices[:1]), ("d",))


def compiled_attention_grads(attend, mesh: Mesh, *, t: int, kv: int = 2, g: int = 2, h: int = 128,
                             dump_to=None, under=None):
    """``jax.grad`` of ``sum(attend(q, k, v, segment_ids))`` over q, k and v (bf16, batch 1, ``kv``
    kv heads of ``g`` query heads each, head dim ``h``), compiled for ``mesh`` without the
    persistent cache; ``dump_to``: XLA's dump directory (the per-kernel PTX); ``under``: a context
    the lowering runs in (default ``jax.set_mesh(mesh)``, so kernels see the target's devices)."""
    rep = NamedSharding(mesh, PartitionSpec())
    q = jax.ShapeDtypeStruct((1, t, kv * g, h), jnp.bfloat16, sharding=rep)
    k = jax.ShapeDtypeStruct((1, t, kv, h), jnp.bfloat16, sharding=rep)
    seg = jax.ShapeDtypeStruct((1, t), jnp.int32, sharding=rep)
    loss = jax.grad(lambda q, k, v, s: jnp.sum(attend(q, k, v, s).astype(jnp.float32)), argnums=(0, 1, 2))
    with under if under is not None else jax.set_mesh(mesh):
        lowered = jax.jit(loss).lower(q, k, k, seg)
    return compile_without_cache(lowered, {"xla_dump_to": str(dump_to)} if dump_to is not None else None)
