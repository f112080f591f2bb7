"""The machine code of the GPU kernels we own, compiled deviceless for an H200
(mlir_train/targets/h200.txtpb) and read with mlir_train.planner.kernel_audit: every pipelined wgmma
loop waits on its wgmmas before its shared memory is refilled (the Mosaic-GPU interpreter
cannot see that race), nothing spills, registers stay under the limit. Widths are Qwen3-30B-A3B's
(hidden 2048, expert width 768, and 384 = 768 over 2 tensor ranks), bf16, 128 experts. Skipped,
with the reason, where the deviceless GPU compiler is absent.

Regenerate the figures in benchmarks/README.md with ``python -m benchmarks.kernel_ptx``."""

import pytest

from mlir_train.planner.kernel_audit import moe_kernel_cases, parse_ptx
from mlir_train.planner.targets import DEVICE_KINDS

H200 = DEVICE_KINDS["h200"]


@pytest.fixture(scope="module")
def h200_device(h200_devices):
    return h200_devices[0]


CASES = [c[0] for c in moe_kernel_cases()]  # 8 kernels, about a second each to compile


@pytest.mark.parametrize("case", CASES)
def test_moe_kernel_waits_in_its_pipeline_and_does_not_spill(h200_device, case):
    from mlir_train.planner.kernel_audit import audit_kernel

    _, fn, args = next(c for c in moe_kernel_cases() if c[0] == case)
    (report,) = audit_kernel(fn, *args, device=h200_device)
    assert report.name.startswith(fn.__name__.replace("block_", "moe_block_")), report
    assert report.pipelined_loops >= 1, report  # the K (or block) loop issues wgmma
    assert report.pipelined_loops_with_wait == report.pipelined_loops, report.row()
    assert report.spill_bytes == 0, report.row()
    assert report.registers is not None and report.registers <= report.register_limit, report.row()


RACY_PTX = """
.visible .entry k(
)
.maxntid 128, 1, 1
{
$L__BB0_4:
	add.s32 	%r1, %r1, 1;
$L__BB0_2:
	{
	LAB_WAIT:
	mbarrier.try_wait.parity.shared.b64 P1, [%r54], %r45, %r46;
	@P1 bra.uni DONE;
	bra.uni     LAB_WAIT;
	DONE:
	}
	wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%r1}, %rd1, %rd2, p, 1, 1, 0, 0;
	wgmma.commit_group.sync.aligned;
	@%p11 bra 	$L__BB0_4;
	cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes [%r51], [%rd2, {%r52} ], [%r54];
	bra.uni 	$L__BB0_4;
}
ptxas info    : Compiling entry function 'k' for 'sm_90a'
ptxas info    : Function properties for k
    0 bytes stack frame, 8 bytes spill stores, 4 bytes spill loads
ptxas info    : Used 90 registers, used 2 barriers, 1 bytes smem
"""


def test_parse_ptx_finds_the_unwaited_pipeline_and_spills():
    """The parser on a trimmed copy of the racy kernel's PTX (no compiler needed): the barrier
    spin loop is not a pipelined loop, both back edges of the K loop issue wgmma and wait on none."""
    (r,) = parse_ptx(RACY_PTX, RACY_PTX)
    assert (r.name, r.registers, r.register_limit, r.spill_bytes) == ("k", 90, 255, 12)
    assert len(r.loops) == 3 and r.pipelined_loops == 2 and r.pipelined_loops_with_wait == 0
    fixed = RACY_PTX.replace("wgmma.commit_group.sync.aligned;", "wgmma.commit_group.sync.aligned;\n\twgmma.wait_group.sync.aligned 1;")
    assert parse_ptx(fixed)[0].pipelined_loops_with_wait == 2
    assert parse_ptx(fixed.replace(".maxntid 128, 1, 1", ".maxntid 384, 1, 1"))[0].register_limit == 170


def test_flash_attention_tiles_follow_the_target():
    from mlir_train.model.attention import flash_block_sizes

    assert flash_block_sizes(4096, "9.0").block_q_dkv == 64 and flash_block_sizes(4096, "9.0").block_q == 128
    assert flash_block_sizes(4096, None).block_q_dkv == 32  # CPU (interpreter) and unknown targets
    assert flash_block_sizes(4096, "8.0").block_q_dkv == 32 and flash_block_sizes(4096, "10.0").block_q_dkv == 32
    assert flash_block_sizes(48, "9.0").block_q_dkv == 16  # 64 must divide t


def test_flash_attention_tiles_for_256_wide_heads():
    """Heads wider than 128 (Qwen3.5 / Qwen3-Next) step the dK/dV loop 16 query rows at a time and
    keep 8 warps; the 128-wide heads' tiles and warps are the ones pinned above."""
    from mlir_train.model.attention import flash_block_sizes, flash_num_warps

    def tiles(t, cc, h):
        b = flash_block_sizes(t, cc, head_dim=h)
        return (b.block_q, b.block_k, b.block_q_dkv, b.block_kv_dkv, b.block_q_dq, b.block_kv_dq), flash_num_warps(b, h)

    assert tiles(4096, "9.0", 256) == ((64, 64, 16, 64, 64, 64), 8)
    assert tiles(4096, "9.0", 128) == ((128, 128, 64, 64, 64, 64), 8)
    assert tiles(4128, "9.0", 256) == ((32, 32, 16, 32, 32, 32), 8)  # 64 does not divide t: 32-row tiles
    assert tiles(4096, None, 256) == ((64, 64, 16, 32, 32, 32), 8)
    assert tiles(4096, None, 128) == ((128, 128, 32, 32, 32, 32), None)
    assert tiles(48, "9.0", 256) == ((16, 16, 16, 16, 16, 16), None)


def test_flash_attention_backward_uses_wgmma_without_spills_on_h200(h200_device, tmp_path):
    """The Pallas-Triton attention, compiled under a mesh of H200s (its tiles follow the mesh's
    devices), forward and backward, read from XLA's per-module PTX with ptxas -v (~10 s)."""
    from mlir_train.model.attention import pallas_mha_missing

    if pallas_mha_missing():
        pytest.skip(pallas_mha_missing())
    from tests.helpers import compiled_attention_grads, one_device_mesh
    from mlir_train.planner.kernel_audit import audit_xla_dump
    from mlir_train.model.attention import flash_attention

    compiled_attention_grads(flash_attention, one_device_mesh([h200_device]), t=2048, dump_to=tmp_path)
    reports = {r.name: r for r in audit_xla_dump(str(tmp_path))}
    for name in ("mha_forward", "mha_backward"):
        r = reports[name]
        assert r.wgmma > 0 and r.mma_sync == 0, (r.row(), r.wgmma, r.mma_sync)
        assert r.spill_bytes == 0 and r.registers <= r.register_limit, r.row()


@pytest.mark.parametrize("t", [1024, 1056])  # 64 x 64 Hopper tiles; 32 x 32 where 64 does not divide t
def test_flash_attention_with_256_wide_heads_does_not_spill_on_h200(h200_device, tmp_path, t):
    """Qwen3.5 / Qwen3-Next's 256-wide heads (flash_block_sizes' wide-head tiles): forward, and the
    backward kernel's dK/dV and dQ loops, without spills, read with ptxas -v (~10 s each). At
    64-row tiles the forward and both backward loops issue wgmma (the dK/dV loop's two 16-row
    score matmuls are mma.sync); at 32-row tiles everything is mma.sync."""
    from mlir_train.model.attention import pallas_mha_missing

    if pallas_mha_missing():
        pytest.skip(pallas_mha_missing())
    from tests.helpers import compiled_attention_grads, one_device_mesh
    from mlir_train.planner.hlo import matmul_flops
    from mlir_train.planner.kernel_audit import audit_xla_dump
    from mlir_train.model.attention import flash_attention

    compiled = compiled_attention_grads(flash_attention, one_device_mesh([h200_device]), t=t, h=256, dump_to=tmp_path)
    reports = {r.name: r for r in audit_xla_dump(str(tmp_path))}
    for name in ("mha_forward", "mha_backward"):
        r = reports[name]
        assert r.spill_store_bytes == 0 and r.spill_load_bytes == 0, r.row()
        assert r.registers <= r.register_limit, r.row()
        assert (r.wgmma > 0) == (t % 64 == 0) and r.wgmma + r.mma_sync > 0, (r.row(), r.wgmma, r.mma_sync)
    if t % 64 == 0:
        backward = reports["mha_backward"]
        assert backward.pipelined_loops == 2 and backward.pipelined_loops_with_wait == 2, backward.row()
    # The planner reads the tiles from the launch grids: the causal area of square tiles (the
    # dK/dV loop's 16-row steps cover the same), forward 2 matmuls, backward 7; 4 heads.
    tile = 64 if t % 64 == 0 else 32
    area = sum(i + 1 for i in range(t // tile)) * tile * tile
    assert matmul_flops(compiled.as_text()).attention_flops == 2.0 * 4 * 256 * (2 + 7) * area
