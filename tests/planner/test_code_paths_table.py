"""``python -m mlir_train.check``'s code-path rows name the dispatcher and the kernels that ran,
read from the traced step itself (issue 35 item 3): the EP dispatchers' named scopes
(``model.moe.dispatch.DISPATCHERS``) over the exchange's all-to-alls, and the kernels, also those
a host callback runs (the interpreted Mosaic-GPU block kernels under ``--code-paths gpu``).

Each layout's step is traced only (nothing compiled or run): the rows read the jaxpr.
"""

import re

import jax
import jax.numpy as jnp
import pytest

from mlir_train.families import get_model_config
from mlir_train.model import ModelOptions, kernel_options
from mlir_train.model.moe import dispatch
from mlir_train.planner.code_paths import CodePaths, read_jaxpr
from sharding.layout import Layout

MOE = get_model_config("qwen3-moe-tiny", vocab_size=512, num_layers=1)
# Expert width 64 per tensor rank: the Mosaic-GPU weight-gradient kernel's tile under TP2.
MOE_TP2 = get_model_config("qwen3-moe-tiny", vocab_size=512, num_layers=1, moe_intermediate_size=128)


def traced_rows(layout: Layout, options: ModelOptions, cfg=MOE) -> dict[str, str]:
    """The code-path rows of one train step of the one-layer tiny ``cfg`` on ``layout``, traced only."""
    from helpers import (AUX_LOSS, BETA1, LR, MICRO, MICRO_BATCH_SIZE, SEED, SEQ, build_trainer, make_optimizer,
                         megatron_lr_schedule, packed_batch, pipeline_schedule)
    from mlir_train.train.trainer import StepConfig, model_dims
    from sharding.mesh import make_mesh, validate

    parallel = validate(layout, model_dims(cfg), seq_length=SEQ)
    schedule = megatron_lr_schedule(lr=LR, min_lr=LR / 10, train_iters=10, lr_decay_style="cosine", lr_warmup_iters=0)
    optimizer = make_optimizer(lr_schedule=schedule, weight_decay=0.1, beta1=BETA1, beta2=0.95, clip_grad=1.0)
    step = StepConfig(num_micro_batches=MICRO, balancing=AUX_LOSS, micro_batch_size=MICRO_BATCH_SIZE)
    trainer = build_trainer(cfg, step, optimizer, parallel, make_mesh(parallel), options=options,
                            schedule=pipeline_schedule(cfg, parallel, MICRO))
    state = trainer.init_state(SEED)
    traced, _ = trainer.trace_train_step(state, trainer.shard_batch(packed_batch(cfg.vocab_size)))
    return dict(CodePaths.of(traced.jaxpr).rows())


def test_padded_dispatcher_is_named_on_cpu():
    """Without --code-paths gpu, EP on CPU takes the padded dispatcher: dense all-to-alls, the
    overflow rounds' bound, XLA's experts, no kernels."""
    rows = traced_rows(Layout(expert=2, num_devices=2), ModelOptions())
    assert rows["MoE dispatch"].startswith("padded: all_to_all x"), rows
    assert "(dense all-to-all; up to 2 rounds, the first always, the rest on overflow; " in rows["MoE dispatch"], rows
    assert rows["MoE dispatch"].endswith(" in the overflow rounds)"), rows
    assert "kernel" not in rows["expert matmuls"] and rows["kernels"] == "none (XLA ops only)", rows


def test_grouped_dispatcher_and_host_callback_kernels_are_named():
    """--code-paths gpu's EP2 step: the grouped dispatcher on the ragged all-to-all's typed
    stand-in, and the Mosaic-GPU block kernels that host callbacks run (interpreted) named in
    the expert-matmul and kernel rows, next to the interpreted docs-flash kernels (the GPU attention default)."""
    rows = traced_rows(Layout(expert=2, num_devices=2), kernel_options("cpu", is_moe=True, code_paths="gpu"))
    assert rows["MoE dispatch"].startswith("grouped: all_to_all x"), rows
    assert " in the ragged all-to-all's stand-in ragged_all_to_all_dense; " in rows["MoE dispatch"], rows
    how = "(Mosaic-GPU, interpreted, in a host callback)"
    assert f"kernel moe_block_matmul {how} x" in rows["expert matmuls"], rows
    assert f"kernel moe_block_matmul_t {how} x" in rows["expert matmuls"], rows
    kernels = rows["kernels"]
    assert "Mosaic-GPU moe_block_matmul (interpreted, in a host callback) x" in kernels, rows
    assert "Mosaic-GPU moe_block_matmul_t (interpreted, in a host callback) x" in kernels, rows
    assert "Triton docs_flash_fwd_q32_k32 (interpreted) x" in kernels, rows  # the GPU default at seq 32
    assert "kernel docs_flash_" in rows["attention"] and "(Triton, interpreted) x" in rows["attention"], rows


@pytest.mark.parametrize("name", ["gathered", "overflow"])
def test_gathered_and_overflow_rounds_are_named(name):
    """TP2 EP2 + SP (ETP = TP, the tensor ranks hold their own tokens): the gathered grouped
    dispatcher; EP2 with a quarter buffer: the grouped dispatcher's overflow rounds."""
    gpu = kernel_options("cpu", is_moe=True, code_paths="gpu")
    if name == "gathered":
        rows = traced_rows(Layout(tensor=2, expert=2, sequence_parallel=True, num_devices=4), gpu, MOE_TP2)
        gathered = dispatch.DISPATCHERS["gathered"]
        assert rows["MoE dispatch"].startswith(f"{gathered}: all_to_all x"), rows
    else:
        rows = traced_rows(Layout(expert=2, num_devices=2), gpu.replace(ep_buffer_factor=0.25))
        assert rows["MoE dispatch"].startswith("grouped: all_to_all x"), rows
        assert re.search(r"ragged_all_to_all_dense; up to \d+ rounds, the first always, the rest on overflow; \d+ in "
                         r"the overflow rounds\)$", rows["MoE dispatch"]), rows
    assert "kernel moe_block_matmul (Mosaic-GPU, interpreted, in a host callback)" in rows["expert matmuls"], rows


def test_scopes_are_read_through_sub_programs_and_transforms():
    """A scope entered outside a custom VJP, a scan and the gradient still names the ops inside
    them (each sub-program's name stack is relative to the op that holds it)."""

    @jax.custom_vjp
    def f(x):
        return jnp.sin(x) @ x

    f.defvjp(lambda x: (f(x), x), lambda x, g: (g @ x,))

    def step(x):
        with jax.named_scope(dispatch.DISPATCH_SCOPE + "grouped"):
            return jax.lax.scan(lambda c, _: (f(c), None), x, length=2)[0].sum()

    ops = read_jaxpr(jax.make_jaxpr(jax.grad(step))(jnp.ones((4, 4))))
    dots = [op for op in ops if op.primitive == "dot_general"]
    assert len(dots) >= 2 and all(op.scope(dispatch.DISPATCH_SCOPE) == "grouped" for op in dots), dots


def test_the_gpu_programs_own_exchange_and_compiled_kernels_are_named(h200_devices):
    """What a GPU run gets (deviceless H200s, EP2, traced only): the grouped dispatcher on the real
    ``ragged_all_to_all``, the Mosaic-GPU block kernels and Triton flash kernels compiled, no
    host callback."""
    from mlir_train.train.build import build_trainer
    from mlir_train.train.optim import make_optimizer
    from mlir_train.train.trainer import BATCH_KEYS, StepConfig
    from sharding import make_mesh

    parallel = Layout(expert=2, num_devices=2)
    trainer = build_trainer(MOE_TP2, StepConfig(num_micro_batches=1, compute_dtype="bfloat16"),
                            make_optimizer(lr_schedule=1e-4, weight_decay=0.1), parallel,
                            make_mesh(parallel, devices=h200_devices[:2]), options=kernel_options("gpu", is_moe=True))
    batch = {k: jax.ShapeDtypeStruct((1, 2, 256), jnp.float32 if k == "loss_mask" else jnp.int32,
                                     sharding=trainer.batch_sharding) for k in BATCH_KEYS}
    traced, _ = trainer.trace_train_step(trainer.abstract_state(), batch)
    rows = dict(CodePaths.of(traced.jaxpr).rows())
    assert re.match(r"grouped: all_to_all x\d+, ragged_all_to_all x\d+ \(ragged all-to-all; ", rows["MoE dispatch"]), rows
    for kernel in ("moe_block_matmul", "moe_block_matmul_t"):
        assert f"kernel {kernel} (Mosaic-GPU, compiled) x" in rows["expert matmuls"], rows
    assert "Triton docs_flash_fwd_q64_k64 (compiled) x" in rows["kernels"] and "host callback" not in rows["kernels"], rows
