"""The simulator's weight hand-off: one version at a time per actor, the version it noticed, with the
hand-off's measured spread (asyncrl.plan.simulate, "Swaps"; asyncrl.plan.handoff.swap_latencies)."""

from __future__ import annotations

import math
import statistics

import pytest

from asyncrl.plan import Lengths, PlanInputs
from asyncrl.plan.handoff import _pooled_cv, handoff
from asyncrl.plan.simulate import _Sim


def fixed(mean: float) -> Lengths:
    return Lengths(kind="fixed", mean=mean, sigma=0.0, min_tokens=1.0, max_tokens=mean)


class LoggedSim(_Sim):
    """Records every hand-off start (t, engine, V then) and swap end (t, engine, version installed)."""

    def __init__(self, p: PlanInputs) -> None:
        super().__init__(p)
        self.log: list[tuple[float, str, int, int]] = []
        self.publishes: list[tuple[float, int]] = []
        self.notices: list[tuple[float, int]] = []

    def start_handoff(self, e) -> None:
        assert e.staging is None and not e.swapping, "a second hand-off while one is under way"
        self.log.append((self.t, "start", e.index, self.V))
        super().start_handoff(e)

    def on_notice(self, e) -> None:
        self.notices.append((self.t, e.index))
        super().on_notice(e)

    def on_swapped(self, arg) -> None:
        e, version = arg
        self.log.append((self.t, "swapped", e.index, version))
        super().on_swapped(arg)

    def on_phase_done(self, epoch: int) -> None:
        v = self.V
        super().on_phase_done(epoch)
        if self.V != v:
            self.publishes.append((self.t, self.V))


def learner_bound(latency: float, cv: float = 0.0, actors: int = 1, steps: int = 40) -> PlanInputs:
    """A learner-bound pipeline (instant generation, no admission limits in the way): the learner
    publishes every 0.1 s exactly; each actor's hand-off takes ``latency`` and its pause 0.01 s."""
    return PlanInputs(
        num_actors=actors, groups_in_flight=64, group_size=2, lengths=fixed(3.0), gen_step_s=0.0, gen_token_s=1e-9,
        admission_events=True, admission_wake_s=0.0, swap_latency_s=latency, swap_latency_cv=cv, swap_s=0.01,
        refuse_stale_weights=False, groups_per_step=2, max_staleness=50, learner_step_s=0.1,
        learner_token_s=0.0, publish_s=0.0, checkpoint_s=0.0, steps=steps, warmup_steps=2,
    )  # fmt: skip


def test_a_hand_off_longer_than_a_step_swaps_the_version_it_noticed_one_at_a_time() -> None:
    """Publishes every 0.1 s, hand-off 0.15 s + pause 0.01 s: the actor swaps v1 at 0.26, then hands
    over the newest version at each swap's end (v2 at 0.42, v4 at 0.58, v5 at 0.74, ...), never the
    one that is newest when its pause comes (the model before: v2 at 0.25, skipping every other)."""
    sim = LoggedSim(learner_bound(0.15))
    sim.run()
    # (the first groups take a few ns to generate: times to the microsecond)
    assert [round(t, 6) for t, _ in sim.publishes[:4]] == [0.1, 0.2, 0.3, 0.4]
    swaps = [(round(t, 6), v) for t, kind, _, v in sim.log if kind == "swapped"]
    assert swaps[:5] == [(0.26, 1), (0.42, 2), (0.58, 4), (0.74, 5), (0.9, 7)]
    started: dict[int, int] = {}
    for t, kind, eng, v in sim.log:
        if kind == "start":
            started[eng] = v
        else:  # every swap installs the version its hand-off started with
            assert v == started.pop(eng), (t, v)
    # The actor lags (0.16 s per swap, a version per 0.1 s): a hand-off starts at every swap's end.
    for i, (t, kind, _, v) in enumerate(sim.log[:-1]):
        if kind == "swapped":
            assert sim.log[i + 1][:2] == (t, "start") and sim.log[i + 1][3] > v


def test_a_hand_off_shorter_than_a_step_swaps_every_version_from_its_publish() -> None:
    """Hand-off 0.03 s: every version is noticed at its publish and served 0.04 s later, by each actor."""
    sim = LoggedSim(learner_bound(0.03, actors=2))
    sim.run()
    for eng in (0, 1):
        swaps = [(t, v) for t, kind, e, v in sim.log if kind == "swapped" and e == eng]
        pubs = {v: t for t, v in sim.publishes}
        assert [v for _, v in swaps] == list(range(1, len(swaps) + 1))
        assert all(t == pytest.approx(pubs[v] + 0.04, abs=1e-9) for t, v in swaps)


@pytest.mark.parametrize("cv", [0.0, 0.3])
def test_hand_off_durations_have_the_mean_and_spread_asked_for(cv: float) -> None:
    sim = LoggedSim(learner_bound(0.05, cv=cv, actors=3, steps=800))
    sim.run()
    starts: dict[int, float] = {}
    durations = []
    events = [(t, "start", e) for t, kind, e, _ in sim.log if kind == "start"] + [
        (t, "notice", e) for t, e in sim.notices
    ]
    for t, kind, e in sorted(events, key=lambda x: (x[0], x[1] == "start")):
        if kind == "start":
            starts[e] = t
        elif e in starts:
            durations.append(t - starts.pop(e))
    assert len(durations) > 1500
    if cv == 0:
        assert max(durations) == pytest.approx(0.05, abs=1e-12) and min(durations) == pytest.approx(
            0.05, abs=1e-12
        )
    else:
        assert statistics.fmean(durations) == pytest.approx(0.05, rel=0.03)
        assert statistics.pstdev(durations) / statistics.fmean(durations) == pytest.approx(cv, rel=0.1)


def test_the_hand_off_spread_is_each_sample_over_its_own_kinds_mean_pooled() -> None:
    idle, busy = [0.01, 0.03], [0.02, 0.02, 0.02, 0.06]
    factors = [0.5, 1.5] + [2 / 3, 2 / 3, 2 / 3, 2.0]
    want = math.sqrt(sum((f - 1) ** 2 for f in factors) / len(factors))
    assert _pooled_cv(idle, busy) == pytest.approx(want, rel=1e-12)
    # A kind with one sample says nothing about the spread; fewer than 3 samples in all: unknown.
    assert _pooled_cv([0.5], busy) == pytest.approx(_pooled_cv(busy), rel=1e-12)
    assert _pooled_cv([0.01, 0.03]) is None and _pooled_cv([], []) is None
    assert _pooled_cv([0.0, 0.0, 0.0]) is None  # no mean to scale by
    h = handoff([{"latency_idle": idle[:1], "latency_busy": busy}, {"latency_idle": idle[1:]}])
    assert h.swap_latency_cv == pytest.approx(want, rel=1e-12)
    assert handoff([{"latency_busy": [0.04, 0.04, 0.04]}]).swap_latency_cv == 0.0
