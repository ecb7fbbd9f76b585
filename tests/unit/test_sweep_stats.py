"""asyncrl.sweep_stats against slow, obvious float64 reference code, on random inputs and at the edges."""

from __future__ import annotations

import itertools
import math
import random

import numpy as np
import pytest

from asyncrl.sweep_stats import EXACT_MAX, band, bootstrap_ci, moving_average, paired_ci


def _pct(sorted_vals: list[float], q: float) -> float:
    pos = q * (len(sorted_vals) - 1)
    k = int(math.floor(pos))
    nxt = sorted_vals[min(k + 1, len(sorted_vals) - 1)]
    return sorted_vals[k] + (nxt - sorted_vals[k]) * (pos - k)


def exact_reference(values: list[float], level: float = 0.95) -> tuple[float, float, float]:
    """Every one of the n^n resamples, enumerated with itertools, means with math.fsum."""
    n = len(values)
    means = sorted(math.fsum(values[i] for i in idx) / n for idx in itertools.product(range(n), repeat=n))
    a = (1 - level) / 2
    return math.fsum(values) / n, _pct(means, a), _pct(means, 1 - a)


@pytest.mark.parametrize("n", [2, 3, 4, 5])
def test_exact_bootstrap_matches_enumeration(n: int) -> None:
    rng = random.Random(n)
    for _ in range(5):
        vals = [rng.gauss(0, 1) * 10 ** rng.randint(-3, 2) for _ in range(n)]
        ci = bootstrap_ci(vals)
        mean, lo, hi = exact_reference(vals)
        assert ci.n == n
        assert ci.mean == pytest.approx(mean, rel=1e-12, abs=1e-15)
        assert (ci.lo, ci.hi) == pytest.approx((lo, hi), rel=1e-9, abs=1e-12)
        assert min(vals) <= ci.lo <= ci.mean <= ci.hi <= max(vals)


def test_monte_carlo_bootstrap_is_close_to_exact_and_deterministic() -> None:
    n = 6  # 6^6 = 46656 > EXACT_MAX: the Monte Carlo path
    assert n**n > EXACT_MAX
    vals = [0.1, 0.5, 0.2, 0.9, 0.4, 0.45]
    _, lo, hi = exact_reference(vals)
    ci = bootstrap_ci(vals)
    assert ci == bootstrap_ci(vals)  # fixed-seed generator
    assert ci.lo == pytest.approx(lo, abs=0.01) and ci.hi == pytest.approx(hi, abs=0.01)


def test_bootstrap_edges() -> None:
    empty = bootstrap_ci([])
    assert empty.n == 0 and all(math.isnan(v) for v in empty[:3])
    assert bootstrap_ci([None, float("nan"), float("inf")]).n == 0
    assert tuple(bootstrap_ci([0.7])) == (0.7, 0.7, 0.7, 1)
    assert tuple(bootstrap_ci([2.0, 2.0, 2.0])) == (2.0, 2.0, 2.0, 3)
    ci = bootstrap_ci([1.0, None, 3.0, float("nan")])  # missing seeds are left out, not zeros
    assert ci.n == 2 and ci.mean == 2.0 and (ci.lo, ci.hi) == pytest.approx(exact_reference([1.0, 3.0])[1:])
    # A narrower level gives a narrower interval.
    vals = [0.1, 0.4, 0.35, 0.8]
    w95, w50 = bootstrap_ci(vals), bootstrap_ci(vals, level=0.5)
    assert w95.lo <= w50.lo <= w50.hi <= w95.hi


def test_paired_difference_uses_common_seeds_only() -> None:
    treated = {0: 0.9, 1: 0.8, 2: 0.85, 3: None}
    base = {0: 0.5, 1: 0.45, 2: 0.6, 4: 0.1}
    ci = paired_ci(treated, base)
    diffs = [0.4, 0.35, 0.25]
    mean, lo, hi = exact_reference(diffs)
    assert ci.n == 3 and ci.mean == pytest.approx(mean) and (ci.lo, ci.hi) == pytest.approx((lo, hi))
    assert ci.excludes_zero()
    # Pairing removes the shared seed effect: unpaired intervals overlap, the paired one does not.
    t2 = {s: base[s] + 0.01 for s in (0, 1, 2)}
    p = paired_ci(t2, base)
    assert p.excludes_zero() and p.lo == pytest.approx(0.01)
    a, b = bootstrap_ci(list(t2.values())), bootstrap_ci([base[s] for s in (0, 1, 2)])
    assert a.lo < b.hi  # overlapping
    assert not paired_ci({0: 1.0, 1: -1.0}, {0: 0.0, 1: 0.0}).excludes_zero()
    assert paired_ci({0: 1.0}, {1: 0.0}).n == 0


def test_moving_average_against_loop() -> None:
    rng = np.random.default_rng(0)
    y = rng.normal(size=37)
    for w in (1, 2, 5, 50):
        ref = [math.fsum(y[max(0, i - w + 1) : i + 1]) / (i + 1 - max(0, i - w + 1)) for i in range(len(y))]
        assert np.allclose(moving_average(y, w), ref, rtol=1e-12, atol=1e-12)
    assert len(moving_average([], 3)) == 0


def test_band_interpolates_inside_each_curve_only() -> None:
    c1 = ([0.0, 10.0], [0.0, 1.0])
    c2 = ([0.0, 5.0], [1.0, 1.0])  # ends at x=5
    mean, lo, hi = band([c1, c2], [0.0, 2.5, 5.0, 7.5, 20.0])
    assert mean[:3] == pytest.approx([0.5, 0.625, 0.75])
    assert mean[3] == pytest.approx(0.75) and lo[3] == hi[3] == pytest.approx(0.75)  # only c1 left
    assert math.isnan(mean[4])  # past every curve: no value, not an extrapolation
    assert (lo[:3] <= mean[:3]).all() and (mean[:3] <= hi[:3]).all()
