"""A discrete-event simulator of the asyncrl pipeline: actors, admission, buffer, learner, swaps.

The model follows the real roles step by step (DESIGN.md):

* **Actors.** Each of ``num_actors`` engines runs ``groups_in_flight`` group workers. A worker takes
  an admission slot with the rule of :mod:`asyncrl.buffer.admission` (``admitted < (V + eta + 1) *
  groups_per_step * publish_every + credits``: groups per version, and with ``refuse_stale_weights`` the engine's weights must be at most
  eta behind V, now and at the version that will train the slot: ``slot_version``), then its ``group_size`` completions decode in the engine; the group reaches the
  buffer ``group_overhead_s`` after its last token (it starts decoding ``group_start_s`` after the
  admission: the round trip). With ``actors.admission_events`` (the default) a
  refused worker retries ``admission_wake_s`` after a hint (a publish, a credit) and, like the real
  worker, ``admission_poll_s`` after its refused attempt: unless ``swap_wakes_admission`` (the
  actor wakes its workers when its engine's swap ends), a worker refused for stale weights is
  admitted by that poll. Without events it retries ``admission_poll_s /
  2`` after anything that could admit it (a publish, a credit, its engine's swap): the expected delay
  of the real actor's fixed-period poll.
* **Engines are continuous batchers,** discrete or fluid. With ``engine_steps`` a decode step takes
  ``gen_step_s + n * gen_token_s`` for the ``n`` sequences running at its start and gives each one
  token; an idle engine starts a step with the first request that arrives, sequences that arrive
  during a step (a step's groups are written and re-admitted a few ms apart) join the next one, and
  a swap pauses the engine only
  between steps (vLLM's scheduler), so a group one step late or a swap that waits for the step's
  end moves a whole step of tokens. Without it the engine is fluid, the limit of short steps (and
  far fewer events for long completions): with ``n`` running sequences a decode step takes
  ``gen_step_s + n * gen_token_s`` and gives each one token, so every running sequence advances at
  the same rate. Each engine keeps a work counter ``W`` (tokens per running sequence so far): a
  sequence that started at ``W0`` with length ``L`` ends when ``W = W0 + L``, and the version of each
  of its tokens follows from the engine's swap history in ``W`` coordinates (exact per-token versions,
  like vLLM's weight-version spans). A long sequence left alone speeds up: heavy tails matter.
* **Swaps.** Each actor hands one version at a time to its engine, the version it noticed, as the
  real actor does (it verifies and stages the manifest it read, then pauses for that version): at a
  publish, an actor that is not already handing over a version starts on V; ``swap_latency_s``
  later (plus ``swap_latency_running_extra_s`` if the engine is decoding then: the actor stages the
  weights on the engine's cores; times the version's factor in ``swap_latency_work``, a measured run's
  hand-offs replayed, or else a lognormal factor with mean 1 and ``swap_latency_cv``) the
  engine pauses for ``swap_s`` (the reload or commit; plus, on the fluid engine,
  ``swap_running_extra_s`` when sequences are running: the wait for the engine's step, their KV
  recompute; discrete steps decode until the step ends and then stop for ``swap_s`` only, that
  wait being the extra) and then samples with that version (in-flight requests survive). A version
  published meanwhile waits for the swap's end and then takes its own hand-off (``swap_latency_s`` from then: the latency is measured from
  when the actor was free, :func:`asyncrl.plan.handoff.swap_latencies`), so an actor whose hand-off
  outlasts a learner step lags V by a version or more, swapping every version or skipping to the
  newest at each swap's end, as the real one does. With ``swap_min_lag`` > 1 (actors.swap_min_lag) an
  engine starts a hand-off only once V is that many versions ahead, or at once when admission refuses
  one of its workers (a full window: the real actor's waiting worker wakes its version watcher).
* **Learner.** Reads groups in arrival order, drops those staler than eta at the version the step
  starts with (returning their credit), trains ``groups_per_step`` groups for ``learner_step_s +
  learner_token_s * tokens`` (times the step's factor: ``learner_work`` replayed in order, or a
  lognormal draw with ``learner_cv``), publishes (``publish_s``; V is bumped when it ends), then
  checkpoints (``checkpoint_s``, every ``checkpoint_every`` steps). It publishes every
  ``publish_every`` steps (``publish_policy`` steps), or with ``publish_policy`` taken decides at the
  end of each step's train phase: it publishes if every engine serves V (its swap of V has ended) or
  if this is the ``publish_max_steps``-th step since the last publication; a step that publishes
  nothing returns ``groups_per_step`` credits (the real learner lowers its version skew), so the
  admission window advances per step while V stays, and ``slot_version`` over-estimates the training
  version (it only refuses more). Staleness stays in versions. With ``fill_window``
  (learner.fill_window) each step first waits until ``(max_staleness + 1) * groups_per_step *
  publish_every`` groups are unread, or until admission is saturated and no group arrived for
  ``fill_saturated_s``, as the real learner does.

Numbers are steady-state: measured from the end of step ``warmup_steps`` to the end of the last step,
the same window :func:`asyncrl.plan.calibrate.measure` uses on a real run's metrics.jsonl.
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
from collections import deque
from dataclasses import replace
from typing import Any

from asyncrl.buffer.admission import admission_bound_formula, slot_version

from .engine_model import SimEngine, SimGroup
from .inputs import LengthSampler, PlanInputs, check_publish_policy
from .results import EPS as _EPS
from .results import PlanResult, StepTrace, average, summarize
from .sim_learner import LearnerEvents

__all__ = ["PlanResult", "StepTrace", "simulate", "summarize"]


class _Sim(LearnerEvents):
    def __init__(self, p: PlanInputs) -> None:
        check_publish_policy(p)
        self.p = p
        self.t = 0.0
        self.events: list[tuple[float, int, str, Any]] = []
        self.seq = itertools.count()
        self.ids = itertools.count()
        self.lengths = LengthSampler(p.lengths, p.seed)
        self.engines = [SimEngine(i, p) for i in range(p.num_actors)]
        # A refused worker's retry after an event that could admit it: woken by the event (Redis
        # pub/sub hint) or, without events, on its fixed-period poll (half a period on average).
        self.retry_delay = p.admission_wake_s if p.admission_events else p.admission_poll_s / 2
        self.V = 0
        self.admitted = 0
        self.credits = 0
        self.buffer: deque[SimGroup] = deque()
        self.learner_waiting = True
        self.wait_since = 0.0
        # learner.fill_window: the learner waits for a full admission window before its step's reads.
        self.filling = p.fill_window
        self.fill_epoch = 0  # bumped when the unread count changes (the saturated wait restarts)
        self.fill_changed_t = 0.0
        self.batch: list[SimGroup] = []
        self.dropped = 0
        self.decoded = 0  # groups whose last token was sampled, and their decode seconds in all
        self.decode_total = 0.0
        self.decode_sq = 0.0  # and the sum of their squares
        self.step = 0
        self.trace: list[StepTrace] = []
        # learner: remaining work of its current phases [[kind, seconds of own-device work], ...]
        self.phases: list[list[Any]] = []
        self.l_t = 0.0
        self.l_epoch = 0
        self.l_decoding = False
        self.pending: tuple = ()
        self.train_start = self.train_s = 0.0
        self.work_factor = 1.0  # the current step's factor on its learner work
        self.since_publish = 0  # publish_policy=taken: steps since the last publication
        # Per-step learner work factor: lognormal with mean 1 and coefficient of variation learner_cv.
        self.jitter = random.Random(p.seed + 1)
        self.jit_sigma = math.sqrt(math.log1p(p.learner_cv**2))
        self.jit_mu = -(self.jit_sigma**2) / 2
        # Per hand-off factor: lognormal with mean 1 and coefficient of variation swap_latency_cv (its
        # own stream: the learner's draws stay the same with or without it).
        self.handoff_jitter = random.Random(p.seed + 2)
        self.ho_sigma = math.sqrt(math.log1p(p.swap_latency_cv**2))
        self.ho_mu = -(self.ho_sigma**2) / 2
        # Per decode step factor: lognormal with mean 1 and coefficient of variation gen_step_cv (its
        # own stream, so the other draws stay the same with or without it).
        self.step_jitter = random.Random(p.seed + 3)
        self.st_sigma = math.sqrt(math.log1p(p.gen_step_cv**2))
        self.st_mu = -(self.st_sigma**2) / 2

    # ------------------------------------------------------------------ events

    def at(self, t: float, kind: str, arg: Any = None) -> None:
        heapq.heappush(self.events, (t, next(self.seq), kind, arg))

    def run(self) -> list[StepTrace]:
        for e in self.engines:
            self.try_admit(e)
        while self.step < self.p.steps:
            if not self.events:
                raise RuntimeError(
                    f"the simulated pipeline deadlocked at step {self.step} (t={self.t:.3f}s): admission is "
                    f"full at V={self.V} and the learner waits for groups that cannot be admitted"
                )  # fmt: skip
            t, _, kind, arg = heapq.heappop(self.events)
            self.t = t
            getattr(self, "on_" + kind)(arg)
        return self.trace

    # ------------------------------------------------------------------ actors

    def schedule_finish(self, e: SimEngine) -> None:
        if self.p.engine_steps:
            # An idle engine starts a step with the first request that arrives (as vLLM's loop does);
            # requests arriving after it, even at the same simulated instant (real ones never are:
            # the writes and admissions of a step's groups are spread over a few ms), join the next.
            if not e.stepping and not e.paused and (e.running or e.waiting):
                before = len(e.running)
                self.fill(e)
                e.stepping = True
                joined = len(e.running) - before
                cost = (
                    self.p.gen_step_s + len(e.running) * self.p.gen_token_s + joined * self.p.gen_prefill_s
                ) * e.slow
                if self.st_sigma > 0:
                    cost *= math.exp(self.step_jitter.gauss(self.st_mu, self.st_sigma))
                self.at(self.t + cost, "estep", e)
            self.engines_changed()
            return
        e.epoch += 1
        r = e.rate()
        if r > 0:
            self.at(self.t + max(e.running[0][0] - e.W, 0.0) / r, "finish", (e, e.epoch))
        self.engines_changed()

    def bound_allows(self, e: SimEngine) -> bool:
        p = self.p
        gps = p.groups_per_step * p.publish_every
        if p.refuse_stale_weights and self.V - e.version > p.max_staleness:
            return False
        if self.admitted >= admission_bound_formula(self.V, p.max_staleness, gps, self.credits):
            return False
        # The real script's second refusal: weights that would be too stale at the slot's training version.
        return not (
            p.refuse_stale_weights
            and slot_version(self.admitted + 1, gps, self.credits) - e.version > p.max_staleness
        )

    def try_admit(self, e: SimEngine) -> None:
        e.retry_pending = False
        started = False
        while e.in_flight < self.p.groups_in_flight and self.bound_allows(e):
            if not started:
                e.advance(self.t)
                started = True
            self.admitted += 1
            e.in_flight += 1
            g = SimGroup(e, self.p.group_size)
            if self.p.group_start_s > 0:  # the admission round trip: it decodes a moment later
                self.at(self.t + self.p.group_start_s, "start", g)
                continue
            self.submit(e, g)
            for _ in range(self.p.group_size):
                e.waiting.append((self.draw(), g))
        if (self.p.swap_min_lag > 1 and e.in_flight < self.p.groups_in_flight and e.version < self.V
                and e.staging is None and not e.swapping):  # fmt: skip
            self.start_handoff(e)  # a refused worker makes the lazy actor's swap due (actors.swap_min_lag)
        if e.in_flight < self.p.groups_in_flight and self.p.admission_events and self.p.admission_poll_s > 0:
            # Refused: besides the hints, the real worker retries admission_poll_s after this attempt.
            # That poll is what admits it after its own engine's swap (unless swap_wakes_admission).
            e.poll_epoch += 1
            self.at(self.t + self.p.admission_poll_s, "poll", (e, e.poll_epoch))
        if started:
            self.fill(e)
            self.schedule_finish(e)
            self.arm_fill_check()  # this admission may have saturated the window

    def draw(self) -> float:
        """A completion length; whole tokens when the engine steps discretely."""
        x = self.lengths.draw()
        return float(max(1, math.ceil(x - 1e-9))) if self.p.engine_steps else x

    def fill(self, e: SimEngine) -> None:
        """Start waiting sequences while the engine has room (called with ``e`` advanced to now)."""
        if self.p.engine_steps and e.stepping:
            return  # they join at the next step
        cap = self.p.max_running_seqs or float("inf")
        while e.waiting and len(e.running) < cap:
            length, g = e.waiting.popleft()
            heapq.heappush(e.running, (e.W + length, next(self.ids), e.W, g))

    def wake(self, engines: list[SimEngine], delay: float | None = None) -> None:
        """Blocked workers of ``engines`` retry after ``delay`` (default: the expected poll delay).
        A wake with its own delay is not merged into a pending one: it may come first."""
        for e in engines:
            if e.in_flight < self.p.groups_in_flight and (delay is not None or not e.retry_pending):
                e.retry_pending = True
                self.at(self.t + (self.retry_delay if delay is None else delay), "retry", e)

    def submit(self, e: SimEngine, g: SimGroup) -> None:
        """The group's completions reach the engine (called with ``e`` advanced to now)."""
        g.t_gen0, g.paused0 = self.t, e.paused_s

    def on_start(self, g: SimGroup) -> None:
        e = g.actor
        e.advance(self.t)
        self.submit(e, g)
        for _ in range(self.p.group_size):
            e.waiting.append((self.draw(), g))
        self.fill(e)
        self.schedule_finish(e)

    def on_retry(self, e: SimEngine) -> None:
        self.try_admit(e)

    def on_poll(self, arg: tuple[SimEngine, int]) -> None:
        e, epoch = arg
        if epoch == e.poll_epoch and not e.retry_pending:
            self.try_admit(e)

    def on_finish(self, arg: tuple[SimEngine, int]) -> None:
        e, epoch = arg
        if epoch != e.epoch:
            return
        e.advance(self.t)
        # This event was timed for the head sequence's end (a later rate change would have bumped
        # the epoch), so the head is due now: snap W to it rather than trust float round-off.
        if e.running and e.running[0][0] > e.W:
            e.W = e.running[0][0]
        self.complete(e)
        self.fill(e)
        self.schedule_finish(e)

    def on_estep(self, e: SimEngine) -> None:
        """engine_steps: a decode step ended; every running sequence has one more token."""
        e.advance(self.t)
        e.stepping = False
        e.W += 1.0
        self.complete(e)
        if e.pause_pending:  # a swap waited for this step
            e.pause_pending = False
            self.on_notice(e)
        self.schedule_finish(e)

    def complete(self, e: SimEngine) -> None:
        """Retire the sequences that reached their length; a group's last one schedules its write."""
        while e.running and e.running[0][0] <= e.W + _EPS:
            w_end, _, w_start, g = heapq.heappop(e.running)
            for v, n in e.tokens_by_version(w_start, w_end).items():
                g.versions[v] = g.versions.get(v, 0.0) + n
            g.left -= 1
            if g.left == 0:
                g.decode_s = self.t - g.t_gen0 - (e.paused_s - g.paused0)
                self.decoded += 1
                self.decode_total += g.decode_s
                self.decode_sq += g.decode_s**2
                self.at(self.t + self.p.group_overhead_s, "written", g)

    def on_written(self, g: SimGroup) -> None:
        e = g.actor
        e.advance(self.t)
        e.in_flight -= 1
        self.buffer.append(g)
        if self.filling:
            self.unread_changed()
            self.arm_fill_check()
        self.try_admit(e)
        if self.learner_waiting:
            self.gather()

    def swap_due(self, e: SimEngine) -> bool:
        """swap_min_lag (actors.swap_min_lag): V is that far ahead of ``e``, or ``e`` has a worker refused
        by admission (an engine below groups_in_flight after an attempt was refused)."""
        lag = self.p.swap_min_lag
        return lag <= 1 or self.V - e.version >= lag or e.in_flight < self.p.groups_in_flight

    def start_handoff(self, e: SimEngine) -> None:
        """The actor starts handing V to ``e`` (noticed now; staged; then the pause)."""
        e.staging = self.V
        extra = self.p.swap_latency_running_extra_s if e.running or e.waiting else 0.0
        work = self.p.swap_latency_work
        f = work[self.V % len(work)] if work else None  # the measured run's hand-off of this version
        if f is None:
            f = self.handoff_jitter.lognormvariate(self.ho_mu, self.ho_sigma) if self.ho_sigma > 0 else 1.0
        self.at(self.t + (self.p.swap_latency_s + extra) * f, "notice", e)

    def on_notice(self, e: SimEngine) -> None:
        """The hand-off of ``e.staging`` is ready: pause the engine (between steps) and swap."""
        if e.swapping or e.staging is None:
            return
        if self.p.engine_steps and e.stepping:
            e.pause_pending = True  # the scheduler pauses between steps
            return
        e.advance(self.t)
        e.paused = e.swapping = True
        e.epoch += 1  # no progress while paused
        self.engines_changed()
        # The measured extra of a swap with sequences running is, on an engine core that serves the
        # commit between two steps, the wait for the step in progress (it decodes meanwhile): discrete
        # steps took that wait above, and stop only for the commit (swap_s). Paying the extra after
        # the step too started every version late: the demo's eta-4 staleness came out 10-16% high.
        running = (e.running or e.waiting) and not self.p.engine_steps
        extra = self.p.swap_running_extra_s if running else 0.0
        self.at(self.t + self.p.swap_s + extra, "swapped", (e, e.staging))

    def on_swapped(self, arg: tuple[SimEngine, int]) -> None:
        e, version = arg
        e.advance(self.t)
        e.paused = e.swapping = False
        e.version = version
        e.staging = None
        e.swap_w.append(e.W)
        e.swap_v.append(version)
        self.schedule_finish(e)  # (also re-times the learner: the engine's state changed)
        if not self.p.admission_events:
            self.wake([e])
        elif self.p.swap_wakes_admission:
            self.wake(
                [e], self.p.swap_wake_s
            )  # its next poll, half a period later on average; with events: its poll timer
        if e.version < self.V and self.swap_due(e):  # published meanwhile: it hands over the newest
            self.start_handoff(e)


def simulate(p: PlanInputs) -> PlanResult:
    """Run the pipeline model for ``p.steps`` learner steps; steady-state numbers (see summarize),
    averaged over ``p.seeds`` simulations (seeds ``p.seed`` on)."""
    if p.max_staleness < 0:  # no group could ever be admitted: the event loop would never reach p.steps
        raise ValueError(f"max_staleness={p.max_staleness} must be >= 0")
    if p.seeds == 1:
        return summarize(p, _Sim(p).run())
    runs = [replace(p, seed=p.seed + i, seeds=1) for i in range(p.seeds)]
    return average([summarize(q, _Sim(q).run()) for q in runs])
