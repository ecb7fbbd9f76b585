"""The first module the engine standby imports (asyncrl.actors.engine_standby): give its imports a core.

The standby is started with the load-time environment of a spawned engine core, ``LD_PRELOAD`` of
torch's libgomp included, and libgomp binds the process's only thread to the first CPU of the engine's
OpenMP list as it loads (``GOMP_CPU_AFFINITY`` / ``OMP_PLACES``): the standby's import of vLLM would
then share that one core with the actor's own import, which is what the standby is there to avoid. So:

* :data:`LOAD_CPUS` records the affinity libgomp left (what a spawned engine core starts with), and
  :data:`BOUND_AT_LOAD` whether libgomp narrowed it at all;
* the standby then widens itself to the CPUs in ``$ASYNCRL_STANDBY_CPUS`` (the actor's before it bound
  itself to its engine's cores) for the imports that follow;
* the engine process it runs sets the affinity of every thread back to :data:`LOAD_CPUS` (or, where
  libgomp bound nothing, to its parent's at ``start()``), as a spawned one would have it
  (asyncrl.actors.engine_start.EngineProcess).

It also makes the standby die with the actor (``PR_SET_PDEATHSIG = SIGKILL``, as asyncrl.lifetime
does for the learner). ``$ASYNCRL_STANDBY_PARENT`` names the actor: if it is already gone by the time
this runs, the standby exits at once.

Stdlib only; importing it outside the standby (``$ASYNCRL_STANDBY_CPUS`` unset) changes nothing.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

__all__ = ["ENV_CPUS", "ENV_PARENT", "LOAD_CPUS", "BOUND_AT_LOAD", "die_with_parent"]

#: The standby's CPUs before libgomp bound it (set by asyncrl.actors.engine_standby.start_standby).
ENV_CPUS = "ASYNCRL_STANDBY_CPUS"
#: The pid of the process that started the standby (the actor).
ENV_PARENT = "ASYNCRL_STANDBY_PARENT"


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
