"""A spawned engine-core process started when the actor starts, importing vLLM beside the actor's own
import, and adopted as the engine core once vLLM starts one.

Why: on a CPU actor the path to the first step ran two ~6-10 s imports of torch + vLLM one after the
other: the actor's own (the front end), then, once it had built the engine config, the engine core's,
which vLLM spawns (always ``spawn`` inside a Ray actor). The standby is a *spawned* process, a direct
child of the actor like the engine core vLLM would spawn (not a fork, whose heap would be its
server's: see asyncrl.actors.engine_start): it imports the engine core's modules
(asyncrl.actors.engine_start.PRELOAD) right away and then waits on a pipe. When vLLM starts its engine
core (asyncrl.actors.engine_start.EngineProcess), the process object, target and
arguments included, is pickled as a spawn would pickle it and sent to the standby, which runs it as
its own: vLLM's process manager gets the standby's pid and sentinel, signals it and waits for it as
it would a spawned one.

What must stay as with a spawn (the invariants):

* The environment: the standby's is the actor's at *its* start plus the load-time variables vLLM will
  give the engine core (:func:`asyncrl.actors.engine_start.predicted_env`); the engine core replaces it
  with the actor's as of vLLM's ``start()`` before it runs (``EngineProcess.run``). A start whose
  load-time variables differ from the standby's, or whose arguments hold a file descriptor (a spawn
  passes those at exec; the standby is already running), is spawned instead, with the reason logged.
* The CPUs (asyncrl.actors.standby_init): the standby imports on every core the actor had, and the
  engine core takes the binding libgomp gave the standby at load.
* The lifetime: the standby dies with the actor (``PR_SET_PDEATHSIG``, set by standby_init); one
  that is never adopted (a start spawned instead) is terminated once the engine is up (:func:`discard`).

One standby per actor process, used once: an engine restart in the same actor spawns (the standby's
~0.6 GB would otherwise stay resident for the actor's life).
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import sys
from multiprocessing import process as mp_process
from multiprocessing import reduction
from typing import Any

from .engine_start import environ_with, load_time_diff

__all__ = ["start_standby", "adopt", "discard", "standby_pid"]

log = logging.getLogger(__name__)


class _Standby:
    def __init__(self, proc: Any, conn: Any, env: dict[str, str], executable: str) -> None:
        self.proc = proc
        self.conn = conn  # the write end of the standby's pipe
        self.env = env
        self.executable = executable


_standby: _Standby | None = None


def start_standby(extra_env: dict[str, str], preload: tuple[str, ...]) -> int | None:
    """Spawn this process's standby with ``extra_env`` added to its environment, importing ``preload``
    (the first: asyncrl.actors.standby_init); its pid. Returns at once (None: one was started here
    already)."""
    global _standby
    from .standby_init import ENV_CPUS, ENV_PARENT

    if _standby is not None:
        return None
    extra_env = {
        **extra_env,
        ENV_CPUS: ",".join(map(str, sorted(os.sched_getaffinity(0)))),
        ENV_PARENT: str(os.getpid()),  # the standby dies with this process (standby_init)
    }
    ctx = multiprocessing.get_context("spawn")
    reader, writer = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_standby_main, args=(reader, preload), name="asyncrl-engine-standby")
    with environ_with(extra_env):
        proc.start()
    reader.close()
    _standby = _Standby(proc, writer, {**os.environ, **extra_env}, multiprocessing.spawn.get_executable())
    return proc.pid


def standby_pid() -> int | None:
    """The pid of this process's standby while it waits to be adopted."""
    st = _standby
    return None if st is None or st.conn is None or not st.proc.is_alive() else st.proc.pid


class _NoFds:
    """The spawning context while the engine process is pickled for the standby: a file descriptor in
    it (a multiprocessing queue, a lock) cannot be passed to a running process."""

    class NeedsFds(Exception):
        pass

    def duplicate_for_child(self, fd: int) -> int:
        raise self.NeedsFds(f"its arguments hold a file descriptor ({fd})")

    DupFd = None


def adopt(process_obj: Any, env: dict[str, str]) -> Any:
    """Hand ``process_obj`` (an unstarted engine process, its ``_start_env`` set) to the standby; the
    standby's Popen (pid, sentinel, poll, terminate, kill, wait), or None with the reason logged when it
    must be spawned instead."""
    st = _standby
    if st is None or st.conn is None:
        return None
    why = None
    if not st.proc.is_alive():
        why = f"the standby exited ({st.proc.exitcode})"
    elif os.fsdecode(multiprocessing.spawn.get_executable()) != os.fsdecode(st.executable):
        why = "the multiprocessing executable was replaced (a numactl wrapper)"
    else:
        why = load_time_diff(env, st.env)
    buf = None
    if why is None:
        from multiprocessing.context import set_spawning_popen

        set_spawning_popen(_NoFds())
        try:
            buf = reduction.ForkingPickler.dumps(process_obj)
        except _NoFds.NeedsFds as e:
            why = str(e)
        finally:
            set_spawning_popen(None)
    if why is not None or buf is None:
        log.info("%s: spawned, not the standby's (%s)", process_obj.name, why)
        return None
    st.conn.send_bytes(bytes(buf))
    st.conn.close()
    st.conn = None
    popen = st.proc._popen
    log.info(
        "%s: run by the standby (pid %d), which imported vLLM beside this process",
        process_obj.name,
        popen.pid,
    )
    # The engine process object owns the standby's process from now on (multiprocessing joins it).
    mp_process._children.discard(st.proc)
    return popen


def discard() -> None:
    """Terminate a standby that was not adopted (the engine core was spawned instead)."""
    st = _standby
    if st is None or st.conn is None:
        return
    st.conn.close()  # the standby's recv ends: it exits by itself
    st.conn = None
    st.proc.join(5)
    if st.proc.is_alive():
        st.proc.kill()
        st.proc.join(5)


def _standby_main(reader: Any, preload: tuple[str, ...]) -> None:
    """The standby: import ``preload``, wait for an engine process, run it as this process."""
    import importlib

    for name in preload:
        importlib.import_module(name)
    try:
        buf = reader.recv_bytes()
    except EOFError:  # discarded, or the actor is gone
        return
    reader.close()
    obj = reduction.ForkingPickler.loads(buf)
    # As a spawned child would: the process object's own bootstrap (current process, name, run, exit
    # handlers), then exit with its code without running this standby's own exit handlers.
    code = obj._bootstrap()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
