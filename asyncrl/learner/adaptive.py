"""Adaptive staleness: the learner sets the admission bound at run time from what it measures.

``buffer.max_staleness`` stays the hard bound (groups staler than it are dropped at train time) and
the ceiling; with ``buffer.adaptive.enabled`` the learner's rank 0 moves the *admission* bound
``b`` in ``[buffer.adaptive.min_bound, max_staleness]``, one step at a time, every
``buffer.adaptive.every_steps`` learner steps, from the means over that window of:

* the learner's idle fraction (seconds waiting for data / seconds per step): the learner starves,
  so let the actors run further ahead (``b + 1``) - asynchrony is what buys throughput;
* the effective sample size of the importance weights (``ess``, normalised, in (0, 1]) and the
  drift KL(mu || pi_prox) of each stale token bucket (``drift_kl``, s >= 1, in excess of the s = 0
  bucket's engine/trainer mismatch: :func:`staleness_drift`): the data got too far off-policy for
  the correction to hold, so pull the actors closer (``b - 1``).

Quality wins over throughput: a window with a bad ESS or KL lowers the bound even if the learner
idled. The bound is written to Redis (:meth:`asyncrl.buffer.ReplayBuffer.set_staleness_bound`),
where the admission Lua script reads it on every admission, so it takes effect at the next group an
actor asks to start; groups admitted under a looser bound are still trained (they are within the
hard bound). Every decision is logged, appended to ``<run_dir>/staleness_bound.jsonl`` and exported
as the ``asyncrl_buffer_staleness_bound_steps`` gauge (buffer stats).

:class:`StalenessController` is the pure decision logic (unit-tested); :func:`install` wires it to
the buffer and the run dir.

Resume: the controller's state (:meth:`StalenessController.state`: the bound, the records of the
window so far, the fresh-bucket KL, the last step it saw) travels in the learner's checkpoint
(``LearnerState.adaptive``). A resumed learner restores it and writes the *restored* bound to Redis,
not the start bound, so a bound lowered for a bad ESS stays lowered across a crash. The checkpoint of
step ``s`` is taken before step ``s``'s record reaches the callbacks, so :func:`install` feeds the
controller the records of the steps after its last one up to ``s`` again from ``metrics.jsonl``
(which keeps steps <= ``s``); ``staleness_bound.jsonl`` loses the decisions of the steps the resume
discarded. The resumed controller then decides exactly as an uninterrupted one would. A checkpoint
without the state (adaptive off, or an older asyncrl) restarts the controller from its start bound.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, is_dataclass
from pathlib import Path
from typing import Any

from asyncrl.learner.records import METRICS_FILE, records_after, truncate_jsonl

__all__ = ["AdaptiveBound", "Decision", "StalenessController", "install", "staleness_drift", "truncate_log",
           "BOUND_LOG"]  # fmt: skip

log = logging.getLogger(__name__)
BOUND_LOG = "staleness_bound.jsonl"


@dataclass(frozen=True)
class Decision:
    """One evaluation of the controller (every ``every_steps`` steps), whether or not it moved ``bound``."""

    step: int
    bound: int
    previous: int
    reason: str  # "starved" (raised), "ess" / "drift_kl" (lowered), "hold", or "at limit"
    idle_frac: float
    ess: float | None
    drift_kl: float | None


class StalenessController:
    """Pure decision logic of the adaptive admission bound (see the module doc)."""

    def __init__(self, max_staleness: int, *, min_bound: int = 0, start: int = -1, every_steps: int = 5,
                 target_idle: float = 0.2, min_ess: float = 0.5, max_drift_kl: float = 0.05) -> None:  # fmt: skip
        if not 0 <= min_bound <= max_staleness:
            raise ValueError(f"min_bound={min_bound} must be in [0, max_staleness={max_staleness}]")
        self.max_staleness, self.min_bound = max_staleness, min_bound
        self.bound = max_staleness if start < 0 else min(max(start, min_bound), max_staleness)
        self.every_steps, self.target_idle = every_steps, target_idle
        self.min_ess, self.max_drift_kl = min_ess, max_drift_kl
        self._window: list[dict[str, Any]] = []  # the window so far, as _compact records
        self._fresh_kl: float | None = None  # the s = 0 bucket's mean of the last window that had one
        self.last_step = 0  # the step of the last record observed (0: none)

    def observe(self, rec: Mapping[str, Any]) -> Decision | None:
        """Take one step record; every ``every_steps`` records, decide and return the decision."""
        self._window.append(_compact(rec))
        self.last_step = self._window[-1]["step"]
        if len(self._window) < self.every_steps:
            return None
        win, self._window = self._window, []
        step_s = sum(float(r.get("step_s", 0.0)) for r in win)
        idle = sum(float(r.get("wait_s", 0.0)) for r in win) / step_s if step_s > 0 else 0.0
        # ESS only where importance weights were computed (a step without loss tokens reports NaN); an
        # ESS of 0 (every weight masked) is the worst measurement, not a missing one.
        ess_vals = [
            float(r["ess"]) for r in win if r.get("ess") is not None and math.isfinite(float(r["ess"]))
        ]
        ess = sum(ess_vals) / len(ess_vals) if ess_vals else None
        means = bucket_means(win)
        kl = _drift(means, self._fresh_kl)
        self._fresh_kl = means.get(0, self._fresh_kl)
        prev = self.bound
        if ess is not None and ess < self.min_ess:
            reason, want = "ess", prev - 1
        elif kl is not None and kl > self.max_drift_kl:
            reason, want = "drift_kl", prev - 1
        elif idle > self.target_idle:
            reason, want = "starved", prev + 1
        else:
            reason, want = "hold", prev
        self.bound = min(max(want, self.min_bound), self.max_staleness)
        if self.bound == prev and want != prev:
            reason = "at limit"
        return Decision(int(win[-1].get("step", 0)), self.bound, prev, reason, idle, ess, kl)

    def state(self) -> dict[str, Any]:
        """Everything its next decisions depend on besides the config, JSON-safe (a checkpoint's)."""
        return {"bound": self.bound, "window": [dict(r, drift_kl=dict(r["drift_kl"])) for r in self._window],
                "fresh_kl": self._fresh_kl, "step": self.last_step}  # fmt: skip

    def restore(self, state: Mapping[str, Any]) -> None:
        """Continue from :meth:`state`'s output. A bound outside this config's ``[min_bound,
        max_staleness]`` (the config changed across the resume) is clipped into it."""
        bound = int(state["bound"])
        self.bound = min(max(bound, self.min_bound), self.max_staleness)
        if self.bound != bound:
            log.warning("adaptive staleness: the restored bound %d is outside [%d, %d]: clipped to %d",
                        bound, self.min_bound, self.max_staleness, self.bound)  # fmt: skip
        self._window = [_compact(r) for r in state.get("window", [])]
        fresh = state.get("fresh_kl")
        self._fresh_kl = None if fresh is None else float(fresh)
        self.last_step = int(state.get("step", 0))


def _compact(rec: Mapping[str, Any]) -> dict[str, Any]:
    """The fields of a step record a decision reads, JSON-safe; a value the decision skips (a non-finite
    ESS or bucket KL: "nan" strings from metrics.jsonl too) is left out the same way (None / absent)."""
    ess = rec.get("ess")
    ess = float(ess) if ess is not None and math.isfinite(float(ess)) else None
    kl = {str(int(k)): float(v) for k, v in (rec.get("drift_kl") or {}).items() if math.isfinite(float(v))}
    return {"step": int(rec.get("step", 0)), "step_s": float(rec.get("step_s", 0.0)),
            "wait_s": float(rec.get("wait_s", 0.0)), "ess": ess, "drift_kl": kl}  # fmt: skip


def bucket_means(win: list[Mapping[str, Any]]) -> dict[int, float]:
    """Per token-staleness bucket, the mean of ``drift_kl`` over a window's steps (finite values only)."""
    buckets: dict[int, list[float]] = {}
    for r in win:
        for k, v in (r.get("drift_kl") or {}).items():
            if math.isfinite(float(v)):
                buckets.setdefault(int(k), []).append(float(v))
    return {s: sum(v) / len(v) for s, v in buckets.items()}


def staleness_drift(win: list[Mapping[str, Any]], fresh: float | None = None) -> float | None:
    """The drift the bound can act on, from a window of step records: of the stale buckets' means
    (s >= 1, :func:`bucket_means`) the worst one's excess over the fresh bucket's (s = 0), clipped at
    0; the fresh mean is the window's, else ``fresh`` (the last window that measured it: a window of
    only stale tokens, typical while the bound holds the actors back, carries the mismatch too), else
    0; None when no stale bucket has a finite value.

    Why not every bucket as it is: the s = 0 bucket is KL(mu || pi_prox) of tokens sampled by the very
    weights being trained, i.e. the engine/trainer mismatch (a bf16 engine against fp32 training,
    another kernel). No admission bound lowers it, and the stale buckets carry it too, so a mismatch
    above ``max_drift_kl`` alone would ratchet the bound down to ``min_bound``, throughput lost for
    nothing."""
    return _drift(bucket_means(win), fresh)


def _drift(means: Mapping[int, float], fresh: float | None) -> float | None:
    """:func:`staleness_drift` from the window's :func:`bucket_means`."""
    base = means.get(0, fresh if fresh is not None else 0.0)
    stale = [m for s, m in means.items() if s >= 1]
    return max(max(stale) - base, 0.0) if stale else None


class AdaptiveBound:
    """The learner's on-step callback (rank 0): feeds the controller each record, writes a moved bound
    to Redis and every decision to ``staleness_bound.jsonl``; :meth:`state` goes into the checkpoint."""

    def __init__(self, ctrl: StalenessController, buffer: Any, path: Path) -> None:
        self.ctrl, self.buffer, self.path = ctrl, buffer, path

    def __call__(self, rec: Any) -> None:
        d = self.ctrl.observe(asdict(rec) if is_dataclass(rec) else rec)
        if d is None:
            return
        if d.bound != d.previous:
            self.buffer.set_staleness_bound(d.bound)
            log.info("adaptive staleness: bound %d -> %d at step %d (%s: idle %.2f, ess %s, drift_kl %s)",
                     d.previous, d.bound, d.step, d.reason, d.idle_frac, d.ess, d.drift_kl)  # fmt: skip
        with self.path.open("a") as f:
            f.write(json.dumps(asdict(d)) + "\n")

    def state(self) -> dict[str, Any]:
        return self.ctrl.state()


def truncate_log(path: Path, step: int) -> None:
    """Drop the decisions of steps > ``step`` from the decision log (steps a resume discarded; they are
    decided again), replacing it atomically by its head; a torn last line from a kill goes too. Only the
    tail is read (the log grows with the run)."""
    truncate_jsonl(path, step)


def install(
    cfg: Any, buffer: Any, run_dir: Path, saved: Mapping[str, Any] | None = None, step: int = 0
) -> AdaptiveBound | None:
    """Set up the bound in Redis for this run and return the learner's on-step callback (None = off).

    ``saved``, ``step``: the controller state of the checkpoint the learner restored
    (``LearnerState.adaptive``) and its step (0 and None on a fresh start). Call it after the
    checkpoint is loaded and ``metrics.jsonl`` truncated to ``step``: the bound written to Redis is the
    restored one (the start bound without a state), and the decision log keeps no steps past ``step``.

    Off: any bound a previous run of this name left in Redis is removed, so admission uses
    ``max_staleness`` exactly as configured.
    """
    ac = cfg.buffer.adaptive
    if not ac.enabled:
        buffer.set_staleness_bound(None)
        return None
    ctrl = StalenessController(cfg.buffer.max_staleness, min_bound=ac.min_bound, start=ac.start,
                               every_steps=ac.every_steps, target_idle=ac.target_idle, min_ess=ac.min_ess,
                               max_drift_kl=ac.max_drift_kl)  # fmt: skip
    run_dir = Path(run_dir)
    adapt = AdaptiveBound(ctrl, buffer, run_dir / BOUND_LOG)
    replay: list[dict[str, Any]] = []
    if saved is not None:
        ctrl.restore(saved)
        # Records the checkpoint was taken before (its own step's, normally): fed again below.
        # Only the tail after the controller's last step (read from the end, not the run's whole history).
        by_step = {int(r["step"]): r for r in records_after(run_dir / METRICS_FILE, ctrl.last_step)}
        replay = [by_step[s] for s in range(ctrl.last_step + 1, step + 1) if s in by_step]
        if len(replay) < step - ctrl.last_step:
            log.warning("adaptive staleness: metrics.jsonl lacks records of steps %d-%d (killed between the "
                        "checkpoint and its record): the controller goes on without them",
                        ctrl.last_step + 1, step)  # fmt: skip
        log.info("adaptive staleness: admission bound restored to %d from the checkpoint of step %d "
                 "(max_staleness %d)", ctrl.bound, step, ctrl.max_staleness)  # fmt: skip
    elif step > 0:
        log.info("adaptive staleness: the checkpoint of step %d carries no controller state (adaptive was "
                 "off, or an older asyncrl): the bound restarts at %d", step, ctrl.bound)  # fmt: skip
    else:
        log.info("adaptive staleness: admission bound starts at %d (max_staleness %d)",
                 ctrl.bound, ctrl.max_staleness)  # fmt: skip
    truncate_log(adapt.path, min(ctrl.last_step, step) if saved is not None else step)
    buffer.set_staleness_bound(ctrl.bound)
    for rec in replay:
        adapt(rec)
    return adapt
