"""What ptxas made of our GPU kernels, read without a GPU: registers, spills, and whether each
pipelined wgmma loop waits on its wgmmas before reusing their shared memory.

:func:`audit_lowered` compiles a lowered jax function (for compile-only XLA:GPU devices, see
:mod:`mlir_train.planner.targets`) with ``MOSAIC_GPU_DUMP_PTX=1 MOSAIC_GPU_DUMP_PTXAS=1``. Mosaic-GPU's
C++ side prints each kernel's PTX and ptxas report to the process's own stdout/stderr, not
Python's streams, so both file descriptors are redirected to a temporary file for the compile.
The variables are read when the kernel is compiled, so setting them around the call works.

Per kernel (a PTX ``.entry``) the report gives ptxas' registers and spill bytes, the register
limit (255 per thread on sm_90, or less where ``.maxnreg`` / ``.maxntid`` (``.reqntid``) x ``.minnctapersm``
bound it), and the pipelined loops: a loop is a backward branch to a label (the lines between
them); it is pipelined when it issues ``wgmma.mma_async``. The loop is safe when it also holds a
``wgmma.wait_group``: otherwise the next refill of a shared-memory slot (TMA, in the same loop)
can overwrite what an in-flight wgmma still reads (JAX's Mosaic-GPU pipelining guide:
``delay_release=1`` on the block specs plus ``plgpu.wgmma_wait(1)`` after the wgmma). The
barrier spin loops inside ``mbarrier.try_wait`` inline asm are loops too, without wgmma, and are
not counted. The Mosaic-GPU interpreter (CPU tests) runs wgmma synchronously, so this is the
check that can see that race before a GPU does.

Pallas-Triton kernels (``__gpu$xla.gpu.triton``, e.g. the ``mha`` attention) are compiled by
XLA, not Mosaic: :func:`audit_xla_dump` reads their PTX from an ``--xla_dump_to`` directory
and runs ``ptxas -v`` on it for the registers and spills XLA does not dump.
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import os
import re
import sys
import tempfile

MAX_REGISTERS_SM90 = 255
REGISTERS_PER_SM = 65536

_ENTRY = re.compile(r"^\.(?:visible\s+)?\.entry\s+([\w$]+)\s*\(", re.M)
_LABEL = re.compile(r"^\s*([\w$]+):")
_BRANCH = re.compile(r"\bbra(?:\.uni)?\s+([\w$]+)\s*;")
_PTXAS_ENTRY = re.compile(r"Compiling entry function '([\w$]+)'")
_PTXAS_FUNC = re.compile(r"Function properties for ([\w$]+)")
_SPILLS = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")
_REGS = re.compile(r"Used (\d+) registers")


@dataclasses.dataclass(frozen=True)
class PtxLoop:
    first_line: int  # the label's line (0-based, within the entry)
    last_line: int   # the backward branch's line
    issues_wgmma: bool
    waits_wgmma: bool


@dataclasses.dataclass(frozen=True)
class KernelReport:
    name: str
    registers: int | None           # ptxas "Used N registers" (None: no ptxas report)
    register_limit: int
    spill_store_bytes: int | None
    spill_load_bytes: int | None
    loops: tuple[PtxLoop, ...]
    wgmma: int = 0     # wgmma.mma_async instructions (Hopper's asynchronous tensor-core matmul)
    mma_sync: int = 0  # mma.sync instructions (the pre-Hopper synchronous one)
    float_atomic_adds: int = 0  # red/atom ... add ... f32 instructions (a kernel accumulating into global memory)

    @property
    def pipelined_loops(self) -> int:
        return sum(loop.issues_wgmma for loop in self.loops)

    @property
    def pipelined_loops_with_wait(self) -> int:
        return sum(loop.issues_wgmma and loop.waits_wgmma for loop in self.loops)

    @property
    def spill_bytes(self) -> int | None:
        return None if self.spill_store_bytes is None else self.spill_store_bytes + self.spill_load_bytes

    def row(self) -> str:
        return (f"{self.name}: {self.registers}/{self.register_limit} registers, {self.spill_bytes} spill bytes, "
                f"{self.pipelined_loops_with_wait}/{self.pipelined_loops} pipelined loops wait on wgmma")


def _entries(ptx: str) -> dict[str, str]:
    """Entry name -> its PTX text (from its ``.entry`` line to the next one)."""
    starts = [(m.start(), m.group(1)) for m in _ENTRY.finditer(ptx)]
    ends = [s for s, _ in starts[1:]] + [len(ptx)]
    return {name: ptx[s:e] for (s, name), e in zip(starts, ends)}


def _loops(lines: list[str]) -> tuple[PtxLoop, ...]:
    labels: dict[str, int] = {}
    loops = []
    for i, line in enumerate(lines):
        code = line.split("//", 1)[0]
        m = _LABEL.match(code)
        if m:
            labels[m.group(1)] = i
        for target in _BRANCH.findall(code):
            if target in labels:  # already seen above: a backward branch
                body = lines[labels[target]:i + 1]
                loops.append(PtxLoop(labels[target], i, any("wgmma.mma_async" in b for b in body),
                                     any("wgmma.wait_group" in b for b in body)))
    return tuple(loops)


def _register_limit(entry: str) -> int:
    m = re.search(r"\.maxnreg\s+(\d+)", entry)
    if m:
        return min(int(m.group(1)), MAX_REGISTERS_SM90)
    threads = re.search(r"\.(?:maxntid|reqntid)\s+(\d+)(?:\s*,\s*(\d+))?(?:\s*,\s*(\d+))?", entry)
    if not threads:
        return MAX_REGISTERS_SM90
    n = 1
    for g in threads.groups():
        n *= int(g or 1)
    ctas = re.search(r"\.minnctapersm\s+(\d+)", entry)
    return min(MAX_REGISTERS_SM90, REGISTERS_PER_SM // (n * (int(ctas.group(1)) if ctas else 1)))


def parse_ptxas(text: str) -> dict[str, tuple[int, int, int]]:
    """``ptxas -v`` output -> entry name -> (registers, spill store bytes, spill load bytes)."""
    out, name, spills = {}, None, (0, 0)
    for line in text.splitlines():
        if m := (_PTXAS_ENTRY.search(line) or _PTXAS_FUNC.search(line)):
            name = m.group(1)
        elif (m := _SPILLS.search(line)) and name:
            spills = (int(m.group(1)), int(m.group(2)))
        elif (m := _REGS.search(line)) and name:
            out[name] = (int(m.group(1)), *spills)
            spills = (0, 0)
    return out


def parse_ptx(ptx: str, ptxas: str = "") -> list[KernelReport]:
    """One report per ``.entry`` in ``ptx`` (several modules may be concatenated), with
    registers and spills from ``ptxas`` where it reports that entry."""
    stats = parse_ptxas(ptxas)
    reports = []
    for name, entry in _entries(ptx).items():
        regs, stores, loads = stats.get(name, (None, None, None))
        reports.append(KernelReport(name, regs, _register_limit(entry), stores, loads, _loops(entry.splitlines()),
                                    entry.count("wgmma.mma_async"), len(re.findall(r"\bmma\.sync", entry)),
                                    len(re.findall(r"\b(?:red|atom)\.[\w.]*add[\w.]*\.f32\b", entry))))
    return reports


@contextlib.contextmanager
def captured_output():
    """Everything written to file descriptors 1 and 2 inside the block (C++ included), as a
    one-element list filled on exit."""
    out: list[str] = []
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as sink:
        os.dup2(sink.fileno(), 1)
        os.dup2(sink.fileno(), 2)
        try:
            yield out
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])
            sink.seek(0)
            out.append(sink.read().decode(errors="replace"))


@contextlib.contextmanager
def _env(**values):
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def audit_lowered(lowered) -> list[KernelReport]:
    """Compile ``lowered`` (a ``jax.stages.Lowered`` for XLA:GPU devices) and report each
    Mosaic-GPU kernel in it. Raises if the compile printed no PTX (no Mosaic-GPU kernel, or a
    kernel compiled earlier in this process and reused from a cache)."""
    from mlir_train.planner.moe_audit import compile_without_cache

    with _env(MOSAIC_GPU_DUMP_PTX="1", MOSAIC_GPU_DUMP_PTXAS="1"), captured_output() as text:
        compile_without_cache(lowered)
    reports = parse_ptx(text[0], text[0])
    if not reports:
        raise RuntimeError("the compile printed no PTX entry: no Mosaic-GPU kernel was compiled; output was:\n"
                           + text[0][-2000:])
    return reports


def audit_kernel(fn, *args, device) -> list[KernelReport]:
    """:func:`audit_lowered` for ``jax.jit(fn)`` on ``args`` (``ShapeDtypeStruct``s) placed on
    the one compile-only ``device``."""
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    sharding = NamedSharding(Mesh(np.array([device]), ("d",)), PartitionSpec())
    args = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding) for a in args]
    return audit_lowered(jax.jit(fn).lower(*args))


def ptxas_path() -> str | None:
    """``ptxas`` from an nvidia nvcc wheel (CUDA 12 or 13), else from PATH
    (:func:`mlir_train.planner.targets.ptxas_path`)."""
    from mlir_train.planner.targets import ptxas_path as find

    return find()


def ptx_dumped(dump_dir: str) -> bool:
    """Whether XLA wrote its kernels' PTX into the ``--xla_dump_to`` directory: jaxlib 0.10.2 (CUDA
    12 plugin) does; jaxlib 0.11.2 / 0.12.1 with the CUDA 13 plugin wrote none here (15 files, HLO,
    buffer assignment and thunks only), so :func:`audit_xla_dump` has nothing to read there."""
    return bool(glob.glob(os.path.join(dump_dir, "*.ptx")))


def audit_xla_dump(dump_dir: str, arch: str = "sm_90a") -> list[KernelReport]:
    """Reports for the kernels whose PTX XLA wrote into an ``--xla_dump_to`` directory (its
    fusions and Pallas-Triton kernels, one ``.ptx`` per module), with registers and spills from
    running ``ptxas -v`` on each (XLA does not dump its own ptxas report)."""
    import subprocess

    ptxas = ptxas_path()
    reports = []
    for path in sorted(glob.glob(os.path.join(dump_dir, "*.ptx"))):
        with open(path) as f:
            ptx = f.read()
        if not _ENTRY.search(ptx):
            continue
        report = ""
        if ptxas:
            report = subprocess.run([ptxas, f"-arch={arch}", "-v", path, "-o", os.devnull],
                                    capture_output=True, text=True, check=True).stderr
        reports.extend(parse_ptx(ptx, report))
    return reports


def moe_kernel_cases(hidden: int = 2048, widths=(768, 384), experts: int = 128, rows: int = 64 * 640):
    """``(id, kernel, operand ShapeDtypeStructs)`` for each MoE block-kernel call of a
    Qwen3-30B-A3B-like layer (bf16; ``rows``: 4096 tokens x top-8 in blocks of 64 plus one spare
    block per expert): :func:`~mlir_train.model.kernels.mosaic_moe.block_matmul` (forward and input
    gradients, ``k x n`` = hidden x width and width x hidden) and ``block_matmul_t`` (the weight
    gradients, ``[k, rows] x [rows, n]``) at each expert width (768, and 384 per rank of TP2)."""
    import jax
    import jax.numpy as jnp

    from mlir_train.model.kernels import mosaic_moe as moe_gpu

    sds, bf16, i32 = jax.ShapeDtypeStruct, jnp.bfloat16, jnp.int32
    blocks = rows // moe_gpu.BLOCK_ROWS
    cases = []
    for width in widths:
        for k, n in ((hidden, width), (width, hidden)):
            cases.append((f"block_matmul-{k}x{n}", moe_gpu.block_matmul,
                          (sds((rows, k), bf16), sds((experts, k, n), bf16), sds((blocks,), i32), sds((), i32))))
            cases.append((f"block_matmul_t-{k}x{n}", moe_gpu.block_matmul_t,
                          (sds((k, rows), bf16), sds((rows, n), bf16), sds((experts,), i32), sds((experts,), i32))))
    return cases
