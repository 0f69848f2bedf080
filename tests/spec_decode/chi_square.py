"""Pearson's chi-square goodness-of-fit test without scipy (the main venv has none).

The survival function is the regularized upper incomplete gamma Q(dof/2, x/2), computed by its
power series below s + 1 and by a continued fraction above (the textbook split, which keeps both
convergent); tests/spec_decode/test_chi_square.py checks it against published table values.
"""

from __future__ import annotations

import math

import numpy as np

_EPS = 1e-15
_TINY = 1e-300


def _lower_series(s: float, z: float) -> float:
    """Regularized lower incomplete gamma P(s, z) by its power series (z < s + 1)."""
    term = total = 1.0 / s
    n = 0
    while abs(term) > abs(total) * _EPS:
        n += 1
        term *= z / (s + n)
        total += term
    return total * math.exp(-z + s * math.log(z) - math.lgamma(s))


def _upper_fraction(s: float, z: float) -> float:
    """Regularized upper incomplete gamma Q(s, z) by its continued fraction (modified Lentz, z >= s + 1)."""
    b = z + 1.0 - s
    c = 1.0 / _TINY
    d = 1.0 / b
    h = d
    for i in range(1, 10_000):
        an = -i * (i - s)
        b += 2.0
        d = an * d + b
        d = _TINY if abs(d) < _TINY else d
        c = b + an / c
        c = _TINY if abs(c) < _TINY else c
        d = 1.0 / d
        delta = d * c
        h *= delta
        if abs(delta - 1.0) < _EPS:
            break
    return math.exp(-z + s * math.log(z) - math.lgamma(s)) * h


def chi2_sf(x: float, dof: int) -> float:
    """P(X >= x) for X ~ chi-square with ``dof`` degrees of freedom."""
    if x <= 0:
        return 1.0
    s, z = dof / 2.0, x / 2.0
    return 1.0 - _lower_series(s, z) if z < s + 1.0 else _upper_fraction(s, z)


def chi2_critical(alpha: float, dof: int) -> float:
    """The x with chi2_sf(x, dof) = alpha (bisection; sf decreases in x)."""
    lo, hi = 0.0, 10.0 * dof + 100.0
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if chi2_sf(mid, dof) > alpha else (lo, mid)
    return (lo + hi) / 2


def goodness_of_fit(samples: np.ndarray, probs: np.ndarray) -> tuple[float, int]:
    """samples [N] ints in [0, V), probs [V] -> (Pearson statistic, degrees of freedom).

    Categories of probability 0 are left out; a sample in one makes the statistic infinite.
    """
    probs = np.asarray(probs, np.float64)
    counts = np.bincount(samples, minlength=len(probs)).astype(np.float64)
    support = probs > 0
    if counts[~support].sum() > 0:
        return math.inf, int(support.sum()) - 1
    expected = len(samples) * probs[support] / probs[support].sum()
    stat = float(((counts[support] - expected) ** 2 / expected).sum())
    return stat, int(support.sum()) - 1
