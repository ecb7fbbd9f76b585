"""CPU core plans of `asyncrl run` (asyncrl.cpu_binding): disjoint, complete, vLLM's bind format, errors
that name the key; and the binding applied to a real child process's threads."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from asyncrl.config import ConfigError, load_config
from asyncrl.cpu_binding import (
    ENV_CPUS,
    ENV_FRONTEND_CPUS,
    engine_env,
    frontend_cpus,
    frontend_placement,
    plan_cpus,
    resolve_plan,
)


@pytest.mark.parametrize(
    ("cores", "actors", "learner_cpus"),
    [([0, 1], 1, 0), ([0, 1], 2, 0), ([0, 1, 2, 3], 1, 0), ([0, 1, 2, 3], 3, 0), (list(range(16)), 2, 0),
     ([2, 5, 7, 9], 1, 3), ([0, 1, 2], 5, 1)],
)  # fmt: skip
def test_plan_is_disjoint_and_uses_every_core(cores, actors, learner_cpus) -> None:
    plan = plan_cpus(cores, actors, learner_cpus)
    engine_cores = {c for b in plan.engines for c in b}
    assert set(plan.learner).isdisjoint(engine_cores)
    assert set(plan.learner) | engine_cores == set(cores)
    assert len(plan.learner) == (learner_cpus or max(1, len(cores) // (actors + 1)))
    assert plan.learner == tuple(sorted(cores)[-len(plan.learner) :])  # the last cores, like vLLM's reserve
    # every actor slot has cores; blocks are disjoint; slots beyond the blocks share round-robin
    assert all(plan.engine(i) for i in range(actors))
    assert sum(len(b) for b in plan.engines) == len(engine_cores)


def test_two_core_box_puts_learner_on_core_1_and_engine_on_core_0() -> None:
    plan = plan_cpus([0, 1], 1)
    assert plan.learner == (1,) and plan.engines == ((0,),)
    assert engine_env(plan.engine(0)) == {ENV_CPUS: "0", "VLLM_CPU_OMP_THREADS_BIND": "0"}


def test_engine_env_leaves_the_scheduler_a_core_and_splits_ranks() -> None:
    assert engine_env((0, 1, 2, 3))["VLLM_CPU_OMP_THREADS_BIND"] == "0,1,2"
    assert engine_env((0, 1, 2, 3), ranks=2)["VLLM_CPU_OMP_THREADS_BIND"] == "0,2|1"
    assert engine_env((4, 5), ranks=2)["VLLM_CPU_OMP_THREADS_BIND"] == "4|5"  # too few to reserve one


def test_impossible_plans_fail_naming_the_key() -> None:
    with pytest.raises(ConfigError, match=r"run\.learner_cpus=2 leaves no core"):
        plan_cpus([0, 1], 1, learner_cpus=2)
    with pytest.raises(ConfigError, match=r"run\.cpu_binding needs >= 2 cores"):
        plan_cpus([0], 1)
    with pytest.raises(ConfigError, match=r"run\.cpu_binding.*auto.*off"):
        load_config(None, ["run.cpu_binding=always"])
    with pytest.raises(ConfigError, match=r"run\.learner_cpus"):
        load_config(None, ["run.learner_cpus=-1"])


def test_resolve_plan_off_gpu_and_remote_cluster_mean_no_binding() -> None:
    assert resolve_plan(load_config(None, ["run.cpu_binding=off"])) is None
    assert resolve_plan(load_config(None, ["ray.address=10.0.0.1:6379"])) is None
    assert resolve_plan(load_config(None, ["actors.num_gpus_per_actor=1"])) is None
    if len(os.sched_getaffinity(0)) >= 2 and not os.path.exists("/usr/bin/nvidia-smi"):
        plan = resolve_plan(load_config(None, []))
        assert plan is not None and set(plan.learner) <= os.sched_getaffinity(0)
        huge = len(os.sched_getaffinity(0))
        with pytest.raises(ConfigError, match=rf"run\.learner_cpus={huge} leaves no core"):
            resolve_plan(load_config(None, [f"run.learner_cpus={huge}"]))


def _allowed(pid: int) -> set[str]:
    """Cpus_allowed_list of every thread of ``pid``."""
    out = set()
    for tid in os.listdir(f"/proc/{pid}/task"):
        for line in Path(f"/proc/{pid}/task/{tid}/status").read_text().splitlines():
            if line.startswith("Cpus_allowed_list"):
                out.add(line.split()[1])
    return out


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 cores")
def test_bind_from_env_binds_every_thread_and_later_children(tmp_path) -> None:
    """A real process with threads started before the binding (as a Ray actor has): all of them, and a
    process it spawns afterwards (as the vLLM engine core), end up on the given core."""
    core = sorted(os.sched_getaffinity(0))[-1]
    script = (
        "import os, subprocess, threading, time, sys\n"
        "ev = threading.Event()\n"
        "ts = [threading.Thread(target=ev.wait) for _ in range(3)]\n"
        "[t.start() for t in ts]\n"
        "from asyncrl.cpu_binding import bind_from_env\n"
        "threading.Thread(target=bind_from_env).start()  # not the main thread, like a Ray actor's init\n"
        "time.sleep(0.5)\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(30)'])\n"
        "print(child.pid, flush=True)\n"
        "time.sleep(30)\n"
    )
    env = dict(os.environ, **{ENV_CPUS: str(core)})
    proc = subprocess.Popen([sys.executable, "-c", script], env=env, stdout=subprocess.PIPE, text=True)
    try:
        child = int(proc.stdout.readline())
        time.sleep(0.2)
        assert _allowed(proc.pid) == {str(core)}
        assert _allowed(child) == {str(core)}
    finally:
        proc.kill()
        proc.wait()
        subprocess.run(["kill", "-9", str(child)], check=False)


def test_frontend_cpus_and_its_env() -> None:
    plan = plan_cpus([0, 1, 2, 3], 2, learner_cpus=1)  # engines (0,), (1, 2); learner (3,)
    assert frontend_cpus(plan, 1, "engine") == (1, 2)
    assert frontend_cpus(plan, 1, "learner") == (3,)
    assert frontend_cpus(plan, 0, "all") == (0, 1, 2, 3)
    with pytest.raises(ConfigError, match=r"run.actor_frontend_cpus='gpu'; allowed: engine, learner, all"):
        frontend_cpus(plan, 0, "gpu")
    assert ENV_FRONTEND_CPUS not in engine_env((1, 2), frontend=(1, 2))  # same cores: nothing to move
    assert engine_env((1, 2), frontend=(3,))[ENV_FRONTEND_CPUS] == "3"


@pytest.mark.parametrize(
    ("overrides", "where"),
    [
        ([], "all"),  # the demo: max_staleness 1, roles overlap, one actor
        (["buffer.max_staleness=0"], "learner"),  # synchronous: the roles take turns
        (["buffer.max_staleness=4"], "all"),
        (["buffer.max_staleness=1", "actors.num_actors=2"], "engine"),  # several engines: their own cores
        (["buffer.max_staleness=0", "actors.num_actors=2"], "learner"),
        (["buffer.max_staleness=0", "run.actor_frontend_cpus=engine"], "engine"),  # explicit wins
        (["buffer.max_staleness=1", "run.actor_frontend_cpus=learner"], "learner"),
        (["run.actor_frontend_cpus=all"], "all"),
    ],
)
def test_auto_front_end_placement_follows_the_staleness_bound(overrides, where) -> None:
    cfg = load_config(None, overrides)
    assert cfg.run.actor_frontend_cpus == next(
        (o.split("=")[1] for o in overrides if o.startswith("run.actor_frontend_cpus")), "auto"
    )
    assert frontend_placement(cfg) == where


def test_a_bad_front_end_placement_fails_at_load_with_the_allowed_values() -> None:
    with pytest.raises(ConfigError, match=r"actor_frontend_cpus.*auto.*engine.*learner.*all"):
        load_config(None, ["run.actor_frontend_cpus=gpu"])


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores to tell them apart")
def test_the_front_end_moves_after_its_engine_started_and_the_engine_stays(tmp_path) -> None:
    """As an actor does: bind to the engine's core, start a child (the engine core process), then move to
    the front end's core. The child keeps the engine's core; the parent's threads all move."""
    engine, front = sorted(os.sched_getaffinity(0))[:2]
    script = (
        "import subprocess, sys, threading, time\n"
        "from asyncrl.cpu_binding import ENV_FRONTEND_CPUS, bind_from_env\n"
        "ev = threading.Event()\n"
        "threading.Thread(target=ev.wait).start()\n"
        "bind_from_env()\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(30)'])\n"
        "bind_from_env(ENV_FRONTEND_CPUS)\n"
        "print(child.pid, flush=True)\n"
        "time.sleep(30)\n"
    )
    env = dict(os.environ, **engine_env((engine,), frontend=(front,)))
    proc = subprocess.Popen([sys.executable, "-c", script], env=env, stdout=subprocess.PIPE, text=True)
    child = 0
    try:
        child = int(proc.stdout.readline())
        time.sleep(0.2)
        assert _allowed(proc.pid) == {str(front)}
        assert _allowed(child) == {str(engine)}
    finally:
        proc.kill()
        proc.wait()
        if child:
            subprocess.run(["kill", "-9", str(child)], check=False)
