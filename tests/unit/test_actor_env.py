"""What environment reaches an actor process, and by which path (asyncrl.actors.pool).

Only the dynamic loader's variables go through the Ray job's runtime_env (an actor with any other
runtime_env cannot take one of the idle workers Ray starts with its raylet); everything else travels in
the actor's constructor and is applied before anything reads it."""

from __future__ import annotations

import os

import pytest

from asyncrl.actors.pool import ActorPool, actor_env, actor_runtime_env
from asyncrl.actors.ray_actor import RayRolloutActor
from asyncrl.config import load_config
from asyncrl.cpu_binding import ENV_CPUS, ENV_FRONTEND_CPUS, plan_cpus


@pytest.fixture
def shell(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """A launching shell with vLLM/HF settings, one unrelated variable and no LD_PRELOAD."""
    for k in list(os.environ):
        if k.startswith(("VLLM_", "HF_", "TRANSFORMERS_", "OMP_", "KMP_", "LD_PRELOAD", "TOKENIZERS_")):
            monkeypatch.delenv(k)
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("OMP_PROC_BIND", "close")
    monkeypatch.setenv("ASYNCRL_UNRELATED_TO_ACTORS", "x")
    return monkeypatch


def test_without_ld_preload_the_job_runtime_env_is_empty_and_the_rest_goes_to_the_actor(shell) -> None:
    assert actor_runtime_env() == {}
    assert actor_env() == {
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "HF_HUB_OFFLINE": "1",
        "OMP_PROC_BIND": "close",
        "TOKENIZERS_PARALLELISM": "false",
        "VLLM_WORKER_MULTIPROC_METHOD": "spawn",
    }


def test_ld_preload_alone_goes_through_the_runtime_env(shell) -> None:
    shell.setenv("LD_PRELOAD", "/usr/lib/libtcmalloc.so.4")
    assert actor_runtime_env() == {"env_vars": {"LD_PRELOAD": "/usr/lib/libtcmalloc.so.4"}}
    # The actor's own copy still names it: its engine core's spawn environment is built from os.environ.
    assert actor_env()["LD_PRELOAD"] == "/usr/lib/libtcmalloc.so.4"


def test_each_slot_gets_its_own_cores(shell) -> None:
    cfg = load_config(None, ["actors.num_actors=2", "run.actor_frontend_cpus=learner"])
    plan = plan_cpus([0, 1, 2, 3, 4, 5], 2)
    pool = ActorPool(cfg, "/nonexistent", redis_url="redis://127.0.0.1:1/0", cpu_plan=plan)
    envs = [pool._actor_env(i) for i in range(2)]
    for i, env in enumerate(envs):
        assert env[ENV_CPUS] == ",".join(map(str, plan.engine(i)))
        assert env[ENV_FRONTEND_CPUS] == ",".join(map(str, plan.learner))
        assert env["VLLM_CPU_KVCACHE_SPACE"] == "1"
    assert envs[0][ENV_CPUS] != envs[1][ENV_CPUS]
    unbound = ActorPool(cfg, "/nonexistent", redis_url="redis://127.0.0.1:1/0")._actor_env(0)
    assert ENV_CPUS not in unbound and unbound == actor_env()


class _Stop(Exception):
    pass


def test_the_actor_applies_its_environment_before_building_anything(shell) -> None:
    """The constructor's first act: the environment is in place when the RolloutActor (which starts the
    engine standby and binds the process) is built."""
    import asyncrl.actors.ray_actor as ray_actor

    seen: dict[str, str | None] = {}

    class Probe:
        def __init__(self, *a, **k) -> None:
            seen.update({k: os.environ.get(k) for k in ("ASYNCRL_CPUS", "VLLM_CPU_KVCACHE_SPACE")})
            raise _Stop

    cfg = load_config(None, ["metrics.enabled=false"])  # console.log_dir: "" (no redirect)
    shell.setattr(ray_actor, "RolloutActor", Probe)
    shell.delenv("ASYNCRL_CPUS", raising=False)  # restored at teardown, whatever the constructor set
    with pytest.raises(_Stop):
        RayRolloutActor(cfg, "/nonexistent", 0, "redis://127.0.0.1:1/0", None, None,
                        env={"ASYNCRL_CPUS": "0", "VLLM_CPU_KVCACHE_SPACE": "2"})  # fmt: skip
    assert seen == {"ASYNCRL_CPUS": "0", "VLLM_CPU_KVCACHE_SPACE": "2"}
