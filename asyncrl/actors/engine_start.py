"""Start a CPU engine's engine-core process as vLLM would spawn it, or run it in the actor's standby.

Why: an actor's start-up ran two ~6-10 s imports of torch + vLLM one after the other on the 2-core
box: its own (the front end), then, once it had built the engine config, the engine core's, which
vLLM starts with ``spawn`` (always inside a Ray actor: ``vllm.utils.system_utils._maybe_force_spawn``).
The actor's standby (asyncrl.actors.engine_standby), a spawned child started as the actor's first act,
imports the engine core's modules (:data:`PRELOAD`) on the other core while the actor imports its own,
and is handed vLLM's engine-core process object to run once the engine config is built. vLLM's
engine-core process manager is given :class:`EngineProcess` while the engine is built
(:func:`standby_engine_core`): the standby's process where it may run it, a spawn otherwise.

What must stay as with ``spawn`` (the invariants):

* The environment: the standby's is frozen when it started, while vLLM sets variables in the front end
  before it starts the engine core (its CPU platform's, and the OpenMP binding of the in-process
  worker, asyncrl.actors.inproc_executor). The engine process therefore replaces its environment with
  the parent's as of ``start()`` before the engine core runs.
* The CPUs: a spawned engine core starts on its parent's cores (the engine's) and libgomp, preloaded,
  binds it to the first CPU of its OpenMP list as it loads. The standby went through the same load,
  then widened itself to every core the actor had (asyncrl.actors.standby_init) for its imports; the
  engine process takes the binding libgomp gave, on every thread (an import may have started some).
* What is read once, when a library loads (``LD_PRELOAD``, libgomp's ``OMP_*``/``GOMP_*``, glibc's
  ``MALLOC_*``, the interpreter's ``PYTHON*``) cannot be replaced after the fact. The standby is started
  with the values vLLM will give the engine core (:func:`predicted_env`), and a start whose load-time
  variables differ from the standby's in any way (or whose multiprocessing executable was replaced,
  vLLM's ``--numa-bind``) is spawned instead, with the reason logged.
* The name: ``/proc/<pid>/comm`` is set as vLLM's process title would set it (:func:`_set_comm`).

An earlier opt-in variant forked the engine core from a stdlib forkserver that had imported vLLM
(``actors.engine_forkserver``, removed): a forked child's heap is its server's, copy-on-write, and
vLLM's shutdown collection ran ~1.7x slower in it, past vLLM's 5 s exit deadline on a shared core.
This module is stdlib only: it runs before the actor imports anything heavy.
"""

from __future__ import annotations

import contextlib
import ctypes
import glob
import importlib.util
import multiprocessing
import os
import sys
from collections.abc import Iterator
from multiprocessing.context import SpawnProcess
from typing import Any

__all__ = [
    "PRELOAD",
    "EngineProcess",
    "start_standby_for",
    "predicted_env",
    "standby_engine_core",
    "load_time_diff",
    "environ_with",
]

#: What the standby imports, in order: its affinity fix-up, then the engine core's entry point and the
#: modules vLLM loads asyncrl's classes from there.
PRELOAD = (
    "asyncrl.actors.standby_init",
    "vllm.v1.engine.core",
    "asyncrl.actors.inproc_executor",
    "asyncrl.actors.worker_ext",
)

#: Environment variables read when a library or the interpreter loads, not later.
LOAD_TIME_PREFIXES = ("OMP_", "KMP_", "GOMP_", "MKL_", "MALLOC_", "LD_", "PYTHON")

#: Of those, the search paths (compared by the directories they name that exist).
_SEARCH_PATHS = ("LD_LIBRARY_PATH", "PYTHONPATH")


def predicted_env(bind: str | None, ld_preload: str = "") -> dict[str, str] | None:
    """The load-time variables a one-rank CPU engine core bound to ``bind`` (``VLLM_CPU_OMP_THREADS_BIND``)
    is spawned with, told without importing vLLM or torch: vLLM's CPU platform preloads a bundled
    tcmalloc and torch's own libgomp through ``LD_PRELOAD`` (``CpuPlatform.check_and_update_config``), and
    ``OMPProcessManager.configure_omp_envs`` sets rank 0's OpenMP binding (GNU variables when libgomp is
    preloaded, ``OMP_PLACES`` otherwise). None where it cannot be told (``auto``, ``nobind``, several
    ranks, an Intel or LLVM OpenMP preloaded). A wrong guess costs nothing but the gain: the start is
    then spawned (:func:`load_time_diff`)."""
    if not sys.platform.startswith("linux") or not bind or bind in ("auto", "nobind") or "|" in bind:
        return None
    cpus: list[int] = []
    for part in bind.split(","):
        lo, _, hi = part.strip().partition("-")
        if not lo.isdigit() or (hi and not hi.isdigit()):
            return None
        cpus.extend(range(int(lo), int(hi or lo) + 1))
    preload = ld_preload
    if not any(lib in preload for lib in ("libomp", "libgomp", "libiomp")):
        torch_dir = _package_dir("torch")
        found = [] if torch_dir is None else [
            *glob.glob(os.path.join(os.path.dirname(torch_dir), "torch.libs", "libgomp*.so*")),
            *glob.glob(os.path.join(torch_dir, "lib", "libgomp*.so*")),
        ]  # fmt: skip
        if found:
            preload = f"{preload}:{found[0]}" if preload else found[0]
    if "libtcmalloc" not in preload and (vllm_dir := _package_dir("vllm")) is not None:
        for pattern in ("libtcmalloc_minimal*.so*", "libtcmalloc.so*"):
            if found := glob.glob(os.path.join(vllm_dir, "libs", pattern)):
                preload = f"{found[0]}:{preload}" if preload else found[0]
                break
    if "libiomp" in preload or "libomp" in preload:
        return None
    env = {"OMP_NUM_THREADS": str(len(cpus))}
    if "libgomp" in preload:
        env["GOMP_CPU_AFFINITY"] = " ".join(map(str, cpus))
    else:
        env.update(OMP_PLACES="{" + ",".join(map(str, cpus)) + "}", OMP_PROC_BIND="true")
    return {**env, "LD_PRELOAD": preload} if preload else env


def _package_dir(name: str) -> str | None:
    """The directory of an installed top-level package, found without importing it."""
    spec = importlib.util.find_spec(name)
    return (
        None
        if spec is None or not spec.submodule_search_locations
        else list(spec.submodule_search_locations)[0]
    )


def load_time_diff(env: dict[str, str], standby_env: dict[str, str]) -> str | None:
    """The first load-time variable on which ``env`` and ``standby_env`` differ, described; None if none.
    A library search path counts by the directories it names that exist: an import can add one that
    does not (opencv adds ``cv2/../../lib64`` to ``LD_LIBRARY_PATH`` when imported), which changes
    nothing any loader finds."""
    keys = sorted({k for k in (*env, *standby_env) if k.startswith(LOAD_TIME_PREFIXES)})
    for k in keys:
        a, b = env.get(k), standby_env.get(k)
        if k in _SEARCH_PATHS:
            a, b = _existing_dirs(a), _existing_dirs(b)
        if a != b:
            return f"{k}={env.get(k)!r} here, {standby_env.get(k)!r} in the standby"
    return None


def _existing_dirs(path: str | None) -> list[str] | None:
    dirs = [d for d in (path or "").split(":") if d and os.path.isdir(d)]
    return dirs or None


@contextlib.contextmanager
def environ_with(extra: dict[str, str]) -> Iterator[None]:
    """``os.environ`` with ``extra`` while the block runs (a spawned process copies the environment at
    its start: util.spawnv_passfds)."""
    saved = {k: os.environ.get(k) for k in extra}
    os.environ.update(extra)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def start_standby_for(cfg: Any) -> int | None:
    """Start the spawned standby engine core (asyncrl.actors.engine_standby) for an actor of ``cfg``
    where it applies (``actors.engine_standby``: asyncrl binds this actor's cores, so this is a CPU
    engine, and its worker runs in the engine core); its pid."""
    from asyncrl.cpu_binding import ENV_CPUS

    from . import engine_standby

    a = cfg.actors
    if not (
        a.engine_standby
        and a.engine_executor == "auto"
        and a.tensor_parallel_size * a.pipeline_parallel_size == 1
        and os.environ.get(ENV_CPUS)
    ):
        return None
    env = predicted_env(os.environ.get("VLLM_CPU_OMP_THREADS_BIND"), os.environ.get("LD_PRELOAD", ""))
    return None if env is None else engine_standby.start_standby(env, PRELOAD)


class EngineProcess(SpawnProcess):
    """A process run by the actor's standby when that is equivalent to spawning it, spawned otherwise;
    the standby's gets the parent's environment and CPU affinity as of ``start()``."""

    _start_env: dict[str, str] | None = None
    _start_cpus: list[int] | None = None
    _actor_pid: int | None = None  # not _parent_pid: multiprocessing's own (join checks it)

    @staticmethod
    def _Popen(process_obj: Any) -> Any:
        from . import engine_standby

        if engine_standby.standby_pid() is not None:  # a spawned process that imported vLLM beside us
            env = dict(os.environ)
            process_obj._start_env = env
            process_obj._start_cpus = sorted(os.sched_getaffinity(0))
            process_obj._actor_pid = os.getpid()
            popen = engine_standby.adopt(process_obj, env)
            if popen is not None:
                return popen
            # Spawned: the child starts with this environment and these CPUs by itself.
            process_obj._start_env = process_obj._start_cpus = process_obj._actor_pid = None
        from multiprocessing.popen_spawn_posix import Popen

        return Popen(process_obj)

    def run(self) -> None:
        if self._start_env is not None:  # run by the standby: become what a spawn at start() would have made
            os.environ.clear()
            os.environ.update(self._start_env)
            from . import standby_init

            # A spawned engine core inherits the parent's CPUs, then libgomp binds it as it loads.
            cpus = standby_init.LOAD_CPUS if standby_init.BOUND_AT_LOAD else self._start_cpus
            if cpus:
                _set_affinity_all_threads(cpus)
            _set_comm(f"{os.environ.get('VLLM_PROCESS_NAME_PREFIX', 'VLLM')}::{self.name}")
            # Dies with the actor, as the standby did (and exits now if the actor is already gone).
            standby_init.die_with_parent(self._actor_pid)
        super().run()


def _set_affinity_all_threads(cpus: list[int]) -> None:
    """Every thread of this process on ``cpus``: the standby (asyncrl.actors.engine_standby) may have
    started some while it imported on every core."""
    os.sched_setaffinity(0, cpus)
    with contextlib.suppress(FileNotFoundError):
        for tid in os.listdir("/proc/self/task"):
            with contextlib.suppress(ProcessLookupError):  # a thread that ended after the listing
                os.sched_setaffinity(int(tid), cpus)


def _set_comm(title: str) -> None:
    """Name this process's task as vLLM's title would (``/proc/<pid>/comm``, 15 bytes: what ps and the
    tests read) with ``prctl(PR_SET_NAME)``, without touching its memory: setproctitle, where it rewrites
    the title, also overwrites ``/proc/<pid>/environ``, which is where asyncrl.lifetime's reaper finds
    the run's processes by their token. The command line stays the standby's."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(15, ctypes.c_char_p(title.encode()[:15]), 0, 0, 0)  # 15 = PR_SET_NAME


class _EngineContext:
    """What vLLM's engine-core process manager uses of a multiprocessing context: ``Process`` (ours);
    anything else (queues) is the spawn context's."""

    Process = EngineProcess

    def __getattr__(self, name: str) -> Any:
        return getattr(multiprocessing.get_context("spawn"), name)


@contextlib.contextmanager
def standby_engine_core() -> Iterator[None]:
    """While the block runs, vLLM starts engine-core processes as :class:`EngineProcess` (no-op when no
    standby waits in this process). vLLM's own ``get_mp_context`` still runs, for its side effects on
    the environment (``RAY_ADDRESS``, the worker start method) that the child inherits."""
    from . import engine_standby

    if engine_standby.standby_pid() is None:
        yield
        return
    import vllm.v1.engine.utils as engine_utils

    original = engine_utils.get_mp_context

    def get_mp_context() -> Any:
        original()
        return _EngineContext()

    engine_utils.get_mp_context = get_mp_context
    try:
        yield
    finally:
        engine_utils.get_mp_context = original
