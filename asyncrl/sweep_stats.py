"""Statistics of a sweep over seeds: means, bootstrap intervals, paired differences, curve bands.

A cell of a sweep (max_staleness x objective) is run once per seed; every number the report shows
for a cell is the mean over its seeds with a 95% percentile-bootstrap interval over seeds, and an
objective is compared with the baseline (naive) at the same staleness *paired by seed* (same seed =
same initial weights, same prompt order, same sampling seeds), which removes the seed-to-seed
variance the two cells share.

The bootstrap: resample the n per-seed values with replacement, take the mean, repeat; the interval
is the 2.5th and 97.5th percentile (linear interpolation, numpy's default) of those means. With
n^n <= EXACT_MAX (n <= 5 seeds) every one of the n^n equally likely resamples is enumerated, so the
interval is exact and deterministic; above that, MC_SAMPLES resamples from a fixed-seed generator.
Caveat worth stating in any report: with 3 seeds the bootstrap distribution has only 10 distinct
means and its interval is narrower than a t-interval; it describes these seeds, it is not a promise.

Pure numpy, no plotting and no files (unit-tested against slow float64 reference code).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

__all__ = ["Interval", "bootstrap_ci", "paired_ci", "moving_average", "band", "EXACT_MAX", "MC_SAMPLES"]

#: Largest number of resamples enumerated exactly (5 seeds -> 3125).
EXACT_MAX = 3125
MC_SAMPLES = 20000
LEVEL = 0.95


class Interval(tuple):
    """(mean, lo, hi, n): mean of n finite values and its bootstrap interval; NaNs when n == 0."""

    __slots__ = ()

    def __new__(cls, mean: float, lo: float, hi: float, n: int) -> Interval:
        return super().__new__(cls, (mean, lo, hi, n))

    mean = property(lambda self: self[0])
    lo = property(lambda self: self[1])
    hi = property(lambda self: self[2])
    n = property(lambda self: self[3])

    def excludes_zero(self) -> bool:
        """The interval lies strictly on one side of 0 (and there are >= 2 values).

        Descriptive, not a test: with 3 seeds the percentile interval excludes 0 whenever all three
        paired differences share a sign, which happens by chance 1 time in 4 without any effect.
        """
        return self.n >= 2 and (self.lo > 0 or self.hi < 0)


def _finite(values: Sequence[float | None]) -> np.ndarray:
    x = np.asarray([v for v in values if v is not None], dtype=np.float64)
    return x[np.isfinite(x)]


def _resample_means(x: np.ndarray, seed: int) -> np.ndarray:
    n = len(x)
    if n**n <= EXACT_MAX:
        # All n^n index tuples, as rows of an (n^n, n) array: base-n digits of 0..n^n-1.
        codes = np.arange(n**n)
        idx = np.stack([(codes // n**j) % n for j in range(n)], axis=1)
    else:
        idx = np.random.default_rng(seed).integers(0, n, size=(MC_SAMPLES, n))
    return x[idx].mean(axis=1)


def bootstrap_ci(values: Sequence[float | None], level: float = LEVEL, seed: int = 0) -> Interval:
    """Mean of the finite ``values`` and its percentile-bootstrap interval (see the module doc).

    None and non-finite values (a seed that failed or has no such number) are left out; n counts
    what remained. One value: its interval is the point itself (no spread can be estimated).
    """
    x = _finite(values)
    if len(x) == 0:
        return Interval(math.nan, math.nan, math.nan, 0)
    mean = float(x.mean())
    if len(x) == 1:
        return Interval(mean, mean, mean, 1)
    means = _resample_means(x, seed)
    alpha = (1.0 - level) / 2.0
    lo, hi = np.percentile(means, [100 * alpha, 100 * (1 - alpha)])
    return Interval(mean, float(lo), float(hi), len(x))


def paired_ci(
    treated: dict[int, float | None], baseline: dict[int, float | None], level: float = LEVEL
) -> Interval:
    """Mean over the seeds both have of ``treated[seed] - baseline[seed]``, with its bootstrap interval."""
    diffs = []
    for s in sorted(set(treated) & set(baseline)):
        a, b = treated[s], baseline[s]
        if a is not None and b is not None and math.isfinite(a) and math.isfinite(b):
            diffs.append(a - b)
    return bootstrap_ci(diffs, level)


def moving_average(y: Sequence[float], window: int) -> np.ndarray:
    """Trailing mean over the last ``window`` points (fewer at the start): smooths a reward curve
    without shifting it forward in time or step."""
    y = np.asarray(y, dtype=np.float64)
    if window <= 1 or len(y) == 0:
        return y
    c = np.concatenate([[0.0], np.cumsum(y)])
    i = np.arange(1, len(y) + 1)
    lo = np.maximum(i - window, 0)
    return (c[i] - c[lo]) / (i - lo)


def band(
    curves: Sequence[tuple[Sequence[float], Sequence[float]]], grid: Sequence[float], level: float = LEVEL
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Mean and bootstrap interval over seeds of several (x, y) curves at the points of ``grid``.

    Each curve is linearly interpolated at the grid points inside its own x range (no
    extrapolation: a seed that stopped earlier does not vote past its end); a grid point with no
    curve gets NaN. Returns (mean, lo, hi) arrays of len(grid).
    """
    g = np.asarray(grid, dtype=np.float64)
    cols = []
    for x, y in curves:
        x, y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
        v = np.full(len(g), np.nan)
        if len(x):
            inside = (g >= x[0]) & (g <= x[-1])
            v[inside] = np.interp(g[inside], x, y)
        cols.append(v)
    out = np.full((3, len(g)), np.nan)
    for j in range(len(g)):
        ci = bootstrap_ci([c[j] for c in cols], level)
        out[:, j] = ci.mean, ci.lo, ci.hi
    return out[0], out[1], out[2]
