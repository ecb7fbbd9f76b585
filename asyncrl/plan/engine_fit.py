"""The simulator's engine, fitted to a run: the two fits both calibrations share
(:func:`asyncrl.plan.calibrate.calibrate` to a run's tokens/s, :func:`~asyncrl.plan.calibrate.calibrate_run`
to its groups' decode times).

* ``gen_step_s``: a decode step's fixed cost (FLAT_STEP_SHARE of it per running sequence: 0), with
  PREFILL_GROUP_SHARE of it per group joining the step (``gen_prefill_s``), fitted by log-bisection
  (:func:`fit_engine_step`);
* ``gen_step_cv``: the spread of the steps' cost, fitted to the measured spread of the groups' decode
  times, alternately with ``gen_step_s`` (:func:`fit_step_jitter`).
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

from .inputs import PlanInputs
from .simulate import simulate

__all__ = [
    "FLAT_STEP_SHARE",
    "PREFILL_GROUP_SHARE",
    "PREFILL_SOURCE",
    "STEP_SHARE_SOURCE",
    "fit_engine",
    "fit_engine_step",
    "fit_input",
    "fit_step_jitter",
    "jitter_source",
]


def fit_input(
    make,
    target: float,
    lo: float,
    hi: float,
    decreasing: bool = True,
    iters: int = 24,
    key: str = "tokens_per_s",
) -> float:
    """x in [lo, hi] (log-bisection) with simulate(make(x)).<key> == target; clamps at the ends."""
    a, b = math.log(lo), math.log(hi)
    for _ in range(iters):
        mid = 0.5 * (a + b)
        got = getattr(simulate(make(math.exp(mid))), key)
        if (got > target) == decreasing:
            a = mid
        else:
            b = mid
    return math.exp(0.5 * (a + b))


#: The engine of both fits (calibrate_run, calibrate): a decode step costs FLAT_STEP_SHARE of itself per
#: running sequence on top of a fixed cost (``gen_token_s = FLAT_STEP_SHARE * gen_step_s``, ``gen_step_s``
#: fitted): 0, a fixed cost per step, not one per running sequence. Measured on the demo's engine alone (2026-11-28, 25 rounds):
#: a decode step took 3.2 ms with 8 sequences and 3.6 ms with 32 (one or four groups of 5 tokens:
#: 19.4 / 27.7 ms, less the prefill-only rounds' 6.6 / 13.4 ms, over 4 steps), and a small model's or
#: a memory-bound GPU's decode step is the same: its cost is the step, not the batch. Fitted per
#: sequence instead, a step of one group cost a quarter of a step of four, so the simulated groups
#: never shared steps: they reached the buffer one by one ~5 ms apart, where real ones arrive in
#: pairs (about half the gaps between two writes under 1 ms: groups that finish in one step go in
#: one put_many and are re-admitted together), and waited there 48/40/21/0 ms by their place in the
#: batch against 33/23/13/2 ms measured. Eight eta-4 demo runs of 2026-11-28 16:14-16:22 UTC, each
#: predicted from its own dir: staleness error +8.0..+16.7% (mean +11.1%) per sequence, -8.9..+14.4%
#: (mean +2.2%) flat; a small per-sequence share (0.5% or 2% of the step per sequence) gave means of
#: +4.9% / +4.4%. Throughput predictions moved by under 1.5 points. Three test runs (eta 0, 1, 4): eta-4
#: staleness +12.2 / +10.9 / +5.5% -> -1.1 / +3.8 / +0.5%; eta 1 within 1.3 points of before (docs/planning.md).
FLAT_STEP_SHARE = 0.0
#: ... and a group's prompt costs the step it joins PREFILL_GROUP_SHARE of a decode step (``gen_prefill_s
#: = PREFILL_GROUP_SHARE * gen_step_s / group_size`` per joining sequence). Measured on the same engine
#: alone: a prefill-only round (max_tokens 1) took 6.6 ms for one group and 13.4 ms for four, 2.3 ms
#: more per group, against a 3.2 ms decode step: 0.7. Without it every group's first step cost what a
#: decode step does, and only the step's jitter (gen_step_cv) spread the groups' decode times.
PREFILL_GROUP_SHARE = 0.7
STEP_SHARE_SOURCE = f"{FLAT_STEP_SHARE:g} x gen_step_s (a decode step's cost barely grows with its sequences)"
PREFILL_SOURCE = f"{PREFILL_GROUP_SHARE:g} x gen_step_s per joining group (a prompt's prefill, measured on the engine alone)"


def fit_engine_step(p: PlanInputs, target: float, **fit: Any) -> PlanInputs:
    """``p`` with the engine's decode step cost fitted (``fit_input``'s ``key``, tokens/s by default, equal to
    ``target``), ``gen_token_s`` being FLAT_STEP_SHARE of it: the one engine model of both fits."""
    pre = PREFILL_GROUP_SHARE / p.group_size
    step = fit_input(
        lambda x: replace(p, gen_step_s=x, gen_token_s=FLAT_STEP_SHARE * x, gen_prefill_s=pre * x),
        target,
        1e-7,
        10.0,
        **fit,
    )
    return replace(p, gen_step_s=step, gen_token_s=FLAT_STEP_SHARE * step, gen_prefill_s=pre * step)


#: Rounds of the two engine fits (gen_step_s to the mean decode time, gen_step_cv to its spread):
#: each moves the other's output a little (a jittered step makes groups wait for each other).
STEP_JITTER_ROUNDS = 2
#: The step spread's fit searches gen_step_cv in [lo, hi]: below lo it is 0 for the simulation.
STEP_CV_RANGE = (1e-3, 3.0)


def fit_step_jitter(p: PlanInputs, decode_cv: float, target: float, **fit: Any) -> PlanInputs:
    """``p`` with ``gen_step_cv`` fitted to the measured spread (CV) of a group's decode time, and
    ``gen_step_s`` refitted to ``target`` (``fit_engine_step``'s ``fit``) after each round. With every
    step alike the simulated groups lock into phase with the learner: on the eta-4 run of the CI
    attempt of 2026-11-28 18:47 UTC the simulated decode time had a CV of 0.02 against 0.19 measured,
    and the predicted staleness went 1.37 / 1.28 / 1.21 / 1.15 / 1.11 for gen_step_s x 0.9 / 0.95 / 1 /
    1.05 / 1.1 (1.626 measured); on another run 1.41 / 1.86 / 1.69 / 1.46 / 1.45."""
    for _ in range(STEP_JITTER_ROUNDS):
        c = fit_input(
            lambda x, p=p: replace(p, gen_step_cv=x),
            decode_cv,
            *STEP_CV_RANGE,
            decreasing=False,
            key="group_decode_cv",
        )
        p = replace(p, gen_step_cv=c if c > 2 * STEP_CV_RANGE[0] else 0.0)
        p = fit_engine_step(p, target, **fit)
    return p


def jitter_source(decode_cv: float) -> str:
    return f"fitted to the measured spread of the group decode time (CV {decode_cv:.3f})"


def fit_engine(
    p: PlanInputs, target: float, decode_cv: float | None, sources: dict[str, str], **fit: Any
) -> PlanInputs:
    """Both engine fits, as every calibration runs them: ``gen_step_s`` to ``target``, then (discrete
    steps with a measured spread ``decode_cv``) ``gen_step_cv`` alternately with it, naming the
    jitter's source in ``sources``. Without a measured spread the steps stay alike (cv 0)."""
    p = fit_engine_step(p, target, **fit)
    if p.engine_steps and decode_cv is not None:
        p = fit_step_jitter(p, decode_cv, target, **fit)
        sources["gen_step_cv"] = jitter_source(decode_cv)
    return p
