"""What the pipeline simulator needs to know: one typed, documented dataclass of inputs.

Every field has a unit and a meaning a user can measure (``asyncrl plan --from RUN_DIR`` fills the
measurable ones from a run) or must assume (a GPU fleet they do not have yet). Loaded like the run
config: a YAML file plus ``key=value`` overrides, validated with the same ``F(...)`` metadata, so a
bad value fails naming the key and the allowed range.

Invariant: imports neither torch, vllm nor ray (``asyncrl plan`` runs on a laptop).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from pathlib import Path

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from asyncrl.config import ConfigError, F, _validate

__all__ = ["PUBLISH_POLICIES", "Lengths", "PlanInputs", "check_publish_policy", "load_plan_inputs",
           "lognormal_mu_for_mean"]  # fmt: skip

#: learner.publish_policy's values: publish every publish_every steps, or once the engines took the last one.
PUBLISH_POLICIES = ("steps", "taken")


@dataclass
class Lengths:
    """Completion-length law, in tokens (continuous: the simulator's engines are fluid)."""

    kind: str = F(
        "lognormal",
        "fixed = every completion has `mean` tokens; lognormal = heavy-tailed, truncated to "
        "[min_tokens, max_tokens] with the truncated mean equal to `mean`.",
        choices=("fixed", "lognormal"),
    )
    mean: float = F(4.0, "Mean completion length after truncation, in tokens.", gt=0)
    sigma: float = F(
        1.0, "Log-space standard deviation of the lognormal (tail weight; 1.0 ~ reasoning).", ge=0
    )
    min_tokens: float = F(1.0, "Shortest completion, in tokens.", gt=0)
    max_tokens: float = F(16.0, "Longest completion (actors.max_tokens), in tokens.", gt=0)


@dataclass
class PlanInputs:
    """Inputs of the discrete-event simulator (asyncrl.plan.simulate)."""

    # actors
    num_actors: int = F(1, "vLLM engines (actors.num_actors).", ge=1)
    groups_in_flight: int = F(4, "Groups each actor keeps in flight (actors.groups_in_flight).", ge=1)
    group_size: int = F(8, "Completions per group (actors.group_size).", ge=1)
    max_running_seqs: int = F(
        0, "Sequences one engine decodes at once (vLLM max_num_seqs; 0 = all in flight).", ge=0
    )
    lengths: Lengths = F(Lengths(), "Completion-length distribution.")
    gen_step_s: float = F(
        0.0,
        "Seconds of one engine decode step regardless of batch (weight reads: dominates on GPUs).",
        ge=0,
    )
    gen_token_s: float = F(
        1e-3,
        "Seconds one decode step costs per running sequence (compute: dominates on CPUs). A step with "
        "n sequences takes gen_step_s + n * gen_token_s and yields one token per sequence.",
        ge=0,
    )
    gen_prefill_s: float = F(
        0.0,
        "Seconds a decode step costs per sequence that joins it: its prompt's prefill (engine_steps; the "
        "fluid engine has no steps to join).",
        ge=0,
    )
    gen_step_cv: float = F(
        0.0,
        "Coefficient of variation of one engine decode step's cost (engine_steps): each step draws a "
        "lognormal factor with mean 1. 0 = every step takes exactly its cost, and a pipeline of fixed "
        "steps can lock into a phase with the learner's steps that the real engine's jitter breaks "
        "(calibration fits it to the spread of the measured groups' decode times).",
        ge=0,
    )
    group_overhead_s: float = F(
        0.0, "Seconds from a group's last token to its write into the buffer (rewards, the write).", ge=0
    )
    engine_steps: bool = F(
        False,
        "Discrete decode steps, as vLLM iterates: a step takes gen_step_s + n * gen_token_s for the n "
        "sequences running at its start, sequences join and swaps pause only between steps, lengths "
        "are whole tokens. For engines whose steps are long next to the hand-offs (a CPU engine); the "
        "fluid engine (false) is its limit for short steps and much faster to simulate.",
    )
    group_start_s: float = F(
        0.0,
        "Seconds from a worker's admission attempt to its group decoding (the admission round trip).",
        ge=0,
    )
    admission_poll_s: float = F(0.05, "Retry period of a refused admission (actors.admission_poll_s).", ge=0)
    admission_events: bool = F(
        True,
        "actors.admission_events: a refused worker is woken by the event that can admit it (a publish, "
        "a credit) admission_wake_s later, instead of on its next poll (admission_poll_s / 2 on average).",
    )
    swap_wakes_admission: bool = F(
        False,
        "With admission_events: the actor wakes its workers refused for stale weights when its engine's "
        "swap ends (swap_wake_s later) instead of leaving them to their poll. Calibration reads it "
        "from the actors' timelines (asyncrl.plan.handoff.swap_admit_waits).",
    )
    swap_wake_s: float = F(
        0.002, "Seconds from an engine's swap end to its woken workers' retry (swap_wakes_admission).", ge=0
    )
    admission_wake_s: float = F(
        0.002, "Seconds from an admitting event to the woken worker's retry (measured 1.2-2.7 ms).", ge=0
    )
    swap_latency_s: float = F(
        0.01,
        "Seconds of an actor's hand-off of a version (notice, verify, stage) before it pauses its engine: "
        "from the publish, or from the end of its previous swap if a version published meanwhile waited "
        "for it (one hand-off at a time).",
        ge=0,
    )
    swap_latency_cv: float = F(
        0.0,
        "Coefficient of variation of the hand-off (swap_latency_s plus its running extra): each hand-off "
        "draws a lognormal factor with mean 1 (measured 0.14-0.2 on the demo). 0 = every hand-off takes "
        "exactly the mean, and a deterministic pipeline can lock into a phase (e.g. every batch half one "
        "version, half the next) that the real one's jitter breaks.",
        ge=0,
    )
    swap_latency_work: list[float | None] = F(
        [],
        "Per-version factors on the hand-off, replayed by version (the hand-off of version v takes "
        "factor v modulo the list's length) instead of the lognormal swap_latency_cv; null = not "
        "measured (drawn). A measured run's trace (calibrate_run): a run's hand-offs drift with what "
        "shares the engine's core (60 -> 150 ms over one eta-4 demo run), and staleness is not linear in "
        "the hand-off (a pipeline locks into phases), so the mean and spread alone mispredict it.",
    )
    swap_latency_running_extra_s: float = F(
        0.0,
        "Extra swap latency when the engine is decoding at the publish (the actor stages the new weights "
        "on the engine's cores, so it is slower while they decode).",
        ge=0,
    )
    swap_s: float = F(0.045, "Seconds an engine is paused per weight swap (reload + KV recompute).", ge=0)
    swap_running_extra_s: float = F(
        0.0,
        "Extra pause seconds of a swap while sequences are running (the wait for the engine's step in "
        "progress, their KV recompute). Paid by the fluid engine; discrete steps (engine_steps) simulate "
        "that wait themselves and stop for swap_s only.",
        ge=0,
    )
    refuse_stale_weights: bool = F(True, "actors.refuse_stale_weights (admission also checks the sampler).")
    swap_min_lag: int = F(
        1,
        "actors.swap_min_lag: an engine takes a hand-off only once V is this many versions ahead of what it "
        "serves, or at once while it has a worker refused by admission (1 = every version).",
        ge=1,
    )
    # staleness control
    groups_per_step: int = F(4, "Groups per learner step (buffer.groups_per_step).", ge=1)
    max_staleness: int = F(1, "eta (buffer.max_staleness).", ge=0)
    fill_window: bool = F(
        False,
        "learner.fill_window: before each step the learner waits until a full admission window "
        "((max_staleness + 1) * groups_per_step * publish_every groups) is unread in the buffer, or "
        "admission is saturated and nothing arrived for fill_saturated_s.",
    )
    fill_saturated_s: float = F(
        1.0,
        "fill_window: seconds of an unchanged unread count under saturated admission that end the "
        "learner's wait (asyncrl.learner.feed.SATURATED_S).",
        ge=0,
    )
    # learner
    learner_step_s: float = F(0.0, "Fixed seconds of every learner step (launch, optimizer).", ge=0)
    learner_token_s: float = F(1e-4, "Learner seconds per trained completion token.", ge=0)
    learner_cv: float = F(
        0.0,
        "Coefficient of variation of the learner's per-step work (lognormal, mean 1; 0 = constant).",
        ge=0,
    )
    learner_work: list[float] = F(
        [],
        "Per-step factors on the learner's work, replayed in step order (step k takes factor k - 1, "
        "cycling) instead of the lognormal learner_cv: a measured run's trace (calibrate_run), so a "
        "learner that slows down mid-run (a shared machine) does so in the simulation too.",
    )
    publish_every: int = F(1, "Publish weights every N learner steps (learner.publish_every).", ge=1)
    publish_policy: str = F(
        "steps",
        "When a step publishes (learner.publish_policy). steps = every publish_every steps. taken = only "
        "once every engine serves the newest published version (its swap has ended), or after "
        "publish_max_steps steps without a publication; a step that publishes nothing returns "
        "groups_per_step admission credits (the window advances per step). Needs publish_every = 1.",
        choices=PUBLISH_POLICIES,
    )
    publish_max_steps: int = F(
        4,
        "publish_policy=taken: publish at the latest after this many steps without a publication "
        "(learner.publish_max_steps).",
        ge=1,
    )
    publish_s: float = F(0.05, "Learner seconds to gather and publish weights (blocks the learner).", ge=0)
    checkpoint_every: int = F(10, "Checkpoint every N steps (learner.checkpoint_every).", ge=1)
    checkpoint_s: float = F(0.0, "Learner seconds per checkpoint.", ge=0)
    # co-location (actors and learner sharing CPU cores, as `asyncrl run` does on one machine)
    learner_slowdown: float = F(
        1.0, "Factor on learner work while any engine decodes (1 = own devices; >1 = shared cores).", ge=1
    )
    gen_slowdown: float = F(
        1.0, "Factor on engine decode-step time while the learner works (1 = own devices).", ge=1
    )
    # simulation
    steps: int = F(200, "Learner steps to simulate (measured after the warm-up).", ge=1)
    warmup_steps: int = F(10, "Leading steps left out of the steady-state numbers.", ge=0)
    seed: int = F(0, "Seed of the length sampler (and of the drawn jitters).", ge=0)
    seeds: int = F(
        1,
        "Simulations averaged, with seeds seed .. seed + seeds - 1. A pipeline's sub-step timing can "
        "lock into one of two regimes (the demo's eta-4 staleness: 1.7 or 2.1 by the seed of its length "
        "draws, and the same for a 1% change of an input), so one simulation is a draw, not the expected "
        "value that a real run's mean compares with.",
        ge=1,
    )


def _phi(x: float) -> float:
    return 0.5 * (1.0 + math.erf(x / math.sqrt(2.0)))


def _truncated_mean(mu: float, s: float, lo: float, hi: float) -> float:
    """E[clip(X, lo, hi)] for X ~ LogNormal(mu, s)."""
    a, b = math.log(lo), math.log(hi)
    p_lo, p_hi = _phi((a - mu) / s), 1.0 - _phi((b - mu) / s)
    inner = math.exp(mu + s * s / 2) * (_phi((b - mu - s * s) / s) - _phi((a - mu - s * s) / s))
    return lo * p_lo + inner + hi * p_hi


def lognormal_mu_for_mean(mean: float, sigma: float, lo: float, hi: float) -> float:
    """The mu whose lognormal, clipped to [lo, hi], has mean ``mean`` (bisection; monotone in mu)."""
    if not lo < mean < hi:
        raise ConfigError(
            f"lengths.mean={mean} must lie strictly between min_tokens={lo} and max_tokens={hi}"
        )
    left, right = math.log(lo) - 10 * sigma - 1, math.log(hi) + 10 * sigma + 1
    for _ in range(200):
        mid = 0.5 * (left + right)
        if _truncated_mean(mid, sigma, lo, hi) < mean:
            left = mid
        else:
            right = mid
    return 0.5 * (left + right)


class LengthSampler:
    """Draws completion lengths from a :class:`Lengths` law."""

    def __init__(self, law: Lengths, seed: int) -> None:
        self.law = law
        self.rng = random.Random(seed)
        self.mu = 0.0
        if law.kind == "lognormal" and law.sigma > 0:
            self.mu = lognormal_mu_for_mean(law.mean, law.sigma, law.min_tokens, law.max_tokens)

    def draw(self) -> float:
        law = self.law
        if law.kind == "fixed" or law.sigma == 0:
            return law.mean
        x = self.rng.lognormvariate(self.mu, law.sigma)
        return min(max(x, law.min_tokens), law.max_tokens)


def check_publish_policy(p: PlanInputs) -> None:
    """publish_policy and the key it depends on (also checked by the simulator: inputs built in code
    skip :func:`load_plan_inputs`)."""
    if p.publish_policy not in PUBLISH_POLICIES:
        allowed = ", ".join(repr(c) for c in PUBLISH_POLICIES)
        raise ConfigError(f"publish_policy={p.publish_policy!r} is not allowed; allowed values: {allowed}")
    if p.swap_min_lag > 1 and (p.publish_policy == "taken" or p.swap_min_lag > max(1, p.max_staleness)):
        raise ConfigError(
            f"swap_min_lag={p.swap_min_lag} needs publish_policy='steps' and swap_min_lag <= "
            f"max(1, max_staleness={p.max_staleness}) (as actors.swap_min_lag)"
        )
    if p.publish_policy == "taken" and p.publish_every != 1:
        raise ConfigError(
            f"publish_policy='taken' decides every step itself: publish_every must be 1 "
            f"(got {p.publish_every}); or use publish_policy='steps'"
        )


def _check(p: PlanInputs) -> PlanInputs:
    _validate(p, "")
    law = p.lengths
    if law.min_tokens > law.max_tokens:
        raise ConfigError(f"lengths.min_tokens={law.min_tokens} exceeds lengths.max_tokens={law.max_tokens}")
    if law.kind == "fixed" and not law.min_tokens <= law.mean <= law.max_tokens:
        raise ConfigError("lengths.mean must lie in [lengths.min_tokens, lengths.max_tokens]")
    if law.kind == "lognormal" and law.sigma > 0:
        lognormal_mu_for_mean(law.mean, law.sigma, law.min_tokens, law.max_tokens)
    if any(not (math.isfinite(w) and w >= 0) for w in p.learner_work):
        raise ConfigError("learner_work: every factor must be a finite number >= 0")
    if any(w is not None and not (math.isfinite(w) and w >= 0) for w in p.swap_latency_work):
        raise ConfigError("swap_latency_work: every factor must be null or a finite number >= 0")
    if p.warmup_steps >= p.steps:
        raise ConfigError(f"warmup_steps={p.warmup_steps} must be < steps={p.steps}")
    check_publish_policy(p)
    if p.gen_step_s == 0 and p.gen_token_s == 0:
        raise ConfigError("gen_step_s and gen_token_s are both 0: generation would take no time")
    return p


def load_plan_inputs(
    path: str | Path | None = None, overrides: list[str] | None = None, base: PlanInputs | None = None
) -> PlanInputs:
    """``base`` (or the defaults), then the YAML file ``path`` (its ``plan:`` section or the whole
    file), then ``key=value`` overrides; validated. Raises ConfigError naming the key."""
    layers = [OmegaConf.structured(base if base is not None else PlanInputs)]
    if path is not None:
        p = Path(path)
        if not p.exists():
            raise ConfigError(f"plan file not found: {p}")
        data = OmegaConf.load(p)
        layers.append(data.get("plan", data))
    for item in overrides or []:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like key=value")
    if overrides:
        layers.append(OmegaConf.from_dotlist(list(overrides)))
    try:
        merged = OmegaConf.merge(*layers)
    except OmegaConfBaseException as e:
        raise ConfigError(f"plan input {getattr(e, 'full_key', '?')}: {getattr(e, 'msg', e)}") from None
    return _check(OmegaConf.to_object(merged))  # type: ignore[arg-type]
