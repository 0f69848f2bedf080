"""The chi-square helper against published critical values (NIST/SEMATECH e-Handbook, table 1.3.6.7.4)."""

from __future__ import annotations

import numpy as np
import pytest
from chi_square import chi2_critical, chi2_sf, goodness_of_fit


@pytest.mark.parametrize(
    "alpha, dof, table",
    [
        (0.05, 1, 3.841),
        (0.01, 1, 6.635),
        (0.001, 1, 10.828),
        (0.05, 5, 11.070),
        (0.001, 5, 20.515),
        (0.001, 3, 16.266),
        (0.01, 10, 23.209),
        (0.001, 7, 24.322),
        (0.05, 30, 43.773),
    ],
)
def test_critical_values_match_the_table(alpha, dof, table):
    assert chi2_critical(alpha, dof) == pytest.approx(table, abs=2e-3)
    assert chi2_sf(table, dof) == pytest.approx(alpha, rel=2e-3)


def test_goodness_of_fit_statistic():
    samples = np.array([0] * 30 + [1] * 50 + [2] * 20)
    stat, dof = goodness_of_fit(samples, [0.25, 0.5, 0.25, 0.0])
    # (30-25)^2/25 + 0 + (20-25)^2/25
    assert dof == 2 and stat == pytest.approx(2.0)
    assert goodness_of_fit(np.array([3]), [0.5, 0.5, 0.0, 0.0])[0] == np.inf
