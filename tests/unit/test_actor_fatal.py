"""A failure every restart would repeat (ActorFatalError: a reward that never once worked) ends the
run at once, with its one line: the actor's loop does not restart on it and the supervisor does not
replace the actor. Before, a reward returning a dict on every call dead-lettered every group for ever;
and an error failing each incarnation cost actors.loop_restarts restarts (with backoff) per actor and
run.max_restarts replacements (~45 s of engine start each) before the run failed."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from types import SimpleNamespace

import pytest

from asyncrl.actors.supervision import ActorFatalError, ActorSupervisionError, ActorSupervisor
from asyncrl.config import load_config

LINE = "actor-0: the reward of task 'verl' (reward at /x/verl_task.py:3) failed for 64 groups in a row"


def test_the_supervisor_fails_the_run_on_a_fatal_actor_error_without_replacing_it(
    buffer, ray_one_cpu
) -> None:
    ray = ray_one_cpu

    @ray.remote
    def run() -> None:
        raise ActorFatalError(LINE)

    replaced: list[int] = []
    pool = SimpleNamespace(cfg=SimpleNamespace(actors=SimpleNamespace(pool_index=0)), actors=[None],
                           run_refs=[run.remote()], replace_actor=lambda i, before_spawn: replaced.append(i))  # fmt: skip
    ray.wait(pool.run_refs)
    sup = ActorSupervisor(pool, buffer, heartbeat_timeout_s=600, max_restarts=3)
    with pytest.raises(ActorSupervisionError) as e:
        sup.poll()
    assert str(e.value) == f"actor slot 0: {LINE}" and replaced == [] and sup.restarts == [0]


def _config(run_name: str, redis_url: str, *more: str):
    return load_config(overrides=[f"run.name={run_name}", f"redis.url={redis_url}", "actors.loop_restarts=2",
                                  "metrics.enabled=false", *more])  # fmt: skip


def _actor(cfg, tmp_path: Path, redis_url: str):
    """A RolloutActor built in this process, without vLLM (its engine starts only in run)."""
    from asyncrl.actors import engine_start
    from asyncrl.actors.actor import RolloutActor

    mp = pytest.MonkeyPatch()
    mp.setattr(engine_start, "start_standby_for", lambda cfg: None)
    cores = os.sched_getaffinity(0)
    try:
        return RolloutActor(cfg, tmp_path, 0, redis_url=redis_url, model_path=tmp_path)
    finally:
        mp.undo()
        # An actor binds its process to its engine's cores as it starts: not this test process (the
        # later tests of the suite that need two cores found one).
        os.sched_setaffinity(0, cores)


#: A periodic eval asked of a task without eval prompts: the CLI refuses it at start; a pool built from
#: Python (no CLI) meets it in actor 0's constructor (PeriodicEval.for_actor).
NO_EVAL = ("eval.every=1", "task.eval_size=0")


def test_the_actor_loop_does_not_restart_on_a_fatal_error(
    tmp_path: Path, redis_url: str, run_name: str
) -> None:
    actor = _actor(_config(run_name, redis_url), tmp_path, redis_url)
    calls: list[int] = []

    async def run_once() -> None:
        calls.append(1)
        raise ActorFatalError(LINE)

    actor._run_once = run_once  # type: ignore[method-assign]
    with pytest.raises(ActorFatalError, match="failed for 64 groups"):
        asyncio.run(actor.run())
    assert calls == [1] and actor.counters["loop_restarts"] == 0 and actor.counters["state"] == "stopped"


def test_serve_actors_exits_1_with_the_supervisors_line(
    tmp_path: Path, redis_url: str, monkeypatch, capsys
) -> None:
    from asyncrl import cli
    from asyncrl.actors import serve

    def give_up(cfg, rdir):
        raise ActorSupervisionError(f"actor slot 0: {LINE}")

    monkeypatch.setattr(serve, "serve_actors", give_up)
    assert cli.main(["serve-actors", f"redis.url={redis_url}", f"run.dir={tmp_path}"]) == 1
    assert capsys.readouterr().err.strip().splitlines() == [f"asyncrl: error: actor slot 0: {LINE}"]


def test_a_config_error_while_building_the_actor_is_fatal_not_a_restart(
    tmp_path: Path, redis_url: str, run_name: str
) -> None:
    """Built directly: the actor's run raises it as an ActorFatalError naming the key and its way out,
    without a loop restart (before: a ConfigError out of the constructor)."""
    actor = _actor(_config(run_name, redis_url, *NO_EVAL), tmp_path, redis_url)
    with pytest.raises(ActorFatalError) as e:
        asyncio.run(actor.run())
    assert str(e.value).startswith(
        "actor-0: eval.every=1 asks for a periodic eval"
    ) and "eval.every=0" in str(e.value)
    assert "task.eval_size" in str(e.value)
    assert actor.counters["loop_restarts"] == 0 and actor.counters["state"] == "stopped"


def test_the_supervisor_fails_the_run_on_a_config_error_of_an_actors_construction(
    tmp_path: Path, redis_url: str, run_name: str, buffer, ray_one_cpu
) -> None:
    """The real Ray actor of a pool slot, built with that config: the supervisor fails the run at once with
    the key named, and replaces nothing. Before: the constructor's ConfigError failed the Ray actor's
    creation task, which Ray reports as an ActorDiedError without the exception, so the supervisor took
    it for a crash and replaced the actor (run.max_restarts times, each failing the same way)."""
    from asyncrl.actors.ray_actor import RayRolloutActor

    ray = ray_one_cpu
    cfg = _config(run_name, redis_url, *NO_EVAL)
    handle = ray.remote(RayRolloutActor).options(num_cpus=0, max_restarts=1).remote(
        cfg, str(tmp_path), 0, redis_url, None, str(tmp_path)
    )  # fmt: skip
    try:
        ref = handle.run.remote(None)
        assert ray.wait([ref], timeout=120)[0] == [ref]
        replaced: list[int] = []
        pool = SimpleNamespace(cfg=cfg, actors=[handle], run_refs=[ref],
                               replace_actor=lambda i, before_spawn: replaced.append(i))  # fmt: skip
        sup = ActorSupervisor(pool, buffer, heartbeat_timeout_s=600, max_restarts=3)
        with pytest.raises(ActorSupervisionError) as e:
            sup.poll()
        assert str(e.value).startswith("actor slot 0: actor-0: eval.every=1 asks for a periodic eval"), (
            e.value
        )
        assert replaced == [] and sup.restarts == [0]
    finally:
        ray.kill(handle)
