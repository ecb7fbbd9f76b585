"""The hand-off costs of a real run, measured from its actors' timelines instead of assumed.

Each rollout actor writes ``logs/<actor_id>.timeline.jsonl`` (:mod:`asyncrl.actors.timeline`): per
group when it asked for admission, got it, started and finished generating and was written; per
weight swap when the engine paused and for how long. With the learner's ``metrics.jsonl`` that gives
every hand-off the simulator models, in its own terms:

* ``swap_s`` / ``swap_running_extra_s``: the engine's pause per swap when no sequence was running
  (the synchronous case: only the reload) and the extra seconds when sequences were running (their
  KV cache is recomputed after the reload);
* ``swap_latency_s`` / ``swap_latency_running_extra_s``: an actor's hand-off of version v, from the
  end of the learner step that published it (its ``step_time``: the simulator bumps V at the end of
  the step), or from the end of the actor's previous swap if that came later, to the start of its
  pause for v, when its engine was idle then, and the extra when it was decoding (the actor stages
  the new weights on the engine's cores);
* ``swap_latency_cv``: the spread of those hand-offs (each over its own kind's mean, pooled);
* ``group_overhead_s``: per group, from its last token to the buffer write returning (rewards,
  serialization, the Redis write);
* ``group_decode_s``: per group, from its submission to the engine to its last token, less the
  engine's swap pauses in between: the engine's speed as the group saw it, with whatever shared its
  cores then (the planner fits the engine's decode step cost to it); ``group_decode_stepped_s``
  the same less only each pause's commit (for the simulator's discrete steps: :func:`group_decodes`);
* ``group_start_s``: per group admitted at its first attempt, from the attempt to the submission to
  the engine (the admission script's round trip, the prompt);
* ``admission_wake_s``: per group that was refused at least once and woken by a publish's hint, from
  the publish to the admission;
* ``swap_admit_s``: per group refused at least once whose last event before its admission is its
  own engine's swap end (a refusal for stale weights), from that end to the admission: a few ms when
  the actor wakes its workers after a swap, about half of ``actors.admission_poll_s`` when they wait
  for their poll (``swap_wakes_admission``).

Every function takes plain records, so each is tested on hand-made ones with exact values.
Invariant: imports neither torch, vllm nor ray (``asyncrl plan`` runs on a laptop).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from asyncrl.learner.records import read_jsonl

__all__ = [
    "TIMELINE_GLOB",
    "Handoff",
    "read_timeline",
    "publish_ends",
    "swap_pauses",
    "swap_latencies",
    "latency_trace",
    "latency_factors",
    "group_overheads",
    "group_decodes",
    "group_starts",
    "admission_waits",
    "swap_admit_waits",
    "handoff_samples",
    "handoff",
]

#: The actors' timelines in a run dir (asyncrl.actors.timeline.TIMELINE_SUFFIX; not imported: that
#: package imports the engine's dependencies).
TIMELINE_GLOB = "logs/*.timeline.jsonl"


@dataclass
class Handoff:
    """Measured hand-off costs (None: nothing in the run measured it)."""

    swap_s: float | None = None
    swap_running_extra_s: float | None = None
    swap_latency_s: float | None = None
    swap_latency_running_extra_s: float | None = None
    swap_latency_cv: float | None = None
    group_overhead_s: float | None = None
    group_decode_s: float | None = None
    group_decode_stepped_s: float | None = None  # less only each swap's commit (group_decodes)
    group_decode_cv: float | None = None  # the spread of group_decode_s's samples (population CV)
    group_decode_stepped_cv: float | None = None  # and of group_decode_stepped_s's
    group_start_s: float | None = None
    admission_wake_s: float | None = None
    swap_admit_s: float | None = None
    swaps: int = 0
    groups: int = 0
    woken: int = 0  # groups whose admission wait was measured

    def decode(self, engine_steps: bool) -> tuple[float | None, float | None]:
        """(mean, CV) of the group decode time that the engine fits target, both of the same samples.
        Discrete steps (``engine_steps``) wait for the step in progress themselves, so theirs is the
        time less only the swaps' commits (``group_decode_stepped_s``) where the run measured it;
        otherwise, and for a run without commit times, the time less whole swap pauses."""
        if engine_steps and self.group_decode_stepped_s:
            return self.group_decode_stepped_s, self.group_decode_stepped_cv
        return self.group_decode_s, self.group_decode_cv


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def read_timeline(run_dir: str | Path, since: float = float("-inf")) -> tuple[list[dict], list[dict]]:
    """(groups, swaps) of every actor of the run, each record tagged with its ``actor``; only groups
    admitted and swaps started at or after ``since`` (unix seconds), in time order."""
    groups: list[dict] = []
    swaps: list[dict] = []
    for path in sorted(Path(run_dir).glob(TIMELINE_GLOB)):
        actor = path.name.split(".", 1)[0]
        for r in read_jsonl(path):
            if r.get("kind") == "group" and r["t_admit"] >= since:
                groups.append({**r, "actor": actor})
            elif r.get("kind") == "swap" and r["t_start"] >= since:
                swaps.append({**r, "actor": actor})
    groups.sort(key=lambda r: r["t_admit"])
    swaps.sort(key=lambda r: r["t_start"])
    return groups, swaps


def publish_ends(steps: list[dict]) -> dict[int, float]:
    """Version -> unix time its publish ended, from metrics.jsonl records: the ``step_time`` of a step
    that published and did not checkpoint (a checkpoint runs after the publish, so its end is not the
    publish's; those versions are left out)."""
    return {
        int(r["version"]): float(r["step_time"])
        for r in steps
        if r.get("published") and not r.get("checkpointed")
    }


class _Generating:
    """Whether an actor had a group generating at a time: per actor, the groups' start times sorted
    and the running maximum of their end times (O(log n) per question)."""

    def __init__(self, groups: list[dict]) -> None:
        by: dict[str, list[tuple[float, float]]] = {}
        for g in groups:
            by.setdefault(g["actor"], []).append((g["t_gen0"], g["t_gen1"]))
        self.starts: dict[str, list[float]] = {}
        self.ends: dict[str, list[float]] = {}
        for actor, spans in by.items():
            spans.sort()
            self.starts[actor] = [a for a, _ in spans]
            run, ends = float("-inf"), []
            for _, b in spans:
                run = max(run, b)
                ends.append(run)
            self.ends[actor] = ends

    def __call__(self, actor: str, t: float) -> bool:
        i = bisect.bisect_left(self.starts.get(actor, []), t) - 1  # groups started strictly before t
        return i >= 0 and self.ends[actor][i] > t


def swap_pauses(swaps: list[dict], groups: list[dict]) -> tuple[list[float], list[float]]:
    """The pauses of swaps while the actor's engine had no group generating, and while it had."""
    running = _Generating(groups)
    idle = [s["pause_s"] for s in swaps if not running(s["actor"], s["t_start"])]
    busy = [s["pause_s"] for s in swaps if running(s["actor"], s["t_start"])]
    return idle, busy


def latency_trace(
    swaps: list[dict], publish: dict[int, float], groups: list[dict]
) -> list[tuple[int, float, bool]]:
    """(version, seconds, busy) of each actor's hand-off of a version, in the order the swaps started:
    from the moment the actor could start on it (the end of its publish, or the end of the actor's
    previous swap if that came later: an actor hands over one version at a time, the one it noticed)
    to the start of its pause for it; ``busy``: the actor's engine had a group generating when the
    hand-off started. Versions without a publish end (checkpointed steps) are left out.

    Measured from the publish alone, a version published while the actor still swapped the previous
    one would count that wait too, and the simulator, which queues such a version itself, would pay
    it twice (at max_staleness 4 in the demo the hand-off is about as long as a learner step: almost
    every version waits)."""
    running = _Generating(groups)
    out: list[tuple[int, float, bool]] = []
    free: dict[str, float] = {}  # actor -> end of its last swap
    for s in sorted(swaps, key=lambda s: s["t_start"]):
        t = publish.get(int(s["version"]))
        start = t if t is None else max(t, free.get(s["actor"], float("-inf")))
        free[s["actor"]] = s["t_start"] + s["pause_s"]
        if start is not None:
            out.append((int(s["version"]), s["t_start"] - start, running(s["actor"], start)))
    return out


def swap_latencies(
    swaps: list[dict], publish: dict[int, float], groups: list[dict]
) -> tuple[list[float], list[float]]:
    """The seconds of each hand-off (:func:`latency_trace`) that started with the actor's engine idle,
    and of those that started while it had a group generating."""
    trace = latency_trace(swaps, publish, groups)
    return [x for _, x, busy in trace if not busy], [x for _, x, busy in trace if busy]


def latency_factors(
    trace: list[tuple[int, float, bool]], base_s: float, extra_s: float | None
) -> list[float | None]:
    """The simulator's ``swap_latency_work``: per version (the list's index), its hand-off over the
    mean of its kind (``base_s``, plus ``extra_s`` when busy); None for a version nothing measured.
    With several actors, a version's factor is the mean of theirs. Empty when the base is not > 0."""
    if base_s <= 0 or not trace:
        return []
    by: dict[int, list[float]] = {}
    for v, x, busy in trace:
        by.setdefault(v, []).append(max(x, 0.0) / (base_s + ((extra_s or 0.0) if busy else 0.0)))
    return [sum(by[v]) / len(by[v]) if v in by else None for v in range(max(by) + 1)]


def group_overheads(groups: list[dict]) -> list[float]:
    """Seconds per group from its last token to the end of its buffer write (rewards, the write)."""
    return [g["t_written"] - g["t_gen1"] for g in groups]


def group_decodes(groups: list[dict], swaps: list[dict], stopped_s: float | None = None) -> list[float]:
    """Seconds per group from its submission to the engine to its last token, less the part of its
    actor's swap pauses that fell in between (the simulator's ``SimGroup.decode_s``).

    ``stopped_s``: only the last ``stopped_s`` seconds of each pause count as paused (None: all of
    it). A measured pause runs from the actor's commit call to its return, and an engine core serves
    the call between two steps: a swap that came while the engine decoded waited for the step in
    progress, which went on decoding; only the commit at its end stopped the engine, and the commit
    costs what a swap of an idle engine pauses (``swap_s``). The simulator's discrete steps
    (``engine_steps``) take that wait themselves, so their decode time leaves out only the commit."""
    pauses: dict[str, list[tuple[float, float]]] = {}
    for s in swaps:
        end = s["t_start"] + s["pause_s"]
        start = s["t_start"] if stopped_s is None else max(s["t_start"], end - stopped_s)
        pauses.setdefault(s["actor"], []).append((start, end))
    out = []
    for g in groups:
        a, b = g["t_gen0"], g["t_gen1"]
        paused = sum(max(0.0, min(b, e) - max(a, s)) for s, e in pauses.get(g["actor"], ()))
        out.append(b - a - paused)
    return out


def group_starts(groups: list[dict]) -> list[float]:
    """Seconds from a worker's admission attempt to its group's submission to the engine, for the
    groups admitted at the first attempt (the admission round trip, then the prompt); a refused
    worker's wait is modelled from the events and the poll, not measured here."""
    return [g["t_gen0"] - g["t_try"] for g in groups if not g.get("blocked")]


def _last_events(
    groups: list[dict], swaps: list[dict], publish: dict[int, float]
) -> list[tuple[dict, float, float]]:
    """(group, last publish end, last own swap end) in [t_try, t_admit] of every group refused at
    least once (-inf where there was none)."""
    pubs = sorted(publish.values())
    ends: dict[str, list[float]] = {}
    for s in swaps:
        ends.setdefault(s["actor"], []).append(s["t_start"] + s["pause_s"])
    for v in ends.values():
        v.sort()
    out = []
    for g in groups:
        if not g.get("blocked"):
            continue
        last = []
        for times in (pubs, ends.get(g["actor"], [])):
            i = bisect.bisect_right(times, g["t_admit"]) - 1
            last.append(times[i] if i >= 0 and times[i] >= g["t_try"] else float("-inf"))
        out.append((g, last[0], last[1]))
    return out


def admission_waits(groups: list[dict], swaps: list[dict], publish: dict[int, float]) -> list[float]:
    """Seconds from a publish's hint to the admission it woke: for each group refused at least once
    whose last event between its first try and its admission is a publish end. When its own engine's
    swap ended later, the swap admitted it (:func:`swap_admit_waits`); those are left out."""
    return [g["t_admit"] - pub for g, pub, swap in _last_events(groups, swaps, publish) if pub > swap]


def swap_admit_waits(groups: list[dict], swaps: list[dict], publish: dict[int, float]) -> list[float]:
    """Seconds from the end of its own engine's swap to the admission, for each group refused at least
    once whose last event between its first try and its admission is that swap's end."""
    return [g["t_admit"] - swap for g, pub, swap in _last_events(groups, swaps, publish)
            if swap >= pub and swap > float("-inf")]  # fmt: skip


def handoff_samples(
    run_dir: str | Path, steps: list[dict[str, Any]], since: float = float("-inf")
) -> dict[str, list[float]]:
    """Every hand-off sample of one run (``steps``: its metrics.jsonl records) from time ``since`` on."""
    groups, swaps = read_timeline(run_dir, since)
    if not groups and not swaps:  # a run dir from before the timelines (or a learner-only run)
        return {}
    publish = publish_ends(steps)
    idle, busy = swap_pauses(swaps, groups)
    lat_idle, lat_busy = swap_latencies(swaps, publish, groups)
    # The commit's own stop: what an idle engine's swap pauses (without enough idle swaps: the whole pause).
    commit = _mean(idle) if len(idle) >= MIN_KIND_SAMPLES else None
    return {"swap_idle": idle, "swap_busy": busy, "latency_idle": lat_idle, "latency_busy": lat_busy,
            "group_overhead": group_overheads(groups), "group_start": group_starts(groups),
            "group_decode": group_decodes(groups, swaps),
            "group_decode_stepped": group_decodes(groups, swaps, commit),
            "swap_admit": swap_admit_waits(groups, swaps, publish),
            "admission_wake": admission_waits(groups, swaps, publish)}  # fmt: skip


#: Samples a kind (idle / busy) needs to set its own mean beside a well-measured other kind.
MIN_KIND_SAMPLES = 5


def _base_and_extra(
    pool: dict[str, list[float]], idle_key: str, busy_key: str
) -> tuple[float | None, float | None]:
    """(mean of the idle samples, how much larger the busy samples' mean is), both clipped at 0 (a
    step's record is written a moment after its publish returns: a latency can read slightly
    negative; a busy mean below the idle one is noise, not a negative cost). With one kind only:
    that kind's mean and None (the extra is not measured). A kind with fewer than
    ``MIN_KIND_SAMPLES`` samples beside one with at least that many counts as absent: in a
    generation-bound run nearly every hand-off starts with the engine decoding, and the one or two
    that did not (the first after a checkpoint) would set the base alone (a 2-sample idle mean of
    55 ms over 179 busy hand-offs of 45 ms: base 55 ms, extra 0, every simulated hand-off 10 ms long)."""
    idle_xs, busy_xs = pool.get(idle_key, []), pool.get(busy_key, [])
    if len(idle_xs) < MIN_KIND_SAMPLES <= len(busy_xs):
        idle_xs = []
    elif len(busy_xs) < MIN_KIND_SAMPLES <= len(idle_xs):
        busy_xs = []
    idle, busy = _mean(idle_xs), _mean(busy_xs)
    if idle is None or busy is None:
        base = idle if idle is not None else busy
        return (None if base is None else max(base, 0.0)), None
    return max(idle, 0.0), max(busy - max(idle, 0.0), 0.0)


def _pooled_cv(*kinds: list[float]) -> float | None:
    """Coefficient of variation of the samples, each divided by the mean of its own kind (idle, busy:
    their means differ by the running extra, which is not spread), pooled; None below 3 samples.
    Kinds with fewer than 2 samples or a mean <= 0 tell nothing about the spread and are left out."""
    factors = []
    for xs in kinds:
        m = _mean(xs)
        if len(xs) >= 2 and m is not None and m > 0:
            factors += [x / m for x in xs]
    return cv(factors) if len(factors) >= 3 else None


def cv(xs: list[float]) -> float:
    """Population coefficient of variation of ``xs`` (0 when empty or the mean is not positive)."""
    m = _mean(xs)
    if m is None or m <= 0:
        return 0.0
    return (sum((x - m) ** 2 for x in xs) / len(xs)) ** 0.5 / m


def handoff(samples: list[dict[str, list[float]]]) -> Handoff:
    """The simulator's hand-off inputs from the samples of one or more runs, pooled (means; the
    idle/busy splits as in :func:`_base_and_extra`)."""
    pool: dict[str, list[float]] = {}
    for s in samples:
        for k, v in s.items():
            pool.setdefault(k, []).extend(v)
    swap_s, swap_extra = _base_and_extra(pool, "swap_idle", "swap_busy")
    lat, lat_extra = _base_and_extra(pool, "latency_idle", "latency_busy")
    return Handoff(
        swap_latency_cv=_pooled_cv(pool.get("latency_idle", []), pool.get("latency_busy", [])),
        swap_s=swap_s,
        swap_running_extra_s=swap_extra,
        swap_latency_s=lat,
        swap_latency_running_extra_s=lat_extra,
        group_overhead_s=_mean(pool.get("group_overhead", [])),
        group_decode_s=_mean(pool.get("group_decode", [])),
        group_decode_stepped_s=_mean(pool.get("group_decode_stepped", [])),
        group_decode_cv=cv(pool["group_decode"]) if pool.get("group_decode") else None,
        group_decode_stepped_cv=cv(pool["group_decode_stepped"])
        if pool.get("group_decode_stepped")
        else None,
        group_start_s=_mean(pool.get("group_start", [])),
        admission_wake_s=_mean(pool.get("admission_wake", [])),
        swap_admit_s=_mean(pool.get("swap_admit", [])),
        swaps=len(pool.get("swap_idle", [])) + len(pool.get("swap_busy", [])),
        groups=len(pool.get("group_overhead", [])),
        woken=len(pool.get("admission_wake", [])),
    )
