"""The adaptive staleness controller's decisions (pure logic; the Redis side is in tests/integration)."""

from __future__ import annotations

import pytest

from asyncrl.learner.adaptive import StalenessController


def _rec(
    step: int, wait_s: float = 0.0, step_s: float = 1.0, ess: float = 0.9, kl: dict | None = None
) -> dict:
    return {
        "step": step,
        "wait_s": wait_s,
        "step_s": step_s,
        "ess": ess,
        "drift_kl": {"1": 0.001} if kl is None else kl,
    }


def _feed(ctrl: StalenessController, recs: list[dict]) -> list:
    return [d for d in (ctrl.observe(r) for r in recs) if d is not None]


def test_decides_every_n_steps_on_window_means() -> None:
    c = StalenessController(8, start=2, every_steps=4, target_idle=0.2)
    # Idle 0.1, 0.1, 0.1, 0.5 -> window mean 0.8 s / 4 s = 0.2: not above the target, hold.
    ds = _feed(c, [_rec(1, 0.1), _rec(2, 0.1), _rec(3, 0.1), _rec(4, 0.5)])
    assert len(ds) == 1 and ds[0].reason == "hold" and ds[0].bound == 2 and ds[0].step == 4
    assert ds[0].idle_frac == pytest.approx(0.2)
    # The idle fraction is total wait / total step time (long steps weigh more), not a mean of ratios.
    ds = _feed(c, [_rec(5, 0.0, 10.0), _rec(6, 0.8, 1.0), _rec(7, 0.8, 1.0), _rec(8, 0.8, 1.0)])
    assert ds[0].idle_frac == pytest.approx(2.4 / 13) and ds[0].reason == "hold"  # mean of ratios: 0.6
    ds = _feed(c, [_rec(s, 0.5) for s in range(9, 13)])
    assert [(d.previous, d.bound, d.reason) for d in ds] == [(2, 3, "starved")]


def test_starved_learner_raises_up_to_max_staleness() -> None:
    c = StalenessController(3, start=0, every_steps=1)
    ds = _feed(c, [_rec(s, wait_s=0.9) for s in range(1, 6)])
    assert [d.bound for d in ds] == [1, 2, 3, 3, 3]
    assert [d.reason for d in ds[-2:]] == ["at limit", "at limit"]


def test_off_policy_signals_lower_the_bound_and_win_over_starvation() -> None:
    c = StalenessController(8, every_steps=2, min_ess=0.5, max_drift_kl=0.05)
    assert c.bound == 8  # start -1 = max_staleness
    ds = _feed(c, [_rec(1, 0.9, ess=0.3), _rec(2, 0.9, ess=0.5)])  # mean ESS 0.4 < 0.5, learner starving
    assert (ds[0].bound, ds[0].reason) == (7, "ess") and ds[0].ess == pytest.approx(0.4)
    # The worst staleness bucket decides (bucket means over the window): bucket 4 averages 0.06.
    ds = _feed(c, [_rec(3, kl={"1": 0.01, "4": 0.02}), _rec(4, kl={"1": 0.01, "4": 0.10})])
    assert (ds[0].bound, ds[0].reason) == (6, "drift_kl") and ds[0].drift_kl == pytest.approx(0.06)
    ds = _feed(c, [_rec(5, kl={"1": 0.01, "4": 0.04}), _rec(6, kl={"4": 0.05})])  # 0.045 <= 0.05
    assert ds[0].reason == "hold"


def test_floor_missing_signals_and_bad_values() -> None:
    c = StalenessController(4, min_bound=2, start=2, every_steps=1)
    (d,) = _feed(c, [_rec(1, ess=0.1)])
    assert (d.bound, d.reason) == (2, "at limit")
    # ess NaN (a step without loss tokens: not measured) and NaN KL are no evidence: neither lowers it.
    c = StalenessController(4, start=1, every_steps=2)
    ds = _feed(
        c, [_rec(1, 0.9, ess=float("nan"), kl={"2": float("nan")}), _rec(2, 0.9, ess=float("nan"), kl={})]
    )
    assert ds[0].ess is None and ds[0].drift_kl is None and (ds[0].bound, ds[0].reason) == (2, "starved")
    # ess 0 is a measurement, the worst one (every weight masked, e.g. sequence-level icepop on long
    # sequences): it lowers the bound even while the learner starves (before: read as missing, raised).
    c = StalenessController(4, start=2, every_steps=2)
    ds = _feed(c, [_rec(1, 0.9, ess=0.0), _rec(2, 0.9, ess=0.0)])
    assert ds[0].ess == 0.0 and (ds[0].previous, ds[0].bound, ds[0].reason) == (2, 1, "ess")
    assert (
        StalenessController(4, start=9).bound == 4 and StalenessController(4, start=0, min_bound=1).bound == 1
    )
    with pytest.raises(ValueError):
        StalenessController(2, min_bound=3)


def _drift_reference(win: list[dict]) -> float | None:
    """Slow float64 reference of staleness_drift: bucket means, the worst stale one less the fresh one."""
    import numpy as np

    sums: dict[int, list[float]] = {}
    for r in win:
        for k, v in r["drift_kl"].items():
            if np.isfinite(v):
                sums.setdefault(int(k), []).append(np.float64(v))
    stale = [float(np.mean(v)) for s, v in sums.items() if s >= 1]
    if not stale:
        return None
    return max(max(stale) - (float(np.mean(sums[0])) if 0 in sums else 0.0), 0.0)


def test_engine_mismatch_alone_does_not_lower_the_bound() -> None:
    # A bf16 engine against fp32 training: every bucket drifts by ~0.08 from the mismatch, the stale ones
    # barely more. The s = 0 bucket is no staleness: before, the bound fell 8 -> 0 here, one step per window.
    c = StalenessController(8, every_steps=2, max_drift_kl=0.05)
    mismatch = {"0": 0.08, "1": 0.081, "3": 0.085}
    ds = _feed(c, [_rec(s, kl=mismatch) for s in range(1, 21)])
    assert [d.bound for d in ds] == [8] * 10 and {d.reason for d in ds} == {"hold"}
    assert ds[0].drift_kl == pytest.approx(0.005)
    # Staleness on top of the mismatch still lowers it: bucket 3 at 0.08 + 0.06.
    ds = _feed(c, [_rec(21, kl={"0": 0.08, "3": 0.14}), _rec(22, kl={"0": 0.08, "3": 0.14})])
    assert (ds[0].bound, ds[0].reason) == (7, "drift_kl") and ds[0].drift_kl == pytest.approx(0.06)
    # Windows with no fresh tokens (the actors run ahead): the last measured mismatch (0.08) is carried.
    ds = _feed(c, [_rec(s, kl={"2": 0.09, "4": 0.1}) for s in range(23, 29)])
    assert [d.bound for d in ds] == [7, 7, 7] and ds[0].drift_kl == pytest.approx(0.02)


def test_staleness_drift_matches_float64_reference() -> None:
    import random

    import numpy as np

    from asyncrl.learner.adaptive import staleness_drift

    rng = random.Random(0)
    for _ in range(300):
        win = []
        for _ in range(rng.randint(1, 6)):
            kl = {}
            for s in rng.sample(range(6), rng.randint(0, 6)):
                kl[str(s)] = rng.choice([rng.expovariate(20.0), 1e-30, 0.0, float("nan"), float("inf"), 5e3])
            win.append({"drift_kl": kl})
        got, want = staleness_drift(win), _drift_reference(win)
        assert (got is None) == (want is None)
        if want is not None:
            assert got == pytest.approx(want, rel=1e-12, abs=1e-15)
        fresh = rng.expovariate(30.0)  # a carried mismatch stands in only where the window has no s = 0
        got = staleness_drift(win, fresh)
        want = _drift_reference(win if any("0" in r["drift_kl"] and np.isfinite(r["drift_kl"]["0"]) for r in win)
                                else win + [{"drift_kl": {"0": fresh}}])  # fmt: skip
        assert (got is None) == (want is None)
        if want is not None:
            assert got == pytest.approx(want, rel=1e-12, abs=1e-15)
