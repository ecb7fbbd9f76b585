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


def test_the_actor_loop_does_not_restart_on_a_fatal_error(
    tmp_path: Path, redis_url: str, run_name: str
) -> None:
    from asyncrl.actors import engine_start
    from asyncrl.actors.actor import RolloutActor

    cfg = load_config(overrides=[f"run.name={run_name}", f"redis.url={redis_url}", "actors.loop_restarts=2",
                                 "metrics.enabled=false"])  # fmt: skip
    mp = pytest.MonkeyPatch()
    mp.setattr(engine_start, "start_standby_for", lambda cfg: None)
    cores = os.sched_getaffinity(0)
    try:
        actor = RolloutActor(cfg, tmp_path, 0, redis_url=redis_url, model_path=tmp_path)
    finally:
        mp.undo()
        # An actor binds its process to its engine's cores as it starts: not this test process (the
        # later tests of the suite that need two cores found one).
        os.sched_setaffinity(0, cores)
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
