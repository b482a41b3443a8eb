"""Statistical parity of world >= 2 with serial (DESIGN.md contract 1): the one formula every test
that holds a parallel run to serial by statistics (not bits) uses, and its false-failure rate.

Statistic. For a quantity of a run (its best loss, the mean of its per-iteration losses -- the
"trajectory" --, or the saved model's KL(fp || q)), the *paired* relative difference of the
parallel run P from the serial run S with the same seed (so the same sample indices every
iteration): d = (P - S) / S. A correct parallel run differs from serial only by rounding drift,
so it is at most as far from serial as a serial run with another seed: Var d <= 2 sigma**2,
sigma = serial's own relative seed-to-seed spread of that quantity (committed per test, measured
by ``tests/parity_spread.py``; under fp32 drift is often nil and d is 0). The mean over n pairs
is held to

    |mean d| <= K * sqrt(2) * sigma / sqrt(n),      K = Phi^-1(1 - alpha / (2 m))

for the m statistics a test bounds and its budget alpha. With mean d normal and its stdev at most
sqrt(2) sigma / sqrt(n), one statistic fails a correct build with probability at most
2 (1 - Phi(K)) = alpha / m, and the test (union bound over its m statistics) with at most alpha.

Re-measured spread. Where the test has several serial seeds it re-measures sigma (pooled relative
variance over blocks, nu degrees of freedom) and requires s < C * sigma: a stale constant (another
model, other settings) fails loudly instead of mis-sizing the bounds. For a right sigma,
nu s**2 / sigma**2 is chi-square with nu degrees of freedom, so P(s >= C sigma) = Q(nu C**2, nu)
(the chi-square survival function, closed form for even nu); :func:`spread_ratio_bound` picks C
for a share of the test's budget.
"""

from __future__ import annotations

import math
import statistics

ALPHA = 1e-3  # each test's false-failure budget
_NORMAL = statistics.NormalDist()


def k_for(m: int, alpha: float = ALPHA) -> float:
    """K for ``m`` bounded statistics sharing ``alpha``: Phi^-1(1 - alpha / (2 m))."""
    return _NORMAL.inv_cdf(1 - alpha / (2 * m))


def false_failure(k: float, m: int) -> float:
    """The test's false-failure bound for ``m`` statistics held at ``k``: m * 2 (1 - Phi(k))."""
    return m * 2 * (1 - _NORMAL.cdf(k))


def bound(spread: float, n_pairs: int, k: float) -> float:
    """The bound on the mean paired relative difference over ``n_pairs`` pairs."""
    return k * math.sqrt(2) * spread / math.sqrt(n_pairs)


def rel(p: float, s: float) -> float:
    return (p - s) / s


def loss_stats(losses: list[float]) -> dict[str, float]:
    """A run's two loss quantities: its best loss (what auto-round keeps) and its trajectory (the
    mean of its per-iteration losses: far less noisy)."""
    return {"best": min(losses), "trajectory": statistics.fmean(losses)}


def chi2_sf(x: float, nu: int) -> float:
    """P(chi-square with ``nu`` (even) degrees of freedom > x)."""
    assert nu >= 2 and nu % 2 == 0, nu
    term = total = 1.0
    for i in range(1, nu // 2):
        term *= (x / 2) / i
        total += term
    return math.exp(-x / 2) * total


def spread_ratio_bound(nu: int, alpha: float) -> float:
    """The smallest C (to 0.05) with P(s >= C sigma) <= ``alpha`` for a spread on ``nu`` degrees of freedom."""
    c = 1.0
    while chi2_sf(nu * c * c, nu) > alpha:
        c += 0.05
    return round(c, 2)


def pooled_relative_spread(groups: list[list[float]]) -> tuple[float, int]:
    """(s, nu): the pooled relative stdev of each group's values around its own mean (each group: one
    block's quantity over seeds), on nu = sum (len - 1) degrees of freedom."""
    ss = sum(sum((x / statistics.fmean(g) - 1) ** 2 for x in g) for g in groups)
    nu = sum(len(g) - 1 for g in groups)
    return math.sqrt(ss / nu), nu


def check(diffs: dict[str, list[float]], spreads: dict[str, float], k: float) -> dict[str, tuple[float, float]]:
    """{statistic: (mean paired relative difference, its bound)} for each statistic's list of pairs;
    ``spreads`` by statistic (the part of the name before the first ':')."""
    return {name: (statistics.fmean(d), bound(spreads[name.split(":")[0]], len(d), k)) for name, d in diffs.items()}


def failures(result: dict[str, tuple[float, float]]) -> list[str]:
    return [f"{name} {mean:+.3%} (bound {b:.3%})" for name, (mean, b) in result.items() if abs(mean) > b]


def describe(result: dict[str, tuple[float, float]]) -> str:
    return "; ".join(f"{name} {mean:+.3%} (bound {b:.3%})" for name, (mean, b) in result.items())
