"""Start a CPU engine's engine-core process from a forkserver that imported vLLM beside the actor.

Why: an actor's start-up runs two ~8-10 s imports of torch + vLLM one after the other on the 2-core
box: its own (the front end), then, once it has built the engine config, the engine core's, which
vLLM starts with ``spawn`` (always inside a Ray actor: ``vllm.utils.system_utils._maybe_force_spawn``).
Here the actor starts a stdlib forkserver (:mod:`multiprocessing.forkserver`) as its first act, which
imports the engine core's modules (:data:`PRELOAD`) on the other core while the actor imports its own;
the engine core is then forked from it with everything loaded (~1 s instead of ~8-10 s). vLLM's own
API server does the same (``VLLM_WORKER_MULTIPROC_METHOD=forkserver`` with ``vllm.v1.engine.async_llm``
preloaded), but that setting is overridden to ``spawn`` inside a Ray actor, so the engine-core process
manager's context is replaced while the engine is built (:func:`forked_engine_core`).

What must stay as with ``spawn`` (the invariants):

* The environment: a forked child has the *server's* environment, frozen when the server started, while
  vLLM sets variables in the front end before it starts the engine core (its CPU platform's, and the
  OpenMP binding of the in-process worker, asyncrl.actors.inproc_executor). The child therefore
  replaces its environment with the parent's as of ``start()`` before the engine core runs.
* The CPUs: a spawned engine core starts on its parent's cores (the engine's) and libgomp, preloaded,
  binds it to the first CPU of its OpenMP list as it loads. The server went through the same load, then
  widened itself to every core the actor had before it bound itself, so that its imports do not share
  the actor's core (asyncrl.actors.forkserver_init); a forked child takes the binding libgomp gave.
* What is read once, when a library loads (``LD_PRELOAD``, libgomp's ``OMP_*``/``GOMP_*``, glibc's
  ``MALLOC_*``, the interpreter's ``PYTHON*``) cannot be replaced after the fact. The server is started
  with the values vLLM will give the engine core (:func:`predicted_env`), and a start whose load-time
  variables differ from the server's in any way (or whose multiprocessing executable was replaced,
  vLLM's ``--numa-bind``) is spawned instead, with the reason logged.
* The name: ``/proc/<pid>/comm`` is set as vLLM's process title would set it (:func:`_set_comm`).

The server lives as long as the actor (it exits when its parent does) and serves an engine restart as
well; it holds the imported modules (~0.6 GB resident, shared copy-on-write with the engine core).
This module is stdlib only: it runs before the actor imports anything heavy.
"""

from __future__ import annotations

import contextlib
import ctypes
import glob
import importlib.util
import logging
import multiprocessing
import multiprocessing.forkserver as forkserver
import os
import sys
from collections.abc import Iterator
from multiprocessing.context import ForkServerProcess
from typing import Any

from .forkserver_init import ENV_CPUS as ENV_SERVER_CPUS
from .forkserver_init import ENV_PARENT as ENV_SERVER_PARENT

__all__ = [
    "PRELOAD",
    "EngineProcess",
    "start_for",
    "start_standby_for",
    "start_server",
    "predicted_env",
    "forked_engine_core",
    "server_pid",
    "load_time_diff",
]

log = logging.getLogger(__name__)

#: What the server imports, in order: its affinity fix-up, then the engine core's entry point and the
#: modules vLLM loads asyncrl's classes from there.
PRELOAD = (
    "asyncrl.actors.forkserver_init",
    "vllm.v1.engine.core",
    "asyncrl.actors.inproc_executor",
    "asyncrl.actors.worker_ext",
)

#: Environment variables read when a library or the interpreter loads, not later.
LOAD_TIME_PREFIXES = ("OMP_", "KMP_", "GOMP_", "MKL_", "MALLOC_", "LD_", "PYTHON")

#: Of those, the search paths (compared by the directories they name that exist).
_SEARCH_PATHS = ("LD_LIBRARY_PATH", "PYTHONPATH")

# (pid, environment, executable) of the server this module started in this process; None = none.
_server: tuple[int, dict[str, str], str] | None = None


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


def load_time_diff(env: dict[str, str], server_env: dict[str, str]) -> str | None:
    """The first load-time variable on which ``env`` and ``server_env`` differ, described; None if none.
    A library search path counts by the directories it names that exist: an import can add one that
    does not (opencv adds ``cv2/../../lib64`` to ``LD_LIBRARY_PATH`` when imported), which changes
    nothing any loader finds."""
    keys = sorted({k for k in (*env, *server_env) if k.startswith(LOAD_TIME_PREFIXES)})
    for k in keys:
        a, b = env.get(k), server_env.get(k)
        if k in _SEARCH_PATHS:
            a, b = _existing_dirs(a), _existing_dirs(b)
        if a != b:
            return f"{k}={env.get(k)!r} here, {server_env.get(k)!r} in the preloaded server"
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


def start_server(extra_env: dict[str, str], preload: tuple[str, ...] = PRELOAD) -> int | None:
    """Start this process's forkserver with ``extra_env`` added to its environment, importing
    ``preload``; returns its pid (None if a forkserver was already running here: its environment is
    not known, so it is not used). Returns at once: the imports run in the server."""
    global _server
    fs = forkserver._forkserver
    if _server is not None or fs._forkserver_pid is not None:
        return None
    multiprocessing.set_forkserver_preload(list(preload))
    # The server may use every core this thread may (asyncrl.actors.forkserver_init widens it back to
    # them once libgomp has bound it at load).
    extra_env = {
        **extra_env,
        ENV_SERVER_CPUS: ",".join(map(str, sorted(os.sched_getaffinity(0)))),
        ENV_SERVER_PARENT: str(os.getpid()),  # the server dies with this process (forkserver_init)
    }
    env = {**os.environ, **extra_env}
    with environ_with(extra_env):  # the server is started with this process's environment at the time
        forkserver.ensure_running()
    _server = (fs._forkserver_pid, env, multiprocessing.spawn.get_executable())
    return _server[0]


def start_for(cfg: Any) -> int | None:
    """Start the server for an actor of ``cfg`` where it applies (``actors.engine_forkserver``: asyncrl
    binds this actor's cores, so this is a CPU engine, and its worker runs in the engine core); its pid."""
    from asyncrl.cpu_binding import ENV_CPUS

    a = cfg.actors
    if not (
        a.engine_forkserver
        and a.engine_executor == "auto"
        and a.tensor_parallel_size * a.pipeline_parallel_size == 1
        and os.environ.get(ENV_CPUS)
    ):
        return None
    env = predicted_env(os.environ.get("VLLM_CPU_OMP_THREADS_BIND"), os.environ.get("LD_PRELOAD", ""))
    return None if env is None else start_server(env)


def start_standby_for(cfg: Any) -> int | None:
    """Start the spawned standby engine core (asyncrl.actors.engine_standby) for an actor of ``cfg``
    where it applies (``actors.engine_standby``, and the forkserver's conditions, the forkserver off);
    its pid."""
    from asyncrl.cpu_binding import ENV_CPUS

    from . import engine_standby

    a = cfg.actors
    if not (
        a.engine_standby
        and not a.engine_forkserver
        and a.engine_executor == "auto"
        and a.tensor_parallel_size * a.pipeline_parallel_size == 1
        and os.environ.get(ENV_CPUS)
    ):
        return None
    env = predicted_env(os.environ.get("VLLM_CPU_OMP_THREADS_BIND"), os.environ.get("LD_PRELOAD", ""))
    return None if env is None else engine_standby.start_standby(env, PRELOAD)


def server_pid() -> int | None:
    """The pid of the server :func:`start_server` started here, if it is still the running one."""
    if _server is None or forkserver._forkserver._forkserver_pid != _server[0]:
        return None
    return _server[0] if os.path.exists(f"/proc/{_server[0]}") else None


def _why_not_forked(env: dict[str, str]) -> str | None:
    """Why a process started now must be spawned instead of forked from the server (None: it may be)."""
    if server_pid() is None:
        return "no preloaded server is running"
    assert _server is not None
    if os.fsdecode(multiprocessing.spawn.get_executable()) != os.fsdecode(_server[2]):
        return "the multiprocessing executable was replaced (a numactl wrapper)"
    return load_time_diff(env, _server[1])


class EngineProcess(ForkServerProcess):
    """A process forked from the preloaded server when that is equivalent to spawning it, spawned
    otherwise; the child gets the parent's environment and CPU affinity as of ``start()``."""

    _start_env: dict[str, str] | None = None
    _start_cpus: list[int] | None = None
    _server_pid: int | None = None

    @staticmethod
    def _Popen(process_obj: Any) -> Any:
        from . import engine_standby

        env = dict(os.environ)
        process_obj._start_env = env
        process_obj._start_cpus = sorted(os.sched_getaffinity(0))
        if engine_standby.standby_pid() is not None:  # a spawned process that imported vLLM beside us
            process_obj._server_pid = os.getpid()  # its parent: this process
            popen = engine_standby.adopt(process_obj, env)
            if popen is not None:
                return popen
        why = _why_not_forked(env)
        if why is None:
            process_obj._server_pid = server_pid()
            from multiprocessing.popen_forkserver import Popen
        else:
            if _server is not None:
                log.info("%s: spawned, not forked from the preloaded server (%s)", process_obj.name, why)
            process_obj._start_env = process_obj._start_cpus = process_obj._server_pid = None
            from multiprocessing.popen_spawn_posix import Popen
        return Popen(process_obj)

    def run(self) -> None:
        if self._start_env is not None:  # forked or adopted: become what a spawn at start() would have made
            os.environ.clear()
            os.environ.update(self._start_env)
            from . import forkserver_init

            # A spawned engine core inherits the parent's CPUs, then libgomp binds it as it loads.
            cpus = forkserver_init.LOAD_CPUS if forkserver_init.BOUND_AT_LOAD else self._start_cpus
            if cpus:
                _set_affinity_all_threads(cpus)
            _set_comm(f"{os.environ.get('VLLM_PROCESS_NAME_PREFIX', 'VLLM')}::{self.name}")
            # Dies with the server, which dies with the actor: no engine outlives its actor (and if the
            # server is already gone, this exits now instead of running orphaned).
            forkserver_init.die_with_parent(self._server_pid)
        super().run()


def _set_affinity_all_threads(cpus: list[int]) -> None:
    """Every thread of this process on ``cpus``: a forked child has one thread, but the standby
    (asyncrl.actors.engine_standby) may have started some while it imported on every core."""
    os.sched_setaffinity(0, cpus)
    with contextlib.suppress(FileNotFoundError):
        for tid in os.listdir("/proc/self/task"):
            with contextlib.suppress(ProcessLookupError):  # a thread that ended after the listing
                os.sched_setaffinity(int(tid), cpus)


def _set_comm(title: str) -> None:
    """Name this process's task as vLLM's title would (``/proc/<pid>/comm``, 15 bytes: what ps and the
    tests read), without touching its memory. In a child forked from the server and given its parent's
    environment, setproctitle's later call leaves the title alone; where it does rewrite the title in a
    forked child (environment untouched), it also overwrote ``/proc/<pid>/environ``, which is where
    asyncrl.lifetime's reaper finds the run's processes by their token: so the environment is replaced
    and the name set here, with ``prctl(PR_SET_NAME)``. The command line stays the server's."""
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
def forked_engine_core() -> Iterator[None]:
    """While the block runs, vLLM starts engine-core processes as :class:`EngineProcess` (no-op when no
    preloaded server was started in this process). vLLM's own ``get_mp_context`` still runs, for its
    side effects on the environment (``RAY_ADDRESS``, the worker start method) that the child inherits."""
    from . import engine_standby

    if _server is None and engine_standby.standby_pid() is None:
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
