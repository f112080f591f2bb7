"""Which code paths a program takes, read from the program itself, not from the flags that
asked for them: ``python -m mlir_train.check`` prints them for the layout and for its one-device
reference.

Two readings of one train step:

* :func:`read_jaxpr`, the traced step's jaxpr (``jax.jit(...).trace(...).jaxpr``), walked into
  every sub-program (scans, loops, conditionals, ``shard_map`` regions, custom VJPs, and the
  kernel program a host callback runs). Each op that decides a path is kept with its name stack
  (the named scopes, ``jax.named_scope``, it was traced under, joined over the programs above it)
  and the functions of ours that issued it (the op's recorded traceback, frames in ``mlir_train/``): the
  collectives (``all_to_all``, ``ragged_all_to_all``, gathers, reductions, permutes), the kernel
  calls (``pallas_call`` and Mosaic-GPU's ``mpmd_map``, by kernel name, backend, interpreted or
  compiled, and whether a host callback runs it) and XLA's ``ragged_dot``, and the matmuls of
  attention and of the experts. :class:`CodePaths` sums them up: the MoE dispatcher (the
  dispatcher's named scope over the exchange's all-to-alls, ``model.moe.dispatch.DISPATCHERS``:
  tracebacks are cut short under pipeline stages and custom VJPs, name stacks are not), the
  expert matmuls, the attention, the kernels.
* :func:`compiled_collectives`, the compiled program's optimized HLO through the planner's
  reader (:func:`mlir_train.planner.hlo.analyze`): the collectives XLA's partitioner added, by
  kind and executions per step, and its custom calls (kernels, host callbacks of interpreted
  kernels).
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections import Counter
from collections.abc import Iterator
from typing import Any

from mlir_train.model.moe.dispatch import DISPATCH_SCOPE, DISPATCHERS, OVERFLOW_SCOPE, ROUNDS_SCOPE, STAND_IN_SCOPE

# Collective primitives of a jaxpr (jax 0.10 / 0.11 names).
COLLECTIVES = frozenset({"all_to_all", "ragged_all_to_all", "all_gather", "psum", "psum_scatter", "reduce_scatter",
                         "ppermute", "pmax", "pmin", "all_gather_invariant", "psum_invariant"})
# Kernel calls: Pallas's, and Mosaic-GPU's ``plgpu.kernel`` (an ``mpmd_map``, jax 0.10).
KERNEL_CALLS = frozenset({"pallas_call", "mpmd_map"})
KERNELS = KERNEL_CALLS | {"ragged_dot_general", "ragged_dot"}
MATMULS = frozenset({"dot_general"})
_SCOPE = re.compile(r"[^/()]+")  # a name stack's scope names, the transforms' brackets dropped
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
_MOE_FILES = ("model/moe/parallel.py", "model/moe/exchange.py", "model/moe/dispatch.py", "model/moe/block.py")
_PACKAGE = os.sep + "mlir_train" + os.sep
PATH_ROWS = ("MoE dispatch", "expert matmuls", "attention", "kernels", "collectives")


@dataclasses.dataclass(frozen=True)
class Op:
    """One path-deciding op of a program: its primitive, a kernel's name, backend ("Triton",
    "Mosaic-GPU", ...), whether the kernel runs in its interpreter and whether a host callback
    runs it, our functions that issued it (``file:function``, innermost first, paths from the
    package root) and the scopes it was traced under (outermost first)."""

    primitive: str
    kernel: str = ""
    interpreted: bool = False
    origin: tuple[str, ...] = ()
    backend: str = ""
    host_callback: bool = False
    scopes: tuple[str, ...] = ()

    def functions_in(self, files) -> list[str]:
        return [f.split(":", 1)[1] for f in self.origin if f.split(":", 1)[0] in files]

    def scope(self, prefix: str) -> str | None:
        """The innermost scope named ``prefix...``, less the prefix (None: not under one)."""
        return next((s[len(prefix):] for s in reversed(self.scopes) if s.startswith(prefix)), None)

    def how(self) -> str:
        """``backend, interpreted|compiled[, in a host callback]`` of a kernel call."""
        how = [self.backend] if self.backend else []
        how.append("interpreted" if self.interpreted else "compiled")
        return ", ".join(how + (["in a host callback"] if self.host_callback else []))


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


def _kernel(primitive: str, params: dict) -> dict:
    """A kernel call's name, backend and whether it runs in its interpreter."""
    info = params.get("name_and_src_info")
    name = getattr(info, "name", None) or params.get("name") or "?"
    interpret = params.get("interpret")
    compiler = params.get("compiler_params")
    module = " ".join(compiler) if isinstance(compiler, dict) else type(compiler).__module__
    backend = next((b for key, b in (("mosaic_gpu", "Mosaic-GPU"), ("triton", "Triton"), ("mosaic", "Mosaic-TPU"))
                    if key in module), "")
    return dict(kernel=str(name), interpreted=bool(interpret) and interpret is not False,
                backend="Mosaic-GPU" if primitive == "mpmd_map" else backend)


def _scopes(name_stack) -> tuple[str, ...]:
    return tuple(_SCOPE.findall(str(name_stack)))


def read_jaxpr(jaxpr) -> list[Op]:
    """The path-deciding ops of ``jaxpr`` (a Jaxpr or ClosedJaxpr) and of every program inside it,
    the kernel programs of host callbacks (``kernel_jaxpr``, model/kernels/mosaic_moe.py) among them."""
    out: list[Op] = []
    stack = [(getattr(jaxpr, "jaxpr", jaxpr), (), False)]  # (program, scopes above it, inside a host callback)
    while stack:
        program, above, in_callback = stack.pop()
        for eqn in program.eqns:
            name = eqn.primitive.name
            scopes = above + _scopes(eqn.source_info.name_stack)
            if name in COLLECTIVES or name in KERNELS or name in MATMULS:
                kernel = _kernel(name, eqn.params) if name in KERNEL_CALLS else {}
                out.append(Op(name, origin=_origin(eqn.source_info), host_callback=in_callback and bool(kernel),
                              scopes=scopes, **kernel))
            if name not in KERNEL_CALLS:  # a kernel's body is the kernel's, not the program's
                stack.extend((inner, scopes, in_callback) for inner in _sub_jaxprs(eqn.params))
            if name == "pure_callback":  # a kernel a host callback runs (interpreted, one device at a time)
                kernel_jaxpr = getattr(eqn.params["callback"].callback_func, "kernel_jaxpr", None)
                stack.extend([(kernel_jaxpr.jaxpr, scopes, True)] if kernel_jaxpr is not None else [])
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
        """The MoE exchange: the dispatcher whose named scope its all-to-alls were traced under
        (``model.moe.dispatch.DISPATCHERS``), its collectives, the exchange (the real
        ``ragged_all_to_all``, its stand-in, or the padded dispatcher's dense ``all_to_all``) and
        its rounds (the first, and up to how many on overflow); "none" without one."""
        found: dict[str, list[Op]] = {}
        for op in self.ops:
            if op.primitive not in ("all_to_all", "ragged_all_to_all"):
                continue
            name = op.scope(DISPATCH_SCOPE)
            if name is None and not any(f.startswith("model/moe/") for f in op.origin):
                continue
            label = DISPATCHERS.get(name) or f"unscoped ({(op.functions_in(_MOE_FILES) or ['?'])[0]})"
            found.setdefault(label, []).append(op)
        if not found:
            return "none (no expert-parallel exchange)"
        return "; ".join(_exchange(label, ops) for label, ops in sorted(found.items()))

    def _implementations(self, files, known, kinds=MATMULS | KERNELS) -> str:
        found: Counter = Counter()
        for op in self.ops:
            if op.primitive in kinds:
                functions = op.functions_in(files)
                if functions:
                    name = next((f for f in functions if f in known), functions[0])
                    what = f"kernel {op.kernel} ({op.how()})" if op.primitive in KERNEL_CALLS else name
                    found[what + (" (ragged_dot)" if op.primitive.startswith("ragged_dot") else "")] += 1
        return ", ".join(f"{k} x{n}" for k, n in sorted(found.items())) or "none"

    def attention(self) -> str:
        """The attention implementations (our innermost function in the attention files) and their ops."""
        return self._implementations(ATTENTION_FILES, ATTENTION_IMPLS)

    def experts(self) -> str:
        """The expert matmuls' implementations (our innermost function in the expert files)."""
        return self._implementations(EXPERT_FILES, EXPERT_IMPLS)

    def kernels(self) -> str:
        """Every kernel call by backend and name, interpreted or compiled, and whether a host
        callback runs it; XLA's ragged_dot counted apart."""
        found = Counter(f"{op.backend} {op.kernel} ({op.how().removeprefix(op.backend + ', ')})".lstrip()
                        for op in self.ops if op.primitive in KERNEL_CALLS)
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


def _exchange(label: str, ops: list[Op]) -> str:
    """One dispatcher's exchange, from its all-to-alls (see :meth:`CodePaths.dispatch`):
    ``label: collectives (the exchange; its rounds; how many in the overflow rounds)``."""
    stand_in = sum(STAND_IN_SCOPE in op.scopes for op in ops)
    parts = ["ragged all-to-all" if any(op.primitive == "ragged_all_to_all" for op in ops) else
             f"{stand_in} in the ragged all-to-all's stand-in {STAND_IN_SCOPE}" if stand_in else "dense all-to-all"]
    rounds = max(int(op.scope(ROUNDS_SCOPE) or 1) for op in ops)
    parts.append(f"up to {rounds} rounds, the first always, the rest on overflow" if rounds > 1 else "1 round")
    if overflow := sum(OVERFLOW_SCOPE in op.scopes for op in ops):
        parts.append(f"{overflow} in the overflow rounds")
    counts = Counter(op.primitive for op in ops)
    return f"{label}: " + ", ".join(f"{k} x{n}" for k, n in sorted(counts.items())) + f" ({'; '.join(parts)})"


def compiled_collectives(text: str) -> tuple[dict[str, int], tuple[str, ...]]:
    """(collective kind -> executions per step, custom-call targets) of an optimized HLO text."""
    from mlir_train.planner.hlo import analyze

    stats = analyze(text)
    calls = Counter(stats.uncounted_custom_calls)
    calls.update(k.name for k in stats.flops.kernels)
    calls.update(f"attention {getattr(a, 'kind', '?')}" for a in stats.flops.attention_calls)
    return {k: c.count for k, c in stats.collectives.items()}, tuple(f"{k} x{n}" for k, n in sorted(calls.items()))
