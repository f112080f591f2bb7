"""mlir_train.planner.hlo_kernels on hand-written HLO and on an XLA:CPU compile (no GPU needed)."""

import jax
import jax.numpy as jnp

from mlir_train.planner.hlo_kernels import _causal_tile_pairs, matmul_flops

HLO = """
%body (p: (s32[], f32[4,4])) -> (s32[], f32[4,4]) {
  %a = f32[4,8]{1,0} parameter(0)
  %b = f32[8,4]{1,0} parameter(1)
  ROOT %d = f32[4,4]{1,0} dot(%a, %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

ENTRY %main (x: f32[2,4,8], y: f32[2,8,4]) -> f32[2,4,4] {
  %x = f32[2,4,8]{2,1,0} parameter(0)
  %y = f32[2,8,4]{2,1,0} parameter(1)
  %w = (s32[], f32[4,4]{1,0}, f32[], f32[], f32[], /*index=5*/f32[]) while(%t), condition=%c, body=%body
  %k = bf16[384,768]{1,0} custom-call(%e, %u, %l, %r), custom_call_target="mosaic_gpu_v2", operand_layout_constraints={s32[6]{0}, s32[1]{0}, bf16[384,2048]{1,0}, bf16[3,2048,768]{2,1,0}}, api_version=API_VERSION_TYPED_FFI, metadata={op_name="jit(f)/moe_block_matmul/mpmd_map"}
  ROOT %r = f32[2,4,4]{2,1,0} dot(%x, %y), lhs_batch_dims={0}, lhs_contracting_dims={2}, rhs_batch_dims={0}, rhs_contracting_dims={1}
}
"""


def test_counts_dots_loops_and_block_kernels():
    f = matmul_flops(HLO)
    assert f.dot_flops == 2 * 4 * 4 * 8 + 2 * 2 * 4 * 4 * 8
    assert f.batched_dot_flops == 2 * 2 * 4 * 4 * 8
    assert f.while_loops == 1
    (k,) = f.kernels
    assert (k.name, k.rows, k.flops_bound) == ("moe_block_matmul", 384, 2 * 384 * 2048 * 768)
    assert f.kernel_flops_for_rows({384: 192}) == k.flops_bound / 2


def test_counts_an_xla_cpu_compile():
    a, b = jnp.ones((3, 16, 32)), jnp.ones((3, 32, 8))
    f = matmul_flops(jax.jit(lambda a, b: jnp.einsum("bij,bjk->bik", a, b)).lower(a, b).compile().as_text())
    assert f.dot_flops == 2 * 3 * 16 * 32 * 8


def test_causal_tile_pairs():
    assert _causal_tile_pairs(256, 128, 128) == 3  # 1 + 2
    assert _causal_tile_pairs(128, 32, 32) == 10


def test_loop_bodies_count_their_known_trip_count():
    def f(x, w):
        return jax.lax.scan(lambda c, wi: (jnp.tanh(c @ wi), None), x, w)[0]

    flops = matmul_flops(jax.jit(f).lower(jnp.ones((4, 8)), jnp.ones((3, 8, 8))).compile().as_text())
    assert flops.while_loops == 1 and flops.unknown_trip_count_loops == 0
    assert flops.dot_flops == 3 * 2 * 4 * 8 * 8
