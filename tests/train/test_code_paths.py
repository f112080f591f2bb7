"""``--code-paths gpu``: the GPU program's own code paths, whole steps on CPU (issue 35 item 2).

On CPU devices the flag builds the model a GPU run gets (the dropless grouped EP exchange on the
ragged all-to-all's typed stand-in, the Mosaic-GPU block kernels and the flash attention kernel)
with the kernels in the Pallas / Mosaic-GPU interpreters, tiled for compute capability 9.0.
"""

import jax
import numpy as np
import pytest
from flax import nnx

from mlir_train.config import cli
from mlir_train.families import get_model_config, init_model
from mlir_train.model import kernel_options
from mlir_train.model.attention import flash_block_sizes
from mlir_train.model.moe import dispatch
from mlir_train.runtime.errors import ConfigError
from mlir_train.train.build import resolve

BASE = ["--micro-batch-size", "1", "--seq-length", "64"]


def test_flag_is_listed_parsed_and_reaches_every_layer(capsys):
    """--help lists it; auto by default; gpu on CPU builds every layer on the GPU paths with the
    kernels interpreted and Hopper's tiles."""
    with pytest.raises(SystemExit):
        cli.parse(["--help"])
    assert "--code-paths {auto,gpu}" in capsys.readouterr().out
    model = get_model_config("qwen3-moe-tiny", moe_intermediate_size=128)
    assert cli.parse(BASE).extras.code_paths == "auto"
    auto = resolve(cli.parse(BASE), model, num_devices=1, platform="cpu").options
    assert (auto.attention_impl, auto.moe_impl, auto.kernel_interpret) == ("xla", "padded", False)
    options = resolve(cli.parse(BASE + ["--code-paths", "gpu"]), model, num_devices=1, platform="cpu").options
    assert (options.attention_impl, options.moe_impl, options.moe_kernels) == ("docs-flash", "grouped", "mosaic-interpret")
    assert options.kernel_interpret and options.compute_capability == "9.0"
    assert options.ragged_all_to_all is dispatch.ragged_all_to_all_dense
    built = nnx.eval_shape(lambda: init_model(model, options=options))
    for layer in built.layers:
        assert layer.attn.interpret and layer.attn.compute_capability == "9.0"
        assert layer.mlp.plan.block_kernels.name == "mosaic-interpret"
        assert layer.mlp.plan.ragged_all_to_all is dispatch.ragged_all_to_all_dense
    # Hopper's backward tiles, as a GPU run at this length takes them.
    assert flash_block_sizes(64, options.compute_capability).block_q_dkv == 64
    assert flash_block_sizes(64, None).block_q_dkv == 32
    # On a GPU the flag is the platform's own program.
    assert kernel_options("gpu", is_moe=True, code_paths="gpu") == kernel_options("gpu", is_moe=True)


def test_flag_is_refused_where_it_cannot_apply():
    model = get_model_config("qwen3-moe-tiny", moe_intermediate_size=128)
    with pytest.raises(ConfigError, match="--code-paths gpu .* compiles for tpu"):
        resolve(cli.parse(BASE + ["--code-paths", "gpu"]), model, num_devices=1, platform="tpu")
    for flag in ("--attention-kernel", "--moe-gemm-backend"):
        with pytest.raises(ConfigError, match=f"{flag} tokamax does not run under --code-paths gpu"):
            resolve(cli.parse(BASE + ["--code-paths", "gpu", flag, "tokamax"]), model, num_devices=1, platform="cpu")
    with pytest.raises(SystemExit):
        cli.parse(BASE + ["--code-paths", "tpu"])


def _gpu_paths_step(layout):
    """One train step of the tiny MoE model with ``--code-paths gpu``'s options on ``layout``."""
    from helpers import MODELS, train_one_step

    options = kernel_options("cpu", is_moe=True, code_paths="gpu")
    return train_one_step(MODELS["moe"], layout, options)


@pytest.mark.slow  # ~107 s on 2 cores: the interpreters
def test_ep2_whole_step_on_gpu_paths_equals_one_device():
    """EP2 on two devices: the grouped exchange on the stand-in, the Mosaic-GPU kernels and the
    flash kernel interpreted (in a region manual over both devices); equals one device on the
    same paths."""
    from helpers import assert_step_matches
    from sharding.layout import Layout

    got = _gpu_paths_step(Layout(expert=2, num_devices=2))
    ref = _gpu_paths_step(None)
    assert "all-to-all" in got.hlo and "custom-call" in got.hlo
    assert_step_matches(got, ref, moe=True)


def test_tests_compile_with_the_gpu_xla_flags():
    """conftest sets the project's GPU XLA flags too (XLA:CPU ignores them), so the in-process
    deviceless XLA:GPU compiles are those a GPU run gets."""
    import os

    from mlir_train.runtime import platform_setup

    setup = platform_setup.current()
    assert setup is not None and setup.platform == "cpu"
    ours = {f"--{k}" for k in platform_setup.GPU_XLA_FLAGS}
    named = {f.split("=", 1)[0] for f in setup.applied + setup.kept + setup.skipped}
    assert ours <= named
    flags = os.environ["XLA_FLAGS"]
    assert all(f in flags for f in ours - set(setup.skipped))


def test_dense_tp2_sp_whole_step_on_gpu_paths_equals_one_device():
    """TP2 + SP over 8 devices with the flash kernel interpreted (Hopper tiles): one step
    equals one device on the same paths (~40 s on 2 cores)."""
    from helpers import MODELS, assert_step_matches, train_one_step
    from sharding.layout import Layout

    options = kernel_options("cpu", is_moe=False, code_paths="gpu")
    assert (options.attention_impl, options.kernel_interpret, options.compute_capability) == ("docs-flash", True, "9.0")
    got = train_one_step(MODELS["dense"], Layout(tensor=2, sequence_parallel=True, num_devices=8), options)
    assert_step_matches(got, train_one_step(MODELS["dense"], None, options), moe=False)


def test_code_paths_gpu_sizes_xla_cpu_for_the_interpreter():
    """``--code-paths gpu`` on CPU: XLA:CPU's pools 4 threads per device (the interpreter's host
    callbacks hold one each while the devices take turns) and its collective timeouts raised; the
    user's own setting kept; nothing of it without the flag."""
    from mlir_train.runtime import platform_setup

    env: dict[str, str] = {}
    setup = platform_setup.apply_platform_settings(env, "cpu", cpu_devices=8, callback_threads=True)
    assert env["PJRT_NPROC"] == "32" and "PJRT_NPROC=32" in setup.applied
    assert "--xla_cpu_collective_call_terminate_timeout_seconds=3600" in env["XLA_FLAGS"]
    env = {"PJRT_NPROC": "64"}
    assert "PJRT_NPROC" in platform_setup.apply_platform_settings(env, "cpu", cpu_devices=8, callback_threads=True).kept
    assert env["PJRT_NPROC"] == "64"
    env = {}
    platform_setup.apply_platform_settings(env, "cpu", cpu_devices=8)
    assert "PJRT_NPROC" not in env and "collective_call" not in env["XLA_FLAGS"]
