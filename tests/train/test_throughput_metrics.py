"""Issue 37 item 5: the throughput users need, every logged iteration, in the console line and
metrics.jsonl (TensorBoard gets the same scalars)."""

import json

import numpy as np
import pytest

from mlir_train.train.metrics import MetricsWriter, StepLogger, Timers, ep_load_max_over_mean, throughput_scalars


def test_supervised_tokens_count_only_tokens_with_loss():
    got = throughput_scalars(step_time=2.0, loss_tokens=300.0, slots=1000, num_devices=4)
    assert got == {"supervised-tokens-per-sec": 150.0, "supervised-tokens-per-sec-per-device": 37.5,
                   "slot-tokens-per-sec": 500.0}


def test_ep_load_is_the_busiest_ranks_rows_over_the_mean():
    # 2 layers, 4 experts over EP 2 (rank 0: experts 0-1, rank 1: experts 2-3).
    balanced = np.array([[5, 5, 5, 5], [1, 3, 2, 2]])
    assert ep_load_max_over_mean(balanced, 2) == 1.0
    skewed = np.array([[8, 4, 0, 0], [0, 0, 3, 1]])  # layer maxima 12 and 4 over means 6 and 2
    assert ep_load_max_over_mean(skewed, 2) == 2.0
    assert ep_load_max_over_mean(skewed, 1) == 1.0
    assert ep_load_max_over_mean(np.zeros((2, 4)), 2) == 1.0


def test_every_logged_iteration_carries_them(tmp_path, capsys):
    writer = MetricsWriter(str(tmp_path), wandb_project="", wandb_dir="")
    logger = StepLogger(writer, train_iters=3, log_interval=1, tensorboard_log_interval=1, check_nan=True,
                        global_batch_size=2, seq_length=8, lr_at=lambda i: 1e-3, flops_per_step=1.0, num_devices=2,
                        peak_tflops=None, log_timers=False, timers=Timers())
    logger.predicted_step_s = 0.25
    for it in range(1, 4):
        logger.record(it, {"lm loss": np.float32(2.0), "grad-norm": np.float32(1.0), "skipped": np.int32(0),
                           "loss-scale": np.float32(1.0), "loss tokens": np.float32(10.0)})
    writer.close()
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert len(rows) == 3
    for r in rows:
        assert r["supervised-tokens-per-sec"] * 16 == pytest.approx(r["slot-tokens-per-sec"] * 10)
        assert r["supervised-tokens-per-sec-per-device"] * 2 == pytest.approx(r["supervised-tokens-per-sec"])
        assert "tokens-per-sec" not in r
    lines = [l for l in capsys.readouterr().out.splitlines() if l.startswith(" iteration ")]
    assert len(lines) == 3
    assert all("supervised tokens/s:" in l and "slot tokens/s:" in l and
               "| predicted (ms): 250.0 |" in l and l.index("elapsed time") < l.index("predicted (ms)") for l in lines)


def test_the_planner_knows_the_gpus_it_predicts_for():
    from mlir_train.planner.predict import kind_of

    assert kind_of("NVIDIA H200").name == "h200" and kind_of("NVIDIA H100 80GB HBM3").name == "h100"
    assert kind_of("cpu") is None and kind_of("Kunlun P800") is None  # no XLA:GPU target: no prediction
