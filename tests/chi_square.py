"""Chi-square checks of a sampler against an enumerated distribution, shared by the sampling tests."""

from __future__ import annotations

import numpy as np


def chi2(counts: np.ndarray, probs: np.ndarray, n: int) -> tuple[float, int]:
    """Chi-square statistic of `counts` (n draws) against `probs`, the cells of expected count < 5 merged into one;
    returns (statistic, df)."""
    exp = probs * n
    big = exp >= 5
    obs_c = np.array(list(counts[big]) + [counts[~big].sum()], float)
    exp_c = np.array(list(exp[big]) + [exp[~big].sum()], float)
    keep = exp_c > 0
    return float((((obs_c - exp_c) ** 2) / np.where(keep, exp_c, 1))[keep].sum()), int(keep.sum()) - 1


def chi2_critical(df: int, z: float = 3.09) -> float:
    """Wilson–Hilferty upper quantile of chi-square(df); z = 3.09 is the one-sided 0.999 normal quantile, i.e. a
    correct sampler fails one test in a thousand."""
    return df * (1 - 2 / (9 * df) + z * (2 / (9 * df)) ** 0.5) ** 3
