"""The checks of ``gpu_h200.py`` beside its training run, each adding rows to its one table: the
device's own description, the measured peak memory, the start-up kernel self-check at the run's
widths, the GPU path against the XLA path on the same GPU, and ``gpu_kernels_h200.py``'s rows.
Imported by ``gpu_h200.py`` after it has set up the platform (``gpu_common``)."""

from __future__ import annotations

import glob
import json
import os
import re
import tempfile
import time
import traceback

import gpu_common

gpu_common.require_setup()  # the platform is the importing script's (gpu_common.setup), set before jax starts

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from mlir_train.model import kernel_options  # noqa: E402
from mlir_train.planner.code_paths import CodePaths  # noqa: E402
from mlir_train.planner.targets import DEVICE_KINDS  # noqa: E402
from mlir_train.runtime.platform_setup import platform_name  # noqa: E402
from mlir_train.run.certify import TOLERANCES, relative_difference, worst_difference  # noqa: E402

PHASES = ("device", "train", "self-check", "gpu-vs-xla", "kernels")
GIB = 2**30
# The device description's figures the planner's estimates read (mlir_train/planner/targets/h200.txtpb).
KEY_FIELDS = ("core_count", "clock_rate_ghz", "device_memory_size", "memory_bandwidth", "l2_cache_size",
              "shared_memory_per_block_optin", "fpus_per_core")


class Table:
    """The one table every phase adds rows to: ``(phase, what, figure, verdict)``. A phase that would
    start after ``budget_s`` seconds, or is in ``skip``, is a row saying so; one that raises is a FAIL row."""

    def __init__(self, started: float, budget_s: float, skip: set[str]):
        self.started, self.budget_s, self.skip, self.rows = started, budget_s, skip, []

    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def add(self, phase: str, what: str, figure: str, verdict: str) -> None:
        self.rows.append((phase, what, figure, verdict))
        print(f"[{phase}] {what}: {figure} -> {verdict}", flush=True)

    def phase(self, name: str, run) -> None:
        if name in self.skip:
            return self.add(name, "", "skipped: --skip", "-")
        if self.elapsed() > self.budget_s:
            return self.add(name, "", f"skipped: --budget-s {self.budget_s:.0f} spent", "-")
        start = time.perf_counter()
        try:
            run()
        except Exception as e:  # noqa: BLE001 - the table reports it; the other phases still run
            traceback.print_exc()
            self.add(name, "", f"raised {type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}", "FAIL")
        print(f"[{name}] took {time.perf_counter() - start:.1f}s", flush=True)

    def failed(self) -> bool:
        return any(v == "FAIL" for *_, v in self.rows)

    def print(self) -> None:
        print("| phase | what | figure | verdict |")
        print("|---|---|---|---|")
        for row in self.rows:
            print("| " + " | ".join(str(x).replace("|", "/") for x in row) + " |")


# ----- 1. the device ---------------------------------------------------------------------------------------
def target_config_text(device) -> str | None:
    """The ``GpuTargetConfigProto`` XLA:GPU compiles for on ``device``: the ``*gpu_target_config.pbtxt``
    its dump of a tiny compile writes (None where the compiler writes none: not a GPU)."""
    from mlir_train.planner.moe_audit import compile_without_cache

    with tempfile.TemporaryDirectory() as dump:
        x = jax.ShapeDtypeStruct((8,), jnp.float32, sharding=jax.sharding.make_single_device_sharding(device))
        compile_without_cache(jax.jit(lambda v: v * 2 + 1).lower(x), {"xla_dump_to": dump})
        found = sorted(glob.glob(os.path.join(dump, "*gpu_target_config.pbtxt")))
        return open(found[0]).read() if found else None


def _fields(text: str) -> dict[str, str]:
    return {k: m.group(1) for k in KEY_FIELDS if (m := re.search(rf"\b{k}:\s*([^\s]+)", text))}


def describe_device(device, out_dir: str, table: Table) -> None:
    stats = device.memory_stats() or {}
    attrs = {k: getattr(device, k, None) for k in ("device_kind", "platform", "compute_capability", "core_count")}
    attrs.update(jax=jax.__version__, memory_stats={k: int(v) for k, v in stats.items() if isinstance(v, (int, np.integer))})
    with open(os.path.join(out_dir, "device.json"), "w") as f:
        json.dump(attrs, f, indent=1, default=str)
    what = f"{attrs['device_kind']}, compute capability {attrs['compute_capability']}, {attrs['core_count']} SMs, " \
           f"{stats.get('bytes_limit', 0) / GIB:.1f} GiB usable"
    text = target_config_text(device)
    if text is None:
        return table.add("device", what, "no GPU target config (not an XLA:GPU device)", "-")
    path = os.path.join(out_dir, "target_config_measured.txtpb")
    with open(path, "w") as f:
        f.write(text)
    ours, got = _fields(DEVICE_KINDS["h200"].target_config()), _fields(text)
    differ = [f"{k} {ours.get(k)} -> {got.get(k)}" for k in KEY_FIELDS if ours.get(k) != got.get(k)]
    table.add("device", what, f"{path}; vs planner h200.txtpb: " + ("; ".join(differ) or "key fields equal"), "ok")


def peak_memory(device, compiled_bytes: int, table: Table) -> None:
    """The device's measured peak so far against the planner's compiled figure for the train step."""
    stats = device.memory_stats() if device.platform != "cpu" else None
    if not stats or "peak_bytes_in_use" not in stats:
        return table.add("memory", "measured peak vs compiled", f"no memory_stats on {device.platform}; compiled "
                         f"{compiled_bytes / GIB:.2f} GiB", "-")
    peak = stats["peak_bytes_in_use"]
    table.add("memory", "measured peak (peak_bytes_in_use) vs compiled (planner)",
              f"{peak / GIB:.2f} vs {compiled_bytes / GIB:.2f} GiB ({peak / compiled_bytes:.2f}x)",
              "ok" if peak <= 1.1 * compiled_bytes else "CHECK: the planner under-counts")


# ----- 3. the start-up kernel self-check at the run's widths --------------------------------------------------
def self_check(cfg, seq: int, interpret: bool, table: Table) -> None:
    from mlir_train.model.kernels.mosaic_moe import mosaic_block_kernels
    from mlir_train.train import kernel_check

    shapes = kernel_check.Shapes(hidden=cfg.hidden_size, moe_width=cfg.moe_intermediate_size, experts=4,
                                 heads=cfg.num_heads, kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                                 seq_length=seq, dtype="bfloat16")
    block = mosaic_block_kernels(_mosaic_interpreter() if interpret else None)
    from mlir_train.model.attention import pallas_mha_missing

    kernels = kernel_check.selected("docs-flash", block, interpret=interpret)
    if pallas_mha_missing():  # JAX removed its Pallas-Triton mha in 0.12: a row, not a stop
        table.add("self-check", "flash attention (Pallas-Triton mha)", pallas_mha_missing()[:200], "-")
    else:
        kernels += kernel_check.selected("flash", interpret=interpret)
    try:
        import tokamax  # noqa: F401

        kernels += kernel_check.selected("tokamax", interpret=interpret)
    except Exception as e:  # noqa: BLE001 - a missing or broken tokamax is a row, not a stop
        table.add("self-check", "tokamax flash attention", f"not importable ({type(e).__name__}: {e})"[:200], "-")
    tol = kernel_check.TOLERANCE[shapes.dtype]
    for kernel in kernels:
        start = time.perf_counter()
        try:
            err = kernel.run(shapes)
            figure, verdict = f"max relative error {err:.1e} (tolerance {tol:.0e})", "ok" if err <= tol else "FAIL"
        except Exception as e:  # noqa: BLE001 - the row reports it
            figure, verdict = f"raised {type(e).__name__}: {(str(e).splitlines() or [''])[0][:160]}", "FAIL"
        table.add("self-check", f"{kernel.name} at T {seq}, D {shapes.hidden}, F {shapes.moe_width}",
                  f"{figure}, {time.perf_counter() - start:.1f}s", verdict)


def _mosaic_interpreter():
    from mlir_train.model.kernels.mosaic_moe import interpret_params  # CPU rehearsal only

    return interpret_params()


# ----- 4. the GPU path against the XLA path on the same device ----------------------------------------------
def _run_steps(trainer, batch_np, steps: int):
    state = trainer.init_state(seed=0)
    init = jax.device_get(state["params"])
    batch = trainer.shard_batch(dict(batch_np))
    traced, lowered = trainer.trace_train_step(state, batch)
    compiled = lowered.compile()
    paths = CodePaths.of(traced.jaxpr, compiled.as_text())
    metrics = []
    with jax.set_mesh(trainer.mesh):
        for _ in range(steps):
            state, m = compiled(state, batch)
            metrics.append({k: float(v) for k, v in jax.device_get(m).items() if np.ndim(v) == 0})
    final = jax.device_get({"params": state["params"], "opt_state": state["opt_state"]})
    return init, final, metrics, paths


def gpu_vs_xla(cfg, device, options, batch_np, trainer_for, table: Table, steps: int = 2) -> None:
    """Two steps of ``cfg`` with ``options`` (the GPU kernels) against the XLA path on ``device``."""
    xla = kernel_options(platform_name(device), is_moe=True, moe_backend="padded",
                         attention_backend="xla", base=options)
    if xla == options:  # a CPU rehearsal: the CPU's own paths (the GPU's, interpreted, need --code-paths gpu)
        return table.add("gpu-vs-xla", f"{options.moe_impl} experts + {options.attention_impl} attention",
                         "the XLA paths already: nothing to compare on this platform", "-")
    runs = [_run_steps(trainer_for(cfg, device, o), batch_np, steps) for o in (options, xla)]
    (init, final, metrics, paths), (_, xfinal, xmetrics, _) = runs
    tol = TOLERANCES["bfloat16"]
    loss = max(relative_difference(a["lm loss"], b["lm loss"]) for a, b in zip(metrics, xmetrics))
    norm = max(relative_difference(a["grad-norm"], b["grad-norm"]) for a, b in zip(metrics, xmetrics))
    step = lambda f: jax.tree.map(lambda a, a0: a - a0, f["params"], init)
    updates = worst_difference(step(final), step(xfinal))
    moments = worst_difference(final["opt_state"], xfinal["opt_state"])
    ok = loss <= tol.loss and norm <= tol.grad_norm and updates[0] <= tol.params and moments[0] <= tol.moments
    what = f"{cfg.num_layers} layers, {steps} steps, {options.moe_impl} experts + {options.attention_impl} attention " \
           "against padded experts + XLA attention"
    table.add("gpu-vs-xla", what, f"lm loss {loss:.1e}, grad norm {norm:.1e}, updates {updates[0]:.1e} ({updates[1]}), "
              f"Adam moments {moments[0]:.1e} ({moments[1]}); bf16 tolerances {tol.loss:.0e}/{tol.grad_norm:.0e}/"
              f"{tol.params:.0e}/{tol.moments:.0e}", "ok" if ok else "FAIL")
    table.add("gpu-vs-xla", "the GPU program's kernels (read from it)", f"{paths.kernels()}; experts {paths.experts()}; "
              f"attention {paths.attention()}; custom calls {', '.join(paths.custom_calls) or 'none'}", "-")


# ----- 5. every kernel backend ----------------------------------------------------------------------------
def kernel_rows(table: Table) -> None:
    import gpu_kernels_h200 as gk

    rows = gk.kernel_rows(table.budget_s, table.started, 2 if gk.SMOKE else 5, 0.0 if gk.SMOKE else 0.5)
    tol = 3e-2  # bf16 operands against float32 (kernel_check.TOLERANCE)
    for case, name, r, note in rows:
        if r is None:
            table.add("kernels", f"{case.name} / {name}", note, "FAIL" if note.startswith("FAILED") else "-")
        else:
            worst = max(r["fwd"][1], r["bwd"][1])
            table.add("kernels", f"{case.name} / {name}", f"fwd rel {r['fwd'][1]:.1e}, bwd rel {r['bwd'][1]:.1e}, "
                      f"bit-identical {r['same']}, {r['ms']:.2f} ms, {r['tflops']:.3g} TFLOP/s",
                      "ok" if worst <= tol and r["same"].startswith("yes") else "FAIL")
