"""benchmarks/plan_qwen35.py, the "will it fit?" table of README: its arithmetic and a tiny
model's row by default; the script's --quick run (a tiny model compiled on 2 devices) is slow."""

import argparse
import os
import re
import subprocess
import sys

import pytest

from benchmarks import plan_qwen35 as pq

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GIB = 2**30


def test_table_cells_are_the_plans_figures():
    row = pq.Row("qwen3.5-35b-a3b", 32768, "lora", 8, layout="TP1xPP1xEP8xDP8+distopt recompute=full",
                 needed_bytes=int(70.5 * GIB), flop_ratio=1.234,
                 collectives={"all-gather": {"bytes": GIB, "megatron": 2 * GIB}, "all-to-all": {"bytes": 0, "megatron": 0},
                              "reduce-scatter": {"bytes": 2 * GIB, "megatron": 0}},
                 fewest=4, fewest_layout="TP1xPP1xEP4xDP4+distopt recompute=full", fewest_from="estimate")
    cells = row.cells(141.0)
    assert cells[:3] == ["qwen3.5-35b-a3b", "32k", "LoRA"]
    assert cells[4] == "70.5 GiB (50%)"
    assert cells[5] == "1.23x"
    # Traffic against Megatron's volume, largest first; a kind that never runs is left out.
    assert cells[6] == "reduce-scatter 2.00 GiB (Megatron: none), all-gather 1.00 GiB (0.50x)"
    assert cells[7] == "4 (TP1xPP1xEP4xDP4+distopt recompute=full) est."
    twin = pq.Row("qwen3.6-35b-a3b", 4096, "sft", 8, same_as="qwen3.5-35b-a3b", note="no layout fits")
    assert twin.cells(141.0)[:4] == ["qwen3.6-35b-a3b (= qwen3.5-35b-a3b)", "4096", "full SFT", "no layout fits"]
    table = pq.format_table([row, twin], "h200", 141.0)
    assert table.splitlines()[0].count("|") == len(pq.HEADER) + 1 and "8 x H200" in table.splitlines()[0]


def test_qwen36_is_planned_as_qwen35():
    assert pq.same_shapes("qwen3.5-35b-a3b", "qwen3.6-35b-a3b")
    assert not pq.same_shapes("qwen3.5-35b-a3b", "qwen3-next-80b-a3b")


def test_lora_rows_plan_the_lora_job():
    argv = pq.case_argv("qwen3.5-35b-a3b", 4096, "lora", 8, 16)
    assert argv[argv.index("--lora-dim") + 1] == "16" and argv[argv.index("--num-devices") + 1] == "8"
    assert "--lora-dim" not in pq.case_argv("qwen3.5-35b-a3b", 4096, "sft", 8, 16)


def test_fewest_devices_of_a_tiny_model_is_one():
    """From the estimate (no compile, ~5 s): a tiny model fits one device."""
    args = argparse.Namespace(num_devices=2, device_kind="h200", global_batch=2, min_devices=1, max_devices=2, top=1,
                              fewest_compile=False, estimate_only=False, narrow=True, xla_cpu=True, flags=[])
    row = pq.Row("qwen3.5-moe-tiny", 256, "sft", 2)
    pq.fewest_devices(row, args)
    assert row.fewest == 1 and row.fewest_from == "estimate" and row.fewest_layout.startswith("TP1xPP1xEP1xDP1")


@pytest.mark.slow
def test_plan_qwen35_quick():
    """The tiny model searched and compiled on 2 devices (XLA:GPU deviceless where installed)."""
    env = dict(os.environ)
    env["XLA_FLAGS"] = " ".join(f for f in env.get("XLA_FLAGS", "").split()
                                if not f.startswith("--xla_force_host_platform_device_count"))
    env["PYTHONPATH"] = ROOT
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "plan_qwen35.py"), "--quick"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| qwen3.5-moe-tiny")]
    assert len(rows) == 4, proc.stdout[-3000:]  # each row when known, then the table of both
    for line in rows:
        assert re.search(r"\| \d+\.\d GiB \(\d+%\) \| \d+\.\d\dx \|", line), line
        assert re.search(r"\| 1 \(TP1xPP1x", line), line


def test_extrapolation_to_full_depth_is_linear_in_layers():
    """Compiles at 4 and 8 layers, extrapolated to 40: a + b x depth for memory, FLOPs (and
    Megatron's FLOPs beside them) and each kind's collective traffic (and Megatron's volume)."""
    from types import SimpleNamespace

    def plan(layers):
        return SimpleNamespace(name="TP1xPP1xEP8xDP8+distopt recompute=full", num_devices=8,
                               needed_bytes=(10 + 2 * layers) * GIB, compiled_matmul_flops=1e12 * (1 + layers),
                               flops_per_step=8e12 * layers,
                               comm_comparison=[dict(kind="all-to-all", compiled_bytes=layers * GIB,
                                                     megatron_bytes=layers * GIB // 2, ratio=2.0),
                                                dict(kind="all-gather", compiled_bytes=GIB, megatron_bytes=0, ratio=None)])

    args = argparse.Namespace(device_kind="h200")
    p = pq.extrapolate(plan(4), plan(8), 4, 40, args)
    assert p.needed_bytes == 90 * GIB and p.fits  # 90 GiB <= 95 % of 141 GiB
    assert p.matmul_flops == pytest.approx(41e12) and p.flop_ratio == pytest.approx(41e12 * 8 / 320e12)
    assert p.collectives == {"all-gather": {"bytes": GIB, "megatron": 0},
                             "all-to-all": {"bytes": 40 * GIB, "megatron": 20 * GIB}}
    assert pq.format_collectives(p.collectives) == "all-to-all 40.00 GiB (2.00x), all-gather 1.00 GiB (Megatron: none)"
    assert not pq.extrapolate(plan(4), plan(8), 4, 80, args).fits  # 170 GiB
    assert pq.traffic(p) is p.collectives and pq.traffic(SimpleNamespace(comm_comparison=None)) is None  # not compiled
    row = pq.Row("m", 4096, "sft", 8, layout=p.name, needed_bytes=p.needed_bytes, verdict_from=p.verdict_from)
    assert row.cells(141.0)[4] == "90.0 GiB (64%) (extrap.)"


def test_a_layout_xla_refuses_is_passed_over(monkeypatch):
    """The estimate's best does not compile (an XLA error): the next estimated layout stands in,
    and --first-fit compiles no further once one fits."""
    from types import SimpleNamespace

    import mlir_train.planner.plan as planner
    import mlir_train.planner.report as report

    compiled = []

    def fake_plan_layout(cfg, candidate, n, **_):
        compiled.append(candidate)
        return SimpleNamespace(error="INVALID_ARGUMENT: Reshape" if candidate == "A" else None, fits=True,
                               compiled_matmul_flops=1.0, needed_bytes=GIB, name=candidate)

    monkeypatch.setattr(planner, "plan_layout", fake_plan_layout)
    monkeypatch.setattr(report, "format_plan", lambda plan, *a: plan.name)
    monkeypatch.setattr(pq, "_setup", lambda *a: (None, {}))
    estimated = [SimpleNamespace(candidate=c) for c in "ABC"]
    args = argparse.Namespace(probe_layers=0, device_kind="h200", xla_cpu=False, first_fit=True)
    assert [p.name for p in pq.compiled_fits([], 8, estimated, args)] == ["B"] and compiled == ["A", "B"]
    args.first_fit, compiled[:] = False, []
    assert [p.name for p in pq.compiled_fits([], 8, estimated, args)] == ["B", "C"] and compiled == ["A", "B", "C"]
    args.probe_layers, compiled[:] = 4, []  # probes at 4 and 8 layers: the 4-layer failure stops the 8-layer one
    assert pq.compiled_fits([], 8, estimated[:1], args) == [] and compiled == ["A"]


def test_narrow_takes_a_pipeline_or_context_size():
    """--narrow-pipeline 2: only PP2 layouts are sized (from the estimate, no compile)."""
    args = pq._parser().parse_args(["--narrow", "--narrow-pipeline", "2", "--skip", "TP4xPP1xEP2xDP2+distopt recompute=full"])
    assert args.skip == ["TP4xPP1xEP2xDP2+distopt recompute=full"]
    assert pq._narrow_splits(args) == (2, 1) and pq._narrow_splits(argparse.Namespace()) == (1, 1)
    argv = pq.case_argv("qwen3.5-moe-tiny", 256, "sft", 4, 4)
    cfg, common = pq._setup(argv, "h200", True)
    fits = pq.estimated_fits(cfg, 4, common, True, *pq._narrow_splits(args))
    assert fits and {p.candidate.pipeline for p in fits} == {2}
    assert "TP2xPP2xEP1xDP1 recompute=full" in {p.name for p in fits}  # no data ranks: no ZeRO, still sized


def test_skipped_layouts_are_not_compiled(monkeypatch):
    from types import SimpleNamespace

    seen = []
    monkeypatch.setattr(pq, "_setup", lambda *a: (None, {}))
    monkeypatch.setattr(pq, "estimated_fits", lambda *a: [SimpleNamespace(name=n) for n in ("A", "B", "C recompute=full")])
    monkeypatch.setattr(pq, "compiled_fits", lambda argv, n, estimated, args: seen.extend(p.name for p in estimated) or [])
    args = pq._parser().parse_args(["--skip", "A", "C", "--no-fewest"])  # "C": without its recompute
    args.flags = []
    row = pq.plan_case("qwen3.5-moe-tiny", 256, "sft", args)
    assert seen == ["B"] and row.layout is None
