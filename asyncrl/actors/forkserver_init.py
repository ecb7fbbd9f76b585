"""The first module the engine forkserver imports (asyncrl.actors.engine_fork): give its imports a core.

The server is started with the load-time environment of a spawned engine core, ``LD_PRELOAD`` of
torch's libgomp included, and libgomp binds the process's only thread to the first CPU of the engine's
OpenMP list as it loads (``GOMP_CPU_AFFINITY`` / ``OMP_PLACES``): the server's import of vLLM would then
share that one core with the actor's own import, which is what the server is there to avoid. So:

* :data:`LOAD_CPUS` records the affinity libgomp left (what a spawned engine core starts with), and
  :data:`BOUND_AT_LOAD` whether libgomp narrowed it at all;
* the server then widens itself to the CPUs in ``$ASYNCRL_FORKSERVER_CPUS`` (the actor's before it bound
  itself to its engine's cores) for the imports that follow;
* each engine core forked from the server sets its affinity back to :data:`LOAD_CPUS` (or, where
  libgomp bound nothing, to its parent's at ``start()``), as a spawned one would have it.

It also makes the server die with the actor (``PR_SET_PDEATHSIG = SIGKILL``, as asyncrl.lifetime
does for the learner): multiprocessing's server exits on its own only once every holder of its
"alive" pipe is gone, and a CI run once left it behind after its run had ended (its engine core had
been force-killed at shutdown). ``$ASYNCRL_FORKSERVER_PARENT`` names the actor: if it is already gone
by the time this runs, the server exits at once.

Stdlib only; importing it outside the server (``$ASYNCRL_FORKSERVER_CPUS`` unset) changes nothing.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

__all__ = ["ENV_CPUS", "ENV_PARENT", "LOAD_CPUS", "BOUND_AT_LOAD", "die_with_parent"]

#: The server's CPUs before libgomp bound it (set by asyncrl.actors.engine_fork.start_server).
ENV_CPUS = "ASYNCRL_FORKSERVER_CPUS"
#: The pid of the process that started the server (the actor).
ENV_PARENT = "ASYNCRL_FORKSERVER_PARENT"


def die_with_parent(parent: int | None) -> None:
    """SIGKILL this process when the thread that started it ends (Linux); exit now if its parent, pid
    ``parent`` as its starter knew it, is already gone (the signal would never come)."""
    if not parent or not sys.platform.startswith("linux"):
        return
    ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL), 0, 0, 0)  # 1 = PR_SET_PDEATHSIG
    if os.getppid() != parent:
        os._exit(1)


_wide = [int(c) for c in os.environ.get(ENV_CPUS, "").split(",") if c]
#: This process's affinity as the loader left it.
LOAD_CPUS: list[int] = sorted(os.sched_getaffinity(0))
#: Whether libgomp bound this process at load (its affinity is narrower than the one it started with).
BOUND_AT_LOAD = bool(_wide) and set(LOAD_CPUS) != set(_wide)
if _wide:
    os.sched_setaffinity(0, _wide)
die_with_parent(int(os.environ.get(ENV_PARENT) or 0))
