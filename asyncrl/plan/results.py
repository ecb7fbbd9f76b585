"""What a simulation returns: one record per learner step and the steady-state summary over them.

The window (steps ``warmup_steps + 1 .. steps``) is the one :func:`asyncrl.plan.calibrate.measure`
uses on a real run's metrics.jsonl, so predicted and measured numbers compare like for like.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any

from .inputs import PlanInputs

__all__ = ["EPS", "PlanResult", "StepTrace", "average", "summarize"]

EPS = 1e-9


@dataclass
class StepTrace:
    """One simulated learner step (the fields a real metrics.jsonl record has)."""

    step: int
    time: float  # end of the step
    wait_s: float
    tokens: float
    sequences: int
    staleness_hist: dict[int, float]  # staleness -> trained tokens
    dropped_stale: int
    blocked_worker_s: float  # cumulative over all actors' workers at the end of the step
    busy_engine_s: float  # cumulative engine time with at least one running sequence
    train_s: float = 0.0  # wall seconds of the train phase (co-location slows it down)
    groups_decoded: int = 0  # cumulative: groups whose last token was sampled by the end of the step
    decode_s_total: float = 0.0  # cumulative: their decode seconds (SimGroup.decode_s)
    version: int = 0  # the newest published version V at the end of the step (after its publish, if any)
    decode_sq_total: float = 0.0  # cumulative: the squares of their decode seconds (for the spread)


@dataclass
class PlanResult:
    """Steady-state outputs of a simulation (see the module docstring for the window)."""

    samples_per_s: float
    tokens_per_s: float
    steps_per_s: float
    learner_idle_frac: float  # share of the window the learner waited for data
    actor_blocked_frac: float  # share of worker time spent refused by admission
    engine_busy_frac: float  # share of engine time with sequences running (not paused, not empty)
    staleness_mean: float  # over trained tokens
    staleness_max: int
    staleness_dist: dict[int, float]  # staleness -> share of trained tokens
    dropped_stale: int
    window_s: float
    train_s_per_token: float = 0.0  # wall seconds of train phases per trained token
    learner_busy_s_per_step: float = 0.0  # wall seconds per step not spent waiting for data
    group_decode_s: float = 0.0  # mean seconds from a group's submission to its last token, less swap pauses
    group_decode_cv: float = 0.0  # their coefficient of variation (population)
    steps: list[StepTrace] = field(default_factory=list, repr=False)

    def as_dict(self) -> dict[str, Any]:
        d = {k: v for k, v in self.__dict__.items() if k != "steps"}
        d["staleness_dist"] = {str(k): v for k, v in self.staleness_dist.items()}
        return d


def summarize(p: PlanInputs, trace: list[StepTrace]) -> PlanResult:
    """Steady-state numbers over steps ``warmup_steps + 1 .. steps`` of a trace."""
    first = trace[p.warmup_steps - 1] if p.warmup_steps > 0 else None
    t0 = first.time if first else 0.0
    window = trace[p.warmup_steps :]
    dur = max(trace[-1].time - t0, EPS)
    hist: dict[int, float] = {}
    for s in window:
        for k, n in s.staleness_hist.items():
            hist[k] = hist.get(k, 0.0) + n
    tot = sum(hist.values()) or 1.0
    workers = p.num_actors * p.groups_in_flight
    b0 = first.blocked_worker_s if first else 0.0
    u0 = first.busy_engine_s if first else 0.0
    n0, d0, q0 = (
        (first.groups_decoded, first.decode_s_total, first.decode_sq_total) if first else (0, 0.0, 0.0)
    )
    n_dec = trace[-1].groups_decoded - n0
    dec_mean = (trace[-1].decode_s_total - d0) / n_dec if n_dec else 0.0
    dec_var = max((trace[-1].decode_sq_total - q0) / n_dec - dec_mean**2, 0.0) if n_dec else 0.0
    return PlanResult(
        samples_per_s=sum(s.sequences for s in window) / dur,
        tokens_per_s=sum(s.tokens for s in window) / dur,
        steps_per_s=len(window) / dur,
        learner_idle_frac=sum(s.wait_s for s in window) / dur,
        actor_blocked_frac=(trace[-1].blocked_worker_s - b0) / (workers * dur),
        engine_busy_frac=(trace[-1].busy_engine_s - u0) / (p.num_actors * dur),
        staleness_mean=sum(k * n for k, n in hist.items()) / tot,
        staleness_max=max((k for k, n in hist.items() if n > 0), default=0),
        staleness_dist={k: hist[k] / tot for k in sorted(hist)},
        dropped_stale=sum(s.dropped_stale for s in window),
        window_s=dur,
        train_s_per_token=sum(s.train_s for s in window) / max(sum(s.tokens for s in window), EPS),
        learner_busy_s_per_step=(dur - sum(s.wait_s for s in window)) / len(window),
        group_decode_s=dec_mean,
        group_decode_cv=math.sqrt(dec_var) / dec_mean if dec_mean > 0 else 0.0,
        steps=trace,
    )


def average(results: list[PlanResult]) -> PlanResult:
    """The mean of simulations of one pipeline (different seeds): every number is the mean of theirs,
    except the maximum staleness (the largest), the drops (rounded), the staleness distribution (the
    mean share per staleness: its shares still sum to 1) and the step trace (the first one's)."""
    if not results:
        raise ValueError("average of no results")
    n = len(results)
    out: dict[str, Any] = {}
    for f in fields(PlanResult):
        xs = [getattr(r, f.name) for r in results]
        if f.name == "steps":
            out[f.name] = xs[0]
        elif f.name == "staleness_max":
            out[f.name] = max(xs)
        elif f.name == "staleness_dist":
            keys = sorted({k for d in xs for k in d})
            out[f.name] = {k: sum(d.get(k, 0.0) for d in xs) / n for k in keys}
        elif f.name == "dropped_stale":
            out[f.name] = round(sum(xs) / n)
        else:  # a float; a new field of another type fails here instead of averaging silently
            out[f.name] = sum(xs) / n
    return PlanResult(**out)
