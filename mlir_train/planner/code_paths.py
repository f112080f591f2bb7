"""Which code paths a program takes, read from the program itself, not from the flags that
asked for them: ``python -m mlir_train.check`` prints them for the layout and for its one-device
reference.

Two readings of one train step:

* :func:`read_jaxpr`, the traced step's jaxpr (``jax.jit(...).trace(...).jaxpr``), walked into
  every sub-program (scans, loops, conditionals, ``shard_map`` regions, custom VJPs). Each op
  that decides a path is kept with the functions of ours that issued it (the op's recorded
  traceback, frames in ``mlir_train/``): the collectives (``all_to_all``,
  ``ragged_all_to_all``, gathers, reductions, permutes), the kernel calls (``pallas_call`` by
  kernel name, interpreted or compiled, also inside a host callback that runs one) and XLA's ``ragged_dot``, and the matmuls of attention
  and of the experts. :class:`CodePaths` sums them up: the MoE dispatcher (whose function issued
  the exchange's all-to-alls), the expert matmuls, the attention, the kernels.
* :func:`compiled_collectives`, the compiled program's optimized HLO through the planner's
  reader (:func:`mlir_train.planner.hlo.analyze`): the collectives XLA's partitioner added, by
  kind and executions per step, and its custom calls (kernels, host callbacks of interpreted
  kernels).
"""

from __future__ import annotations

import dataclasses
import os
from collections import Counter
from collections.abc import Iterator
from typing import Any

# Collective primitives of a jaxpr (jax 0.10 / 0.11 names).
COLLECTIVES = frozenset({"all_to_all", "ragged_all_to_all", "all_gather", "psum", "psum_scatter", "reduce_scatter",
                         "ppermute", "pmax", "pmin", "all_gather_invariant", "psum_invariant"})
KERNELS = frozenset({"pallas_call", "ragged_dot_general", "ragged_dot"})
MATMULS = frozenset({"dot_general"})
# The exchange functions of the EP dispatchers (mlir_train.model.moe.parallel / .exchange), outermost
# name first in the traceback: which one issued an all-to-all names the dispatcher.
DISPATCHERS = {"_ep_padded": "padded", "ep_ragged": "ragged", "ep_grouped": "grouped"}
# The stand-ins that run a GPU collective's semantics where the platform lacks it.
STAND_INS = ("ragged_all_to_all_dense",)
# Where the attention and the experts live: an op issued from these files belongs to them, and is
# named by the first of the known implementations among its functions (JAX's transformations keep
# only part of the call stack of some ops, e.g. the padded experts' einsums under the dispatcher's
# rounds), else by its innermost function there.
ATTENTION_FILES = ("model/attention.py", "model/kernels/docs_flash.py", "model/kernels/tokamax_ops.py")
ATTENTION_IMPLS = ("docs_flash_attention", "flash_attention", "kernel_attention", "context_parallel_attention",
                   "blocked_attention", "masked_attention")
EXPERT_FILES = ("model/moe/experts.py", "model/moe/dispatch.py", "model/moe/exchange.py", "model/kernels/blocks.py",
                "model/kernels/mosaic_moe.py", "model/kernels/tokamax_ops.py")
EXPERT_IMPLS = ("grouped_experts", "ragged_experts", "blocked_experts", "swiglu_experts", "ep_ragged", "ep_grouped",
                "dispatch_padded")
_PACKAGE = os.sep + "mlir_train" + os.sep
PATH_ROWS = ("MoE dispatch", "expert matmuls", "attention", "kernels", "collectives")


@dataclasses.dataclass(frozen=True)
class Op:
    """One path-deciding op of a program: its primitive, a kernel's name (``pallas_call``), whether
    the kernel runs in its interpreter, and our functions that issued it (``file:function``,
    innermost first, paths from the package root)."""

    primitive: str
    kernel: str = ""
    interpreted: bool = False
    origin: tuple[str, ...] = ()

    def functions_in(self, files) -> list[str]:
        return [f.split(":", 1)[1] for f in self.origin if f.split(":", 1)[0] in files]


def _sub_jaxprs(params: dict) -> Iterator[Any]:
    for value in params.values():
        for item in value if isinstance(value, (list, tuple)) else (value,):
            inner = getattr(item, "jaxpr", None)  # a ClosedJaxpr
            if inner is not None and hasattr(inner, "eqns"):
                yield inner
            elif hasattr(item, "eqns"):
                yield item


def _origin(source_info) -> tuple[str, ...]:
    """Our frames of an op's recorded traceback, innermost first, as ``file:function``."""
    tb = getattr(source_info, "traceback", None)
    if tb is None:
        return ()
    if hasattr(tb, "raw_frames"):
        codes, _ = tb.raw_frames()
        frames = [(c.co_filename, getattr(c, "co_qualname", c.co_name)) for c in codes]
    else:
        frames = [(f.file_name, f.function_name) for f in tb.frames]
    out = []
    for path, function in frames:
        at = path.rfind(_PACKAGE)
        if at >= 0:
            out.append(f"{path[at + len(_PACKAGE):].replace(os.sep, '/')}:{function}")
    return tuple(out)


def _kernel_name(params: dict) -> tuple[str, bool]:
    info = params.get("name_and_src_info")
    name = getattr(info, "name", None) or params.get("name") or "?"
    interpret = params.get("interpret")
    return str(name), bool(interpret) and interpret is not False


def read_jaxpr(jaxpr) -> list[Op]:
    """The path-deciding ops of ``jaxpr`` (a Jaxpr or ClosedJaxpr) and of every program inside it."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    out: list[Op] = []
    stack = [jaxpr]
    while stack:
        for eqn in stack.pop().eqns:
            name = eqn.primitive.name
            if name in COLLECTIVES or name in KERNELS or name in MATMULS:
                kernel, interpreted = _kernel_name(eqn.params) if name == "pallas_call" else ("", False)
                out.append(Op(name, kernel, interpreted, _origin(eqn.source_info)))
            if name != "pallas_call":  # a kernel's body is the kernel's, not the program's
                stack.extend(_sub_jaxprs(eqn.params))
            if name == "pure_callback":  # a kernel a host callback runs (interpreted, one device at a time)
                kernel_jaxpr = getattr(eqn.params["callback"].callback_func, "kernel_jaxpr", None)
                stack.extend([kernel_jaxpr.jaxpr] if kernel_jaxpr is not None else [])
    return out


@dataclasses.dataclass(frozen=True)
class CodePaths:
    """What one program runs, from :func:`read_jaxpr`'s ops (and, optionally, the compiled
    program's collectives)."""

    ops: tuple[Op, ...]
    compiled: dict[str, int] = dataclasses.field(default_factory=dict)  # HLO collective kind -> executions per step
    custom_calls: tuple[str, ...] = ()                                  # HLO custom-call targets

    @classmethod
    def of(cls, jaxpr, compiled_text: str | None = None) -> "CodePaths":
        if compiled_text is None:
            return cls(tuple(read_jaxpr(jaxpr)))
        return cls(tuple(read_jaxpr(jaxpr)), *compiled_collectives(compiled_text))

    def dispatch(self) -> str:
        """The MoE exchange: which dispatcher's function issued the all-to-alls, with which
        collective (the real ``ragged_all_to_all`` or a stand-in); "none" without one."""
        found: Counter = Counter()
        for op in self.ops:
            if op.primitive not in ("all_to_all", "ragged_all_to_all"):
                continue
            functions = [f.split(":", 1)[1] for f in op.origin]
            label = next((DISPATCHERS[f] for f in functions if f in DISPATCHERS), None)
            if label is None and any(f.startswith("model/moe/") for f in op.origin):
                label = f"unrecognised ({functions[0]})"
            if label is None:
                continue
            stand_in = next((f for f in functions if f in STAND_INS), None)
            found[(label, op.primitive + (f" via {stand_in}" if stand_in else ""))] += 1
        if not found:
            return "none (no expert-parallel exchange)"
        return "; ".join(f"{label}: {prim} x{n}" for (label, prim), n in sorted(found.items()))

    def _implementations(self, files, known, kinds=MATMULS | KERNELS) -> str:
        found: Counter = Counter()
        for op in self.ops:
            if op.primitive in kinds:
                functions = op.functions_in(files)
                if functions:
                    name = next((f for f in functions if f in known), functions[0])
                    what = name if op.primitive != "pallas_call" else f"kernel {op.kernel}"
                    found[what + (" (ragged_dot)" if op.primitive.startswith("ragged_dot") else "")] += 1
        return ", ".join(f"{k} x{n}" for k, n in sorted(found.items())) or "none"

    def attention(self) -> str:
        """The attention implementations (our innermost function in the attention files) and their ops."""
        return self._implementations(ATTENTION_FILES, ATTENTION_IMPLS)

    def experts(self) -> str:
        """The expert matmuls' implementations (our innermost function in the expert files)."""
        return self._implementations(EXPERT_FILES, EXPERT_IMPLS)

    def kernels(self) -> str:
        """Every kernel call by name, interpreted or compiled; XLA's ragged_dot counted apart."""
        found = Counter(f"{op.kernel} ({'interpreted' if op.interpreted else 'compiled'})" for op in self.ops
                        if op.primitive == "pallas_call")
        ragged = sum(op.primitive.startswith("ragged_dot") for op in self.ops)
        parts = [f"{k} x{n}" for k, n in sorted(found.items())] + ([f"XLA ragged_dot x{ragged}"] if ragged else [])
        return ", ".join(parts) or "none (XLA ops only)"

    def collectives(self) -> str:
        """The collectives the program asks for (jaxpr) and, when read, what XLA compiled."""
        asked = Counter(op.primitive for op in self.ops if op.primitive in COLLECTIVES)
        text = ", ".join(f"{k} x{n}" for k, n in sorted(asked.items())) or "none"
        if self.compiled or self.custom_calls:
            hlo = ", ".join(f"{k} {n}" for k, n in sorted(self.compiled.items())) or "none"
            text += f" | compiled, per step: {hlo}"
            if self.custom_calls:
                text += f"; custom calls {', '.join(self.custom_calls)}"
        return text

    def rows(self) -> list[tuple[str, str]]:
        """(:data:`PATH_ROWS` name, what this program runs there)."""
        return list(zip(PATH_ROWS, (self.dispatch(), self.experts(), self.attention(), self.kernels(),
                                    self.collectives())))


def compiled_collectives(text: str) -> tuple[dict[str, int], tuple[str, ...]]:
    """(collective kind -> executions per step, custom-call targets) of an optimized HLO text."""
    from mlir_train.planner.hlo import analyze

    stats = analyze(text)
    calls = Counter(stats.uncounted_custom_calls)
    calls.update(k.name for k in stats.flops.kernels)
    calls.update(f"attention {getattr(a, 'kind', '?')}" for a in stats.flops.attention_calls)
    return {k: c.count for k, c in stats.collectives.items()}, tuple(f"{k} x{n}" for k, n in sorted(calls.items()))
