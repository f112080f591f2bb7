"""The floor plan holds: imports go one way between layers, the config layer starts no jax, and
a Trainer comes from one builder.

Layers, bottom up (README's module table): ``runtime.errors`` / ``runtime.log`` (the one error
family and logger) < ``config`` (flags, model registry, policies) and the rest of ``runtime``
(platform, distributed) < ``data`` and the top-level ``sharding`` < ``model`` < ``families`` (one
folder per model family and the registry) < ``train``'s step
(trainer, optimizer, schedule, pipeline, hooks, build) < ``checkpoint`` < ``run`` (the job and
its loop) and ``planner`` < the entry points (``sft``, ``plan``,
``convert``, ``preprocess``, ``check``). A module may import its own package and anything on a lower
floor, never a higher one.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys

import pytest

from tests.helpers import ROOT

FLOORS = [  # (module prefix, floor): the longest matching prefix decides
    ("mlir_train.runtime.errors", 0), ("mlir_train.runtime.log", 0),
    ("mlir_train.config", 1), ("mlir_train.runtime", 1),
    ("mlir_train.data", 2), ("sharding", 2),
    ("mlir_train.model", 3),
    ("mlir_train.families", 4),
    ("mlir_train.train", 5),
    ("mlir_train.checkpoint", 6),
    ("mlir_train.run", 7), ("mlir_train.planner", 7),
    ("mlir_train.sft", 8), ("mlir_train.plan", 8), ("mlir_train.convert", 8), ("mlir_train.preprocess", 8),
    ("mlir_train.check", 8),
]


def floor_of(module: str) -> int | None:
    best = None
    for prefix, floor in FLOORS:
        if (module == prefix or module.startswith(prefix + ".")) and (best is None or len(prefix) > len(best[0])):
            best = (prefix, floor)
    return None if best is None else best[1]


def modules() -> dict[str, str]:
    out = {}
    for top in ("mlir_train", "sharding"):
        for dirpath, _, files in os.walk(os.path.join(ROOT, top)):
            for f in files:
                if f.endswith(".py"):
                    rel = os.path.relpath(os.path.join(dirpath, f), ROOT)[:-3].replace(os.sep, ".")
                    out[rel.removesuffix(".__init__")] = os.path.join(dirpath, f)
    return out


def imports(path: str) -> set[str]:
    """Every module of ours a file imports, at the top or inside a function."""
    found = set()
    for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module)
            found |= {f"{node.module}.{a.name}" for a in node.names}  # from pkg import submodule
    return {m for m in found if m.split(".")[0] in ("mlir_train", "sharding")}


def test_every_module_is_on_a_floor():
    assert [m for m in modules() if m != "mlir_train" and floor_of(m) is None] == []


def test_imports_never_run_up_a_floor():
    mods = modules()
    upward = []
    for mod, path in mods.items():
        own = floor_of(mod)
        for target in imports(path):
            if target not in mods or mods[target].endswith("__init__.py"):  # modules, not package faces
                continue
            if target.startswith(mod.rsplit(".", 1)[0] + ".") and floor_of(target) == own:
                continue  # a sibling in the same package
            if floor_of(target) > own:
                upward.append(f"{mod} (floor {own}) imports {target} (floor {floor_of(target)})")
    assert upward == [], "\n".join(upward)


def test_the_config_layer_starts_no_jax_and_no_model():
    """Flags are read, and a bad one refused, before any accelerator runtime starts."""
    code = ("import sys\nfrom mlir_train.config import cli, flag_table, flags, models, policies, sections\n"
            "cli.parse(['--model-name', 'qwen3-moe-tiny', '--moe-router-load-balancing-type', 'seq_aux_loss'])\n"
            "bad = [m for m in sys.modules if m == 'jax' or m.startswith(('jax.', 'mlir_train.model', 'mlir_train.train',"
            " 'mlir_train.checkpoint', 'flax'))]\nprint(bad)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True).stdout
    assert out.strip().splitlines()[-1] == "[]"


def _python_sources():
    for top in ("mlir_train", "benchmarks", "tests", "scripts", "examples"):
        for dirpath, _, files in os.walk(os.path.join(ROOT, top)):
            for f in files:
                if f.endswith(".py"):
                    yield os.path.join(dirpath, f)
    for f in os.listdir(os.path.join(ROOT, "notebooks")):
        if f.endswith(".ipynb"):
            yield os.path.join(ROOT, "notebooks", f)


def test_a_trainer_comes_only_from_the_builder():
    """``mlir_train.train.build`` is the one place that constructs a Trainer (sft, plan, convert,
    the benchmarks, the notebooks and the tests all ask it)."""
    builder = os.path.join(ROOT, "mlir_train", "train", "build.py")
    direct = [os.path.relpath(p, ROOT) for p in _python_sources()
              if p != builder and re.search(r"(?<![\w.])(?<!class )Trainer\(", open(p, encoding="utf-8").read())]
    assert direct == []


@pytest.mark.parametrize("entry", ["sft", "plan", "convert", "preprocess", "check"])
def test_entry_points_stay_where_users_call_them(entry):
    """``python -m mlir_train.<entry> --help`` works (the move kept every command line)."""
    proc = subprocess.run([sys.executable, "-m", f"mlir_train.{entry}", "--help"], capture_output=True, text=True,
                          cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"mlir_train.{entry}" in proc.stdout or "usage" in proc.stdout.lower()
