"""The actor's swap-pause histogram is cumulative: it never shrinks as old swaps leave the recent window.

Prometheus reads any decrease of a ``_bucket``/``_count`` series as a counter reset; a histogram built
from the actor's last 256 swap pauses stopped counting at 256 and dropped buckets as old values left."""

from __future__ import annotations

import asyncio
import pickle
from types import SimpleNamespace

from asyncrl.actors.actor import RolloutActor, initial_counters
from asyncrl.metrics_export import actor_collector


class _Receiver:
    """The nccl path's receiver: every poll is one swap (no manifests, no engine)."""

    def __init__(self) -> None:
        self.version = 0

    async def poll(self, mode: str):
        self.version += 1
        # Pauses cycle through several buckets: 1 ms .. 3 s.
        pause = (0.001, 0.02, 0.2, 0.7, 3.0)[self.version % 5]
        return SimpleNamespace(version=self.version, pause_s=pause, mode=mode, prepare_s=0.0)


def _actor() -> RolloutActor:
    """A RolloutActor without its constructor (no Redis, no vLLM): just what swaps and stats() use."""
    a = RolloutActor.__new__(RolloutActor)
    a.actor_id = "actor-0"
    a.counters = initial_counters(a.actor_id)
    a.engine = SimpleNamespace(version=0, in_flight=0, progress={})
    a.receiver = _Receiver()
    a.swap_mode = "in_flight"
    a.timeline = SimpleNamespace(record=lambda *args, **kw: None)
    a.rewards = SimpleNamespace(running=0)
    a.cfg = SimpleNamespace(actors=SimpleNamespace(groups_in_flight=4))  # stats(): the group workers gauge
    a._waker = None

    async def _heartbeat() -> None:
        a.last_stats = a.stats()

    a._heartbeat_async = _heartbeat
    return a


async def _swaps(a: RolloutActor, n: int) -> None:
    for _ in range(n):
        assert await a._maybe_swap()


def _scrape(snap: dict) -> dict[str, float]:
    """The swap-pause histogram's samples of one scrape: {name{le}: value}."""
    fam = next(f for f in actor_collector("actor-0", lambda: snap).collect()
               if f.name == "asyncrl_actor_swap_pause_seconds")  # fmt: skip
    return {s.name + s.labels.get("le", ""): s.value for s in fam.samples}


def test_the_swap_pause_histogram_keeps_counting_past_the_recent_window() -> None:
    a = _actor()
    asyncio.run(_swaps(a, 300))
    first = pickle.loads(pickle.dumps(a.last_stats))  # what crosses the Ray boundary
    asyncio.run(_swaps(a, 10))
    second = pickle.loads(pickle.dumps(a.stats()))
    s1, s2 = _scrape(first), _scrape(second)
    assert s1["asyncrl_actor_swap_pause_seconds_count"] == 300
    assert s2["asyncrl_actor_swap_pause_seconds_count"] == 310
    assert s2["asyncrl_actor_swap_pause_seconds_bucket+Inf"] == 310
    assert s2["asyncrl_actor_swap_pause_seconds_sum"] > s1["asyncrl_actor_swap_pause_seconds_sum"]
    assert all(s2[k] >= v for k, v in s1.items()), "a bucket decreased between two scrapes"
    # 310 swaps, pauses cycling over 5 values: 62 of each; <= 0.5 s takes three of them.
    assert s2["asyncrl_actor_swap_pause_seconds_bucket0.5"] == 3 * 62
    # The recent window stays (the timeline and the integration tests read its last entry).
    assert len(second["swap_pause_s"]) == 256 and second["swap_pause_s"][-1] == 0.001


def test_the_actors_stats_carry_the_cumulative_counts_as_plain_data() -> None:
    a = _actor()
    asyncio.run(_swaps(a, 400))
    st = a.stats()
    h = st["swap_pause_hist"]
    assert isinstance(h, dict) and sum(h["counts"]) == 400 == st["swaps"]
    assert all(type(c) is int for c in h["counts"]) and isinstance(h["sum"], float)
    assert abs(h["sum"] - 80 * (0.001 + 0.02 + 0.2 + 0.7 + 3.0)) < 1e-6
    # A snapshot, not the live counters: later swaps do not change it.
    asyncio.run(_swaps(a, 1))
    assert sum(h["counts"]) == 400 and sum(a.stats()["swap_pause_hist"]["counts"]) == 401


def test_the_learners_last_step_time_is_its_start_until_the_first_step() -> None:
    """Before the first step the exported "last step" is the exporter's start, never 0: at 0 the
    AsyncrlNoLearnerStep alert (time() - last step > 600 s) fired during every learner start-up."""
    import time

    from asyncrl.learner.records import StepRecord
    from asyncrl.metrics_export import LearnerExporter, learner_collectors

    def last_step(exporter: LearnerExporter) -> float:
        (col, _buf) = learner_collectors(exporter, dict)
        fam = next(f for f in col.collect() if f.name == "asyncrl_learner_last_step_timestamp_seconds")
        return fam.samples[0].value

    t0 = time.time()
    exporter = LearnerExporter()
    assert t0 <= last_step(exporter) <= time.time()
    exporter(StepRecord(step=1, version=1, step_time=t0 + 100.0))
    assert last_step(exporter) == t0 + 100.0


def test_the_learners_waiting_since_gauge_is_live() -> None:
    """AsyncrlLearnerStarved tells a learner blocked on data from one in a long step by this gauge: the
    time its current wait began, 0 while it trains, set as it happens (not from the step records)."""
    from asyncrl.learner.records import StepRecord
    from asyncrl.metrics_export import LearnerExporter, learner_collectors

    def since(exporter: LearnerExporter) -> float:
        (col, _buf) = learner_collectors(exporter, dict)
        fam = next(f for f in col.collect() if f.name == "asyncrl_learner_waiting_since_timestamp_seconds")
        return fam.samples[0].value

    exporter = LearnerExporter()
    assert since(exporter) == 0.0  # start-up: not waiting yet
    exporter.waiting(1234.5)
    assert since(exporter) == 1234.5
    exporter(StepRecord(step=1, version=1, step_time=2000.0))  # a step record leaves it alone
    assert since(exporter) == 1234.5
    exporter.waiting(0.0)
    assert since(exporter) == 0.0


def test_a_step_record_s_non_finite_values_reach_the_gauges_as_nan() -> None:
    """StepRecord.to_dict writes NaN as "nan" (JSON has none); the exporter used to skip the string, so
    the ESS gauge kept the previous step's value on a step that measured none."""
    import math

    from asyncrl.learner.records import StepRecord
    from asyncrl.metrics_export import LearnerExporter, learner_collectors

    exporter = LearnerExporter()
    exporter(StepRecord(step=1, ess=0.8))
    exporter(StepRecord(step=2, ess=math.nan))
    (col, _buf) = learner_collectors(exporter, dict)
    fam = next(f for f in col.collect() if f.name == "asyncrl_learner_is_ess_ratio")
    assert math.isnan(fam.samples[0].value)
