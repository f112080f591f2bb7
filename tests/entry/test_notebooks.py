"""The notebooks still run: each is executed top to bottom in a fresh kernel with small settings.

``MLIR_TRAIN_NB_SMALL=1`` makes every notebook pick its small settings (a few iterations on short
rows); the kernel inherits this process's environment, so it also gets conftest's 8 fake CPU
devices and JAX's persistent compilation cache (shared with the rest of the suite: the quickstart
and MoE notebooks compile the same training step, so the second one reads it from the cache).
"""

import os
import tempfile
import time

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

NOTEBOOKS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "notebooks")


@pytest.fixture(scope="module")
def data_cache(tmp_path_factory):
    # One tokenised-data cache for the notebooks of this run (they use the same data settings).
    return str(tmp_path_factory.mktemp("nb_data_cache"))


@pytest.mark.parametrize("name", ["quickstart", pytest.param("sharding_explorer", marks=pytest.mark.slow),
                                  pytest.param("moe", marks=pytest.mark.slow)])
def test_notebook_runs(name, tmp_path, data_cache, monkeypatch):
    monkeypatch.setenv("MLIR_TRAIN_NB_SMALL", "1")
    monkeypatch.setenv("MLIR_TRAIN_NB_WORKDIR", str(tmp_path))
    monkeypatch.setenv("MLIR_TRAIN_NB_DATA_CACHE", data_cache)
    monkeypatch.setenv("MPLBACKEND", "Agg")
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", os.environ.get(
        "MLIR_TRAIN_TEST_JAX_CACHE", os.path.join(tempfile.gettempdir(), "mlir_train_test_jax_cache")))
    monkeypatch.setenv("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")
    path = os.path.join(NOTEBOOKS, f"{name}.ipynb")
    nb = nbformat.read(path, as_version=4)
    # Committed notebooks carry no outputs (they would go stale and bloat diffs).
    assert all(not c.get("outputs") and c.get("execution_count") is None for c in nb.cells if c.cell_type == "code")
    start = time.perf_counter()
    # A cell error raises CellExecutionError with the cell's source and traceback.
    nbclient.NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    print(f"{name}.ipynb ran in {time.perf_counter() - start:.1f}s")
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    assert not errors, errors
