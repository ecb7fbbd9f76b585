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
the buffer and the run dir. A resumed learner restarts the controller from its start bound.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, is_dataclass
from pathlib import Path
from typing import Any

__all__ = ["Decision", "StalenessController", "install", "staleness_drift", "BOUND_LOG"]

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
        self._window: list[Mapping[str, Any]] = []
        self._fresh_kl: float | None = None  # the s = 0 bucket's mean of the last window that had one

    def observe(self, rec: Mapping[str, Any]) -> Decision | None:
        """Take one step record; every ``every_steps`` records, decide and return the decision."""
        self._window.append(rec)
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


def install(cfg: Any, buffer: Any, run_dir: Path) -> Callable[[Any], None] | None:
    """Set up the bound in Redis for this run and return the learner's on-step callback (None = off).

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
    buffer.set_staleness_bound(ctrl.bound)
    path = Path(run_dir) / BOUND_LOG
    log.info(
        "adaptive staleness: admission bound starts at %d (max_staleness %d)", ctrl.bound, ctrl.max_staleness
    )

    def on_step(rec: Any) -> None:
        d = ctrl.observe(asdict(rec) if is_dataclass(rec) else rec)
        if d is None:
            return
        if d.bound != d.previous:
            buffer.set_staleness_bound(d.bound)
            log.info("adaptive staleness: bound %d -> %d at step %d (%s: idle %.2f, ess %s, drift_kl %s)",
                     d.previous, d.bound, d.step, d.reason, d.idle_frac, d.ess, d.drift_kl)  # fmt: skip
        with path.open("a") as f:
            f.write(json.dumps(asdict(d)) + "\n")

    return on_step
