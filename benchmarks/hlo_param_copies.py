"""Name the weight copies a compiled step makes: in XLA's optimized HLO, every instruction of the entry
computation that reads a program parameter and writes a buffer at least ``--min-frac`` of that
parameter's size (a copy, a bitcast-convert, a transpose, a relayout fusion...), largest first.

A weight should be read in place by the matmul or kernel that needs it; on a TPU, XLA can instead
write it somewhere else first each step (a layout change, a bitcast it does not make free, a scan
slice moved to another memory space), which costs a write and a read of the whole weight. Three
such copies were found by hand on a v5e (the gate_up slice of a layer scan, MXFP4 expert bytes
bitcast to int8, gpt-oss's embedding relaid row-major); this reads a dump for all of them at once.
Parameters are followed in the entry computation only. A layer scan's body reaches its weights
through the loop's tuple, so in every while body (any depth) it lists instead the *data-movement
writes* of at least ``--min-mib``: copies, transposes, bitcast-converts, slices, and loop fusions
made only of those (XLA's ``dynamic-slice_bitcast_fusion`` that copied each layer's gate_up slice
every step, found by hand on a v5e). Fused computations are not walked: what a fusion does inside
writes no buffer of its own.

    XLA_FLAGS="--xla_dump_to=/tmp/x --xla_dump_hlo_module_re=.*_step.*" python benchmarks/tpu_e2e.py ...
    python benchmarks/hlo_param_copies.py /tmp/x           # every *after_optimizations.txt there
    python benchmarks/hlo_param_copies.py step.hlo.gz      # one module (plain or gzipped text)
"""

from __future__ import annotations

import argparse
import glob
import gzip
import math
import os
import re

_BYTES = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2}
_BYTES.update({"f32": 4, "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8})
# `%name = type[dims]{layout} op(operands), ...` (one instruction a line)
# ops that only re-describe a buffer, and tuple plumbing
_VIEWS = ("bitcast", "get-tuple-element", "tuple", "reshape")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+) = (\w+)\[([\d,]*)\]\S* ([\w\-]+)\((.*?)\)(?:,|$)")


def shape_bytes(dtype: str, dims: str) -> int:
    n = math.prod(int(d) for d in dims.split(",") if d) if dims else 1
    return n * _BYTES.get(dtype, 4)


def entry_lines(text: str) -> list[str]:
    """The instruction lines of the module's ENTRY computation."""
    out, inside = [], False
    for line in text.splitlines():
        if line.startswith("ENTRY"):
            inside = True
            continue
        if inside:
            if line.startswith("}"):
                break
            out.append(line)
    return out


def param_copies(text: str, min_frac: float = 0.5, min_bytes: int = 1 << 20) -> list[dict]:
    """Instructions of the entry computation that read a parameter of >= ``min_bytes`` and write at
    least ``min_frac`` of its bytes, as dicts (op, name, param, bytes), largest first."""
    params: dict[str, int] = {}
    hits = []
    for line in entry_lines(text):
        m = _INSTR.match(line)
        if not m:
            continue
        name, dtype, dims, op, operands = m.groups()
        size = shape_bytes(dtype, dims)
        if op == "parameter":
            params[name] = size
            continue
        if op in _VIEWS or "output_to_operand_aliasing" in line:  # no new buffer, or written in place
            continue
        for operand in re.findall(r"%([\w.\-]+)", operands):
            psize = params.get(operand)
            if psize is not None and psize >= min_bytes and size >= min_frac * psize:
                hits.append(dict(op=op, name=name, param=operand, bytes=size))
                break
    return sorted(hits, key=lambda h: -h["bytes"])


# Ops that only move or re-type data: a loop fusion made of these (and parameters / constants) is a
# copy of its input, whatever XLA named it.
_MOVES = _VIEWS + ("copy", "transpose", "bitcast-convert", "slice", "dynamic-slice", "convert")
_HEADER = re.compile(r"^(?:ENTRY\s+)?%([\w.\-]+) .*\{\s*$")


def computations(text: str) -> dict[str, list[str]]:
    """Computation name -> its instruction lines (HLO text: a header ending in ``{``, lines, ``}``)."""
    comps: dict[str, list[str]] = {}
    cur: list[str] | None = None
    for line in text.splitlines():
        m = _HEADER.match(line)
        if m and not line.startswith(" "):
            cur = comps.setdefault(m.group(1), [])
        elif line.startswith("}"):
            cur = None
        elif cur is not None:
            cur.append(line)
    return comps


def loop_bodies(comps: dict[str, list[str]]) -> list[str]:
    """Names of every while body reachable from the computations that run as programs (not fused)."""
    bodies, todo = [], [name for name, lines in comps.items() if any("while(" in ln for ln in lines)]
    seen = set()
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        for line in comps.get(name, []):
            m = re.search(r"\bbody=%([\w.\-]+)", line)
            if " while(" in line and m:
                bodies.append(m.group(1))
                todo.append(m.group(1))
    return sorted(set(bodies))


def _only_moves(lines: list[str]) -> bool:
    ops = [m.group(4) for m in map(_INSTR.match, lines) if m]
    return bool(ops) and all(op in _MOVES or op in ("parameter", "constant") for op in ops)


def loop_moves(text: str, min_bytes: int = 1 << 20) -> list[dict]:
    """Data-movement writes of >= ``min_bytes`` in while bodies (module docstring), as dicts
    (op, name, body, bytes), largest first: what every iteration writes, e.g. a layer's weight."""
    comps = computations(text)
    hits = []
    for body in loop_bodies(comps):
        for line in comps[body]:
            m = _INSTR.match(line)
            if not m:
                continue
            name, dtype, dims, op, _ = m.groups()
            size = shape_bytes(dtype, dims)
            if size < min_bytes or op in _VIEWS or "output_to_operand_aliasing" in line:
                continue
            called = re.search(r"\bcalls=%([\w.\-]+)", line)
            moves = op in _MOVES or (
                op == "fusion"
                and "kind=kLoop" in line
                and called
                and _only_moves(comps.get(called.group(1), []))
            )
            if moves:
                hits.append(dict(op=op, name=name, body=body, bytes=size))
    return sorted(hits, key=lambda h: -h["bytes"])


def read_text(path: str) -> str:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return f.read()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("paths", nargs="+", help="HLO text files (.txt / .gz) or dump directories")
    p.add_argument("--min-frac", type=float, default=0.5)
    p.add_argument("--min-mib", type=float, default=1.0)
    args = p.parse_args()
    files = []
    for path in args.paths:
        files += (
            sorted(glob.glob(os.path.join(path, "*after_optimizations.txt")))
            if os.path.isdir(path)
            else [path]
        )
    for f in files:
        text = read_text(f)
        hits = param_copies(text, args.min_frac, int(args.min_mib * 2**20))
        total = sum(h["bytes"] for h in hits)
        print(f"{os.path.basename(f)}: {len(hits)} weight copies, {total / 2**30:.2f} GiB written a step")
        for h in hits[:20]:
            print(f"  {h['bytes'] / 2**20:10.1f} MiB  {h['op']:<18} {h['name']}  <- {h['param']}")
        moves = loop_moves(text, int(args.min_mib * 2**20))
        if moves:
            per = sum(h["bytes"] for h in moves)
            print(f"  in loop bodies: {len(moves)} data-movement writes, {per / 2**20:.1f} MiB an iteration")
            for h in moves[:20]:
                print(f"  {h['bytes'] / 2**20:10.1f} MiB  {h['op']:<18} {h['name']}  (loop body {h['body']})")


if __name__ == "__main__":
    main()
