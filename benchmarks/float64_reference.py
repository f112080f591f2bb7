"""How far a layout's float32 gradients are from float64, against how far one device's are.

A layout that reorders float32 sums (context pieces, tensor-split heads, pipeline ticks, the
period scan) differs from the one-device step by rounding; a bug differs by more. To tell them
apart this runs the same computation in float64 (``jax_enable_x64`` with ``jnp.float32`` read as
``jnp.float64`` everywhere in the library: every explicit float32 upcast becomes a float64 one),
from the *same* float32-drawn weights, and prints per gradient leaf (max |diff| / max |ref|):

* ``1dev32``: one device float32 against one device float64 (the float noise of the model);
* ``lay32``: the layout in float32 against one device float64;
* ``lay64``: the layout in float64 against one device float64 (0 up to float64 rounding: the
  layout computes the same function; anything larger is a bug);
* ``lay32 - 1dev32``: the layout's float32 against one device's (what the step tests compare).

Each run is its own process (x64 is process-wide); the runs write ``.npz`` files under ``--dir``
and ``--compare`` prints the table::

    PYTHONPATH=$PWD python benchmarks/float64_reference.py --run one --bits 32 --dir /tmp/f64
    PYTHONPATH=$PWD python benchmarks/float64_reference.py --run one --bits 64 --dir /tmp/f64
    PYTHONPATH=$PWD python benchmarks/float64_reference.py --run cp2tp2 --bits 32 --dir /tmp/f64   # and 64
    PYTHONPATH=$PWD python benchmarks/float64_reference.py --compare cp2tp2 --dir /tmp/f64

``--run periods`` / ``--run per-run`` do the same for the decoder's period scan against running
every run as its own scan (8-layer qwen3.5-moe-tiny, recompute none; the forward and gradient
of tests/model/test_periods.py), with ``--compare periods``.
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

MIXED = ("linear_attention", "full_attention")
LAYOUTS = {  # name: Layout fields; the whole-step cases of tests/train/test_qwen3_5_layouts.py
    "one": None,
    "dp8": {},
    "cp2": dict(context=2),
    "cp2ep2": dict(context=2, expert=2),
    "tp2": dict(tensor=2, sequence_parallel=True),
    "cp2tp2": dict(context=2, tensor=2, sequence_parallel=True),
    "cp2pp2": dict(context=2, pipeline=2),
    "pp2": dict(pipeline=2),
}


def _parse():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--run", choices=[*LAYOUTS, "periods", "per-run"])
    p.add_argument("--bits", type=int, choices=[32, 64], default=32)
    p.add_argument("--model", default="qwen3.5-moe-tiny")
    p.add_argument("--layers", type=int, default=2,
                   help="the step runs' depth: 2 is one DeltaNet and one attention layer; more follow the model's "
                        "own pattern (3 DeltaNet, 1 attention)")
    p.add_argument("--compare", choices=[*LAYOUTS, "periods"])
    p.add_argument("--loss", choices=["squares", "probe"], default="probe",
                   help="the model runs' loss: the sum of squares of the final hidden states plus the router's "
                        "probabilities (tests/model/test_periods.py until 2026-12-04), or both against fixed probes")
    p.add_argument("--dir", required=True)
    return p.parse_args()


def _file(args, run, bits):
    loss = f"-{args.loss}" if run in ("periods", "per-run") else ("" if args.layers == 2 else f"-L{args.layers}")
    return os.path.join(args.dir, f"{args.model}-{run}{loss}-{bits}.npz")


def _weights(args, run):
    """The float32-drawn initial weights every run starts from (written by the first float32 run)."""
    import numpy as np
    path = os.path.join(args.dir, f"{args.model}-{'model' if run in ('periods', 'per-run') else 'step'}{'' if args.layers == 2 else f'-L{args.layers}'}-init.npz")
    return path, (dict(np.load(path)) if os.path.exists(path) else None)


def run_step(args):
    """One train step (tests.helpers.train_one_step) on ``args.run``'s layout."""
    import jax
    import numpy as np
    from mlir_train.families import get_model_config
    from sharding.layout import Layout
    from tests.helpers import named_leaves, train_one_step

    mixers = dict(layer_types=MIXED) if args.layers == 2 else {}
    cfg = get_model_config(args.model, vocab_size=512, num_layers=args.layers, **mixers)
    path, init = _weights(args, args.run)

    def start(trainer, state):
        if init is None:
            return state
        params = jax.tree_util.tree_map_with_path(
            lambda p, x: np.asarray(init[jax.tree_util.keystr(p, simple=True, separator="/")], x.dtype), state["params"])
        return dict(state, params=jax.device_put(params, trainer.master_shardings))

    fields = LAYOUTS[args.run]
    got = train_one_step(cfg, None if fields is None else Layout(**fields), init=start)
    if init is None:
        np.savez(path, **dict(named_leaves(got.init_params)))
    np.savez(_file(args, args.run, args.bits), **dict(named_leaves(got.adam_mu)),
             **{f"metric:{k}": v for k, v in got.metrics.items()})


def run_model(args):
    """The 8-layer decoder's hidden states and router statistics, and the gradient of
    tests/model/test_periods.py's loss, by the period scan or run by run."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx
    from mlir_train.families import build_model, get_model_config
    from mlir_train.model import ModelOptions
    from tests.helpers import named_leaves
    from tests.model.test_periods import _per_run, _probe_loss

    cfg = get_model_config(args.model, vocab_size=512, num_layers=8)
    graph, state = nnx.split(build_model(cfg, ModelOptions(remat="none")))
    path, init = _weights(args, args.run)
    if init is None:
        np.savez(path, **dict(named_leaves(state)))
    else:
        state = jax.tree_util.tree_map_with_path(
            lambda p, x: jnp.asarray(init[jax.tree_util.keystr(p, simple=True, separator="/")], x.dtype), state)
    ids_path = os.path.join(args.dir, f"{args.model}-model-ids.npy")
    if not os.path.exists(ids_path):  # drawn as the test draws them, in 32-bit mode (x64 draws others)
        assert args.bits == 32, "run --bits 32 first: it draws the token ids"
        np.save(ids_path, np.asarray(jax.random.randint(jax.random.key(0), (1, 8), 0, cfg.vocab_size)))
    ids = jnp.asarray(np.load(ids_path), jnp.int32)
    run = _per_run if args.run == "per-run" else (lambda m, i: m.hidden_states(i))

    def loss(state):
        h, stats = run(nnx.merge(graph, state), ids)
        if args.loss == "squares":  # RMS-normalised states: their sum of squares hardly depends on the weights
            return jnp.sum(h ** 2) + jnp.sum(stats["probs_per_expert"])
        return _probe_loss(h, stats)

    value, grads = jax.jit(jax.value_and_grad(loss))(state)
    np.savez(_file(args, args.run, args.bits), **dict(named_leaves(grads)), **{"metric:loss": np.asarray(value)})


def _rel(a, b):
    import numpy as np
    return float(np.abs(a.astype(np.float64) - b).max() / max(np.abs(b).max(), 1e-300))


def compare(args):
    import numpy as np
    one = "per-run" if args.compare == "periods" else "one"
    ref = dict(np.load(_file(args, one, 64)))
    one32 = dict(np.load(_file(args, one, 32)))
    lay32 = dict(np.load(_file(args, args.compare, 32)))
    lay64_path = _file(args, args.compare, 64)
    lay64 = dict(np.load(lay64_path)) if os.path.exists(lay64_path) else None
    print(f"{args.model} {args.compare} against {one}, per leaf max|diff| / max|{one} float64|")
    print(f"{'leaf':48s} {'1dev32':>8s} {'lay32':>8s} {'lay64':>8s} {'lay32-1dev32':>12s} {'lay32/1dev32':>12s}")
    worst = [0.0] * 4
    for k in sorted(ref):
        if k.startswith("metric:"):
            continue
        e1, el = _rel(one32[k], ref[k]), _rel(lay32[k], ref[k])
        e64 = _rel(lay64[k], ref[k]) if lay64 is not None else float("nan")
        d = float(np.abs(lay32[k].astype(np.float64) - one32[k]).max() / max(np.abs(ref[k]).max(), 1e-300))
        worst = [max(w, x) for w, x in zip(worst, (e1, el, e64 if e64 == e64 else 0.0, d))]
        print(f"{k:48s} {e1:8.1e} {el:8.1e} {e64:8.1e} {d:12.1e} {el / max(e1, 1e-300):12.1f}")
    print(f"{'worst':48s} {worst[0]:8.1e} {worst[1]:8.1e} {worst[2]:8.1e} {worst[3]:12.1e}")
    for k in sorted(ref):
        if k.startswith("metric:"):
            print(k, float(one32[k]), float(lay32[k]), float(ref[k]), "" if lay64 is None else float(lay64[k]))


def main():
    args = _parse()
    os.makedirs(args.dir, exist_ok=True)
    if args.compare:
        return compare(args)
    if args.bits == 64:
        import jax
        import jax.numpy as jnp
        jax.config.update("jax_enable_x64", True)
        jnp.float32 = jnp.float64  # every explicit float32 in the library reads as float64
    (run_model if args.run in ("periods", "per-run") else run_step)(args)


if __name__ == "__main__":
    main()
