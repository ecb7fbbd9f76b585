"""The pipeline simulator against closed forms, its invariants on random inputs, and calibration
recovering known inputs from a run dir written from a simulated trace."""

from __future__ import annotations

import itertools
import json
import math
import random
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from asyncrl.config import ConfigError
from asyncrl.plan import Lengths, PlanInputs, load_plan_inputs, simulate
from asyncrl.plan.calibrate import calibrate, learner_work, measure
from asyncrl.plan.engine_fit import PREFILL_GROUP_SHARE
from asyncrl.plan.inputs import LengthSampler, lognormal_mu_for_mean

REPO = Path(__file__).resolve().parents[2]


def fixed(mean: float, max_tokens: float = 1e6) -> Lengths:
    return Lengths(kind="fixed", mean=mean, sigma=0.0, min_tokens=min(1.0, mean), max_tokens=max_tokens)


def sync_inputs(rng: random.Random) -> PlanInputs:
    gps = rng.randint(1, 6)
    return PlanInputs(
        num_actors=1, groups_in_flight=gps + rng.randint(0, 3), group_size=rng.randint(1, 8),
        lengths=fixed(rng.uniform(1, 50)), gen_step_s=rng.uniform(1e-3, 2e-2), gen_token_s=0.0,
        group_overhead_s=rng.uniform(0, 0.1), group_start_s=rng.uniform(0, 0.05), admission_poll_s=0.0, admission_events=False, swap_latency_s=rng.uniform(0, 0.2),
        swap_s=rng.uniform(0, 0.2), groups_per_step=gps, max_staleness=0,
        learner_step_s=rng.uniform(0, 0.3), learner_token_s=rng.uniform(0, 1e-3),
        publish_s=rng.uniform(0, 0.2), checkpoint_s=0.0, steps=30, warmup_steps=5,
    )  # fmt: skip


@pytest.mark.parametrize("seed", range(8))
def test_sync_bound_is_the_serial_sum_of_every_stage(seed: int) -> None:
    """eta = 0 with refuse_stale_weights: nothing overlaps, one step = notify + swap + start + decode +
    overhead + train + publish, and every trained token has staleness 0."""
    p = sync_inputs(random.Random(seed))
    L, G, k = p.lengths.mean, p.group_size, p.groups_per_step
    tokens = k * G * L
    gen = p.group_start_s + L * p.gen_step_s + p.group_overhead_s  # all decode together: step time n-free
    train = p.learner_step_s + p.learner_token_s * tokens
    cycle = p.swap_latency_s + p.swap_s + gen + train + p.publish_s
    r = simulate(p)
    assert r.tokens_per_s == pytest.approx(tokens / cycle, rel=1e-9)
    assert r.samples_per_s == pytest.approx(k * G / cycle, rel=1e-9)
    assert r.learner_idle_frac == pytest.approx((cycle - train - p.publish_s) / cycle, rel=1e-9)
    busy_worker_s = k * gen
    assert r.actor_blocked_frac == pytest.approx(1 - busy_worker_s / (p.groups_in_flight * cycle), rel=1e-9)
    assert r.staleness_dist == {0: pytest.approx(1.0)} and r.staleness_max == 0


@pytest.mark.parametrize("eta", [1, 2, 5])
def test_learner_bound_trains_at_its_own_rate_on_data_exactly_eta_old(eta: int) -> None:
    """Instant generation and swaps: the buffer always holds (eta + 1) steps, the learner never
    waits, and the oldest group (the one trained) was sampled exactly eta versions ago."""
    gps, G, L = 3, 4, 7.0
    p = PlanInputs(
        num_actors=2, groups_in_flight=20, group_size=G, lengths=fixed(L), gen_step_s=0.0, gen_token_s=1e-12,
        admission_poll_s=0.0, admission_events=False, swap_latency_s=0.0, swap_s=0.0, groups_per_step=gps, max_staleness=eta,
        learner_step_s=0.05, learner_token_s=2e-3, publish_s=0.02, steps=60, warmup_steps=2 * eta + 2,
    )  # fmt: skip
    r = simulate(p)
    step = 0.05 + 2e-3 * gps * G * L + 0.02
    assert r.tokens_per_s == pytest.approx(gps * G * L / step, rel=1e-6)
    assert r.learner_idle_frac == pytest.approx(0.0, abs=1e-6)
    assert r.staleness_dist == {eta: pytest.approx(1.0)}


@pytest.mark.parametrize("n_actors", [1, 3])
def test_generation_bound_is_the_engines_throughput(n_actors: int) -> None:
    """A CPU-like engine (a step costs gen_token_s per running sequence) yields 1/gen_token_s
    tokens/s however many sequences run; with an instant learner that is the pipeline's rate."""
    c = 2e-3
    p = PlanInputs(
        num_actors=n_actors, groups_in_flight=3, group_size=4, lengths=fixed(9.0), gen_step_s=0.0,
        gen_token_s=c, admission_poll_s=0.0, admission_events=False, swap_latency_s=0.0, swap_s=0.0, groups_per_step=2,
        max_staleness=50, learner_step_s=0.0, learner_token_s=0.0, publish_s=0.0, steps=600, warmup_steps=10,
    )  # fmt: skip
    r = simulate(p)
    assert r.tokens_per_s == pytest.approx(n_actors / c, rel=0.02)  # window edges cut groups
    assert r.engine_busy_frac == pytest.approx(1.0, abs=1e-9)


def test_max_running_seqs_caps_a_gpu_like_engine() -> None:
    """A GPU-like engine (step time independent of n) running at most k sequences: k / gen_step_s."""
    a, k = 0.01, 5
    p = PlanInputs(
        num_actors=1, groups_in_flight=4, group_size=8, max_running_seqs=k, lengths=fixed(6.0),
        gen_step_s=a, gen_token_s=0.0, admission_poll_s=0.0, admission_events=False, swap_latency_s=0.0, swap_s=0.0,
        groups_per_step=1, max_staleness=40, learner_step_s=0.0, learner_token_s=0.0, publish_s=0.0,
        steps=100, warmup_steps=10,
    )  # fmt: skip
    assert simulate(p).tokens_per_s == pytest.approx(k / a, rel=0.03)


@pytest.mark.parametrize("seed", range(12))
def test_random_pipelines_respect_the_staleness_bound_and_never_deadlock(seed: int) -> None:
    rng = random.Random(100 + seed)
    eta = rng.randint(0, 4)
    p = PlanInputs(
        num_actors=rng.randint(1, 4), groups_in_flight=rng.randint(1, 6), group_size=rng.randint(1, 6),
        max_running_seqs=rng.choice([0, 3, 16]),
        lengths=Lengths(kind="lognormal", mean=rng.uniform(20, 200), sigma=rng.uniform(0.3, 1.5),
                        min_tokens=1, max_tokens=1000),
        gen_step_s=rng.uniform(0, 0.02), gen_token_s=rng.uniform(1e-5, 1e-3),
        group_overhead_s=rng.uniform(0, 0.05), admission_poll_s=rng.uniform(0, 0.1),
        swap_latency_s=rng.uniform(0, 0.3), swap_s=rng.uniform(0, 0.3),
        refuse_stale_weights=rng.random() < 0.7, groups_per_step=rng.randint(1, 5), max_staleness=eta,
        learner_step_s=rng.uniform(0, 0.5), learner_token_s=rng.uniform(0, 1e-4),
        publish_every=1, publish_s=rng.uniform(0, 0.3), checkpoint_every=rng.randint(1, 10),
        checkpoint_s=rng.uniform(0, 0.5), learner_cv=rng.uniform(0, 1), learner_slowdown=rng.uniform(1, 3),
        gen_slowdown=rng.uniform(1, 3), engine_steps=seed % 2 == 1, steps=60, warmup_steps=5, seed=seed,
    )  # fmt: skip
    r = simulate(p)
    assert 0 <= r.staleness_max <= eta
    assert sum(r.staleness_dist.values()) == pytest.approx(1.0)
    assert 0 <= r.learner_idle_frac <= 1 and 0 <= r.actor_blocked_frac <= 1 + 1e-9
    assert r.samples_per_s > 0 and r.tokens_per_s > 0
    # Trained tokens per step are whole groups: samples = steps * groups_per_step * G.
    assert r.samples_per_s == pytest.approx(r.steps_per_s * p.groups_per_step * p.group_size, rel=1e-9)
    if eta == 0 and p.refuse_stale_weights:
        assert r.dropped_stale == 0 and r.staleness_max == 0


def test_publishing_every_other_step_keeps_admission_open() -> None:
    """Admission counts groups per version (groups_per_step * publish_every, as replay.from_config
    passes it): with publish_every > 1 the learner consumes k steps of groups between two bumps of V,
    and a bound that widened by only groups_per_step per publish closed after ~(eta + 1) * k / (k - 1)
    steps (a deadlock this simulator found). Now the run reaches its step target and the staleness
    bound (in versions) still holds."""
    for eta in (0, 3):
        p = PlanInputs(max_staleness=eta, publish_every=2, lengths=fixed(4.0, 16.0), steps=50, warmup_steps=1)
        r = simulate(p)  # raised "deadlocked at step 2" (eta 0) / "step 8" (eta 3) before the fix
        assert r.steps_per_s > 0
        assert r.staleness_max <= eta


def _reference_truncated_mean(mu: float, s: float, lo: float, hi: float, n: int = 200_000) -> float:
    """E[clip(X, lo, hi)], X ~ LogNormal(mu, s), by the midpoint rule in log space (float64)."""
    a, b = mu - 12 * s, mu + 12 * s
    h = (b - a) / n
    tot = 0.0
    for i in range(n):
        z = a + (i + 0.5) * h
        dens = math.exp(-((z - mu) ** 2) / (2 * s * s)) / (s * math.sqrt(2 * math.pi))
        tot += min(max(math.exp(z), lo), hi) * dens * h
    return tot


@pytest.mark.parametrize(("mean", "sigma", "lo", "hi"), [(300.0, 1.0, 1.0, 8192.0), (3.0, 0.5, 1.0, 5.0),
                                                         (4.9, 2.0, 1.0, 5.0), (1.2, 1.5, 1.0, 16.0)])  # fmt: skip
def test_lognormal_lengths_have_the_requested_truncated_mean(mean, sigma, lo, hi) -> None:
    mu = lognormal_mu_for_mean(mean, sigma, lo, hi)
    assert _reference_truncated_mean(mu, sigma, lo, hi) == pytest.approx(mean, rel=1e-6)
    draws = [LengthSampler(Lengths("lognormal", mean, sigma, lo, hi), 3).draw() for _ in range(1)]
    sampler = LengthSampler(Lengths("lognormal", mean, sigma, lo, hi), 3)
    draws = [sampler.draw() for _ in range(40_000)]
    assert min(draws) >= lo and max(draws) <= hi
    assert sum(draws) / len(draws) == pytest.approx(mean, rel=0.03)


def test_bad_inputs_fail_naming_the_key() -> None:
    with pytest.raises(ConfigError, match="max_staleness"):
        load_plan_inputs(overrides=["max_staleness=-1"])
    with pytest.raises(ConfigError, match="lengths.mean"):
        load_plan_inputs(overrides=["lengths.mean=20", "lengths.max_tokens=16"])
    with pytest.raises(ConfigError, match="warmup_steps"):
        load_plan_inputs(overrides=["steps=5", "warmup_steps=5"])
    with pytest.raises(ConfigError, match="nope"):
        load_plan_inputs(overrides=["nope=1"])


def _write_run(rdir: Path, p: PlanInputs) -> None:
    """A run dir as `asyncrl run` leaves it (config.yaml + metrics.jsonl) from a simulated trace."""
    rdir.mkdir(parents=True)
    (rdir / "config.yaml").write_text(
        f"actors: {{num_actors: {p.num_actors}, groups_in_flight: {p.groups_in_flight}, group_size: "
        f"{p.group_size}, admission_poll_s: {p.admission_poll_s}, admission_events: {str(p.admission_events).lower()}, "
        f"refuse_stale_weights: true, max_tokens: "
        f"{int(p.lengths.max_tokens)}}}\nbuffer: {{groups_per_step: {p.groups_per_step}, max_staleness: "
        f"{p.max_staleness}}}\nlearner: {{publish_every: {p.publish_every}, checkpoint_every: {p.checkpoint_every}, "
        f"fill_window: {str(p.fill_window).lower()}}}\n"
    )
    r = simulate(p)
    prev = 0.0
    with open(rdir / "metrics.jsonl", "w") as f:
        for s in r.steps:
            train = s.train_s
            ckpt = s.step % p.checkpoint_every == 0
            rec = {"step": s.step, "time": s.time, "step_s": s.time - prev, "wait_s": s.wait_s, "train_s": train,
                   "publish_s": p.publish_s, "published": True, "checkpointed": ckpt, "tokens": s.tokens,
                   "sequences": s.sequences, "staleness_hist": {str(k): v for k, v in s.staleness_hist.items()}}  # fmt: skip
            f.write(json.dumps(rec) + "\n")
            prev = s.time


@pytest.mark.parametrize(("steps", "length"), [(True, 5.0), (False, 80.0)])
def test_calibration_recovers_the_inputs_that_produced_a_run(
    tmp_path: Path, steps: bool, length: float
) -> None:
    """Short completions are calibrated with discrete engine steps, long ones fluid (DISCRETE_STEPS_MAX_TOKENS);
    the engine's step is a fixed cost (asyncrl.plan.engine_fit.FLAT_STEP_SHARE) plus each joining group's
    prefill (PREFILL_GROUP_SHARE of a step), recovered from the tok/s."""
    truth = PlanInputs(
        num_actors=1, groups_in_flight=4, group_size=8, lengths=fixed(length, length + 1), engine_steps=steps,
        gen_step_s=32 * 3e-4 * 5 / length, gen_token_s=0.0, admission_poll_s=0.05, swap_latency_s=0.01, swap_s=0.045, groups_per_step=4,
        max_staleness=0, learner_step_s=0.0, learner_token_s=2e-4, publish_s=0.01, checkpoint_s=0.0, steps=120,
        warmup_steps=12,
    )  # fmt: skip
    truth = replace(truth, gen_prefill_s=PREFILL_GROUP_SHARE * truth.gen_step_s / truth.group_size)
    _write_run(tmp_path / "s0", truth)
    m = measure(tmp_path / "s0")
    assert m.train_s_per_token == pytest.approx(2e-4, rel=1e-6) and m.mean_length == pytest.approx(length)
    p, sources = calibrate([tmp_path / "s0"], replace(PlanInputs(), lengths=fixed(4.0, length + 1)))
    assert p.engine_steps is steps, sources["engine_steps"]
    assert p.gen_step_s == pytest.approx(truth.gen_step_s, rel=0.01), sources["gen_step_s"]
    assert p.gen_token_s == 0.0 and sources["gen_step_s"].startswith("fitted to")
    assert p.gen_prefill_s == pytest.approx(truth.gen_prefill_s, rel=0.01), sources["gen_prefill_s"]
    assert p.learner_token_s == pytest.approx(2e-4, rel=1e-6) and sources["learner_token_s"] == "measured"
    # ... and predicts an overlapping run it never saw.
    for eta in (1, 4):
        real = simulate(replace(truth, max_staleness=eta, steps=300, warmup_steps=20))
        pred = simulate(replace(p, max_staleness=eta))
        assert pred.tokens_per_s == pytest.approx(real.tokens_per_s, rel=0.02)
        assert pred.staleness_mean == pytest.approx(real.staleness_mean, rel=0.05, abs=0.02)


def test_plan_cli_projects_the_shipped_fleet_file_without_heavy_imports() -> None:
    code = ("import sys, json, io, contextlib; from asyncrl.cli import main; buf = io.StringIO()\n"
            "with contextlib.redirect_stdout(buf): rc = main(['plan', '--plan', 'configs/plan_qwen2.5_7b_8x8.yaml',"
            " '--staleness', '0,2', '--json', 'steps=60', 'warmup_steps=10'])\n"
            "assert rc == 0; out = json.loads(buf.getvalue())\n"
            "assert not {'torch', 'vllm', 'ray'} & set(sys.modules), 'heavy import'\n"
            "print(json.dumps([r['speedup_vs_sync'] for r in out['results']]))")  # fmt: skip
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    speedups = json.loads(r.stdout.strip().splitlines()[-1])
    assert speedups[0] == pytest.approx(1.0) and speedups[1] > 1.2


@pytest.mark.parametrize("poll,swap", [(0.04, 0.0), (0.2, 0.0), (0.2, 0.03), (0.04, 0.03)])
def test_synchronous_step_pays_the_admission_retry_delay(poll: float, swap: float) -> None:
    """At eta=0 every step waits for its engine's swap, then for the refused worker's retry. With
    events the publish's hint wakes it admission_wake_s later; if its engine is still swapping it is
    refused (stale weights) and, the swap sending no hint, its poll admits it one poll period after
    that refusal (as the real worker, whose 50 ms poll made the eta=0 step ~25 ms longer than a wake
    at the swap's end would). Without events: poll / 2 after the publish on average, overlapping the
    swap. Deterministic inputs, so the step periods differ by exactly the two admission times'."""

    def period(events: bool, swap_wakes: bool = False) -> float:
        p = PlanInputs(
            num_actors=1, groups_in_flight=2, group_size=4, lengths=fixed(5.0), gen_step_s=0.0, gen_token_s=1e-3,
            admission_poll_s=poll, admission_events=events, swap_wakes_admission=swap_wakes,
            admission_wake_s=0.002, swap_latency_s=0.0,
            swap_s=swap, groups_per_step=2, max_staleness=0, learner_step_s=0.03, learner_token_s=0.0,
            publish_s=0.005, learner_cv=0.0, steps=40, warmup_steps=5,
        )  # fmt: skip
        r = simulate(p)
        assert r.staleness_max == 0
        return 1.0 / r.steps_per_s

    # Admission after the publish, in both. Polled: poll / 2 after the publish, or after the swap when
    # that retry came before the swap's end (refused, the swap's end re-arms the expected poll).
    polled = poll / 2 if poll / 2 >= swap else swap + poll / 2
    woken = 0.002 if swap == 0 else 0.002 + poll  # refused at the hint, admitted by the poll after it
    assert period(False) - period(True) == pytest.approx(polled - woken, rel=1e-6)
    # An actor that wakes its workers when its engine's swap ends: admitted admission_wake_s after
    # the later of the hint and the swap's end.
    assert period(False) - period(True, swap_wakes=True) == pytest.approx(polled - (swap + 0.002), rel=1e-6)


@pytest.mark.parametrize("seed", range(6))
def test_sync_bound_with_discrete_steps_is_whole_steps_of_the_whole_batch(seed: int) -> None:
    """engine_steps at eta = 0: the k groups of a step arrive together after group_start_s; the first
    starts a step alone (an idle engine starts with the first request), the others join the next, so
    decoding takes ceil(L) + 1 steps and ceil(L) * k * G sequence-steps (one group alone: ceil(L)); the
    rest as in the fluid closed form."""
    rng = random.Random(50 + seed)
    p = replace(sync_inputs(rng), engine_steps=True, gen_token_s=rng.uniform(1e-5, 1e-3))
    if seed == 0:
        p = replace(p, group_start_s=0.0)  # admitted and submitted in one go: all in the first step
    L, G, k = math.ceil(p.lengths.mean - 1e-9), p.group_size, p.groups_per_step
    tokens = k * G * L
    n_steps = L + 1 if k > 1 and p.group_start_s > 0 else L
    gen = p.group_start_s + n_steps * p.gen_step_s + L * k * G * p.gen_token_s + p.group_overhead_s
    cycle = p.swap_latency_s + p.swap_s + gen + p.learner_step_s + p.learner_token_s * tokens + p.publish_s
    r = simulate(p)
    assert r.tokens_per_s == pytest.approx(tokens / cycle, rel=1e-9)
    assert r.staleness_dist == {0: pytest.approx(1.0)}
    # A group's decode time, as the actor's timeline measures it: from its submission to its last
    # token. All k together: L steps of k * G sequences. Apart: a step of the first group alone, L - 1
    # of all k, and one more of the other k - 1, which the first one does not wait for.
    full = p.gen_step_s + k * G * p.gen_token_s
    if n_steps == L:
        decode = L * full
    else:
        first, last = p.gen_step_s + G * p.gen_token_s, p.gen_step_s + (k - 1) * G * p.gen_token_s
        decode = first + (L - 1) * full + (k - 1) / k * last
    assert r.group_decode_s == pytest.approx(decode, rel=1e-9)


def test_a_swap_waits_for_the_decode_step_in_progress() -> None:
    """One 3-token completion in flight, 0.1 s steps, an instant learner: the publish comes with the
    next completion's first step, the swap is due 0.05 s later (mid-step) and starts when that step
    ends, so exactly 1 of its 3 tokens is sampled with the old weights (fluid: half a token) and the
    step period is 3 steps + the 0.02 s pause."""
    p = PlanInputs(
        num_actors=1, groups_in_flight=1, group_size=1, lengths=fixed(3.0, 3.0), gen_step_s=0.1, gen_token_s=0.0,
        engine_steps=True, admission_events=True, admission_wake_s=0.0, swap_latency_s=0.05, swap_s=0.02,
        groups_per_step=1, max_staleness=4, learner_step_s=0.0, learner_token_s=0.0, publish_s=0.0, steps=40,
        warmup_steps=5,
    )  # fmt: skip
    r = simulate(p)
    assert r.tokens_per_s == pytest.approx(3 / 0.32, rel=1e-9)
    assert r.staleness_dist == {0: pytest.approx(2 / 3), 1: pytest.approx(1 / 3)}
    fluid = simulate(replace(p, engine_steps=False))
    assert fluid.staleness_dist == {0: pytest.approx(5 / 6), 1: pytest.approx(1 / 6)}


def test_seeds_average_the_simulations_of_consecutive_seeds() -> None:
    """PlanInputs.seeds: every number is the plain mean of the simulations with seeds seed, seed + 1,
    ... (the maximum staleness the largest); lognormal lengths make the seeds differ."""
    from asyncrl.plan.results import average

    p = PlanInputs(
        num_actors=1, groups_in_flight=4, group_size=4, engine_steps=True, gen_token_s=1e-3,
        lengths=Lengths(kind="lognormal", mean=6.0, sigma=1.0, min_tokens=1.0, max_tokens=12.0),
        swap_latency_s=0.012, swap_s=0.002, groups_per_step=4, max_staleness=4, learner_step_s=0.02,
        learner_token_s=1e-4, publish_s=0.004, steps=60, warmup_steps=6, seed=3,
    )  # fmt: skip
    each = [simulate(replace(p, seed=s)) for s in (3, 4, 5)]
    assert len({r.staleness_mean for r in each}) == 3  # the seeds do differ
    got = simulate(replace(p, seeds=3))
    for key in ("tokens_per_s", "samples_per_s", "staleness_mean", "learner_idle_frac", "group_decode_s"):
        assert getattr(got, key) == pytest.approx(sum(getattr(r, key) for r in each) / 3, rel=1e-12), key
    assert got.staleness_max == max(r.staleness_max for r in each)
    assert sum(got.staleness_dist.values()) == pytest.approx(1.0)
    assert got.steps == each[0].steps
    with pytest.raises(ValueError, match="no results"):
        average([])
    with pytest.raises(ConfigError, match="seeds"):
        load_plan_inputs(overrides=["seeds=0"])


def test_learner_work_is_replayed_step_by_step() -> None:
    """A learner-bound pipeline (instant generation): step k's busy time is learner_step_s times the
    trace's factor k - 1, cycling through the trace."""
    p = PlanInputs(
        num_actors=1, groups_in_flight=8, group_size=1, lengths=fixed(1.0), gen_token_s=1e-7, group_overhead_s=0.0,
        swap_latency_s=0.0, swap_s=0.0, groups_per_step=1, max_staleness=4, learner_step_s=0.1, learner_token_s=0.0,
        publish_s=0.0, checkpoint_s=0.0, learner_cv=0.5, learner_work=[1.0, 3.0, 0.5], steps=12, warmup_steps=2,
    )  # fmt: skip
    r = simulate(p)
    busy = [b.time - a.time - b.wait_s for a, b in itertools.pairwise(r.steps)]
    assert busy == pytest.approx([0.1 * [1.0, 3.0, 0.5][k % 3] for k in range(1, 12)], rel=1e-6)


def test_learner_work_factors_are_each_steps_busy_time_over_its_expected_cost() -> None:
    p = PlanInputs(learner_step_s=0.01, learner_token_s=1e-3, publish_s=0.02, checkpoint_s=0.05)
    steps = [
        {"step_s": 30.0, "wait_s": 29.0, "tokens": 100, "published": True, "checkpointed": False},  # start-up: 1
        {"step_s": 0.5, "wait_s": 0.37, "tokens": 100, "published": True, "checkpointed": False},  # 0.13 / 0.13
        {"step_s": 0.3, "wait_s": 0.0, "tokens": 50, "published": True, "checkpointed": False},  # 0.3 / 0.08
        {"step_s": 0.4, "wait_s": 0.1, "tokens": 100, "published": True, "checkpointed": True},  # 0.3 / 0.18
        {"step_s": 0.1, "wait_s": 0.2, "tokens": 100, "published": False, "checkpointed": False},  # 0 / 0.11
    ]  # fmt: skip
    assert learner_work(steps, p) == pytest.approx([1.0, 1.0, 3.75, 0.3 / 0.18, 0.0], rel=1e-9)
    with pytest.raises(ConfigError, match="learner_work"):
        load_plan_inputs(overrides=["learner_work=[1.0,-1.0]"])


@pytest.mark.parametrize(
    "text, bad",
    [("0,-1", "'-1'"), ("0,a", "'a'"), ("1.5", "'1.5'"), (",", "','"), ("0, ,x", "'x'")],
)
def test_staleness_list_refuses_anything_but_integers_ge_0(text: str, bad: str) -> None:
    from asyncrl.plan.report import parse_staleness, run_plan

    with pytest.raises(ConfigError, match=r"^--staleness: " + re.escape(bad)):
        parse_staleness(text)
    # What `asyncrl plan --staleness` calls: refused before any simulation (-1 never returned before).
    with pytest.raises(ConfigError, match="--staleness"):
        run_plan(None, [], text, ["steps=20", "warmup_steps=5"])


def test_staleness_list_parses_sorted_unique() -> None:
    from asyncrl.plan.report import parse_staleness

    assert parse_staleness(" 4,0, 1,4 ,") == [0, 1, 4]


def test_simulate_refuses_a_negative_bound_instead_of_spinning() -> None:
    p = load_plan_inputs(None, ["steps=20", "warmup_steps=5"])
    with pytest.raises(ValueError, match="max_staleness=-1"):
        simulate(replace(p, max_staleness=-1))


def test_plan_from_a_run_dir_without_steps_is_a_user_error(tmp_path: Path) -> None:
    """`asyncrl plan --from EMPTY_DIR`: one `asyncrl: error:` line and exit 2, not a traceback and 1."""
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1}) + "\n")
    with pytest.raises(ConfigError, match="1 learner steps; need at least 3 to measure"):
        measure(tmp_path)
    r = subprocess.run([sys.executable, "-m", "asyncrl.cli", "plan", "--from", str(tmp_path / "none")],
                       cwd=REPO, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.strip().endswith("metrics.jsonl: 0 learner steps; need at least 3 to measure")


def _fill_window_truth() -> PlanInputs:
    """A generation-bound pipeline at eta 4 whose learner waits for a full window (learner.fill_window):
    without the wait its data would be ~0.5 versions old, with it exactly 4 (a sweep run dir's shape)."""
    truth = PlanInputs(
        num_actors=1, groups_in_flight=4, group_size=8, lengths=fixed(5.0, 6.0), engine_steps=True,
        gen_step_s=9.6e-3, gen_token_s=0.0, admission_poll_s=0.05, swap_latency_s=0.01, swap_s=0.045,
        groups_per_step=4, max_staleness=4, learner_token_s=2e-4, publish_s=0.01, checkpoint_s=0.0, steps=120,
        warmup_steps=12, fill_window=True,
    )  # fmt: skip
    return replace(truth, gen_prefill_s=PREFILL_GROUP_SHARE * truth.gen_step_s / truth.group_size)


def test_plan_from_a_fill_window_run_dir_models_the_learners_wait(tmp_path: Path) -> None:
    """Every shipped sweep run sets learner.fill_window=true: calibrated from such a run dir, the
    simulator waits for the window as the run's learner did and predicts its staleness, idle and
    throughput (without the wait: staleness 0.45 for a measured 4.00, the users' walkthrough)."""
    _write_run(tmp_path / "s4", _fill_window_truth())
    m = measure(tmp_path / "s4")
    assert m.staleness_mean == pytest.approx(4.0)
    p, sources = calibrate([tmp_path / "s4"], replace(PlanInputs(), lengths=fixed(4.0, 6.0)))
    assert p.fill_window is True and sources["fill_window"] == "config"
    pred = simulate(p)
    assert pred.staleness_mean == pytest.approx(m.staleness_mean, abs=0.05)
    assert pred.learner_idle_frac == pytest.approx(m.learner_idle_frac, abs=0.03)
    assert pred.samples_per_s == pytest.approx(m.samples_per_s, rel=0.03)
    assert simulate(replace(p, fill_window=False)).staleness_mean < 1.0  # what the plan said before


def test_fill_window_under_saturated_admission_waits_for_the_quiet_period() -> None:
    """publish_every=2: a step that publishes nothing leaves admission saturated one step's groups short
    of the window, so the learner waits until nothing arrived for fill_saturated_s (the real learner's
    SATURATED_S), every other step: per step, half the quiet period more."""
    base = replace(_fill_window_truth(), publish_every=2, steps=80, warmup_steps=10)

    def step_s(quiet: float) -> float:
        r = simulate(replace(base, fill_saturated_s=quiet))
        return base.groups_per_step * base.group_size / r.samples_per_s

    assert step_s(0.6) - step_s(0.2) == pytest.approx(0.2, rel=0.1)
