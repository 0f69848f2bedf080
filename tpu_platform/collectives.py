"""What a compiled program communicates: its collectives, read from the optimized HLO text.

Tensor parallelism is correct only if it is also cheap: a Megatron-style layer costs exactly two
all-reduces of the [T, H] activations (after ``o`` and after ``down``), plus one for the
vocabulary-parallel embedding and one all-gather of the sampled rows' logits per step. A sharding
mistake shows up here (an all-gather of a weight, an extra all-reduce) long before it shows up in a
profile, so tests and ``benchmarks/tensor_parallel.py`` read these numbers from the HLO.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import numpy as np

COLLECTIVE_OPS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
# "%name = f32[4,64]{1,0} all-reduce(", its async "-start" form, and combined collectives whose
# result is a tuple: "%name = (f32[8,64]{1,0}, f32[8,64]{1,0}) all-reduce(".
_LINE = re.compile(r"=\s*(?P<result>\([^)]*\)|\S+)\s+(?P<op>" + "|".join(COLLECTIVE_OPS) + r")(?:-start)?\(")
_ARRAY = re.compile(r"(?P<dtype>[a-z]+[0-9a-z]*)\[(?P<dims>[0-9,]*)\]")


@dataclass(frozen=True)
class Collective:
    """One collective instruction; ``operands`` are the (HLO dtype, per-device shape) of each array
    it carries (XLA may combine several arrays into one instruction)."""

    op: str  # one of COLLECTIVE_OPS
    operands: tuple[tuple[str, tuple[int, ...]], ...]

    @property
    def shape(self) -> tuple[int, ...] | tuple[tuple[int, ...], ...]:
        """The result's shape, or the shapes of a combined instruction's arrays."""
        shapes = tuple(shape for _, shape in self.operands)
        return shapes[0] if len(shapes) == 1 else shapes

    @property
    def nbytes(self) -> int:
        """Bytes of the result on one device (the payload an all-reduce sums)."""
        return sum(math.prod(shape) * _itemsize(dtype) for dtype, shape in self.operands)


def _itemsize(hlo_dtype: str) -> int:
    names = {
        "pred": 1,
        "bf16": 2,
        "f16": 2,
        "f32": 4,
        "f64": 8,
        "s8": 1,
        "u8": 1,
        "s32": 4,
        "u32": 4,
        "s64": 8,
        "u64": 8,
        "f8e4m3fn": 1,
        "f8e5m2": 1,
    }
    if hlo_dtype in names:
        return names[hlo_dtype]
    return np.dtype(hlo_dtype).itemsize  # anything else numpy knows by the same name


def collectives(hlo_text: str) -> list[Collective]:
    """Every collective instruction of an HLO module's text (``compiled.as_text()``), in order.

    A loop body's collectives appear once, however often the loop runs (scanned layers): compile
    with unrolled layers to count per layer.
    """
    out = []
    for line in hlo_text.splitlines():
        m = _LINE.search(line)
        if m:
            arrays = tuple(
                (a["dtype"], tuple(int(d) for d in a["dims"].split(",") if d))
                for a in _ARRAY.finditer(m["result"])
            )
            out.append(Collective(m["op"], arrays))
    return out


def ring_bytes_sent(c: Collective, num_devices: int) -> float:
    """Bytes one device sends for ``c`` with a ring algorithm (the bandwidth-optimal bound):
    all-reduce 2(N-1)/N of the payload, all-gather (N-1)/N of the gathered result."""
    n = num_devices
    if n <= 1:
        return 0.0
    if c.op == "all-reduce":
        return 2 * (n - 1) / n * c.nbytes
    if c.op == "all-gather":
        return (n - 1) / n * c.nbytes
    return float(c.nbytes)  # reduce-scatter, all-to-all, permute: at most one payload
