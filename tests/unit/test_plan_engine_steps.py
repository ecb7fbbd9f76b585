"""The simulator's discrete engine steps: a step's cost, the prefill of the sequences that join it and
its jitter (asyncrl.plan.simulate: PlanInputs.gen_step_s, gen_prefill_s, gen_step_cv), and the spread
of the simulated groups' decode times that calibration fits the jitter to (PlanResult.group_decode_cv)."""

from __future__ import annotations

import math
import random
import statistics
from dataclasses import replace

import pytest

from asyncrl.plan import Lengths, PlanInputs, simulate
from asyncrl.plan.results import StepTrace, summarize
from asyncrl.plan.simulate import _Sim


class StepLog(_Sim):
    """Records every engine step: (its start, its end, sequences running in it, sequences that joined it)."""

    def __init__(self, p: PlanInputs) -> None:
        super().__init__(p)
        self.steps: list[list[float]] = []
        self.open: dict[int, list[float]] = {}

    def schedule_finish(self, e) -> None:
        was, before = e.stepping, len(e.running)
        super().schedule_finish(e)
        if e.stepping and not was:  # a step started now
            self.open[e.index] = [self.t, math.nan, len(e.running), len(e.running) - before]

    def on_estep(self, e) -> None:
        rec = self.open.pop(e.index)
        rec[1] = self.t
        self.steps.append(rec)
        super().on_estep(e)


def pipeline(**kw) -> PlanInputs:
    """One engine, 4 groups of 4 completions of exactly 6 tokens in flight, a quick learner."""
    base = PlanInputs(
        num_actors=1, groups_in_flight=4, group_size=4, engine_steps=True, gen_step_s=0.004, gen_token_s=0.0,
        lengths=Lengths(kind="fixed", mean=6.0, sigma=0.0, min_tokens=1.0, max_tokens=6.0),
        admission_events=True, admission_wake_s=0.0, swap_latency_s=0.003, swap_s=0.001, groups_per_step=2,
        max_staleness=2, learner_step_s=0.002, learner_token_s=0.0, publish_s=0.001, checkpoint_s=0.0,
        steps=400, warmup_steps=20,
    )  # fmt: skip
    return replace(base, **kw)


def test_a_step_costs_its_fixed_cost_and_each_joining_sequences_prefill_exactly() -> None:
    p = pipeline(gen_prefill_s=0.0005, gen_token_s=1e-4)
    sim = StepLog(p)
    sim.run()
    assert len(sim.steps) > 1000
    joins = {k for _, _, _, k in sim.steps}
    assert 0 in joins and max(joins) >= p.group_size  # steps with and without a prompt joining
    for start, end, n, k in sim.steps:
        assert end - start == pytest.approx(0.004 + n * 1e-4 + k * 0.0005, abs=1e-12)


@pytest.mark.parametrize("cv", [0.0, 0.3, 0.8])
def test_step_jitter_has_mean_one_and_the_spread_asked_for(cv: float) -> None:
    """Each step's cost times a lognormal factor of mean 1 and CV ``cv``: the factors (duration over
    the step's deterministic cost) against the float64 moments of the law on over 2,000 draws."""
    p = pipeline(gen_prefill_s=0.0005, gen_step_cv=cv, steps=1000)
    sim = StepLog(p)
    sim.run()
    f = [(end - start) / (0.004 + k * 0.0005) for start, end, _, k in sim.steps]
    assert len(f) > 2000
    if cv == 0:
        assert min(f) == pytest.approx(1.0, abs=1e-9) and max(f) == pytest.approx(1.0, abs=1e-9)
        return
    sigma = math.sqrt(math.log1p(cv * cv))
    assert statistics.fmean(f) == pytest.approx(1.0, abs=3 * cv / math.sqrt(len(f)))
    assert statistics.pstdev(f) / statistics.fmean(f) == pytest.approx(cv, rel=0.1)
    # The median of a mean-1 lognormal is exp(-sigma^2 / 2): below 1, a right-skewed spread.
    assert statistics.median(f) == pytest.approx(math.exp(-(sigma**2) / 2), rel=0.05)


def test_jitter_spreads_decode_times_and_keeps_their_mean_within_the_joins_wait() -> None:
    """Fixed-length groups on fixed steps decode in the same number of steps, give or take the wait
    for the step in progress when they arrive and a swap's commit: a small spread. Jitter spreads them
    more, growing with its CV, while the mean moves by much less than a step."""
    flat = simulate(pipeline())
    assert flat.group_decode_cv < 0.1
    spreads = [simulate(pipeline(gen_step_cv=cv)) for cv in (0.2, 0.5)]
    assert flat.group_decode_cv < spreads[0].group_decode_cv < spreads[1].group_decode_cv
    for r in spreads:
        assert abs(r.group_decode_s - flat.group_decode_s) < 0.5 * 0.004


def _trace(decodes: list[float], per_step: int) -> list[StepTrace]:
    out, n, tot, sq = [], 0, 0.0, 0.0
    for i in range(0, len(decodes), per_step):
        for x in decodes[i : i + per_step]:
            n, tot, sq = n + 1, tot + x, sq + x * x
        out.append(StepTrace(step=len(out) + 1, time=0.1 * (len(out) + 1), wait_s=0.0, tokens=10.0, sequences=2,
                             staleness_hist={0: 10.0}, dropped_stale=0, blocked_worker_s=0.0, busy_engine_s=0.0,
                             groups_decoded=n, decode_s_total=tot, decode_sq_total=sq))  # fmt: skip
    return out


@pytest.mark.parametrize("seed", range(5))
def test_decode_mean_and_spread_are_the_windows_groups_in_float64(seed: int) -> None:
    rng = random.Random(seed)
    decodes = [rng.lognormvariate(math.log(0.04), rng.uniform(0.01, 1.0)) for _ in range(300)]
    warmup = rng.randrange(1, 10)
    r = summarize(replace(PlanInputs(), warmup_steps=warmup, steps=100), _trace(decodes, 3))
    window = decodes[3 * warmup :]  # the groups decoded after the end of step `warmup`
    assert r.group_decode_s == pytest.approx(statistics.fmean(window), rel=1e-9)
    assert r.group_decode_cv == pytest.approx(statistics.pstdev(window) / statistics.fmean(window), rel=1e-6)
    one = summarize(replace(PlanInputs(), warmup_steps=warmup, steps=100), _trace([0.05] * 300, 3))
    assert one.group_decode_cv == pytest.approx(0.0, abs=1e-6)  # no spread (not a negative variance's NaN)
