"""Paired statistics for the quality evaluation: exact McNemar for accuracies, paired bootstrap
intervals for continuous metrics, Holm's step-down correction. numpy only, so that report.py can
rerun on a results.json without torch."""

from __future__ import annotations

import math
from typing import Dict, List, Sequence, Tuple

import numpy as np

BOOTSTRAP = 10_000


def mcnemar_exact(a: Sequence[bool], b: Sequence[bool]) -> Tuple[int, int, float]:
    """(wins of a, wins of b, two-sided exact p): the binomial test of the discordant pairs."""
    a, b = np.asarray(a, dtype=bool), np.asarray(b, dtype=bool)
    wa, wb = int((a & ~b).sum()), int((~a & b).sum())
    n = wa + wb
    if n == 0:
        return wa, wb, 1.0
    k = min(wa, wb)
    tail = sum(math.comb(n, i) for i in range(k + 1)) / 2.0 ** n
    return wa, wb, min(1.0, 2.0 * tail)


def paired_bootstrap(a: Sequence[float], b: Sequence[float], seed: int = 0,
                     samples: int = BOOTSTRAP) -> Tuple[float, float, float, float]:
    """(mean of a - b, 2.5% and 97.5% percentiles of the bootstrap mean difference, two-sided
    bootstrap p: twice the smaller share of resampled means on either side of 0, counted as
    (k + 1) / (samples + 1) so that it is never 0)."""
    d = np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64)
    if d.size == 0:
        return (float("nan"),) * 4
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, d.size, size=(samples, d.size))
    means = d[idx].mean(axis=1)
    lo, hi = np.percentile(means, [2.5, 97.5])
    p = 2.0 * (min((means <= 0).sum(), (means >= 0).sum()) + 1) / (samples + 1)
    return float(d.mean()), float(lo), float(hi), float(min(1.0, p))


def holm(pvalues: Dict[str, float]) -> Dict[str, float]:
    """Holm-adjusted p-values (family-wise error over the given comparisons)."""
    order = sorted(pvalues, key=pvalues.get)
    m = len(order)
    adjusted: Dict[str, float] = {}
    running = 0.0
    for i, key in enumerate(order):
        running = max(running, min(1.0, (m - i) * pvalues[key]))
        adjusted[key] = running
    return adjusted


def wilson(successes: int, n: int, z: float = 1.959964) -> Tuple[float, float]:
    """Wilson score 95% interval of a proportion."""
    if n == 0:
        return float("nan"), float("nan")
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return centre - half, centre + half


def mean_interval(x: Sequence[float], seed: int = 0,
                  samples: int = BOOTSTRAP) -> Tuple[float, float, float]:
    """(mean, bootstrap 95% interval) of one method's values, for plots."""
    m, lo, hi, _ = paired_bootstrap(x, np.zeros(len(x)), seed, samples)
    return m, lo, hi


def self_check() -> List[str]:
    """Known answers; returns the failures (run by tests/python and by evaluate.py --check)."""
    failures = []
    if mcnemar_exact([True] * 6 + [False] * 4, [False] * 6 + [False] * 4)[2] != 2 / 64:
        failures.append("mcnemar 6-0 should be 2/64")
    if mcnemar_exact([True, False], [False, True])[2] != 1.0:
        failures.append("mcnemar 1-1 should be 1")
    if abs(mcnemar_exact([True] * 9 + [False], [False] * 9 + [True])[2] - 22 / 1024) > 1e-12:
        failures.append("mcnemar 9-1 should be 22/1024")
    h = holm({"a": 0.01, "b": 0.04, "c": 0.03})
    if not (abs(h["a"] - 0.03) < 1e-12 and abs(h["c"] - 0.06) < 1e-12
            and abs(h["b"] - 0.06) < 1e-12):
        failures.append(f"holm: {h}")
    d, lo, hi, p = paired_bootstrap([1.0, 2.0, 3.0, 4.0], [0.0, 1.0, 2.0, 3.0])
    if not (d == 1.0 and lo == 1.0 and hi == 1.0 and p == 2.0 / (BOOTSTRAP + 1)):
        failures.append(f"bootstrap of a constant difference: {d, lo, hi, p}")
    rng = np.random.default_rng(1)
    x = rng.normal(0.3, 1.0, 400)
    d, lo, hi, p = paired_bootstrap(x, np.zeros_like(x))
    if not (lo < 0.3 < hi and hi - lo < 0.3 and p < 0.01):
        failures.append(f"bootstrap of N(0.3, 1), n=400: {d, lo, hi, p}")
    lo, hi = wilson(4, 8)
    if not (abs(lo - 0.2152) < 1e-3 and abs(hi - 0.7848) < 1e-3):
        failures.append(f"wilson 4/8: {lo, hi}")
    return failures
