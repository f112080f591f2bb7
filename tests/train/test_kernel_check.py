"""The start-up kernel self-check (``mlir_train.train.kernel_check``): the GPU kernels, run on CPU by
the Pallas and Mosaic-GPU interpreters, pass it; a deliberately wrong kernel stops the run naming
itself and the flag of its fallback, or, with that flag at ``auto``, is replaced loudly."""

import re

import jax.numpy as jnp
import pytest
from flax import nnx

from mlir_train.train import kernel_check
from mlir_train.families import get_model_config
from mlir_train.families.qwen3 import Qwen3
from mlir_train.model import ModelOptions
from mlir_train.model.kernels.blocks import BlockKernels, xla_block_kernels
from mlir_train.model.kernels.mosaic_moe import mosaic_block_kernels
from mlir_train.runtime.errors import ConfigError

# Small widths the kernels' tiles divide (64-row blocks, 64-wide weight-gradient tiles).
SHAPES = kernel_check.Shapes(hidden=64, moe_width=64, experts=2, heads=4, kv_heads=2, head_dim=32, seq_length=64,
                             dtype="float32")


def _broken_block_kernels(scale=1.1):
    """The XLA block kernels with a forward matmul 10% off: what a racy tile would look like."""
    ref = xla_block_kernels(64)
    return BlockKernels("broken", 64, lambda *a: ref.matmul(*a) * scale, ref.matmul_t)


def test_interpreted_kernels_pass(capsys):
    from mlir_train.model.kernels.mosaic_moe import interpret_params

    kernels = kernel_check.selected("docs-flash", mosaic_block_kernels(interpret_params()), interpret=True)
    assert [k.key for k in kernels] == ["docs-flash", "mosaic-interpret"]
    assert kernel_check.self_check(kernels, SHAPES) == {}
    out = capsys.readouterr().out
    line = re.search(r"^mlir-train: kernel self-check took (\d+\.\d)s \(float32, tolerance 5e-03\): (.*)$", out, re.M)
    assert line, out
    assert "document-skipping flash attention (our Pallas-Triton, --attention-kernel mlir) ok" in line.group(2)
    assert "MoE expert matmuls (mosaic-interpret block kernels) ok" in line.group(2)
    print(f"self-check on the CPU interpreters: {line.group(1)} s")


def test_wrong_kernel_stops_naming_kernel_and_flag():
    kernels = kernel_check.selected("xla", _broken_block_kernels())
    with pytest.raises(ConfigError) as e:
        kernel_check.self_check(kernels, SHAPES, {"moe_gemm_backend": "mosaic"})
    msg = str(e.value)
    assert "MoE expert matmuls (broken block kernels)" in msg and "--moe-gemm-backend mosaic" in msg, msg
    assert "select the fallback with --moe-gemm-backend padded" in msg and "--no-kernel-self-check" in msg, msg


def test_failing_kernel_under_auto_falls_back_loudly(monkeypatch):
    def raising(interpret):
        def fn(q, k, v, seg):
            raise ValueError("no kernel for this shape")
        return fn

    monkeypatch.setitem(kernel_check.ATTENTION_KERNELS, "flash", ("flash attention (Pallas-Triton mha)", raising))
    lines = []
    kernels = kernel_check.selected("flash", _broken_block_kernels())
    fallbacks = kernel_check.self_check(kernels, SHAPES, {"attention_kernel": "auto"}, log=lines.append)
    assert fallbacks == {"attention_impl": "xla", "moe_impl": "padded"}
    summary, warn_attn, warn_moe = lines  # the seconds first, also when the run stops
    assert "flash attention (Pallas-Triton mha) failed: ValueError: no kernel for this shape" in warn_attn
    assert "falling back to XLA attention" in warn_attn and "--attention-kernel xla selects it" in warn_attn
    assert "(broken block kernels) failed: max relative error" in warn_moe and "--moe-gemm-backend padded" in warn_moe
    assert summary.startswith("kernel self-check took ") and summary.count("FAILED") == 2
    # The explicit choice stops instead, naming the attention flag.
    with pytest.raises(ConfigError, match=r"flash attention .* select the fallback with --attention-kernel xla"):
        kernel_check.self_check(kernels[:1], SHAPES, {"attention_kernel": "pallas-mha"}, log=lines.append)


def test_bf16_tolerance_catches_a_small_error():
    """At bf16 a 10% error is far outside the tolerance, the reference path well inside it."""
    bf16 = kernel_check.Shapes(**{**SHAPES.__dict__, "dtype": "bfloat16"})
    assert kernel_check.check_block_kernels(xla_block_kernels(64), bf16) < kernel_check.TOLERANCE["bfloat16"] / 3
    assert kernel_check.check_block_kernels(_broken_block_kernels(), bf16) > kernel_check.TOLERANCE["bfloat16"]


def test_what_is_selected_follows_the_model():
    """CPU defaults select nothing; the GPU kernels are read off the model's attributes."""
    cfg = get_model_config("qwen3-moe-tiny", vocab_size=256, num_layers=2)
    build = lambda **kw: nnx.eval_shape(lambda: Qwen3(cfg, rngs=nnx.Rngs(0), options=ModelOptions(**kw)))
    assert kernel_check.selected_by(build(attention_impl="xla", moe_impl="padded", moe_platform="cpu")) == []
    gpu = kernel_check.selected_by(build(attention_impl="flash", moe_impl="grouped", moe_platform="gpu"))
    assert [(k.key, k.fallback.flag) for k in gpu] == [("flash", "--attention-kernel"), ("mosaic", "--moe-gemm-backend")]
    # With a capacity the grouped block runs the padded experts: no block kernels to check.
    capped = build(attention_impl="xla", moe_impl="grouped", moe_platform="gpu", capacity_factor=1.0)
    assert kernel_check.selected_by(capped) == []


def test_sft_stops_with_exit_2_before_any_state(monkeypatch, capsys):
    """Through the entry point: the check runs before the trainer is built and a failure under
    an explicit backend choice is a user error (exit 2), before data or state."""
    from mlir_train import sft
    from mlir_train.config.flags import RunConfig

    monkeypatch.setattr(kernel_check, "selected_by", lambda model: kernel_check.selected("xla", _broken_block_kernels()))
    monkeypatch.setattr(kernel_check.Shapes, "of_run", classmethod(lambda cls, run: SHAPES))
    flat = RunConfig.flat
    # Stands for --moe-gemm-backend mosaic, the explicit choice (issue 22's backend flags).
    monkeypatch.setattr(RunConfig, "flat", lambda self: flat(self) | {"moe_gemm_backend": "mosaic"})
    argv = [a for a in sft.DEFAULT_ARGV] + ["--cpu-devices", "8"]
    with pytest.raises(SystemExit) as e:
        sft.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "error: kernel self-check: MoE expert matmuls (broken block kernels)" in err and "--moe-gemm-backend padded" in err


def test_auto_fallback_changes_the_model_options(monkeypatch):
    """Under ``auto`` the entry point's trainer is built with the fallback's model options."""
    from mlir_train import families, sft
    from mlir_train.config import cli
    from mlir_train.train.build import resolve

    cfg = cli.parse(sft.DEFAULT_ARGV)
    run = resolve(cfg, families.from_flags(cfg.model, cfg.model.padded_vocab_size(512, 2)))
    monkeypatch.setattr(kernel_check, "selected_by", lambda model: kernel_check.selected("xla", _broken_block_kernels()))
    monkeypatch.setattr(kernel_check.Shapes, "of_run", classmethod(lambda cls, run: SHAPES))
    lines = []
    options = kernel_check.checked_options(run, log=lines.append)
    assert options == run.options.replace(moe_impl="padded")
    assert "falling back to the padded/blocked XLA experts" in lines[1]
    assert run.trainer(options=options).options == options
    monkeypatch.setattr(kernel_check, "selected_by", lambda model: [])
    assert kernel_check.checked_options(run) is run.options


def test_long_sequences_check_against_the_blocked_reference(monkeypatch):
    """Past REFERENCE_SCORES the reference is blocked_attention on one kv group (a 32k-token
    run's [heads, T, T] float32 scores would not fit): it still tells a right kernel from a wrong one."""
    monkeypatch.setattr(kernel_check, "REFERENCE_SCORES", 0)
    right = lambda q, k, v, seg: kernel_check.ATTENTION_KERNELS["docs-flash"][1](True)(q, k, v, seg)
    assert kernel_check.check_attention(right, SHAPES) < 1e-4
    assert kernel_check.check_attention(lambda q, k, v, seg: q, SHAPES) > 0.1
