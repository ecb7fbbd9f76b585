"""The planner's model of ``actors.swap_min_lag`` (lazy swaps): an engine takes a hand-off only once V is
that many versions ahead, or at once while admission refuses one of its workers."""

from __future__ import annotations

from pathlib import Path

import pytest

from asyncrl.config import ConfigError
from asyncrl.plan import Lengths, PlanInputs, load_plan_inputs, simulate
from asyncrl.plan.calibrate import inputs_from_run_config
from asyncrl.plan.simulate import _Sim


def demo_like(**kw) -> PlanInputs:
    """One engine, the demo's shape (4 groups of 8, 5 tokens) at eta 4, with swaps that cost the engine
    as much as on the CPU box (a pause of 20 ms, 10 more with running sequences)."""
    base = dict(
        num_actors=1, groups_in_flight=4, group_size=8, lengths=Lengths("fixed", 5.0, 0.0, 1.0, 16.0),
        gen_step_s=0.008, gen_token_s=1e-4, engine_steps=True, swap_latency_s=0.015, swap_s=0.02,
        swap_running_extra_s=0.01, groups_per_step=4, max_staleness=4, learner_step_s=0.01,
        learner_token_s=0.0, publish_s=0.004, checkpoint_every=10, steps=300, warmup_steps=30,
    )  # fmt: skip
    base.update(kw)
    return PlanInputs(**base)


def _swaps_and_trace(p: PlanInputs):
    sim = _Sim(p)
    trace = sim.run()
    return sum(len(e.swap_v) - 1 for e in sim.engines), trace


def test_lazy_swaps_skip_versions_and_buy_throughput_with_staleness_when_swaps_cost_the_engine() -> None:
    eager, lazy = demo_like(), demo_like(swap_min_lag=4)
    n_eager, t_eager = _swaps_and_trace(eager)
    n_lazy, t_lazy = _swaps_and_trace(lazy)
    assert n_eager >= 0.95 * eager.steps and n_lazy <= n_eager / 3
    r_eager, r_lazy = simulate(eager), simulate(lazy)
    assert r_lazy.steps_per_s >= 1.2 * r_eager.steps_per_s
    assert r_lazy.staleness_mean > r_eager.staleness_mean + 1.0
    for trace in (t_eager, t_lazy):  # the bound holds either way: nothing trained beyond eta, no drops
        assert max(k for s in trace for k in s.staleness_hist) <= 4
        assert sum(s.dropped_stale for s in trace) == 0


def test_a_full_window_makes_every_swap_due_so_a_lazy_actor_never_starves_the_learner() -> None:
    """Learner-bound (a 120 ms step): admission refuses the workers at every version, each refusal makes
    the swap due, and the lazy pipeline matches the eager one step for step."""
    eager, lazy = demo_like(learner_step_s=0.12), demo_like(learner_step_s=0.12, swap_min_lag=4)
    (n_eager, _), (n_lazy, _) = _swaps_and_trace(eager), _swaps_and_trace(lazy)
    assert n_lazy == n_eager
    assert simulate(lazy).steps_per_s == pytest.approx(simulate(eager).steps_per_s, rel=0.01)


def test_swap_min_lag_inputs_are_checked_as_the_run_config_is(tmp_path: Path) -> None:
    assert PlanInputs().swap_min_lag == 1
    assert load_plan_inputs(overrides=["swap_min_lag=4", "max_staleness=4"]).swap_min_lag == 4
    with pytest.raises(ConfigError, match=r"swap_min_lag=0 is out of range; must be >= 1"):
        load_plan_inputs(overrides=["swap_min_lag=0"])
    with pytest.raises(ConfigError, match=r"swap_min_lag=2 needs .* <= max\(1, max_staleness=1\)"):
        load_plan_inputs(overrides=["swap_min_lag=2", "max_staleness=1"])
    with pytest.raises(ConfigError, match=r"publish_policy='steps'"):
        simulate(PlanInputs(swap_min_lag=2, max_staleness=4, publish_policy="taken"))
    rdir = tmp_path / "run"
    rdir.mkdir()
    (rdir / "config.yaml").write_text(
        "actors: {num_actors: 1, groups_in_flight: 4, group_size: 8, admission_poll_s: 0.05, "
        "refuse_stale_weights: true, max_tokens: 16, swap_min_lag: 4}\n"
        "buffer: {groups_per_step: 4, max_staleness: 4}\nlearner: {publish_every: 1, checkpoint_every: 10}\n"
    )
    assert inputs_from_run_config(rdir).swap_min_lag == 4
    old = (rdir / "config.yaml").read_text().replace(", swap_min_lag: 4", "")
    (rdir / "config.yaml").write_text(old)
    assert inputs_from_run_config(rdir, PlanInputs(swap_min_lag=3, max_staleness=4)).swap_min_lag == 1
