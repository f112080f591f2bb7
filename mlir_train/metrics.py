"""Where logged numbers go: the console (Megatron's line), TensorBoard, metrics.jsonl, wandb.

Tag names are Megatron's (``lm loss``, ``learning-rate``, ``grad-norm``,
``load_balancing_loss``, ``iteration-time``, ...), in TensorBoard and as the keys of each
``metrics.jsonl`` line, so the same notebook or tool reads either.
"""

from __future__ import annotations

import json
import math
import os
import time
from typing import Any

import numpy as np


class MetricsWriter:
    """TensorBoard + metrics.jsonl (+ wandb when asked). Only process 0 writes."""

    def __init__(self, log_dir: str | None, *, enabled: bool = True, wandb_project: str = "", wandb_name: str = "",
                 config: dict[str, Any] | None = None):
        self.enabled = enabled and log_dir is not None
        self.log_dir = log_dir
        self.tb = None
        self.jsonl = None
        self.wandb = None
        if not self.enabled:
            return
        os.makedirs(log_dir, exist_ok=True)
        from tensorboardX import SummaryWriter

        self.tb = SummaryWriter(log_dir)
        self.jsonl = open(os.path.join(log_dir, "metrics.jsonl"), "a")
        if config is not None:
            with open(os.path.join(log_dir, "config.json"), "w") as f:
                json.dump(config, f, indent=2, default=str)
        if wandb_project:
            try:
                import wandb
            except ImportError:
                print("wandb: --wandb-project given but the wandb package is not installed "
                      "(pip install wandb); logging to TensorBoard and metrics.jsonl only.")
            else:
                self.wandb = wandb.init(project=wandb_project, name=wandb_name or None, config=config, dir=log_dir)

    def write(self, iteration: int, scalars: dict[str, float], arrays: dict[str, Any] | None = None) -> None:
        if not self.enabled:
            return
        for tag, value in scalars.items():
            if value is not None and math.isfinite(value):
                self.tb.add_scalar(tag, value, iteration)
        record: dict[str, Any] = {"iteration": iteration, **{k: v for k, v in scalars.items() if v is not None}}
        for tag, value in (arrays or {}).items():
            value = np.asarray(value)
            record[tag] = value.tolist()
            if value.ndim == 1:
                for i, v in enumerate(value):
                    self.tb.add_scalar(f"{tag}/{i}", float(v), iteration)
        self.jsonl.write(json.dumps(record) + "\n")
        self.jsonl.flush()
        if self.wandb is not None:
            self.wandb.log({k: v for k, v in record.items() if k != "iteration"}, step=iteration)

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
        if self.jsonl is not None:
            self.jsonl.close()
        if self.wandb is not None:
            self.wandb.finish()


class Timers:
    """Named wall-clock accumulators (Megatron's ``--log-timers-to-tensorboard`` timers)."""

    def __init__(self):
        self.totals: dict[str, float] = {}
        self._start: dict[str, float] = {}

    def start(self, name: str) -> None:
        self._start[name] = time.perf_counter()

    def stop(self, name: str) -> float:
        elapsed = time.perf_counter() - self._start.pop(name)
        self.totals[name] = self.totals.get(name, 0.0) + elapsed
        return elapsed

    def pop_all(self) -> dict[str, float]:
        out, self.totals = self.totals, {}
        return out


ROUTER_LOSSES = ("load_balancing_loss", "seq_load_balancing_loss", "global_load_balancing_loss", "z_loss")


def router_scalars(m: dict[str, Any], model_cfg, *, per_layer: bool = False) -> dict[str, float]:
    """A step's MoE router numbers under Megatron's tag names: each load-balancing loss in use
    and the z-loss (times their coefficients, averaged over the MoE layers), dropped tokens, and
    with ``per_layer`` (``--moe-per-layer-logging``) Megatron's ``moe/<name>_layer_<i>`` for each
    MoE layer ``i`` (its decoder-layer index): the raw, coefficient-free value averaged over the
    step's micro-batches (the step's ``"<name> per layer"`` arrays), as Megatron's tracker logs it."""
    out = {name: float(m[name]) for name in ROUTER_LOSSES if name in m}
    out["dropped tokens"] = float(m["dropped_tokens"])
    if per_layer:
        moe_layers = [i for i, is_moe in enumerate(model_cfg.layer_kinds()) if is_moe]
        for name in ROUTER_LOSSES:
            for i, v in zip(moe_layers, np.asarray(m.get(f"{name} per layer", [])).tolist()):
                out[f"moe/{name}_layer_{i}"] = float(v)
    return out


def console_line(iteration: int, train_iters: int, m: dict[str, float], eta_s: float | None) -> str:
    """A log line shaped like Megatron's ``training_log``."""
    parts = [
        f" iteration {iteration:8d}/{train_iters:8d}",
        f"consumed samples: {int(m['consumed samples']):12d}",
        f"elapsed time per iteration (ms): {m['iteration-time'] * 1000:.1f}",
        f"learning rate: {m['learning-rate']:.6E}",
        f"global batch size: {int(m['batch-size']):5d}",
        f"lm loss: {m['lm loss']:.6E}",
    ]
    if "load_balancing_loss" in m:
        parts.append(f"load_balancing_loss: {m['load_balancing_loss']:.6E}")
    for name in ("seq_load_balancing_loss", "global_load_balancing_loss"):
        if name in m:
            parts.append(f"{name}: {m[name]:.6E}")
    if m.get("z_loss"):
        parts.append(f"z_loss: {m['z_loss']:.6E}")
    parts += [
        f"loss scale: {m['loss-scale']:.1f}",
        f"grad norm: {m['grad-norm']:.3f}",
        f"number of skipped iterations: {int(m['skipped iterations']):3d}",
        f"tokens/s: {m['tokens-per-sec']:.0f}",
        f"TFLOP/s/device: {m['throughput']:.3f}",
    ]
    if m.get("mfu") is not None:
        parts.append(f"MFU: {100 * m['mfu']:.1f}%")
    if eta_s is not None:
        parts.append(f"ETA: {int(eta_s) // 60:d}:{int(eta_s) % 60:02d}")
    return " | ".join(parts) + " |"
