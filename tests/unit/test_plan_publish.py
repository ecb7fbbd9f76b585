"""The simulator's publish policies (learner.publish_policy): ``steps`` publishes every publish_every
steps; ``taken`` publishes only once every engine serves the newest version, or after
publish_max_steps steps without a publication, and returns groups_per_step credits on every step
that publishes nothing (the window advances per step, not per version)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from asyncrl.config import ConfigError
from asyncrl.plan import Lengths, PlanInputs, StepTrace, load_plan_inputs, simulate
from asyncrl.plan.calibrate import inputs_from_run_config
from asyncrl.plan.simulate import _Sim


def publications(trace: list[StepTrace]) -> list[int]:
    """The steps that published (V moved during the step)."""
    prev, out = 0, []
    for s in trace:
        if s.version != prev:
            assert s.version == prev + 1, "one publication per step at most"
            out.append(s.step)
        prev = s.version
    return out


def gaps(trace: list[StepTrace]) -> list[int]:
    """Steps between consecutive publications (the first counted from the start)."""
    pubs = publications(trace)
    return [b - a for a, b in zip([0, *pubs[:-1]], pubs, strict=True)]


def pipeline(**kw) -> PlanInputs:
    """Two engines, heavy-tailed completions, a learner step of ~0.11 s (0.08 + 1e-4 * 4 groups * 4 *
    ~20 tokens) with checkpoints in between."""
    base = dict(
        num_actors=2, groups_in_flight=4, group_size=4, lengths=Lengths("lognormal", 20.0, 0.8, 1.0, 100.0),
        gen_token_s=2e-4, swap_latency_s=0.01, swap_s=0.01, groups_per_step=4, max_staleness=1,
        learner_step_s=0.08, learner_token_s=1e-4, publish_s=0.01, checkpoint_every=10, checkpoint_s=0.02,
        steps=200, warmup_steps=20,
    )  # fmt: skip
    base.update(kw)
    return PlanInputs(**base)


@pytest.mark.parametrize("engine_steps", [False, True])
@pytest.mark.parametrize("eta", [0, 1, 3])
def test_taken_with_fast_swaps_publishes_every_step_exactly_as_steps(eta: int, engine_steps: bool) -> None:
    """Swaps that end well within a learner step (notice + pause = 0.02 s after the publish, plus with
    engine_steps the rest of a decode step: at most 32 sequences * 0.2 ms; a train phase takes
    >= 0.08 s and starts after the publish): at the end of every train phase every engine serves V,
    so taken publishes on every step. Its decision only moves the publish phase's creation from the
    step's start to its train phase's end; with a constant learner (learner_cv 0) nothing else
    differs: same events in the same order, same random draws. So the two runs are identical, step
    by step, not just close."""
    p = pipeline(max_staleness=eta, engine_steps=engine_steps, learner_cv=0.0)
    steps, taken = simulate(p), simulate(replace(p, publish_policy="taken"))
    assert publications(taken.steps) == list(range(1, p.steps + 1))
    assert taken.steps == steps.steps
    assert taken.as_dict() == steps.as_dict()
    assert taken.staleness_max <= eta


@pytest.mark.parametrize("engine_steps", [False, True])
@pytest.mark.parametrize(("eta", "seed"), [(1, 0), (2, 1), (3, 2)])
def test_taken_with_slow_swaps_publishes_less_and_keeps_the_learner_fed(
    eta: int, seed: int, engine_steps: bool
) -> None:
    """A swap 0.4 s after each publish (+ 0.05 s pause): ~4 learner steps. steps publishes every step,
    so the engines always serve weights ~4 versions old: refused for stale weights (eta < 4) the
    workers idle and the learner waits. taken publishes only when the engines took the last version
    (or after publish_max_steps = 4 steps), the non-publishing steps' credits keep the window moving,
    and the learner waits less, training on data that is never more than eta versions stale."""
    p = pipeline(
        max_staleness=eta,
        engine_steps=engine_steps,
        swap_latency_s=0.4,
        swap_s=0.05,
        learner_cv=0.2,
        seed=seed,
    )
    steps = simulate(p)
    taken = simulate(replace(p, publish_policy="taken"))
    assert len(taken.steps) == p.steps  # all steps completed (a deadlock raises)
    assert len(publications(steps.steps)) == p.steps
    n_pub = len(publications(taken.steps))
    assert taken.steps[-1].version == n_pub < p.steps / 2
    assert max(gaps(taken.steps)) <= p.publish_max_steps
    # Staleness in versions, at every step (warm-up included), within eta.
    assert all(k <= eta for s in taken.steps for k, n in s.staleness_hist.items() if n > 0)
    assert taken.staleness_max <= eta
    assert taken.learner_idle_frac <= steps.learner_idle_frac
    assert taken.tokens_per_s >= steps.tokens_per_s


def test_taken_publishes_at_the_latest_after_publish_max_steps() -> None:
    """Swaps 2 s after a publish (~18 learner steps): the engines hardly ever serve V at a step's end,
    so the cap decides: publications at most publish_max_steps apart, mostly exactly that far."""
    for cap in (1, 2, 3, 6):
        p = pipeline(max_staleness=4, swap_latency_s=2.0, swap_s=0.05, publish_policy="taken",
                     publish_max_steps=cap, steps=150)  # fmt: skip
        trace = simulate(p).steps
        g = gaps(trace)
        assert len(trace) == p.steps and max(g) <= cap
        if cap > 1:
            assert g.count(cap) > len(g) / 2, g
        assert all(k <= p.max_staleness for s in trace for k, n in s.staleness_hist.items() if n > 0)


@pytest.mark.parametrize("eta", [1, 3])
def test_every_step_without_a_publication_returns_groups_per_step_credits(eta: int) -> None:
    """The admission ledger of taken: the credits are the dropped groups plus groups_per_step for
    each step that published nothing (the real learner's version skew), no more, no less."""
    p = pipeline(max_staleness=eta, swap_latency_s=0.4, swap_s=0.05, publish_policy="taken", steps=120)
    sim = _Sim(p)
    trace = sim.run()
    silent = p.steps - trace[-1].version
    assert silent > p.steps / 2
    dropped = sum(s.dropped_stale for s in trace) + sim.dropped  # sim.dropped: after the last step
    assert sim.credits == dropped + p.groups_per_step * silent
    # steps returns no such credits: only drops.
    sim = _Sim(replace(p, publish_policy="steps"))
    trace = sim.run()
    assert sim.credits == sum(s.dropped_stale for s in trace) + sim.dropped


def test_publish_policy_inputs_are_validated_naming_the_keys() -> None:
    p = load_plan_inputs(overrides=["publish_policy=taken", "publish_max_steps=2"])
    assert (p.publish_policy, p.publish_max_steps) == ("taken", 2)
    assert (PlanInputs().publish_policy, PlanInputs().publish_max_steps) == ("steps", 4)
    with pytest.raises(
        ConfigError, match=r"publish_policy='lazy' is not allowed; allowed values: 'steps', 'taken'"
    ):
        load_plan_inputs(overrides=["publish_policy=lazy"])
    with pytest.raises(ConfigError, match=r"publish_max_steps=0 is out of range; must be >= 1"):
        load_plan_inputs(overrides=["publish_max_steps=0"])
    with pytest.raises(ConfigError, match=r"publish_policy='taken'.*publish_every must be 1 \(got 2\)"):
        load_plan_inputs(overrides=["publish_policy=taken", "publish_every=2"])
    # Inputs built in code skip load_plan_inputs: the simulator checks them too.
    with pytest.raises(ConfigError, match=r"publish_every must be 1"):
        simulate(PlanInputs(publish_policy="taken", publish_every=3))
    with pytest.raises(ConfigError, match=r"publish_policy='often' is not allowed"):
        simulate(PlanInputs(publish_policy="often"))


def _run_config(rdir: Path, learner: str) -> Path:
    rdir.mkdir()
    (rdir / "config.yaml").write_text(
        "actors: {num_actors: 2, groups_in_flight: 3, group_size: 4, admission_poll_s: 0.05, "
        "refuse_stale_weights: true, max_tokens: 64}\nbuffer: {groups_per_step: 2, max_staleness: 1}\n"
        f"learner: {{publish_every: 1, checkpoint_every: 10{learner}}}\n"
    )
    return rdir


def test_calibration_carries_the_publish_policy_of_a_run(tmp_path: Path) -> None:
    p = inputs_from_run_config(_run_config(tmp_path / "new", ", publish_policy: taken, publish_max_steps: 3"))
    assert (p.publish_policy, p.publish_max_steps) == ("taken", 3)
    # A run dir from before the keys: every publish_every steps.
    base = PlanInputs(publish_policy="taken", publish_max_steps=7)
    p = inputs_from_run_config(_run_config(tmp_path / "old", ""), base)
    assert (p.publish_policy, p.publish_max_steps) == ("steps", 4)
