"""A CPU-only machine with the test extra's CUDA plugin installed runs quietly: no plugin
traceback, none of the plugin libraries' "Could not find cuda drivers" lines, and the platform
line still says what was found (issue 22, item 5)."""

import glob
import os
import re
import subprocess
import sys

import pytest

from mlir_train.runtime import platform_setup

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NOISE = ("Jax plugin configuration error", "Traceback", *platform_setup._DRIVERLESS_NOISE)

START = """
from mlir_train.runtime.platform_setup import configure_platform
from mlir_train.runtime import log
log.info(configure_platform().describe())
import jax
print(len(jax.devices()), jax.devices()[0].platform)
"""


def _clean_env():
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS")}
    return env  # as a user's shell: nothing set for JAX


def test_a_cpu_start_prints_no_plugin_noise_and_names_what_it_found():
    proc = subprocess.run([sys.executable, "-c", START], env=_clean_env(), capture_output=True, text=True,
                          timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    for noise in NOISE:
        assert noise not in proc.stderr, proc.stderr
    assert "mlir-train: platform cpu (" in proc.stdout
    assert proc.stdout.strip().endswith("8 cpu")
    if "cuda" in platform_setup._installed_plugins():
        assert "cuda plugin installed but no such device here" in proc.stdout


def test_only_the_driverless_lines_are_dropped():
    text = ("WARNING: All log messages before absl::InitializeLog() is called are written to STDERR\n"
            "I0000 00:00:1.0 1 cudart_stub.cc:31] Could not find cuda drivers on your machine, GPU will not be used.\n"
            "E0000 something else went wrong\n")
    assert platform_setup.drop_driverless_noise(text) == "E0000 something else went wrong\n"


@pytest.mark.parametrize("script", sorted(glob.glob(os.path.join(ROOT, "benchmarks", "*.py"))),
                         ids=lambda p: os.path.basename(p))
def test_every_benchmark_sets_the_platform_before_jax(script):
    """A benchmark that imports jax before configure_platform (or JAX_PLATFORMS) starts the CUDA
    plugin on a CPU host, which prints its "Unable to load CUDA" traceback."""
    source = open(script).read()
    first_jax = re.search(r"^(import jax|from jax)", source, re.M)
    if first_jax is None:
        return
    before = source[:first_jax.start()]
    # gpu_common.setup: the H200 scripts' configure_platform (GPU only, or an explicit CPU rehearsal);
    # require_setup: a module of theirs, which refuses to be imported before it.
    assert any(call in before for call in ("configure_platform(", 'os.environ.setdefault("JAX_PLATFORMS"',
                                           "gpu_common.setup(", "gpu_common.require_setup(")), script


def test_orbax_read_only_and_pytorch_notices_are_filtered(caplog):
    """Orbax's "Given directory is read only" (our read-only managers only read: convert, resume,
    --load) and transformers' "PyTorch was not found" (we use its tokenizers only) are dropped;
    their loggers' other lines pass."""
    import logging

    from mlir_train.checkpoint.manager import _quiet_read_only
    from mlir_train.data.tokenizer import quiet_transformers_import

    absl = logging.getLogger("absl")
    with caplog.at_level(logging.INFO), _quiet_read_only():
        absl.warning("Given directory is read only=/ck")
        absl.warning("something else")
    absl.warning("Given directory is read only=/ck after")  # only while a read-only manager is made
    quiet_transformers_import()
    quiet_transformers_import()  # once, however often called
    logging.getLogger("transformers").warning("PyTorch was not found. Models won't be available")
    messages = [r.getMessage() for r in caplog.records]
    assert messages == ["something else", "Given directory is read only=/ck after"]
    assert len(logging.getLogger("transformers").filters) == 1
