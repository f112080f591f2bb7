"""Which buffers are live at the peak of a compiled XLA program, from an ``--xla_dump_to`` dump.

    XLA_FLAGS="--xla_dump_to=DIR --xla_dump_hlo_as_text" python ...   # compile something
    python benchmarks/peak_buffers.py DIR [--module jit__step] [--top 25]

Reads XLA's ``*-live-range.txt`` ("Live ranges at N (peak)": every buffer alive at the peak
of the heap simulation, with its size) and the optimized HLO of the same module for each
buffer's shape and the JAX op (``op_name`` metadata) that produced it, then prints the buffers
grouped by (shape, producing op), largest total first, and the total.
"""

from __future__ import annotations

import argparse
import collections
import glob
import os
import re


def peak_buffers(dump_dir: str, module: str = "jit__step") -> list[tuple[str, int, str, str]]:
    """``(buffer, bytes, shape, op_name)`` for every buffer live at the module's peak."""
    live = sorted(glob.glob(os.path.join(dump_dir, f"*{module}*after_optimizations-live-range.txt")))
    hlo = sorted(glob.glob(os.path.join(dump_dir, f"*{module}*after_optimizations.txt")))
    if not live or not hlo:
        raise SystemExit(f"{dump_dir}: no *{module}*after_optimizations(-live-range).txt (dump with --xla_dump_hlo_as_text)")
    text = open(live[-1]).read()
    section = text[text.index("(peak):"):].split("\n", 1)[1]
    section = section.split("Stack trace breakdown", 1)[0]
    entries = re.findall(r"^\s+(\S+?)(\{[^}]*\})?: (\d+) bytes", section, re.MULTILINE)
    shapes, ops = {}, {}
    for line in open(hlo[-1]):
        m = re.match(r"\s*(?:ROOT )?%?([\w.\-]+) = (\S+?) ", line)
        if m:
            shapes[m.group(1)] = m.group(2)
            op = re.search(r'op_name="([^"]*)"', line)
            ops[m.group(1)] = op.group(1) if op else ""
    out = []
    for name, idx, size in entries:
        shape = shapes.get(name, "?")
        if idx and idx != "{}" and shape.startswith("("):  # an element of a tuple (a loop carry)
            shape = _tuple_element(shape, [int(i) for i in idx.strip("{}").split(",")])
        out.append((name + (idx or ""), int(size), shape, ops.get(name, "")))
    return out


def _tuple_element(shape: str, index: list[int]) -> str:
    for i in index:
        parts, depth, cur = [], 0, ""
        for ch in re.sub(r"/\*index=\d+\*/", "", shape.strip())[1:-1]:
            depth += ch in "([{" and 1 or 0
            depth -= ch in ")]}" and 1 or 0
            if ch == "," and depth == 0:
                parts.append(cur.strip())
                cur = ""
            else:
                cur += ch
        parts.append(cur.strip())
        shape = parts[i] if i < len(parts) else "?"
    return shape


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("dump_dir")
    ap.add_argument("--module", default="jit__step")
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args()
    buffers = peak_buffers(args.dump_dir, args.module)
    groups: dict[tuple[str, str], list[int]] = collections.defaultdict(list)
    for name, size, shape, op in buffers:
        short = re.sub(r"^jit\(\w+\)/", "", op)
        short = re.sub(r"(while/body/closed_call/)+", "…/", short)
        if "{" in name.split(".")[-1] and not short:
            short = "(loop carry / tuple element)"
        groups[re.sub(r"\{[\d,]*\}", "", shape)[:60], short[-90:]].append(size)
    total = sum(size for _, size, _, _ in buffers)
    print(f"{len(buffers)} buffers live at the peak, {total / 2**20:.1f} MiB")
    print(f"{'MiB':>8} {'n':>4}  shape / producing op")
    for (shape, op), sizes in sorted(groups.items(), key=lambda kv: -sum(kv[1]))[:args.top]:
        print(f"{sum(sizes) / 2**20:8.2f} {len(sizes):4d}  {shape}  {op}")


if __name__ == "__main__":
    main()
