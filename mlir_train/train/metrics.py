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

from mlir_train.runtime import log
from mlir_train.runtime.errors import NonFiniteLoss


class MetricsWriter:
    """TensorBoard + metrics.jsonl (+ wandb when asked). Only process 0 writes."""

    def __init__(self, log_dir: str | None, *, enabled: bool = True, wandb_project: str = "", wandb_name: str = "",
                 wandb_dir: str = "", config: dict[str, Any] | None = None):
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
                log.warning("--wandb-project given but the wandb package is not installed "
                            "(pip install wandb); logging to TensorBoard and metrics.jsonl only.")
            else:
                self.wandb = wandb.init(project=wandb_project, name=wandb_name or None, config=config,
                                        dir=wandb_dir or log_dir)

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
    and the z-loss (times their coefficients, averaged over the MoE layers), dropped tokens, the
    expert-parallel exchange's overflow rows and further rounds, and
    with ``per_layer`` (``--moe-per-layer-logging``) Megatron's ``moe/<name>_layer_<i>`` for each
    MoE layer ``i`` (its decoder-layer index): the raw, coefficient-free value averaged over the
    step's micro-batches (the step's ``"<name> per layer"`` arrays), as Megatron's tracker logs it."""
    out = {name: float(m[name]) for name in ROUTER_LOSSES if name in m}
    out["dropped tokens"] = float(m["dropped_tokens"])
    # Dropless rows that overflowed the expert-parallel exchange buffer (--moe-ep-buffer-factor)
    # and went in further rounds: computed exactly, counted so the factor can be sized
    # (ExchangeRounds reports them once, at the end of the run).
    out["ep overflow rows"] = float(m["ep_overflow_rows"])
    out["ep further rounds"] = float(m.get("ep_further_rounds", 0.0))
    if per_layer:
        moe_layers = [i for i, is_moe in enumerate(model_cfg.moe_layers()) if is_moe]
        for name in ROUTER_LOSSES:
            for i, v in zip(moe_layers, np.asarray(m.get(f"{name} per layer", [])).tolist()):
                out[f"moe/{name}_layer_{i}"] = float(v)
    return out


def ep_load_max_over_mean(tokens_per_expert, expert_parallel: int) -> float:
    """How far the step's routing is from balanced across the expert-parallel ranks: per MoE
    layer the rows routed to the most-loaded EP rank's experts (rank ``r`` holds experts
    ``[r E/EP, (r+1) E/EP)``, as Megatron places them), summed over the layers, over the same
    sum for the mean rank. 1.0 is balanced; the experts' matmuls and the exchange wait for the
    most-loaded rank of each layer, so this is about what they take over a balanced routing's."""
    t = np.asarray(tokens_per_expert, np.float64)
    t = t.reshape(-1, t.shape[-1])
    rows = t.reshape(t.shape[0], expert_parallel, -1).sum(axis=-1)  # [layers, EP ranks]
    mean = rows.mean(axis=1).sum()
    return float(rows.max(axis=1).sum() / mean) if mean > 0 else 1.0


def throughput_scalars(step_time: float, loss_tokens: float, slots: int, num_devices: int) -> dict[str, float]:
    """Tokens per second as users need them: ``supervised-tokens-per-sec``, the tokens that carry
    a loss (prompt, padding and packing slack excluded) over wall time, in total and per device;
    ``slot-tokens-per-sec``, every slot of the global batch (global batch x sequence length)
    over wall time, the figure peers headline (what ``tokens-per-sec`` used to be)."""
    return {"supervised-tokens-per-sec": loss_tokens / step_time,
            "supervised-tokens-per-sec-per-device": loss_tokens / step_time / num_devices,
            "slot-tokens-per-sec": slots / step_time}


def console_line(iteration: int, train_iters: int, m: dict[str, float], eta_s: float | None) -> str:
    """A log line shaped like Megatron's ``training_log``."""
    parts = [
        f" iteration {iteration:8d}/{train_iters:8d}",
        f"consumed samples: {int(m['consumed samples']):12d}",
        f"elapsed time per iteration (ms): {m['iteration-time'] * 1000:.1f}",
    ]
    if m.get("predicted-iteration-time") is not None:  # the planner's roofline for this layout (GPU runs)
        parts.append(f"predicted (ms): {m['predicted-iteration-time'] * 1000:.1f}")
    parts += [
        f"learning rate: {m['learning-rate']:.6E}",
        f"global batch size: {int(m['batch-size']):5d}",
        f"lm loss: {m['lm loss']:.6E}",
    ]
    parts += [f"{name}: {m[name]:.6E}" for name in sorted(m) if name.startswith("mtp_") and name.endswith(" loss")]
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
        f"supervised tokens/s: {m['supervised-tokens-per-sec']:.0f} "
        f"({m['supervised-tokens-per-sec-per-device']:.0f}/device)",
        f"slot tokens/s: {m['slot-tokens-per-sec']:.0f}",
    ]
    if "ep-load-max-over-mean" in m:
        parts.append(f"ep load max/mean: {m['ep-load-max-over-mean']:.3f}")
    parts += [f"TFLOP/s/device: {m['throughput']:.3f}"]
    if m.get("mfu") is not None:
        parts.append(f"MFU: {100 * m['mfu']:.1f}%")
    if eta_s is not None:
        parts.append(f"ETA: {int(eta_s) // 60:d}:{int(eta_s) % 60:02d}")
    return " | ".join(parts) + " |"




class ExchangeRounds:
    """The dropless MoE exchange's rounds over a run, reported once at its end: how many steps
    needed rounds beyond the first (rows past the ``--moe-ep-buffer-factor`` buffers, computed
    exactly), how many rounds a MoE layer took on average and so what they cost: each further
    round is one more pass of the exchange and the local experts over a buffer of the first
    round's size. A warning only when a pass took :data:`WARN_AT` further rounds or more on average:
    below that the rounds cost about the compute a buffer large enough for one round would (rounds
    x factor x the routed rows either way) and only their latency is extra."""

    WARN_AT = 1.0

    def __init__(self, layer_passes: int, buffer_factor: float | None):
        self.layer_passes, self.buffer_factor = layer_passes, buffer_factor  # MoE layers x micro-batches
        self.steps = self.steps_with_rounds = 0
        self.further = self.rows = 0.0

    def add(self, scalars: dict[str, float]) -> None:
        if "ep further rounds" in scalars:
            self.steps += 1
            self.steps_with_rounds += scalars["ep further rounds"] > 0
            self.further += scalars["ep further rounds"]
            self.rows += scalars["ep overflow rows"]

    def report(self) -> None:
        if not self.steps_with_rounds or not self.layer_passes:
            return
        extra = self.further / (self.steps * self.layer_passes)
        text = (f"MoE exchange: {self.steps_with_rounds} of {self.steps} steps needed rounds beyond the first "
                f"({int(self.rows)} rows past the --moe-ep-buffer-factor {self.buffer_factor:g} buffers, exact): "
                f"{1 + extra:.2f} rounds per MoE layer pass on average: {100 * extra:.0f}% more exchange latency, "
                "about the compute a buffer large enough for one round would take")
        if extra >= self.WARN_AT:
            log.warning(text + "; a larger --moe-ep-buffer-factor takes fewer rounds for more buffer memory")
        else:
            log.info(text)


class StepLogger:
    """The loop's logging hook. ``record(iteration, metrics)`` turns one step's device metrics
    (read by the host only when asked, one step late) into Megatron's console line every
    ``--log-interval`` and TensorBoard/metrics.jsonl scalars every ``--tensorboard-log-interval``,
    stops on a non-finite loss (unless disabled), and keeps the loss history."""

    def __init__(self, writer: MetricsWriter, *, train_iters: int, log_interval: int, tensorboard_log_interval: int,
                 check_nan: bool, global_batch_size: int, seq_length: int, lr_at, flops_per_step: float,
                 num_devices: int, peak_tflops: float | None, log_timers: bool, timers: "Timers",
                 model_cfg=None, per_layer_router: bool = False, exchange: ExchangeRounds | None = None,
                 expert_parallel: int = 1):
        self.writer, self.train_iters, self.lr_at = writer, train_iters, lr_at
        self.model_cfg, self.per_layer_router = model_cfg, per_layer_router  # --moe-per-layer-logging
        self.log_interval, self.tb_interval = log_interval, max(1, tensorboard_log_interval)
        self.check_nan, self.gbs, self.seq_length = check_nan, global_batch_size, seq_length
        self.flops_per_step, self.num_devices, self.peak = flops_per_step, num_devices, peak_tflops
        self.log_timers, self.timers = log_timers, timers
        self.expert_parallel = expert_parallel
        # The planner's step time for this layout (seconds), where one was computed (GPU runs):
        # logged beside the measured one.
        self.predicted_step_s: float | None = None
        self.history: dict[str, list] = {"lm loss": [], "valid": []}
        self.first_logged: tuple[int, float] | None = None  # (iteration, lm loss) of the first console line
        self.exchange = exchange or ExchangeRounds(0, None)
        self.skipped = 0
        self.pending = None  # (iteration, device metrics): read one step late so the host never stalls the device
        self.last_done = self.start_time = time.perf_counter()
        self.first_iteration: int | None = None

    def step_done(self, iteration: int, metrics_dev, *, first: bool = False, started: float | None = None) -> None:
        """After dispatching ``iteration``: the first step (compile + run) is read at once, with
        its time counted from ``started``; later ones one step late."""
        if first:
            import jax

            jax.block_until_ready(metrics_dev)
            self.last_done = started  # Megatron's first iteration time includes its warm-up too
            self.record(iteration, metrics_dev)
            self.start_time = time.perf_counter()
            self.first_iteration = iteration
            return
        self.flush()
        self.pending = (iteration, metrics_dev)

    def flush(self) -> None:
        if self.pending is not None:
            pending, self.pending = self.pending, None
            self.record(*pending)

    def record(self, iteration: int, metrics_dev) -> None:
        import jax

        m = jax.device_get(metrics_dev)
        now = time.perf_counter()
        step_time, self.last_done = now - self.last_done, now
        lm_loss, grad_norm = float(m["lm loss"]), float(m["grad-norm"])
        self.skipped += int(m["skipped"])
        if self.check_nan and not int(m["skipped"]) and not (math.isfinite(lm_loss) and math.isfinite(grad_norm)):
            raise NonFiniteLoss(
                f"iteration {iteration}: lm loss {lm_loss} / grad norm {grad_norm} is not finite; stopping before "
                "any checkpoint of this state is written (--no-check-for-nan-in-loss-and-grad disables the check)")
        self.history["lm loss"].append((iteration, lm_loss))
        from mlir_train.model import flops as flops_lib

        scalars = {
            "lm loss": lm_loss, "grad-norm": grad_norm, "learning-rate": self.lr_at(iteration),
            "batch-size": self.gbs, "consumed samples": iteration * self.gbs, "iteration-time": step_time,
            "loss-scale": float(m["loss-scale"]), "skipped iterations": self.skipped,
            **throughput_scalars(step_time, float(m["loss tokens"]), self.gbs * self.seq_length, self.num_devices),
            "throughput": flops_lib.tflops_per_device(self.flops_per_step, step_time, self.num_devices),
            "mfu": flops_lib.mfu(self.flops_per_step, step_time, self.num_devices, self.peak),
            "loss tokens": float(m["loss tokens"]),
            "predicted-iteration-time": self.predicted_step_s,
        }
        scalars |= {k: float(v) for k, v in m.items() if k.startswith("mtp_") and k.endswith(" loss")}  # --mtp-num-layers
        arrays = {}
        if "load_balancing_loss" in m:
            scalars |= router_scalars(m, self.model_cfg, per_layer=self.per_layer_router)
            scalars["ep-load-max-over-mean"] = ep_load_max_over_mean(m["tokens_per_expert"], self.expert_parallel)
            arrays["expert-load"] = np.asarray(m["tokens_per_expert"]).sum(axis=0)
            self.exchange.add(scalars)
        if self.log_timers:
            totals = self.timers.pop_all()
            scalars |= {f"timers/{k}": totals.get(k, 0.0) for k in ("data-wait", "step-dispatch", "eval")}
        last = iteration == self.train_iters
        if iteration % self.log_interval == 0 or last:
            done = iteration - (self.first_iteration or 0)
            eta = (time.perf_counter() - self.start_time) / max(done, 1) * (self.train_iters - iteration)
            print(console_line(iteration, self.train_iters, scalars, eta), flush=True)
            self.first_logged = self.first_logged or (iteration, lm_loss)
        if iteration % self.tb_interval == 0 or last:
            self.writer.write(iteration, scalars, arrays)

    def validation(self, iteration: int, loss: float) -> None:
        ppl = math.exp(min(loss, 20.0))
        print(f" validation loss at iteration {iteration} | lm loss value: {loss:.6E} | lm loss PPL: {ppl:.6E} |")
        self.writer.write(iteration, {"lm loss validation": loss, "lm loss validation ppl": ppl})
        self.history["valid"].append((iteration, loss))
