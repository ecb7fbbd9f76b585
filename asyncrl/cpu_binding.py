"""Disjoint CPU cores for the learner and the vLLM engines of one `asyncrl run` on a CPU-only machine.

Why: co-located on a CPU box, the learner and the engines fight for the same cores. vLLM already binds
its worker's OpenMP threads (``VLLM_CPU_OMP_THREADS_BIND=auto``: all cores but the last), but the engine
core, the Ray actor process and the learner float over every core, so the learner's step shares its
core with whatever vLLM process is running or spinning (measured 3.4x slower than alone).

The plan (``run.cpu_binding=auto`` when no GPU is visible and the run owns this machine's actors):

* the learner gets the *last* ``run.learner_cpus`` cores (auto: an equal share with each engine, >= 1):
  its process affinity (``sched_setaffinity`` on the child right after it starts, before any thread of
  it exists, so every later thread inherits it) and ``OMP_NUM_THREADS`` = that many cores for torch;
* the remaining cores are shared out among the actor slots in contiguous blocks; each actor process
  binds itself to its block (:func:`bind_from_env`, so the engine core and worker processes it spawns
  inherit it) and its engine's OpenMP threads get the block through ``VLLM_CPU_OMP_THREADS_BIND``
  (one ``|``-separated list per worker rank, vLLM 0.32's format), keeping vLLM's rule of leaving a
  block's last core to the scheduler process when the block has more than one core;
* once its engine is up, the actor process itself (vLLM's front end) may move elsewhere
  (``run.actor_frontend_cpus``, :func:`frontend_cpus`); the engine's processes keep the block.

Invariant: the learner's cores and the engines' cores are disjoint whenever the plan exists.
This module is stdlib only (the orchestrator imports it before Ray, torch or vLLM).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from asyncrl.config import ConfigError

__all__ = [
    "CpuPlan",
    "plan_cpus",
    "resolve_plan",
    "engine_env",
    "bind_from_env",
    "bind_process",
    "cpulist",
    "ENV_CPUS",
    "ENV_FRONTEND_CPUS",
    "frontend_cpus",
    "frontend_placement",
]

#: Cores an actor process binds itself to (set per actor slot by the pool, asyncrl.actors.pool.actor_env).
ENV_CPUS = "ASYNCRL_CPUS"
#: Cores an actor process moves to once its engine is up, when not its engine's (run.actor_frontend_cpus).
ENV_FRONTEND_CPUS = "ASYNCRL_FRONTEND_CPUS"


def cpulist(cpus: Sequence[int]) -> str:
    """``[0, 2, 3]`` -> ``"0,2,3"`` (the format of VLLM_CPU_OMP_THREADS_BIND and of our env var)."""
    return ",".join(str(c) for c in cpus)


@dataclass(frozen=True)
class CpuPlan:
    learner: tuple[int, ...]
    engines: tuple[tuple[int, ...], ...]  # blocks; actor slot i uses engines[i % len(engines)]

    def engine(self, slot: int) -> tuple[int, ...]:
        return self.engines[slot % len(self.engines)]


def plan_cpus(cores: Sequence[int], num_actors: int, learner_cpus: int = 0) -> CpuPlan:
    """Split ``cores`` (>= 2) between the learner (the last ones) and ``num_actors`` engine blocks.

    More actors than engine cores: blocks are shared round-robin (actors of one block share its cores)."""
    cores = sorted(set(cores))
    n = len(cores)
    if n < 2:
        raise ConfigError(
            f"run.cpu_binding needs >= 2 cores to separate the learner from the engines; have {cores}"
        )
    k = learner_cpus or max(1, n // (num_actors + 1))
    if k >= n:
        raise ConfigError(
            f"run.learner_cpus={learner_cpus} leaves no core for the engines ({n} cores available: {cores}); "
            f"allowed: 0 (auto) to {n - 1}"
        )
    rest = cores[: n - k]
    blocks = min(num_actors, len(rest))
    size = len(rest) // blocks
    engines = [tuple(rest[i * size : (i + 1) * size]) for i in range(blocks)]
    engines[-1] = tuple(rest[(blocks - 1) * size :])  # the remainder goes to the last block
    return CpuPlan(learner=tuple(cores[n - k :]), engines=tuple(engines))


def resolve_plan(cfg: Any) -> CpuPlan | None:
    """The plan for ``asyncrl run`` with ``cfg``, or None where binding does not apply (off, a GPU, a
    Ray cluster whose actors may live elsewhere, a single core)."""
    if cfg.run.cpu_binding == "off":
        return None
    if cfg.ray.address or cfg.actors.num_gpus_per_actor > 0 or shutil.which("nvidia-smi"):
        return None
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        return None
    return plan_cpus(cores, cfg.actors.num_actors, cfg.run.learner_cpus)


def frontend_placement(cfg: Any) -> str:
    """``run.actor_frontend_cpus`` with ``auto`` resolved: ``learner`` for a synchronous run
    (``buffer.max_staleness`` 0, which also caps an adaptive bound at 0); with overlap ``all`` for one
    actor, else ``engine``.

    Why: at max_staleness 0 the roles take turns (the actors generate step V's groups with V, then
    the learner trains on them and publishes V + 1), so the learner's cores idle while the front end
    runs and it can have them; the engine core keeps its own. With overlap there is no idle core: pinned
    to the engine's core the front end (~14 ms of CPU per demo step) saturates it (measured 29.6 + 13.7
    ms of its 45.6 ms step) while the learner's core has slack; pinned to the learner's it slows the
    learner's step (~1.5-1.7x alone). ``all`` lets the scheduler put it where there is slack: demo A/B,
    sides alternated, steady steps/s at max_staleness 1 19.84 -> 21.31 (4 pairs), at 4 17.98 -> 20.29
    (3 pairs), the learner's step ~1.05x its time with ``engine`` (1.09-1.27x alone in the bench's
    sittings), the mean staleness unchanged. Measured with one actor only: with several, ``all`` would
    also float each front end over the other engines' cores, so they keep ``engine``."""
    where = cfg.run.actor_frontend_cpus
    if where == "auto":
        if cfg.buffer.max_staleness == 0:
            return "learner"
        return "all" if cfg.actors.num_actors == 1 else "engine"
    return where


def frontend_cpus(plan: CpuPlan, slot: int, where: str) -> tuple[int, ...]:
    """The cores actor slot ``slot``'s own process moves to once its engine is up (``where``: a resolved
    ``run.actor_frontend_cpus``, :func:`frontend_placement`).

    Measured on the demo (2 cores, max_staleness 1, CPU time per learner step): the engine-core process
    51 ms and the actor process (vLLM's front end, rewards, Redis) 23 ms share core 0, which is then
    saturated, while the learner uses 40 ms of core 1 and waits the rest. ``learner`` moves the front end
    there: generation gets core 0 alone, and the learner shares its core.
    """
    if where == "engine":
        return plan.engine(slot)
    if where == "learner":
        return plan.learner
    if where == "all":
        return tuple(sorted({*plan.learner, *(c for b in plan.engines for c in b)}))
    raise ConfigError(f"run.actor_frontend_cpus={where!r}; allowed: engine, learner, all")


def engine_env(cpus: Sequence[int], ranks: int = 1, frontend: Sequence[int] | None = None) -> dict[str, str]:
    """Environment of an actor bound to ``cpus`` whose engine has ``ranks`` worker processes; ``frontend``:
    the cores its own process moves to once the engine is up (default: stay on ``cpus``)."""
    omp = list(cpus[:-1]) if len(cpus) > ranks else list(cpus)  # vLLM's rule: the scheduler keeps one
    per_rank = [omp[r::ranks] or omp for r in range(ranks)]
    env = {ENV_CPUS: cpulist(cpus), "VLLM_CPU_OMP_THREADS_BIND": "|".join(cpulist(p) for p in per_rank)}
    if frontend is not None and tuple(frontend) != tuple(cpus):
        env[ENV_FRONTEND_CPUS] = cpulist(frontend)
    return env


def bind_from_env(var: str = ENV_CPUS) -> tuple[int, ...] | None:
    """Bind this process (and so every process it starts later) to the cores in ``$var``, if set.

    An actor binds to ``$ASYNCRL_CPUS`` before it starts an engine (the engine's processes inherit it)
    and to ``$ASYNCRL_FRONTEND_CPUS`` after; a later engine restart binds to the first again first."""
    spec = os.environ.get(var, "")
    if not spec:
        return None
    cpus = tuple(int(c) for c in spec.split(","))
    bind_process(cpus)
    return cpus


def bind_process(cpus: Sequence[int], pid: int | None = None) -> None:
    """Bind every thread of this process (or of process ``pid``) to ``cpus``. ``sched_setaffinity(0)``
    binds only the calling thread, and a Ray actor's constructor does not run on the main thread: its
    other threads (the event loop that starts the engine, Ray's own) would stay unbound."""
    for tid in os.listdir(f"/proc/{pid or 'self'}/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except ProcessLookupError:  # a thread that ended meanwhile
            pass
