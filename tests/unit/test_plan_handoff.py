"""Hand-off costs measured from the actors' timelines (asyncrl.plan.handoff), on hand-made run dirs
with exact expected values, and the simulator's extra swap pause with sequences running."""

from __future__ import annotations

import json
import statistics
from dataclasses import replace
from pathlib import Path

import pytest

from asyncrl.actors.timeline import TIMELINE_SUFFIX, Timeline
from asyncrl.plan import Lengths, PlanInputs, simulate
from asyncrl.plan.calibrate import calibrate, calibrate_run, measure
from asyncrl.plan.handoff import (
    TIMELINE_GLOB,
    admission_waits,
    group_decodes,
    group_overheads,
    group_starts,
    handoff,
    handoff_samples,
    latency_factors,
    latency_trace,
    publish_ends,
    read_timeline,
    swap_admit_waits,
    swap_latencies,
    swap_pauses,
)


def group(actor: str, t_admit: float, gen0: float, gen1: float, written: float, *, t_try: float | None = None,
          blocked: bool = False) -> dict:  # fmt: skip
    return {"kind": "group", "actor": actor, "t_try": t_admit if t_try is None else t_try, "t_admit": t_admit,
            "t_gen0": gen0, "t_gen1": gen1, "t_written": written, "blocked": blocked, "tokens": 40,
            "v_start": 0, "v_end": 0}  # fmt: skip


def swap(actor: str, t_start: float, pause: float, version: int) -> dict:
    return {"kind": "swap", "actor": actor, "t_start": t_start, "pause_s": pause, "version": version}


def test_timeline_files_match_the_glob_the_planner_reads(tmp_path: Path) -> None:
    """The actor writes where the planner looks (the planner does not import the actor package)."""
    tl = Timeline(tmp_path, "actor-3")
    tl.record("swap", t_start=5.0, pause_s=0.25, version=2)
    tl.record(
        "group", **{k: v for k, v in group("x", 1.0, 1.5, 2.0, 2.5).items() if k not in ("kind", "actor")}
    )
    tl.close()
    assert tl.path.name == "actor-3" + TIMELINE_SUFFIX
    assert [p.name for p in tmp_path.glob(TIMELINE_GLOB)] == [tl.path.name]
    groups, swaps = read_timeline(tmp_path)
    assert swaps == [swap("actor-3", 5.0, 0.25, 2)]
    assert groups == [group("actor-3", 1.0, 1.5, 2.0, 2.5)]


def test_a_timeline_that_cannot_be_written_never_raises(tmp_path: Path) -> None:
    (tmp_path / "logs").write_text("a file where the directory should be")
    tl = Timeline(tmp_path, "actor-0")
    tl.record("swap", t_start=1.0, pause_s=0.1, version=1)  # logged once, then a no-op
    tl.record("swap", t_start=2.0, pause_s=0.1, version=2)
    tl.close()


def test_read_timeline_tags_actors_filters_the_window_and_skips_a_torn_line(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    logs.mkdir()
    a0 = [
        group("", 3.0, 3.1, 3.5, 3.6),
        swap("", 2.0, 0.1, 1),
        group("", 0.5, 0.6, 0.9, 1.0),
        swap("", 0.2, 0.1, 0),
    ]
    a1 = [swap("", 1.5, 0.2, 1), group("", 1.2, 1.3, 1.4, 1.5)]
    for name, recs in (("actor-0", a0), ("actor-1", a1)):
        lines = [json.dumps({k: v for k, v in r.items() if k != "actor"}) for r in recs]
        (logs / f"{name}{TIMELINE_SUFFIX}").write_text("\n".join(lines) + '\n{"kind": "gro')
    (logs / "actor-0.log").write_text("not a timeline\n")
    groups, swaps = read_timeline(tmp_path, since=1.0)
    assert [(g["actor"], g["t_admit"]) for g in groups] == [("actor-1", 1.2), ("actor-0", 3.0)]
    assert [(s["actor"], s["t_start"]) for s in swaps] == [("actor-1", 1.5), ("actor-0", 2.0)]
    assert len(read_timeline(tmp_path)[0]) == 3


def test_publish_ends_are_step_times_of_published_steps_without_a_checkpoint() -> None:
    steps = [{"version": 1, "step_time": 10.0, "published": True, "checkpointed": False},
             {"version": 1, "step_time": 11.0, "published": False, "checkpointed": False},
             {"version": 2, "step_time": 12.0, "published": True, "checkpointed": True},
             {"version": 3, "step_time": 13.5, "published": True, "checkpointed": False}]  # fmt: skip
    assert publish_ends(steps) == {1: 10.0, 3: 13.5}


def test_swap_pauses_split_by_whether_the_engine_was_generating() -> None:
    groups = [group("a", 0.0, 1.0, 2.0, 2.1), group("b", 0.0, 5.0, 6.0, 6.1)]
    swaps = [swap("a", 1.5, 0.03, 1), swap("a", 3.0, 0.01, 2), swap("b", 1.5, 0.02, 1), swap("b", 5.5, 0.05, 2),
             swap("a", 2.0, 0.07, 3)]  # 2.0 = t_gen1: the group had finished  # fmt: skip
    idle, busy = swap_pauses(swaps, groups)
    assert idle == [0.01, 0.02, 0.07] and busy == [0.03, 0.05]


def test_swap_latency_is_measured_from_the_publish_and_split_by_engine_state_at_the_publish() -> None:
    publish = {1: 10.0, 2: 20.0}
    groups = [group("b", 19.9, 19.95, 20.05, 20.06)]  # b decodes across the publish of v2
    swaps = [swap("a", 10.004, 0.03, 1), swap("b", 20.010, 0.03, 2), swap("a", 19.999, 0.03, 2),
             swap("a", 30.0, 0.03, 3)]  # v3 checkpointed: no publish end, left out  # fmt: skip
    idle, busy = swap_latencies(swaps, publish, groups)
    assert idle == pytest.approx([0.004, -0.001], abs=1e-12) and busy == pytest.approx([0.010], abs=1e-12)


def test_a_version_published_during_the_previous_swap_is_measured_from_that_swaps_end() -> None:
    """One hand-off at a time: v2 (published at 10.02) could not start before a's swap of v1 ended
    (10.03 + 0.01), so its hand-off is 10.07 - 10.04, not 10.07 - 10.02; b was free: from its publish.
    Idle / busy is the engine's state when the hand-off started (a's group runs from 10.041 on)."""
    publish = {1: 10.0, 2: 10.02}
    groups = [group("a", 10.041, 10.041, 10.06, 10.07)]
    swaps = [swap("a", 10.07, 0.01, 2), swap("a", 10.03, 0.01, 1), swap("b", 10.05, 0.01, 2)]
    idle, busy = swap_latencies(swaps, publish, groups)
    assert idle == pytest.approx([0.03, 0.03, 0.03], abs=1e-12) and busy == []
    groups = [group("a", 10.03, 10.03, 10.2, 10.21)]  # now a decodes from 10.03 on: its v2 hand-off is busy
    idle, busy = swap_latencies(swaps, publish, groups)
    assert idle == pytest.approx([0.03, 0.03], abs=1e-12) and busy == pytest.approx([0.03], abs=1e-12)
    # The old measure (from the publish alone) would have read 0.05 for a's v2.


def test_latency_trace_keeps_each_versions_hand_off_in_order_and_factors_are_over_their_kinds_mean() -> None:
    """The trace behind swap_latencies, per version in swap order; the factors the simulator replays:
    each hand-off over its kind's mean (idle: the base; busy: base + extra), averaged over actors,
    None where no hand-off of the version was measured (v0, v3: checkpointed, no publish end)."""
    publish = {1: 10.0, 2: 20.0, 4: 40.0}
    groups = [group("b", 19.9, 19.95, 20.05, 20.06)]  # b decodes across the publish of v2
    swaps = [swap("a", 10.004, 0.03, 1), swap("b", 20.010, 0.03, 2), swap("a", 20.002, 0.03, 2),
             swap("a", 30.0, 0.03, 3), swap("a", 40.008, 0.03, 4), swap("b", 10.002, 0.03, 1)]  # fmt: skip
    trace = latency_trace(swaps, publish, groups)
    assert [(v, busy) for v, _, busy in trace] == [(1, False), (1, False), (2, False), (2, True), (4, False)]
    assert [x for _, x, _ in trace] == pytest.approx([0.002, 0.004, 0.002, 0.010, 0.008], abs=1e-12)
    assert swap_latencies(swaps, publish, groups) == ([x for _, x, b in trace if not b], [trace[3][1]])
    f = latency_factors(trace, 0.004, 0.006)
    assert len(f) == 5 and f[0] is None and f[3] is None
    # v1: (0.002 + 0.004) / 2 / 0.004; v2: a idle 0.002 / 0.004, b busy 0.010 / (0.004 + 0.006); v4: 2.
    assert (
        f[1] == pytest.approx(0.75) and f[2] == pytest.approx((0.5 + 1.0) / 2) and f[4] == pytest.approx(2.0)
    )
    assert latency_factors(trace, 0.004, None)[2] == pytest.approx((0.5 + 2.5) / 2)  # no extra measured
    assert latency_factors(trace, 0.0, 0.006) == [] and latency_factors([], 0.004, None) == []
    # A latency read slightly negative (the record is written a moment after the publish returns) is 0.
    assert latency_factors([(1, -0.001, False)], 0.004, None) == [None, 0.0]


def test_replayed_hand_offs_time_each_version_by_its_own_factor() -> None:
    """swap_latency_work replaces the lognormal draw version by version: every factor 2 is the
    hand-off twice as long (identical result); None falls back to the draw (spread 0: factor 1)."""
    base = PlanInputs(num_actors=1, groups_in_flight=1, group_size=1, lengths=_fixed(10.0), gen_token_s=1e-2,
                      admission_events=True, admission_wake_s=0.0, swap_latency_s=0.015, swap_s=0.0,
                      groups_per_step=1, max_staleness=4, learner_step_s=0.0, learner_token_s=0.0, publish_s=0.0,
                      steps=60, warmup_steps=5)  # fmt: skip
    doubled = simulate(replace(base, swap_latency_s=0.03))
    replayed = simulate(replace(base, swap_latency_work=[2.0] * 7))
    assert replayed.staleness_mean == pytest.approx(doubled.staleness_mean, rel=1e-12)
    assert replayed.tokens_per_s == pytest.approx(doubled.tokens_per_s, rel=1e-12)
    assert doubled.staleness_mean != pytest.approx(simulate(base).staleness_mean)  # the factor matters here
    same = simulate(replace(base, swap_latency_work=[None, 1.0, None]))
    assert same.staleness_mean == pytest.approx(simulate(base).staleness_mean, rel=1e-12)


def test_group_overhead_and_start_are_the_times_around_the_decode_loop() -> None:
    groups = [group("a", 1.0, 1.001, 1.5, 1.506, t_try=0.998), group("a", 2.0, 2.0, 2.4, 2.403),
              group("a", 3.0, 3.004, 3.4, 3.41, t_try=2.5, blocked=True)]  # fmt: skip
    assert group_overheads(groups) == pytest.approx([0.006, 0.003, 0.01], abs=1e-12)
    # From the attempt to the submission, for groups admitted at once (a refused one's wait is modelled).
    assert group_starts(groups) == pytest.approx([0.003, 0.0], abs=1e-12)


def test_admission_wait_runs_from_the_publish_that_woke_the_worker() -> None:
    publish = {1: 10.0, 2: 20.0}
    swaps = [swap("a", 10.005, 0.020, 1), swap("b", 10.004, 0.030, 1), swap("a", 20.004, 0.020, 2)]
    groups = [
        group("a", 10.027, 10.03, 10.1, 10.11, t_try=9.9, blocked=True),  # own swap ended after the publish: polled
        group("b", 10.045, 10.05, 10.1, 10.11, t_try=9.9, blocked=True),  # same (its swap ended at 10.034)
        group("a", 10.05, 10.05, 10.1, 10.11, t_try=9.9),  # never refused: no wait to measure
        group("a", 20.001, 20.0, 20.1, 20.11, t_try=19.5, blocked=True),  # woken by the publish: 1 ms
        group("b", 20.003, 20.0, 20.1, 20.11, t_try=19.5, blocked=True),  # a's swap is not b's event: 3 ms
        group("a", 20.5, 20.5, 20.6, 20.7, t_try=20.3, blocked=True),  # no event since its first try: left out
    ]  # fmt: skip
    assert admission_waits(groups, swaps, publish) == pytest.approx([0.001, 0.003], abs=1e-9)


def test_swap_admit_wait_runs_from_the_own_swap_that_ended_the_refusal() -> None:
    """The complement of the publish-woken waits: the same groups as above, those whose own engine's
    swap ended after the publish (a refusal for stale weights), from that swap's end."""
    publish = {1: 10.0, 2: 20.0}
    swaps = [swap("a", 10.005, 0.020, 1), swap("b", 10.004, 0.030, 1), swap("a", 20.004, 0.020, 2)]
    groups = [
        group("a", 10.027, 10.03, 10.1, 10.11, t_try=9.9, blocked=True),  # a's swap ended at 10.025: 2 ms
        group("b", 10.045, 10.05, 10.1, 10.11, t_try=9.9, blocked=True),  # b's at 10.034: 11 ms
        group("a", 10.05, 10.05, 10.1, 10.11, t_try=9.9),  # never refused
        group("a", 20.001, 20.0, 20.1, 20.11, t_try=19.5, blocked=True),  # woken by the publish
        group("a", 20.5, 20.5, 20.6, 20.7, t_try=20.3, blocked=True),  # no event since its first try
    ]  # fmt: skip
    assert swap_admit_waits(groups, swaps, publish) == pytest.approx([0.002, 0.011], abs=1e-9)
    assert admission_waits(groups, swaps, publish) == pytest.approx([0.001], abs=1e-9)


def test_group_decode_leaves_out_its_own_engines_swap_pauses() -> None:
    swaps = [swap("a", 1.05, 0.02, 2), swap("a", 0.99, 0.02, 1), swap("b", 1.02, 0.03, 1)]
    groups = [group("a", 1.0, 1.0, 1.1, 1.11),  # a's pauses 1.05-1.07 and (of 0.99-1.01) 1.0-1.01: 0.07
              group("b", 1.0, 1.0, 1.04, 1.05),  # b's pause 1.02-1.05 overlaps 1.02-1.04: 0.02
              group("a", 2.0, 2.0, 2.1, 2.11)]  # no pause: 0.1  # fmt: skip
    assert group_decodes(groups, swaps) == pytest.approx([0.07, 0.02, 0.1], abs=1e-12)
    # Only each pause's last 10 ms stopped the engine (its commit): a's 1.06-1.07 and 1.0-1.01, b's
    # 1.04-1.05 (after b's group ended).
    assert group_decodes(groups, swaps, 0.01) == pytest.approx([0.08, 0.04, 0.1], abs=1e-12)
    assert group_decodes(groups, swaps, 1.0) == group_decodes(groups, swaps)


def test_handoff_pools_runs_and_derives_the_simulator_inputs() -> None:
    a = {"swap_idle": [0.02, 0.04], "swap_busy": [0.05], "latency_idle": [0.004, -0.002], "latency_busy": [],
         "group_overhead": [0.003], "group_start": [0.001, 0.002], "admission_wake": [0.002]}  # fmt: skip
    b = {"swap_idle": [], "swap_busy": [0.07], "latency_idle": [0.010], "latency_busy": [0.02, 0.03],
         "group_overhead": [0.005, 0.007], "admission_wake": []}  # fmt: skip
    h = handoff([a, b])
    assert h.swap_s == pytest.approx(0.03) and h.swap_running_extra_s == pytest.approx(0.03)
    assert h.swap_latency_s == pytest.approx(0.004) and h.swap_latency_running_extra_s == pytest.approx(0.021)
    assert h.group_overhead_s == pytest.approx(0.005) and h.admission_wake_s == pytest.approx(0.002)
    assert h.group_start_s == pytest.approx(0.0015)
    assert (h.swaps, h.groups, h.woken) == (4, 3, 1)
    assert h.group_decode_cv is None and h.group_decode_stepped_cv is None  # no decode samples
    # The decode times' spread: the population CV of every run's samples pooled.
    h = handoff(
        [{"group_decode": [0.03, 0.05], "group_decode_stepped": [0.02]}, {"group_decode": [0.04, 0.06]}]
    )
    assert h.group_decode_cv == pytest.approx(statistics.pstdev([0.03, 0.05, 0.04, 0.06]) / 0.045, rel=1e-12)
    assert h.group_decode_stepped_cv == 0.0 and h.group_decode_s == pytest.approx(0.045)
    # What the engine fits target: a mean and the CV of the same samples, stepped only for discrete steps.
    assert h.decode(True) == (pytest.approx(0.02), 0.0)
    assert h.decode(False) == (pytest.approx(0.045), h.group_decode_cv)
    # A run without commit times (no stepped samples): discrete steps fall back to the plain pair.
    h = handoff([{"group_decode": [0.03, 0.05]}])
    assert h.decode(True) == (pytest.approx(0.04), pytest.approx(0.25, rel=1e-12)) == h.decode(False)
    assert handoff([{}]).decode(True) == (None, None)
    # Only busy swaps: swap_s is their mean, the extra unmeasured; a negative mean latency clips to 0.
    h = handoff([{"swap_busy": [0.05, 0.07], "latency_busy": [-0.003, 0.001]}])
    assert h.swap_s == pytest.approx(0.06) and h.swap_running_extra_s is None and h.swap_latency_s == 0.0
    assert h.swap_latency_running_extra_s is None
    assert h.group_overhead_s is None and h.group_start_s is None and h.admission_wake_s is None
    # A busy mean below the idle one is noise, not a negative cost.
    assert handoff([{"swap_idle": [0.05], "swap_busy": [0.04]}]).swap_running_extra_s == 0.0
    # Two idle hand-offs beside 5 busy ones do not set the base: the busy mean does, the extra unmeasured.
    h = handoff([{"latency_idle": [0.055, 0.054], "latency_busy": [0.04, 0.05, 0.045, 0.045, 0.045]}])
    assert h.swap_latency_s == pytest.approx(0.045) and h.swap_latency_running_extra_s is None
    h = handoff([{"swap_idle": [0.01] * 5, "swap_busy": [0.03, 0.05]}])  # and the other way round
    assert h.swap_s == pytest.approx(0.01) and h.swap_running_extra_s is None
    h = handoff([{"swap_idle": [0.01] * 5, "swap_busy": [0.03] * 5}])  # both measured: base and extra
    assert h.swap_s == pytest.approx(0.01) and h.swap_running_extra_s == pytest.approx(0.02)


def _run_dir(rdir: Path, eta: int) -> None:
    """A 20-step run, one step every 0.2 s. actor-0 swaps after every publish: odd versions with its
    engine idle (5 ms after the publish, 30 ms pause; its group admitted 15 ms after the swap ended,
    by its poll), even ones while a group generates from 2 ms before the publish (12 ms after it, 50
    ms pause; that group was admitted without a refusal). actor-1 never swaps; its refused workers
    are woken 2 ms after each publish. Every group starts 1 ms after its admission and is written
    4 ms after its last token."""
    rdir.mkdir(parents=True)
    (rdir / "config.yaml").write_text(
        "actors: {num_actors: 2, groups_in_flight: 4, group_size: 8, admission_poll_s: 0.05, admission_events: true,"
        " refuse_stale_weights: true, max_tokens: 5}\n"
        f"buffer: {{groups_per_step: 4, max_staleness: {eta}}}\nlearner: {{publish_every: 1, checkpoint_every: 10}}\n"
    )  # fmt: skip
    t0 = 1000.0
    steps, tl0, tl1 = [], [], []
    for i in range(1, 21):
        end = t0 + 0.2 * i
        steps.append({"step": i, "version": i, "time": end - t0, "step_time": end, "step_s": 0.2, "wait_s": 0.08,
                      "train_s": 0.1, "publish_s": 0.01, "published": True, "checkpointed": i % 10 == 0,
                      "tokens": 160, "sequences": 32, "staleness_hist": {"0": 160}})  # fmt: skip
        if i % 2 == 0:
            tl0.append(group("", end - 0.003, end - 0.002, end + 0.047, end + 0.051, t_try=end - 0.01))
            tl0.append(swap("", end + 0.012, 0.05, i))
        else:
            tl0.append(swap("", end + 0.005, 0.03, i))
            tl0.append(
                group("", end + 0.05, end + 0.051, end + 0.1, end + 0.104, t_try=end - 0.01, blocked=True)
            )
        tl1.append(
            group("", end + 0.002, end + 0.003, end + 0.05, end + 0.054, t_try=end - 0.01, blocked=True)
        )
    (rdir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in steps))
    (rdir / "logs").mkdir()
    for name, tl in (("actor-0", tl0), ("actor-1", tl1)):
        (rdir / "logs" / f"{name}{TIMELINE_SUFFIX}").write_text(
            "".join(json.dumps({k: v for k, v in r.items() if k != "actor"}) + "\n" for r in tl)
        )


def test_calibration_takes_the_handoffs_from_the_timelines(tmp_path: Path) -> None:
    _run_dir(tmp_path / "s0", 0)
    m = measure(tmp_path / "s0")
    assert m.warmup == 3 and m.window_start == 1000.6
    samples = handoff_samples(m.run_dir, [json.loads(x) for x in (tmp_path / "s0" / "metrics.jsonl").open()],
                              m.window_start)  # fmt: skip
    # Window: steps 4..20 -> the swaps to v3..v20 and the groups admitted from 1000.6 on.
    assert len(samples["swap_idle"]) == len(samples["swap_busy"]) == 9
    p, sources = calibrate([tmp_path / "s0"])
    assert p.swap_s == pytest.approx(0.03)  # idle swaps: v3, 5, ..., 19
    assert p.swap_running_extra_s == pytest.approx(0.02)  # busy ones (v4, 6, ..., 20) paused 0.05
    # Latency: 5 ms idle (9 swaps), 12 ms busy (v4..v18 but v10: v10 and v20 checkpointed, left out).
    assert samples["latency_idle"] == pytest.approx([0.005] * 9) and len(samples["latency_busy"]) == 7
    assert p.swap_latency_s == pytest.approx(0.005) and p.swap_latency_running_extra_s == pytest.approx(0.007)
    assert p.group_overhead_s == pytest.approx(0.004)  # last token to the write
    # From the attempt to the submission, for actor-0's even groups (admitted at once): 8 ms.
    assert p.group_start_s == pytest.approx(0.008)
    # Only actor-1's admissions were woken by a publish (16 non-checkpointed ones), 2 ms after it.
    assert p.admission_wake_s == pytest.approx(0.002)
    for key in ("swap_s", "swap_running_extra_s", "swap_latency_s", "swap_latency_running_extra_s",
                "group_overhead_s", "group_start_s", "admission_wake_s"):  # fmt: skip
        assert sources[key] == "measured (18 swaps, 36 groups, 16 woken admissions)", (key, sources[key])


def test_calibrate_run_measures_every_component_of_its_own_run(tmp_path: Path) -> None:
    """The learner's wall costs, the hand-offs and the engine's decode time all come from the one
    run; the engine's decode step cost is the one whose simulated group decode time is the
    measured one. Decode times (_run_dir): actor-0's even groups 0.049 s less the 0.015 s of their
    swap's commit that they overlap (the last 0.03 s of its 0.05 s pause, 0.03 s being what the idle
    swaps pause; the engine steps discretely: max_tokens 5), its odd ones 0.049 s, actor-1's 0.047 s."""
    _run_dir(tmp_path / "s1", 1)
    p, sources = calibrate_run(tmp_path / "s1")
    assert p.max_staleness == 1 and p.learner_token_s == pytest.approx(0.1 / 160)
    assert p.publish_s == pytest.approx(0.01) and p.learner_slowdown == p.gen_slowdown == 1.0
    assert p.swap_s == pytest.approx(0.03) and p.swap_running_extra_s == pytest.approx(0.02)
    assert p.swap_latency_s == pytest.approx(0.005) and p.admission_wake_s == pytest.approx(0.002)
    # Every hand-off is its kind's mean (5 ms idle, 12 = 5 + 7 ms busy), replayed by version; the
    # checkpointed versions 10 and 20 (and v0) have no publish end: drawn. Version 20 cycles to 0.
    want = [None if v % 10 == 0 else 1.0 for v in range(20)]
    assert p.swap_latency_work == pytest.approx(want)
    assert sources["swap_latency_work"].startswith("measured (18 hand-offs replayed by version")
    assert calibrate_run(tmp_path / "s1", replay=False)[0].swap_latency_work == []
    # Groups admitted from step 3's end on: actor-0's odd ones of steps 3..19 and even ones of 4..20
    # (9 each), actor-1's of steps 3..20 (18).
    decode = (9 * 0.034 + 9 * 0.049 + 18 * 0.047) / 36
    assert sources["gen_step_s"] == f"fitted to the measured group decode time {decode * 1e3:.1f} ms"
    assert p.gen_token_s == 0.0 and p.gen_step_s > 0  # a fixed cost per decode step (FLAT_STEP_SHARE)
    # ... and the spread of its steps (gen_step_cv) the one whose simulated decode times spread as the
    # measured ones do (population CV). The fits take one simulation; the prediction's mean of eight
    # spreads the same and is as long within a few percent (a 20-step run: 100 steps replayed).
    spread = statistics.pstdev([0.034] * 9 + [0.049] * 9 + [0.047] * 18) / decode
    assert (
        sources["gen_step_cv"] == f"fitted to the measured spread of the group decode time (CV {spread:.3f})"
    )
    assert p.gen_step_cv > 0 and p.gen_prefill_s == pytest.approx(0.7 * p.gen_step_s / 8)
    one = simulate(replace(p, seeds=1))
    assert one.group_decode_s == pytest.approx(decode, rel=0.01) and one.group_decode_cv == pytest.approx(
        spread, rel=0.02
    )
    assert simulate(p).group_decode_s == pytest.approx(decode, rel=0.05)
    assert simulate(p).group_decode_cv == pytest.approx(spread, rel=0.05)
    # actor-0's odd groups were admitted by their poll, 15 ms after their swap: not woken by it.
    assert p.swap_wakes_admission is False
    assert sources["swap_wakes_admission"] == "measured (stale-weights admissions 15.0 ms after a swap)"
    for f in (tmp_path / "s1" / "logs").iterdir():
        f.unlink()
    with pytest.raises(ValueError, match="no actor timeline"):
        calibrate_run(tmp_path / "s1")


def test_calibration_without_timelines_keeps_the_assumed_handoffs(tmp_path: Path) -> None:
    _run_dir(tmp_path / "s0", 0)
    for f in (tmp_path / "s0" / "logs").iterdir():
        f.unlink()
    p, sources = calibrate([tmp_path / "s0"])
    d = PlanInputs()
    assert (p.swap_s, p.swap_latency_s, p.group_overhead_s) == (
        d.swap_s,
        d.swap_latency_s,
        d.group_overhead_s,
    )
    assert sources["swap_s"] == sources["admission_wake_s"] == "assumed"


def _fixed(mean: float) -> Lengths:
    return Lengths(kind="fixed", mean=mean, sigma=0.0, min_tokens=1.0, max_tokens=mean)


def test_the_extra_swap_costs_are_paid_only_with_sequences_running() -> None:
    """Synchronous: the engine is idle at every publish and swap, the extras cost nothing (identical
    run). One group in flight at eta=4 with an instant learner: every publish and swap lands while the
    next group decodes, so an extra costs exactly what the same seconds of its plain cost do."""
    sync = PlanInputs(num_actors=1, groups_in_flight=2, group_size=4, lengths=_fixed(5.0), gen_token_s=1e-3,
                      admission_events=True, swap_latency_s=0.003, swap_s=0.02, groups_per_step=2, max_staleness=0,
                      learner_step_s=0.03, publish_s=0.005, steps=40, warmup_steps=5)  # fmt: skip
    assert simulate(replace(sync, swap_running_extra_s=0.5)).tokens_per_s == simulate(sync).tokens_per_s
    busy = PlanInputs(num_actors=1, groups_in_flight=1, group_size=1, lengths=_fixed(10.0), gen_token_s=1e-2,
                      admission_events=True, admission_wake_s=0.0, swap_latency_s=0.0, swap_s=0.0,
                      groups_per_step=1, max_staleness=4, learner_step_s=0.0, learner_token_s=0.0, publish_s=0.0,
                      steps=60, warmup_steps=5)  # fmt: skip
    # Latency: the engine decodes the next group at every publish, so the extra latency applies; the
    # swap is instant, so it costs no throughput, but the first 3 of the group's 10 tokens (30 ms at
    # 10 ms each) are sampled before the swap: one version stale when trained.
    late = simulate(replace(busy, swap_latency_running_extra_s=0.03))
    assert late.tokens_per_s == pytest.approx(simulate(busy).tokens_per_s, rel=1e-9)
    assert late.staleness_mean == pytest.approx(0.3, rel=1e-9)
    assert late.staleness_mean == pytest.approx(simulate(replace(busy, swap_latency_s=0.03)).staleness_mean)
    assert (
        simulate(replace(sync, swap_latency_running_extra_s=0.5)).tokens_per_s == simulate(sync).tokens_per_s
    )
    with_extra = simulate(replace(busy, swap_running_extra_s=0.03))
    assert with_extra.tokens_per_s == pytest.approx(
        simulate(replace(busy, swap_s=0.03)).tokens_per_s, rel=1e-9
    )
    assert with_extra.tokens_per_s == pytest.approx(10.0 / (10 * 1e-2 + 0.03), rel=1e-9)


def test_discrete_steps_stop_only_for_the_commit_of_a_swap_that_came_while_decoding() -> None:
    """With discrete steps a swap noticed during a step waits for its end (decoding) and then stops
    the engine for swap_s: the measured running extra is that wait, not paid again. One group of one
    10-token sequence in flight, 10 ms steps, every publish lands while it decodes: 10 steps + 20 ms
    of commit per group, whatever the extra; the fluid engine pays the extra on top."""
    base = PlanInputs(num_actors=1, groups_in_flight=1, group_size=1, lengths=_fixed(10.0), gen_token_s=1e-2,
                      admission_events=True, admission_wake_s=0.0, swap_latency_s=0.0, swap_s=0.02,
                      groups_per_step=1, max_staleness=4, learner_step_s=0.0, learner_token_s=0.0, publish_s=0.0,
                      steps=60, warmup_steps=5, engine_steps=True)  # fmt: skip
    stepped = simulate(base)
    assert stepped.tokens_per_s == pytest.approx(10.0 / (10 * 1e-2 + 0.02), rel=1e-9)
    extra = simulate(replace(base, swap_running_extra_s=0.03))
    assert (extra.tokens_per_s, extra.staleness_mean) == (stepped.tokens_per_s, stepped.staleness_mean)
    fluid = simulate(replace(base, engine_steps=False, swap_running_extra_s=0.03))
    assert fluid.tokens_per_s == pytest.approx(10.0 / (10 * 1e-2 + 0.05), rel=1e-9)


def test_generating_index_matches_a_scan_on_random_intervals() -> None:
    """The O(log n) 'was a group generating' index against the obvious scan, overlaps and edges included."""
    import random

    from asyncrl.plan.handoff import _Generating

    rng = random.Random(7)
    for _ in range(50):
        groups = []
        for _ in range(rng.randint(0, 30)):
            a = round(rng.uniform(0, 10), 1)
            groups.append(group(rng.choice("ab"), a, a, a + round(rng.uniform(0, 3), 1), a + 4))
        index = _Generating(groups)
        for _ in range(40):
            actor, t = rng.choice("abc"), round(rng.uniform(-1, 14), 1)  # on interval edges too
            scan = any(g["actor"] == actor and g["t_gen0"] < t < g["t_gen1"] for g in groups)
            assert index(actor, t) is scan, (actor, t)


def test_plan_predicts_an_eta_with_a_run_from_that_runs_components_and_projects_the_others(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """`asyncrl plan --from`: a row whose eta a run had is that run's calibrate_run prediction (with the
    overrides on top); the other rows come from the inputs fitted to all runs; a run without actor
    timelines falls back to the fitted inputs and says why."""
    from asyncrl.plan.report import run_plan

    _run_dir(tmp_path / "s0", 0)
    _run_dir(tmp_path / "s4", 4)
    dirs = [str(tmp_path / "s0"), str(tmp_path / "s4")]
    assert run_plan(None, dirs, "0,1,4", ["publish_s=0.02"], as_json=True) == 0
    rows = {r["max_staleness"]: r for r in json.loads(capsys.readouterr().out)["results"]}
    own0, _ = calibrate_run(dirs[0])
    fitted, _ = calibrate(dirs)
    want0 = simulate(replace(own0, max_staleness=0, publish_s=0.02))
    want1 = simulate(replace(fitted, max_staleness=1, publish_s=0.02))
    assert rows[0]["tokens_per_s"] == want0.tokens_per_s and rows[0]["measured"] is not None
    assert rows[1]["tokens_per_s"] == want1.tokens_per_s and rows[1]["measured"] is None
    assert "own components" in rows[0]["inputs_from"] and "own components" in rows[4]["inputs_from"]
    assert rows[1]["inputs_from"] == "fitted to all runs" and rows[0]["own_inputs"]["publish_s"] == 0.02
    # The two calibrations differ here (the test can tell which one a row used).
    assert want0.tokens_per_s != simulate(replace(fitted, max_staleness=0, publish_s=0.02)).tokens_per_s
    for f in (tmp_path / "s4" / "logs").iterdir():
        f.unlink()
    assert run_plan(None, dirs, "4", [], as_json=True) == 0
    row = json.loads(capsys.readouterr().out)["results"][0]
    assert row["inputs_from"].startswith("fitted to all runs (") and "timeline" in row["inputs_from"]
    assert row["own_inputs"] is None


def test_a_long_runs_timeline_is_bounded_and_the_planner_reads_its_recent_files(tmp_path: Path) -> None:
    """Days of groups (~250 bytes each) must not fill the disk: past max_bytes the file becomes the
    actor's .prev file (the one before it dropped), so at most ~2x max_bytes stay; the planner reads
    both files as the same actor, newest records included. A reopened timeline (actor restart)
    counts what its file already holds."""
    tl = Timeline(tmp_path, "actor-0", max_bytes=2000)
    for i in range(200):
        tl.record("swap", t_start=float(i), pause_s=0.01, version=i)
    tl.close()
    files = sorted(p.name for p in tmp_path.glob(TIMELINE_GLOB))
    assert files == ["actor-0.prev" + TIMELINE_SUFFIX, "actor-0" + TIMELINE_SUFFIX]
    sizes = [p.stat().st_size for p in tmp_path.glob(TIMELINE_GLOB)]
    line = len(json.dumps({"kind": "swap", "t_start": 199.0, "pause_s": 0.01, "version": 199})) + 1
    assert all(s < 2000 + line for s in sizes) and sum(sizes) < 2 * (2000 + line)
    _groups, swaps = read_timeline(tmp_path)
    versions = [s["version"] for s in swaps]
    assert versions == list(range(versions[0], 200)) and len(versions) > 2000 // line
    assert {s["actor"] for s in swaps} == {"actor-0"}
    again = Timeline(tmp_path, "actor-0", max_bytes=2000)  # a restarted actor appends, then rotates
    before = (tmp_path / "logs" / ("actor-0" + TIMELINE_SUFFIX)).stat().st_size
    for i in range(200, 200 + (2000 - before) // line + 2):
        again.record("swap", t_start=float(i), pause_s=0.01, version=i)
    again.close()
    assert (tmp_path / "logs" / ("actor-0" + TIMELINE_SUFFIX)).stat().st_size < before
