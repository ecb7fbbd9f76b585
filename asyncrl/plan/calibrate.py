"""Measure a real run and calibrate the simulator's inputs from it.

:func:`measure` reads a run dir (``config.yaml`` + the learner's ``metrics.jsonl``) and returns its
steady-state numbers over the same window the simulator reports (end of step ``warmup`` to the
last step), so predicted and measured numbers are comparable one to one.

:func:`calibrate` turns one or more run dirs into :class:`PlanInputs`, and says where every number
came from (``sources``: measured / fitted / config / assumed):

* the pipeline's shape (actors, concurrency, G, groups_per_step, eta, publish and checkpoint
  policy, max_tokens) comes from the run's config;
* learner seconds per token, per-step overhead, publish and checkpoint costs and the mean completion
  length are measured on the run with the smallest eta (the one where learner and actors overlap
  least, so its costs are the uncontended ones);
* the engine's decode step cost ``gen_step_s`` (a fixed cost per step: FLAT_STEP_SHARE in engine_fit, plus
  PREFILL_GROUP_SHARE of it per joining group) is fitted: the one value for which the simulator
  reproduces that run's trained tokens/s (bisection; throughput falls monotonically as generation
  slows); with discrete steps and actor timelines, the steps' jitter ``gen_step_cv`` is fitted to the
  measured spread of the groups' decode times, alternately with it (fit_step_jitter);
* given a second run with a larger eta (actors and learner overlap), the co-location factors are
  calibrated on it: ``learner_slowdown`` is the measured ratio of learner seconds per token,
  ``gen_slowdown`` is fitted to its throughput. Staleness is never fitted: it is a prediction.

:func:`calibrate_run` instead takes every input from the one run it is to predict, measured on its
components (learner wall costs, the hand-offs, the engine's decode step cost and its jitter fitted to
the measured decode times of its groups: their mean and spread), so that run's throughput and
staleness are both predictions.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from asyncrl.config import ConfigError
from asyncrl.learner.records import METRICS_FILE, read_jsonl

from .engine_fit import (
    PREFILL_SOURCE,
    STEP_SHARE_SOURCE,
    fit_engine,
    fit_input,
)
from .handoff import (
    Handoff,
    cv,
    handoff,
    handoff_samples,
    latency_factors,
    latency_trace,
    publish_ends,
    read_timeline,
)
from .inputs import Lengths, PlanInputs
from .simulate import simulate

__all__ = ["Measured", "measure", "calibrate", "calibrate_run", "inputs_from_run_config"]


@dataclass
class Measured:
    """Steady-state numbers of a real run (window: after step ``warmup``)."""

    run_dir: str
    max_staleness: int
    steps: int
    warmup: int
    window_s: float
    samples_per_s: float
    tokens_per_s: float
    learner_idle_frac: float
    staleness_mean: float
    staleness_max: int
    train_s_per_token: float
    step_overhead_s: float  # step_s - wait - train - publish on steps without a checkpoint
    checkpoint_s: float
    publish_s: float
    mean_length: float
    learner_busy_s_per_step: float = 0.0  # window seconds per step not spent waiting for data
    learner_cv: float = 0.0  # coefficient of variation of (step_s - wait_s)
    window_start: float = 0.0  # unix time the window starts (the actors' timelines are cut there)
    extra: dict[str, Any] = field(default_factory=dict)


#: A learner-bound run's throughput may sit this far below the unslowed-engine prediction (noise)
#: before the engines are taken as slowed down too.
GEN_FIT_SLACK = 0.08
#: Completions at most this long (mean, tokens) are simulated with discrete decode steps: a
#: completion then spans few engine steps, and whether a group joins a step or waits for the next, or a
#: swap waits for a step's end, moves whole steps' worth of tokens between versions. Longer ones are
#: simulated fluid (its limit, and far fewer events).
DISCRETE_STEPS_MAX_TOKENS = 64.0
#: Simulated steps (and warm-up) behind every fitted number: long enough that the simulator's own
#: sampling noise (lengths, learner jitter) is small next to a real run's.
FIT_STEPS, FIT_WARMUP = 300, 20


def default_warmup(n_steps: int) -> int:
    """Leading steps left out: the first one holds the start-up, the next ones fill the pipeline."""
    return min(max(3, n_steps // 10), max(n_steps - 2, 0))


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


def measure(run_dir: str | Path, warmup: int | None = None) -> Measured:
    rdir = Path(run_dir)
    recs = read_jsonl(rdir / METRICS_FILE)
    if len(recs) < 3:
        # A user's input (an empty or just-started run dir), not a bug: ConfigError is reported without
        # a traceback by the CLI.
        raise ConfigError(f"{rdir / METRICS_FILE}: {len(recs)} learner steps; need at least 3 to measure")
    cfg = OmegaConf.load(rdir / "config.yaml")
    k = default_warmup(len(recs)) if warmup is None else warmup
    t0 = recs[k - 1]["time"] if k > 0 else recs[0]["time"] - recs[0]["step_s"]
    win = recs[k:]
    dur = max(win[-1]["time"] - t0, 1e-9)
    tokens = sum(r["tokens"] for r in win)
    hist: dict[int, float] = {}
    for r in win:
        for s, n in r["staleness_hist"].items():
            hist[int(float(s))] = hist.get(int(float(s)), 0.0) + n
    plain = [r for r in win if not r["checkpointed"]]
    ckpt = [r for r in win if r["checkpointed"]]

    def residual(r: dict) -> float:
        return max(r["step_s"] - r["wait_s"] - r["train_s"] - r["publish_s"], 0.0)

    overhead = _mean([residual(r) for r in plain])
    return Measured(
        run_dir=str(rdir),
        max_staleness=int(cfg.buffer.max_staleness),
        steps=len(recs),
        warmup=k,
        window_s=dur,
        samples_per_s=sum(r["sequences"] for r in win) / dur,
        tokens_per_s=tokens / dur,
        learner_idle_frac=sum(r["wait_s"] for r in win) / dur,
        staleness_mean=sum(s * n for s, n in hist.items()) / max(sum(hist.values()), 1e-9),
        staleness_max=max((s for s, n in hist.items() if n > 0), default=0),
        train_s_per_token=sum(r["train_s"] for r in win) / max(tokens, 1),
        step_overhead_s=overhead,
        checkpoint_s=max(_mean([residual(r) for r in ckpt]) - overhead, 0.0) if ckpt else 0.0,
        publish_s=_mean([r["publish_s"] for r in win if r["published"]]),
        mean_length=tokens / max(sum(r["sequences"] for r in win), 1),
        learner_busy_s_per_step=(dur - sum(r["wait_s"] for r in win)) / len(win),
        learner_cv=cv([r["step_s"] - r["wait_s"] for r in win]),
        window_start=float(recs[k - 1]["step_time"])
        if k > 0 and "step_time" in recs[k - 1]
        else float("-inf"),
    )


def measure_handoffs(runs: list[Measured]) -> Handoff:
    """The hand-off costs (asyncrl.plan.handoff) pooled over the steady-state windows of ``runs``."""
    return handoff([handoff_samples(m.run_dir, read_jsonl(Path(m.run_dir) / METRICS_FILE), m.window_start)
                    for m in runs])  # fmt: skip


def inputs_from_run_config(run_dir: str | Path, base: PlanInputs | None = None) -> PlanInputs:
    """The pipeline's shape from a run dir's ``config.yaml`` (costs left as in ``base``)."""
    cfg = OmegaConf.load(Path(run_dir) / "config.yaml")
    a, b, lrn = cfg.actors, cfg.buffer, cfg.learner
    p = base or PlanInputs()
    return replace(
        p,
        num_actors=int(a.num_actors),
        groups_in_flight=int(a.groups_in_flight),
        group_size=int(a.group_size),
        admission_poll_s=float(a.admission_poll_s),
        admission_events=bool(a.get("admission_events", False)),  # run dirs from before the events: polled
        refuse_stale_weights=bool(a.refuse_stale_weights),
        swap_min_lag=int(a.get("swap_min_lag", 1)),  # run dirs from before the option: every version
        groups_per_step=int(b.groups_per_step),
        max_staleness=int(b.max_staleness),
        fill_window=bool(lrn.get("fill_window", False)),  # run dirs from before the knob: no wait
        publish_every=int(lrn.publish_every),
        # Run dirs from before learner.publish_policy published every publish_every steps.
        publish_policy=str(lrn.get("publish_policy", "steps")),
        publish_max_steps=int(lrn.get("publish_max_steps", 4)),
        checkpoint_every=int(lrn.checkpoint_every),
        lengths=replace(p.lengths, max_tokens=float(a.max_tokens)),
    )


def _measured_run(m: Measured, base: PlanInputs | None) -> tuple[PlanInputs, dict[str, str]]:
    """The shape of run ``m`` (its config) with its completion lengths and learner costs measured."""
    p = inputs_from_run_config(m.run_dir, base)
    sources = {k: "config" for k in ("num_actors", "groups_in_flight", "group_size", "groups_per_step",
                                      "max_staleness", "fill_window", "publish_every", "publish_policy",
                                      "publish_max_steps", "checkpoint_every",
                                      "refuse_stale_weights", "swap_min_lag", "admission_poll_s", "admission_events",
                                      "lengths.max_tokens")}  # fmt: skip
    law = p.lengths
    if law.kind == "lognormal" and not law.min_tokens < m.mean_length < law.max_tokens:
        law = replace(law, kind="fixed")  # every completion at the cap: no spread to model
    p = replace(
        p,
        engine_steps=m.mean_length <= DISCRETE_STEPS_MAX_TOKENS,
        lengths=replace(law, mean=min(max(m.mean_length, law.min_tokens), law.max_tokens)),
        learner_token_s=m.train_s_per_token,
        learner_step_s=m.step_overhead_s,
        publish_s=m.publish_s,
        checkpoint_s=m.checkpoint_s,
        learner_cv=m.learner_cv,
        steps=FIT_STEPS,
        warmup_steps=FIT_WARMUP,
    )
    return p, sources


def calibrate(
    run_dirs: list[str | Path], base: PlanInputs | None = None
) -> tuple[PlanInputs, dict[str, str]]:
    """Simulator inputs from real runs, and where each came from (see the module docstring)."""
    if not run_dirs:
        raise ValueError("calibrate needs at least one run dir")
    runs = sorted((measure(d) for d in run_dirs), key=lambda m: m.max_staleness)
    ref = runs[0]
    p, sources = _measured_run(ref, base)
    sources["engine_steps"] = (f"measured mean length {ref.mean_length:.1f} tokens "
                               f"{'<=' if p.engine_steps else '>'} {DISCRETE_STEPS_MAX_TOKENS:g}")  # fmt: skip
    sources.update({"lengths.mean": f"measured ({ref.run_dir})", "learner_token_s": "measured",
                    "learner_step_s": "measured (per-step overhead)", "publish_s": "measured",
                    "checkpoint_s": "measured", "gen_step_s": f"fitted to {ref.tokens_per_s:.1f} tok/s",
                    "gen_token_s": STEP_SHARE_SOURCE, "gen_prefill_s": PREFILL_SOURCE,
                    "swap_s": "assumed", "swap_latency_s": "assumed",
                    "group_overhead_s": "assumed", "lengths.kind": "assumed", "lengths.sigma": "assumed"})  # fmt: skip
    # The hand-offs, from the actors' timelines of every run given (each cost is the same mechanism at
    # any eta; pooling gives more samples). A run dir without timelines keeps the assumed values.
    h = measure_handoffs(runs)
    p = apply_handoffs(p, h, sources)
    p = fit_engine(p, ref.tokens_per_s, h.decode(p.engine_steps)[1], sources)
    overlap = [m for m in runs[1:] if m.max_staleness > ref.max_staleness]
    if overlap:
        # Two unknowns, two observables of the overlapping run: the learner's busy seconds per step
        # (its slowdown only acts while engines work, so it is fitted, not a plain ratio) and tok/s.
        o = overlap[-1]
        q = replace(p, max_staleness=o.max_staleness, learner_cv=o.learner_cv)
        for _ in range(3):
            ls = fit_input(lambda x, q=q: replace(q, learner_slowdown=x), o.learner_busy_s_per_step, 1.0, 50.0,
                      decreasing=False, key="learner_busy_s_per_step")  # fmt: skip
            q = replace(q, learner_slowdown=ls)
            # The smallest engine slowdown that explains the throughput: a learner-bound run's tok/s
            # does not depend on it, and then the engines are taken as unslowed.
            if simulate(replace(q, gen_slowdown=1.0)).tokens_per_s > o.tokens_per_s * (1 + GEN_FIT_SLACK):
                q = replace(
                    q,
                    gen_slowdown=fit_input(
                        lambda x, q=q: replace(q, gen_slowdown=x), o.tokens_per_s, 1.0, 50.0
                    ),
                )
            else:
                q = replace(q, gen_slowdown=1.0)
        p = replace(
            p, learner_slowdown=q.learner_slowdown, gen_slowdown=q.gen_slowdown, learner_cv=o.learner_cv
        )
        sources["learner_cv"] = f"measured (eta={o.max_staleness})"
        sources["learner_slowdown"] = (
            f"fitted to {o.learner_busy_s_per_step * 1e3:.1f} learner ms/step at eta={o.max_staleness}"
        )
        sources["gen_slowdown"] = f"fitted to {o.tokens_per_s:.1f} tok/s at eta={o.max_staleness}"
    return replace(p, seeds=PREDICT_SEEDS), sources  # predictions average (the fits above took one)


#: The hand-offs the simulator takes from a run's timelines (asyncrl.plan.handoff.Handoff fields).
HANDOFF_KEYS = ("swap_s", "swap_running_extra_s", "swap_latency_s", "swap_latency_running_extra_s",
                "swap_latency_cv", "group_overhead_s", "group_start_s", "admission_wake_s")  # fmt: skip


#: calibrate_run(replay=True) simulates the run's steps this many times over (its learner trace
#: replayed in order each time): one pass is as short as the run's window, where the simulated
#: pipeline's sub-step timing is as sensitive as a real run's (eta=1 staleness moved by up to 0.3
#: versions between one pass and five); five keep the trace's slow and fast stretches in proportion.
REPLAY_CYCLES = 5
#: calibrate_run's prediction averages this many simulations (PlanInputs.seeds): the demo's eta-4
#: pipeline locks into one of two timing regimes by the seed of its length draws (staleness 1.7 or
#: 2.1 on one run's inputs, and the same for a 1% change of gen_token_s), so one simulation is a
#: draw: +19.6% on one run where the mean of 8 was +1.4% (ten eta-4 run dirs of 2026-11-28: the
#: mean of 8 within -1.7..+8.2% of each; docs/planning.md, "The commit's wait").
PREDICT_SEEDS = 8
#: A worker refused for stale weights admitted within this share of actors.admission_poll_s of its
#: engine's swap end (on average) was woken by the swap; one left to its poll waits about half a period.
SWAP_WAKE_MAX_POLL_SHARE = 0.25


def apply_handoffs(p: PlanInputs, h: Handoff, sources: dict[str, str]) -> PlanInputs:
    """``p`` with the hand-offs ``h`` measured (the others keep their value, marked assumed)."""
    for key in HANDOFF_KEYS:
        if getattr(h, key) is not None:
            p = replace(p, **{key: getattr(h, key)})
            sources[key] = f"measured ({h.swaps} swaps, {h.groups} groups, {h.woken} woken admissions)"
        else:
            sources.setdefault(key, "assumed")
    if h.swap_admit_s is not None:
        woken = h.swap_admit_s <= SWAP_WAKE_MAX_POLL_SHARE * p.admission_poll_s
        p = replace(p, swap_wakes_admission=woken, swap_wake_s=h.swap_admit_s if woken else p.swap_wake_s)
        sources["swap_wakes_admission"] = (
            f"measured (stale-weights admissions {h.swap_admit_s * 1e3:.1f} ms after a swap)"
        )
    else:
        sources.setdefault("swap_wakes_admission", "assumed")
    return p


def learner_work(steps: list[dict[str, Any]], p: PlanInputs) -> list[float]:
    """Per-step learner work factors of a run (metrics.jsonl records, in order): each step's busy
    seconds (step_s - wait_s) over what ``p``'s mean costs give for it (per-step overhead, its tokens,
    its publish and checkpoint). The first step's wall time holds the start-up: factor 1."""
    out = []
    for i, r in enumerate(steps):
        expected = (p.learner_step_s + p.learner_token_s * r["tokens"] + (p.publish_s if r["published"] else 0.0)
                    + (p.checkpoint_s if r["checkpointed"] else 0.0))  # fmt: skip
        busy = max(r["step_s"] - r["wait_s"], 0.0)
        out.append(busy / expected if i > 0 and expected > 0 else 1.0)
    return out


def calibrate_run(
    run_dir: str | Path, base: PlanInputs | None = None, replay: bool = True
) -> tuple[PlanInputs, dict[str, str]]:
    """The inputs of one run, each measured on that run's own components, to predict its pipeline.

    Unlike :func:`calibrate`, nothing is fitted to a pipeline output: the learner's costs are its
    measured wall seconds (per token, per step, per publish and checkpoint; co-location included, so
    no slowdown factor), the hand-offs come from the actors' timelines, and the engine's
    decode step cost ``gen_step_s`` (fixed, see FLAT_STEP_SHARE) is the one for which the simulated
    groups' mean decode time (submission to last token, less swap pauses) equals the measured one: a
    component's latency, not the pipeline's throughput or staleness. Those (and the learner's idle
    and the drops) are then the simulator's prediction.
    With ``replay`` the learner's per-step work is the run's own, step by step
    (:func:`learner_work`), over the run's steps and window: a learner slowed for part of the run
    (another process on the machine) makes the simulated pipeline learner-bound over that part too;
    and so are the actors' hand-offs, version by version (:func:`_replay_handoffs`).
    On this box identical runs differ by up to 30% in engine and learner speed (the 2 cores are
    shared), so a run is predicted from its own component costs rather than another run's.
    """
    m = measure(run_dir)
    p, sources = _measured_run(m, base)
    p = replace(p, learner_slowdown=1.0, gen_slowdown=1.0)
    steps = read_jsonl(Path(run_dir) / METRICS_FILE) if replay else []
    if replay:
        # The run's own steps, in order, over the same window.
        work = learner_work(steps, p)
        p = replace(p, learner_work=work, steps=REPLAY_CYCLES * len(work), warmup_steps=m.warmup)
        sources["learner_work"] = f"measured ({len(work)} steps replayed in order, {REPLAY_CYCLES} times)"
    h = measure_handoffs([m])
    if h.group_decode_s is None:
        raise ValueError(f"{run_dir}: no actor timeline (logs/*.timeline.jsonl) to measure the engine from")
    p = apply_handoffs(p, h, sources)
    if replay:
        p = _replay_handoffs(p, run_dir, steps, sources)
    # Discrete steps wait for the step in progress themselves (the commit's wait decodes): their
    # decode time is the one less only the commits (asyncrl.plan.handoff.group_decodes).
    decode_s, decode_cv = h.decode(p.engine_steps)
    p = fit_engine(p, decode_s, decode_cv, sources, decreasing=False, key="group_decode_s")
    # The prediction is the mean of PREDICT_SEEDS simulations (the fit above, of a component's
    # latency, takes one: it is the same in every regime within 1-2%).
    p = replace(p, seeds=PREDICT_SEEDS)
    sources.update({
        "engine_steps": f"measured mean length {m.mean_length:.1f} tokens",
        "lengths.mean": "measured", "lengths.kind": "assumed", "lengths.sigma": "assumed",
        "learner_token_s": "measured (wall, co-location included)", "learner_step_s": "measured",
        "publish_s": "measured", "checkpoint_s": "measured", "learner_cv": "measured",
        "learner_slowdown": "1 (in the measured wall seconds)", "gen_slowdown": "1 (in gen_step_s)",
        "gen_step_s": f"fitted to the measured group decode time {decode_s * 1e3:.1f} ms",
        "gen_token_s": STEP_SHARE_SOURCE, "gen_prefill_s": PREFILL_SOURCE,
    })  # fmt: skip
    return p, sources


def _replay_handoffs(
    p: PlanInputs, run_dir: str | Path, steps: list[dict[str, Any]], sources: dict[str, str]
) -> PlanInputs:
    """``p`` with the run's own hand-offs replayed by version (``swap_latency_work``), the whole run
    as the learner's work is, cycling with it: the list has one entry per version the run's steps
    (its metrics.jsonl records) published, so version v of the k-th pass takes the run's version v's
    factor."""
    groups, swaps = read_timeline(run_dir)
    factors = latency_factors(latency_trace(swaps, publish_ends(steps), groups), p.swap_latency_s,
                              p.swap_latency_running_extra_s)  # fmt: skip
    last = int(steps[-1]["version"]) if steps else 0
    if not factors or last < 1:
        return p
    factors = (factors + [None] * last)[:last]  # versions 0..last-1; version last cycles to 0
    sources["swap_latency_work"] = (
        f"measured ({sum(f is not None for f in factors)} hand-offs replayed by version, with the learner's work)"
    )
    return replace(p, swap_latency_work=factors)


def lengths_for(mean: float, max_tokens: float, sigma: float = 1.0) -> Lengths:
    """A heavy-tailed length law with the given truncated mean (helper for plan files and tests)."""
    return Lengths(kind="lognormal", mean=mean, sigma=sigma, min_tokens=1.0, max_tokens=max_tokens)
