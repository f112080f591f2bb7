"""The ahead-of-time planner on the real model sizes: exact state bytes, a sane fit verdict.

Each plan is a ``python -m mlir_train.plan`` subprocess: it needs its own fake device count
and XLA:CPU settings, set before jax starts (the test process already has 8 devices). These
compile for XLA:CPU (``--xla-cpu``) and check the analytic breakdown and its estimate verdict;
tests/planner/test_gpu_plan.py checks the deviceless XLA:GPU compile and its compiled verdict.
"""

import json
import os
import subprocess
import sys

import pytest

from mlir_train.families import get_model_config
from mlir_train.planner.candidates import candidate, candidate_layouts
from mlir_train.planner.estimate import activation_bytes
from mlir_train.planner.targets import GIB, USABLE_FRACTION
from mlir_train.config.sections import padded_vocab_size

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _plan(tmp_path, *flags: str) -> tuple[list[dict], str]:
    """The plans and printout of ``python -m mlir_train.planner.plan``; its exit status is 0
    where a plan fits, 3 (EXIT_DOES_NOT_FIT) where none does."""
    out = tmp_path / "plan.json"
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
    proc = subprocess.run([sys.executable, "-m", "mlir_train.planner.plan", *flags, "--json", str(out)], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode in (0, 3), proc.stdout[-3000:] + proc.stderr[-3000:]
    plans = json.load(open(out))
    assert (proc.returncode == 0) == any(p["error"] is None and p["fits"] for p in plans), proc.stdout[-3000:]
    return plans, proc.stdout


def _num_params(name: str, tp: int) -> int:
    cfg = get_model_config(name)
    return cfg.replace(vocab_size=padded_vocab_size(cfg.vocab_size, 128, tp)).num_params()


def _check_state_bytes(plan: dict, name: str, tp: int, devices: int) -> None:
    # --use-distributed-optimizer splits every float32 master weight over all devices
    # (TP/EP x the data ranks), so each holds num_params * 4 / devices bytes of them.
    assert plan["master_bytes"] == pytest.approx(_num_params(name, tp) * 4 / devices, rel=1e-3)
    # Adam's two moments, same layout (+ a few scalar step counts).
    assert plan["optimizer_bytes"] == pytest.approx(2 * plan["master_bytes"], rel=1e-6)
    # What XLA compiled takes exactly the state (+ batch, iteration) the planner counted.
    counted = plan["master_bytes"] + plan["optimizer_bytes"] + plan["batch_bytes"]
    assert plan["compiled_argument_bytes"] == pytest.approx(counted, rel=1e-6)


def test_qwen3_30b_a3b_tp2_ep2_distopt_on_8_h200(tmp_path):
    [plan], text = _plan(
        tmp_path, "--model-name", "qwen3-30b-a3b", "--num-devices", "8", "--device-kind", "h200",
        "--seq-length", "4096", "--micro-batch-size", "1", "--global-batch-size", "16", "--bf16",
        "--tensor-model-parallel-size", "2", "--expert-model-parallel-size", "2", "--use-distributed-optimizer",
        "--recompute-granularity", "full", "--xla-cpu")
    assert plan["error"] is None
    _check_state_bytes(plan, "qwen3-30b-a3b", tp=2, devices=8)
    total = plan["total_bytes"]
    # ~14 GiB master + 28 GiB Adam + 15 GiB bf16 weights + 29 GiB gradients + activations:
    # fits the 141 GiB of an H200, and would not fit the 80 GiB of an H100.
    assert 60 * GIB < total < 0.95 * 141 * GIB and total > USABLE_FRACTION * 80 * GIB
    assert plan["fits"] is True and "FITS in 141 GiB" in text
    assert plan["flops_per_step"] > 0 and plan["tokens_per_s"] > 0
    assert plan["compiled_temp_bytes"] > 0 and "not a GPU budget" in text
    assert plan["verdict_from"] == "estimate" and "--xla-cpu" in text
    # The communication audit is in the text and the JSON: the EP all-to-all against Megatron's
    # (TP2 SP-less here: Megatron's top-k rows of the whole sequence, forward twice with full recompute).
    kinds = {r["kind"]: r for r in plan["comm_comparison"]}
    assert kinds["all-to-all"]["megatron_bytes"] > 0 and kinds["all-to-all"]["compiled_bytes"] > 0
    assert "compiled vs Megatron's analytic volume" in text
    assert plan["megatron_executed_flops"] == pytest.approx(plan["flops_per_step"] * 4 / 3)
    assert plan["roofline"] is None  # no GPU target compiled: no roofline


def test_qwen3_235b_a22b_tp4_ep8_distopt_on_64_h100(tmp_path):
    [plan], text = _plan(
        tmp_path, "--model-name", "qwen3-235b-a22b", "--num-devices", "64", "--device-kind", "h100",
        "--seq-length", "4096", "--micro-batch-size", "1", "--global-batch-size", "64", "--bf16",
        "--tensor-model-parallel-size", "4", "--expert-model-parallel-size", "8", "--use-distributed-optimizer",
        "--recompute-granularity", "full", "--xla-cpu")
    assert plan["error"] is None
    _check_state_bytes(plan, "qwen3-235b-a22b", tp=4, devices=64)
    # 235B over 64 devices: ~14 GiB master + 27 GiB Adam + bf16 weights and gradients + fp32
    # accumulator ~ 85+ GiB: more than 95 % of an 80 GiB H100.
    assert plan["total_bytes"] > USABLE_FRACTION * 80 * GIB
    # An "80GB" H100 reports 79.1 GiB (openxla's h100_sxm description, device_memory_size).
    assert plan["fits"] is False and "DOES NOT FIT in 79 GiB" in text


def test_activation_estimate_follows_the_recompute_policy():
    cfg = get_model_config("qwen3-30b-a3b")
    sizes = {r: activation_bytes(cfg, candidate(r, tensor=2, expert=2), micro_batch=1, seq=4096, dtype_bytes=2)
             for r in ("none", "selective", "full")}
    assert sizes["none"] > sizes["selective"] > sizes["full"]
    # Full recompute keeps one [T, D] bf16 input per layer (+ one layer's working set, logits).
    assert sizes["full"] < 16 * GIB < sizes["none"]
    seq_parallel = activation_bytes(cfg, candidate("full", tensor=2, expert=2, sequence_parallel=True),
                                    micro_batch=1, seq=4096, dtype_bytes=2)
    assert seq_parallel < sizes["full"]


def test_pipeline_activation_estimate_follows_the_schedule():
    """1F1B keeps a bounded number of chunk items' residuals whatever the micro-batch count; GPipe every
    micro-batch's saved activations (the compiled CPU figures behave the same way, see
    tests/train/test_pipeline.py::test_1f1b_memory_is_bounded_by_stages_not_micro_batches)."""
    from mlir_train.train.pipeline.schedule import make_schedule

    cfg = get_model_config("qwen3-30b-a3b")
    layout = candidate("full", tensor=2, expert=2, pipeline=2, sequence_parallel=True)
    size = lambda kind, m: activation_bytes(cfg, layout, micro_batch=1, seq=2048, dtype_bytes=2, num_micro=m,
                                            schedule=make_schedule(cfg.num_layers, 2, kind=kind))
    assert size("1f1b", 64) == size("1f1b", 4) < size("gpipe", 4) < size("gpipe", 64)
    assert size("gpipe", 64) > 3 * size("1f1b", 64)


def test_search_candidates_cover_the_layouts():
    from mlir_train.config import cli

    layouts = candidate_layouts(cli.parse(["--model-name", "qwen3-30b-a3b"]), 8)
    names = {l.name(8) for l in layouts}
    assert "TP2xPP1xEP2xDP4+distopt recompute=full" in names
    assert "TP8xPP1xEP1xDP1 recompute=none" in names
    assert all(l.layout.expert <= 8 // (l.layout.tensor * l.layout.pipeline) for l in layouts)


def test_a_candidate_is_the_one_layout_type_plus_a_recompute_policy():
    """The planner has no layout class of its own: a candidate pairs sharding's Layout with a
    RecomputePolicy, and its printed name is the planner's as before."""
    from mlir_train.config.policies import RecomputePolicy
    from mlir_train.planner.candidates import Candidate
    from sharding.layout import Layout

    c = candidate("full", tensor=2, expert=4, expert_tensor=1, sequence_parallel=True, distributed_optimizer=True)
    assert c == Candidate(Layout(tensor=2, expert=4, expert_tensor=1, sequence_parallel=True,
                                 distributed_optimizer=True), RecomputePolicy("full"))
    assert type(c.layout) is Layout and c.etp == c.layout.etp == 1
    assert c.name(8) == "TP2xPP1xEP4xETP1xDP4+SP+distopt recompute=full"
    assert candidate(tensor=2, context=2).name(8) == "TP2xCP2xPP1xEP1xDP2 recompute=none"


@pytest.mark.slow
def test_search_ranks_fitting_layouts(tmp_path):
    ranked, text = _plan(
        tmp_path, "--model-name", "qwen3-30b-a3b", "--num-devices", "8", "--device-kind", "h200",
        "--seq-length", "4096", "--micro-batch-size", "1", "--global-batch-size", "16", "--bf16",
        "--search", "--search-top", "2")
    assert 1 <= len(ranked) <= 2 and all(p["fits"] for p in ranked)
    assert "does not fit (estimate):" in text and "ranking" in text
    speeds = [p["tokens_per_s"] for p in ranked]
    assert speeds == sorted(speeds, reverse=True)


def test_the_planner_imports_no_jax():
    """python -m mlir_train.plan sets the platform up (compile-only GPU devices, fake CPU
    devices) before jax starts: its modules must not import jax (the sharding package does)."""
    code = "import sys, mlir_train.planner.plan; assert 'jax' not in sys.modules, 'jax imported'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, env=os.environ | {"PYTHONPATH": ROOT})


def test_lora_flags_plan_the_adapters_on_a_frozen_base(tmp_path):
    """The planner takes LoRA's flags: fp32 masters and Adam moments are the adapters', the base is
    counted once in bf16, and what XLA compiled takes exactly that state."""
    [plan], text = _plan(
        tmp_path, "--model-name", "qwen3-moe-tiny", "--num-devices", "8", "--seq-length", "128",
        "--micro-batch-size", "1", "--global-batch-size", "8", "--bf16", "--expert-model-parallel-size", "2",
        "--use-distributed-optimizer", "--lora-dim", "4", "--lora-target-modules", "linear_qkv", "*experts*",
        "--xla-cpu")
    assert plan["error"] is None and "LoRA frozen base (compute dtype)" in text
    cfg = get_model_config("qwen3-moe-tiny")
    # the adapters: rank 4 on q/k/v (one A and B each) and every expert's fc1 (A, B [4, 2F]) and fc2
    per_layer = 3 * 4 * cfg.hidden_size + 4 * (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim + cfg.num_experts * 4 * (
        cfg.hidden_size + 2 * cfg.moe_intermediate_size + cfg.moe_intermediate_size + cfg.hidden_size)
    assert plan["master_bytes"] == pytest.approx(per_layer * cfg.num_layers * 4 / 8, rel=1e-2)  # ZeRO-1 over 8
    assert plan["optimizer_bytes"] == pytest.approx(2 * plan["master_bytes"], rel=1e-3)
    assert plan["frozen_base_bytes"] > 20 * plan["master_bytes"]
    counted = plan["master_bytes"] + plan["optimizer_bytes"] + plan["frozen_base_bytes"] + plan["batch_bytes"]
    assert plan["compiled_argument_bytes"] == counted + 4  # + the int32 iteration


def test_a_plan_leads_with_one_step_time_and_says_where_it_comes_from():
    """One step time first: the compiled program's matmul FLOPs at the assumed MFU when a program
    was compiled for the target, else Megatron's model FLOPs, labelled as an estimate."""
    from types import SimpleNamespace

    from mlir_train.planner.report import step_time_line

    compiled = SimpleNamespace(compiled_for_target=True, compiled_step_time_s=2.0, compiled_matmul_flops=4e15,
                               compiled_tokens_per_s=1000.0, conditionals=1, step_time_s=1.5, tokens_per_s=1300.0)
    line = step_time_line(compiled, 0.4)
    assert line.startswith("  step time 2.00s, 1,000 tokens/s: the compiled program's matmul FLOPs (every overflow "
                           "round taken) at 40% of the 5000 TFLOP/s peak") and "cross-checks" in line
    estimate = SimpleNamespace(compiled_for_target=False, compiled_step_time_s=None, step_time_s=1.5,
                               tokens_per_s=1300.0)
    assert "Megatron's model FLOPs at 40% of peak (--assumed-mfu), an estimate" in step_time_line(estimate, 0.4)
    assert "--peak-tflops" in step_time_line(SimpleNamespace(compiled_for_target=False, compiled_step_time_s=None,
                                                             step_time_s=None), 0.4)


def test_a_layout_that_cannot_exist_is_an_error_not_a_report(tmp_path):
    """One layout asked for that the device count cannot hold: the report says NOT PLANNED and the
    run ends with one error line, exit status 2 (it was exit 0)."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
    proc = subprocess.run([sys.executable, "-m", "mlir_train.plan", "--model-name", "qwen3-moe-tiny", "--num-devices", "8",
                           "--seq-length", "64", "--micro-batch-size", "1", "--tensor-model-parallel-size", "3",
                           "--xla-cpu"], env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    err = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "NOT PLANNED" in proc.stdout and err[-1].startswith("mlir-train: error: no plan for"), err[-3:]


@pytest.mark.parametrize("memory_gb, status", [(1e-4, 3), (1000.0, 0)])
def test_the_exit_status_says_whether_it_fits(memory_gb, status, capsys):
    """A script's branch: 3 (EXIT_DOES_NOT_FIT) when the layout asked for does not fit the
    device memory, 0 when it does (``python -m mlir_train.plan`` exits with this status)."""
    from mlir_train.planner.plan import EXIT_DOES_NOT_FIT, exit_status

    assert exit_status(["--model-name", "qwen3-moe-tiny", "--num-layers", "2", "--num-devices", "2", "--seq-length",
                        "64", "--micro-batch-size", "1", "--expert-model-parallel-size", "2", "--device-memory-gb",
                        str(memory_gb), "--xla-cpu"]) == status
    out = capsys.readouterr().out
    assert EXIT_DOES_NOT_FIT == 3 and ("DOES NOT FIT" in out.upper()) == (status == 3), out[-800:]
