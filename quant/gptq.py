"""GPTQ for the FP4 formats: round each weight row to MXFP4 / NVFP4 in order and push its rounding
error onto the rows not yet rounded, weighted by the layer's input statistics.

Plain round-to-nearest (``quant/search.py``) treats every weight error alike. What the model
feels is the output error ``X (W - Q)`` over real inputs X; with ``H = X^T X`` (K x K) GPTQ
(Frantar et al., 2022) minimises it greedily: after rounding row k of ``W [K, N]`` it corrects the
later rows by ``-(w_k - q_k) / U[k, k] * U[k, k+1:]``, U the upper Cholesky factor of ``H^-1``.
Lazy blocks keep the correction of far rows to one matmul per block of rows.

The result is an ordinary record of the same format (codes, block scales, global scale): the
dequant and every kernel are unchanged; only the choice of codes and scales used data. Each
block's scale is chosen when GPTQ reaches the block's first row, from the rows as corrected so
far, by the same candidate search as ``quant/search.py`` with errors weighted by ``diag(H)``.

Runs in NumPy on the host (float64 Cholesky; the row loop is sequential by nature).
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np
import scipy.linalg

from tpuserve.quant.codecs import E2M1_MAX, E2M1_VALUES, E4M3_MAX
from tpuserve.quant.fp4 import _E4M3_SMALLEST_NORMAL, MXFP4_BLOCK, NVFP4_BLOCK
from tpuserve.quant.search import NVFP4_SHRINK

_E2M1_MAG = E2M1_VALUES[:8].astype(np.float64)  # 0, .5, 1, 1.5, 2, 3, 4, 6
_E2M1_MID = (_E2M1_MAG[1:] + _E2M1_MAG[:-1]) / 2  # decision points between magnitudes
# e2m1_round searches a row (GPTQ's loop: the call overhead of 7 comparisons would cost more) and
# compares a block of rows (a scale candidate in _BlockScaler.choose: searchsorted's ~30 ns an
# element was most of an NVFP4 GPTQ).
_SEARCH_MAX = 4096


def e2m1_round(x: np.ndarray, step: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Nearest e2m1 code of ``x / step`` (saturating at 6) -> (codes u8, dequantized values)."""
    mag = np.abs(x) / step
    if mag.size <= _SEARCH_MAX:
        idx = np.searchsorted(_E2M1_MID, mag).astype(np.uint8)
    else:  # the same index counted down from the top (NaN included): 7 comparisons, ~10x faster
        idx = np.full(mag.shape, len(_E2M1_MID), np.uint8)
        for mid in _E2M1_MID:
            idx -= mag <= mid
    neg = np.signbit(x)  # a negative value that rounds to zero keeps its sign, as e2m1_encode does
    codes = idx | (neg.astype(np.uint8) << 3)
    return codes, np.where(neg, -_E2M1_MAG[idx], _E2M1_MAG[idx]) * step


def damped_cholesky_inverse(h: np.ndarray, damp: float) -> tuple[np.ndarray, np.ndarray]:
    """Upper Cholesky factor of ``(H + damp * mean(diag H) I)^-1``, and the mask of dead inputs.

    An input that never fired (zero diagonal) gets a unit diagonal; its weights cannot matter. A
    Hessian from fewer tokens than inputs is singular up to the damping; should rounding still
    leave it indefinite, the damping grows tenfold (up to three times) rather than fail a load.
    """
    h = np.array(h, np.float64)
    h = (h + h.T) / 2
    dead = np.diag(h) <= 0
    h[dead, dead] = 1.0
    mean_diag = np.mean(np.diag(h))
    for attempt in range(4):
        try:
            damped = h + (damp * 10**attempt) * mean_diag * np.eye(len(h))
            return _upper_cholesky_of_inverse(damped), dead
        except np.linalg.LinAlgError:
            continue
    raise np.linalg.LinAlgError(
        f"GPTQ: the input Hessian stays indefinite even with damping {damp * 1000:g} x its mean diagonal"
    )


def _upper_cholesky_of_inverse(h: np.ndarray) -> np.ndarray:
    """Upper ``U`` with ``H^-1 = U^T U``, from one Cholesky and one triangular inverse.

    With J the reversal permutation, factor ``J H J = M M^T`` (M lower); then
    ``H^-1 = (J M^-1 J)^T (J M^-1 J)`` and ``J M^-1 J`` is upper with a positive diagonal, so it is
    the factor (Cholesky factors are unique). Inverting H and factoring the inverse costs ~3x the
    flops, most of a 1.5k-input layer's GPTQ time. Raises LinAlgError when H is not positive definite.
    """
    m = np.linalg.cholesky(h[::-1, ::-1])
    m_inv = scipy.linalg.solve_triangular(m, np.eye(len(h)), lower=True, check_finite=False)
    return np.ascontiguousarray(m_inv[::-1, ::-1])


class _BlockScaler:
    """Per-block step sizes ``[N]`` for one format, chosen from the block's current rows."""

    def __init__(self, fmt: str, w: np.ndarray, amax: float | None = None):
        self.fmt = fmt
        if fmt == "mxfp4":
            self.block, self.global_scale = MXFP4_BLOCK, None
        elif fmt == "nvfp4":
            self.block = NVFP4_BLOCK
            amax = float(np.max(np.abs(w))) if amax is None else float(amax)
            # ModelOpt convention (global multiplies): the largest block scale lands on e4m3's max.
            self.global_scale = np.float32(amax / (E4M3_MAX * E2M1_MAX)) if amax > 0 else np.float32(1)
        else:
            raise ValueError(f"GPTQ formats are 'mxfp4' and 'nvfp4', got {fmt!r}")

    def candidates(self, amax: np.ndarray):
        """Yield (stored scale [N], step [N] f64) candidates for blocks with amax [N]."""
        if self.fmt == "mxfp4":
            a32 = np.maximum(amax.astype(np.float32), np.float32(np.finfo(np.float32).tiny))
            floor_e = ((a32.view(np.int32) >> 23) & 255) - 127
            for bump in (0, 1):
                e = np.clip(floor_e - 2 + bump, -127, 127)
                yield (e + 127).astype(np.uint8), np.ldexp(1.0, e).astype(np.float64)
        else:
            g = np.float32(self.global_scale)
            base = (amax.astype(np.float32) / np.float32(E2M1_MAX)) / g
            for c in NVFP4_SHRINK:
                s8 = (
                    np.clip(base * np.float32(c), _E4M3_SMALLEST_NORMAL, E4M3_MAX)
                    .astype(np.float32)
                    .astype(jnp.float8_e4m3fn)
                )
                yield s8, s8.astype(np.float32).astype(np.float64) * float(g)

    def choose(self, rows: np.ndarray, weight: np.ndarray):
        """rows [block, N], weight [block] (diag H) -> (stored scale [N], step [N])."""
        amax = np.max(np.abs(rows), axis=0)
        best: list[np.ndarray] | None = None
        for stored, step in self.candidates(amax):
            _, deq = e2m1_round(rows, step[None, :])
            err = weight @ np.square(deq - rows)
            if best is None:
                best = [stored, step, err]
            else:
                better = err < best[2]
                best[0] = np.where(better, stored, best[0])
                best[1] = np.where(better, step, best[1])
                best[2] = np.where(better, err, best[2])
        assert best is not None, "candidates() yields at least one scale"
        return best[0], best[1]


def gptq_fp4(
    w: np.ndarray,
    hessian: np.ndarray,
    fmt: str,
    *,
    damp: float = 0.1,
    lazy_rows: int = 128,
    act_order: bool = False,
    amax: float | None = None,
):
    """GPTQ of one weight ``w [K, N]`` (``x @ w``) given ``hessian [K, K] = X^T X``.

    Returns (codes u8 [K, N], block scales [K/block, N] (e8m0 bytes u8 for MXFP4, float8_e4m3fn for
    NVFP4), global scale f32 scalar or None). ``lazy_rows`` must be a multiple of the block.

    act_order: round rows in decreasing ``diag(H)`` (the most-used inputs first, while the most
    rows are left to absorb their error); block scales are then chosen up front from the
    unmodified weights ("static groups"), since a block's rows are no longer visited together.

    Each column is quantized on its own but for NVFP4's global scale, taken from the weight's
    largest magnitude: ``amax`` gives the whole weight's when ``w`` is a block of its columns (a
    device's shard), and the block then gets exactly the whole weight's codes and scales.
    """
    w = np.array(w, np.float64)
    k, n = w.shape
    scaler = _BlockScaler(fmt, w, amax)
    b = scaler.block
    if k % b or lazy_rows % b:
        raise ValueError(f"{fmt}: K={k} and lazy_rows={lazy_rows} must be multiples of {b}")
    if hessian.shape != (k, k):
        raise ValueError(f"hessian {hessian.shape} does not match weight rows {k}")
    hessian = np.asarray(hessian, np.float64)
    hdiag = np.diag(hessian)
    # One entry per group, each set (by choose()) before it is read or stacked.
    scales: list[Any] = [None] * (k // b)
    steps: list[Any] = [None] * (k // b)
    order = np.arange(k)
    if act_order:
        for g in range(k // b):
            scales[g], steps[g] = scaler.choose(w[g * b : (g + 1) * b], hdiag[g * b : (g + 1) * b])
        order = np.argsort(-hdiag, kind="stable")
    u, dead = damped_cholesky_inverse(hessian[np.ix_(order, order)], damp)
    w = w[order]
    w[dead] = 0.0
    codes = np.zeros((k, n), np.uint8)
    for start in range(0, k, lazy_rows):
        stop = min(start + lazy_rows, k)
        blk = w[start:stop].copy()
        err = np.zeros_like(blk)
        for i in range(stop - start):
            row = start + i
            g = order[row] // b
            if not act_order and row % b == 0:
                scales[g], steps[g] = scaler.choose(blk[i : i + b], hdiag[row : row + b])
            codes[order[row]], q = e2m1_round(blk[i], steps[g])
            e = (blk[i] - q) / u[row, row]
            blk[i + 1 :] -= np.outer(u[row, row + 1 : stop], e)
            err[i] = e
        w[stop:] -= u[start:stop, stop:].T @ err
    return codes, np.stack(scales), scaler.global_scale
