"""The supported version range (issue 47): what pyproject declares, README's table says, and the
installed stack is. Runs in both lanes: jax 0.10.2 on Python 3.11 (the default) and the newest
jax on Python >= 3.12 (scripts/test_newest_jax.sh), so each end checks itself."""

import importlib
import pathlib
import re
import sys
from importlib import metadata

import jax
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", text)[:3])


def _requirements(extra: str | None = None) -> list[str]:
    """pyproject's requirement strings (the dependencies, or an extra's) whose markers hold here."""
    import tomllib

    from packaging.requirements import Requirement

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = project["dependencies"] if extra is None else project["optional-dependencies"][extra]
    return [r for r in reqs if Requirement(r).marker is None or Requirement(r).marker.evaluate()]


def _spec(name: str, extra: str | None = None):
    from packaging.requirements import Requirement

    specs = [Requirement(r).specifier for r in _requirements(extra) if Requirement(r).name == name]
    assert len(specs) == 1, (name, extra, specs)
    return specs[0]


@pytest.mark.parametrize("package", ["jax", "flax"])
def test_installed_stack_is_within_the_declared_range(package):
    """The lane runs what pyproject admits for this Python, with an upper bound: the newest release
    that passed here."""
    spec = _spec(package)
    assert metadata.version(package) in spec, (package, metadata.version(package), str(spec))
    assert any(s.operator in ("<", "<=") for s in spec), f"{package} has no upper bound: {spec}"


def test_flax_is_one_that_imports_with_this_jax():
    """flax 0.12.8 / 0.12.9 fail at import with jax >= 0.11.2 and do not declare it: pyproject asks
    flax >= 0.12.10 wherever pip resolves jax >= 0.11.2 (Python >= 3.12)."""
    from packaging.version import Version

    if sys.version_info >= (3, 12):
        assert not _spec("flax").contains("0.12.9") and _spec("flax").contains("0.12.10")
        assert all(not _spec("jax").contains(v) for v in ("0.10.2", "0.11.1"))
    if Version(jax.__version__) >= Version("0.11.2"):
        assert Version(metadata.version("flax")) >= Version("0.12.10")
    from flax import nnx  # noqa: F401  (imports with this jax)


def test_tokamax_range_matches_the_jax_lane():
    """tokamax 0.0.12 is the last for jax 0.10 / Python 3.11, 0.0.13+ need jax >= 0.11."""
    spec = _spec("tokamax", "cuda")
    if sys.version_info >= (3, 12):
        assert "0.0.17" in spec and "0.0.12" not in spec
    else:
        assert "0.0.12" in spec and "0.0.13" not in spec
    try:
        installed = metadata.version("tokamax")
    except metadata.PackageNotFoundError:
        pytest.skip("tokamax not installed")
    assert installed in spec


def test_readme_table_names_the_declared_bounds():
    """README's "Supported versions" table carries the same jax, flax and tokamax ends."""
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## Supported versions"):]
    section = section[:section.index("\n## ", 3)]
    for text in ("jax 0.10.2", "jax 0.12.1", "flax 0.12.12", "tokamax 0.0.17", "tokamax 0.0.12", "flax 0.12.8",
                 "scripts/test_newest_jax.sh"):
        assert text in section, text
    # The newest jax the table names is pyproject's upper bound.
    assert str(max((s.version for s in _spec_all("jax")), key=_version)) == "0.12.1"


def _spec_all(name):
    import tomllib

    from packaging.requirements import Requirement

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return [s for r in project["dependencies"] if Requirement(r).name == name for s in Requirement(r).specifier]


# Every module of the package imports on this jax: no import of a removed module (issue 47: the
# default GPU attention's module is gone from jax 0.12.1). Imported lazily inside functions, the
# Pallas mha kernel is reached only through --attention-kernel pallas-mha, refused where absent.
MODULES = sorted(".".join(p.relative_to(ROOT).with_suffix("").parts)
                 for p in (ROOT / "mlir_train").rglob("*.py") if p.name != "__main__.py")


def test_every_module_imports_on_this_jax():
    failed = {}
    for name in MODULES:
        try:
            importlib.import_module(name)
        except ImportError as e:  # pragma: no cover - the failure message names them
            failed[name] = str(e)
    assert not failed, failed


def test_gpu_code_paths_exist_on_this_jax():
    """What the GPU program runs by default is importable here: our Pallas-Triton attention (the
    GPU default on every supported jax), the Mosaic-GPU block kernels and their interpreter, and
    the ragged all-to-all."""
    from mlir_train.model import kernel_options
    from mlir_train.model.attention import pallas_mha_missing
    from mlir_train.model.kernels import docs_flash, mosaic_moe

    options = kernel_options("gpu", is_moe=True)
    assert options.attention_impl == "docs-flash" and options.moe_impl == "grouped"
    assert docs_flash.plgpu.CompilerParams and mosaic_moe.interpret_params() is not None
    assert callable(jax.lax.ragged_all_to_all)
    removed = _version(jax.__version__) >= (0, 12)
    assert (pallas_mha_missing() is not None) == removed, pallas_mha_missing()


def test_no_module_imports_the_removed_attention_at_top_level():
    """jax.experimental.pallas.ops.gpu.attention is imported only inside the pallas-mha path."""
    for path in (ROOT / "mlir_train").rglob("*.py"):
        for line in path.read_text().splitlines():
            if re.match(r"(from|import) jax\.experimental\.pallas\.ops\.gpu", line):
                raise AssertionError(f"{path}: module-level import of a module jax 0.12 removed: {line}")
