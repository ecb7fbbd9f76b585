"""The simulator's engine model: one actor's continuous-batching engine and the groups it decodes.

See :mod:`asyncrl.plan.simulate` for the model (fluid or discrete steps, the work counter ``W`` and
exact per-token versions from the engine's swap history in ``W`` coordinates).
"""

from __future__ import annotations

import bisect
from collections import deque

from .inputs import PlanInputs
from .results import EPS

__all__ = ["SimEngine", "SimGroup"]


class SimGroup:
    __slots__ = ("actor", "left", "versions", "t_gen0", "paused0", "decode_s")

    def __init__(self, actor: SimEngine, n: int) -> None:
        self.actor = actor
        self.left = n
        self.versions: dict[int, float] = {}  # policy version -> tokens it sampled
        # Its decode time, as the actor's timeline measures it (asyncrl.plan.handoff.group_decodes):
        # from its submission to the engine to its last token, less the engine's swap pauses between.
        self.t_gen0 = 0.0
        self.paused0 = 0.0  # the engine's paused_s at the submission
        self.decode_s = 0.0

    @property
    def oldest(self) -> int:
        return min(self.versions) if self.versions else self.actor.version


class SimEngine:
    """One actor's engine in fluid form (see the module docstring)."""

    def __init__(self, index: int, p: PlanInputs) -> None:
        self.index = index
        self.p = p
        self.W = 0.0
        self.t = 0.0
        self.running: list[tuple[float, int, float, SimGroup]] = []  # heap (W_end, id, W_start, group)
        self.waiting: deque[tuple[float, SimGroup]] = deque()  # (length, group) beyond max_running_seqs
        self.paused = False
        self.swapping = False
        self.version = 0
        self.swap_w = [0.0]  # W at each version change; versions_at[i] holds from swap_w[i]
        self.swap_v = [0]
        self.in_flight = 0  # groups admitted and not yet written
        self.epoch = 0  # invalidates a scheduled finish event when the rate changes
        self.retry_pending = False
        self.poll_epoch = 0  # invalidates a scheduled poll retry when a newer refusal re-arms it
        self.blocked_s = 0.0  # integral of (groups_in_flight - in_flight) dt
        self.busy_s = 0.0
        self.paused_s = 0.0  # seconds paused for swaps so far
        self.slow = 1.0  # gen_slowdown while a co-located learner works
        self.stepping = False  # engine_steps: a decode step is in progress
        self.pause_pending = False  # engine_steps: a swap waits for the step to end
        # The version the actor is handing to this engine (noticed, verified, staged), None when idle:
        # one hand-off at a time, of the version it noticed (asyncrl.plan.simulate, "Swaps").
        self.staging: int | None = None

    def rate(self) -> float:
        if self.p.engine_steps:  # W moves at step ends only; > 0 says "decoding"
            return 1.0 if self.stepping else 0.0
        n = len(self.running)
        if self.paused or n == 0:
            return 0.0
        return 1.0 / ((self.p.gen_step_s + n * self.p.gen_token_s) * self.slow)

    def advance(self, t: float) -> None:
        dt = t - self.t
        if dt > 0:
            r = self.rate()
            if not self.p.engine_steps:
                self.W += dt * r
            if r > 0:
                self.busy_s += dt
            if self.paused:
                self.paused_s += dt
            self.blocked_s += dt * (self.p.groups_in_flight - self.in_flight)
            self.t = t

    def tokens_by_version(self, w0: float, w1: float) -> dict[int, float]:
        """Split the work interval [w0, w1] over the versions the engine served in it."""
        out: dict[int, float] = {}
        i = bisect.bisect_right(self.swap_w, w0) - 1
        while w0 < w1 - EPS:
            end = self.swap_w[i + 1] if i + 1 < len(self.swap_w) else w1
            seg = min(end, w1) - w0
            if seg > 0:
                out[self.swap_v[i]] = out.get(self.swap_v[i], 0.0) + seg
            w0 = min(end, w1)
            i += 1
        return out
