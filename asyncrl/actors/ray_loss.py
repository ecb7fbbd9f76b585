"""Ray-loss detection and bounded Ray teardown for the local Ray this process started.

A SIGTERM to the whole process group of `asyncrl run` (``timeout``, ``kill -- -PGID``, systemd, scancel)
also kills Ray's GCS and raylet: every Ray call then waits on the dead GCS until Ray's core worker ends
the process. :func:`local_ray_lost` tells when that happened, :func:`call_bounded` abandons a Ray
teardown call once it does, :func:`kill_local_ray` kills what is left without a Ray call, and
:class:`RayLost` tells the caller to end its process with os._exit (:func:`exit_now`). Used by the
pool's stop (asyncrl.actors.pool.ActorPool.stop_bounded), `asyncrl run` (asyncrl.run_teardown) and
`asyncrl serve-actors` (asyncrl.actors.serve). Moved out of asyncrl.actors.pool (still importable from
there); ray loads only inside the calls.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from collections.abc import Callable
from typing import Any


class RayLost(RuntimeError):
    """The local Ray this process started lost its GCS or raylet: its Ray calls were abandoned and its
    processes killed; the process must end with os._exit (Ray's atexit shutdown waits on the dead GCS)."""

    def __init__(self) -> None:
        super().__init__("the local Ray lost its GCS or raylet (a signal to the process group?): "
                         "its processes were killed without an orderly stop")  # fmt: skip


def call_bounded(fn: Callable[[], Any], watch: Callable[[], bool] = lambda: True, poll_s: float = 0.5) -> Any:
    """``fn()`` (a call of Ray's teardown), abandoned as soon as the local Ray this process started has
    lost its GCS or raylet while ``watch()`` is true: every Ray call would then wait on the dead GCS until
    Ray's core worker ends the process. ``fn`` runs in a daemon thread that is left behind; what is left
    of Ray's processes is killed and :class:`RayLost` raised. ``fn``'s own result or error otherwise."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["result"] = fn()
        except BaseException as e:  # re-raised in the caller's thread
            box["error"] = e

    t = threading.Thread(target=run, name="ray-teardown", daemon=True)
    t.start()
    while t.is_alive():
        if watch() and local_ray_lost():
            kill_local_ray()
            raise RayLost()
        t.join(poll_s)
    if "error" in box:
        raise box["error"]
    return box.get("result")


def local_ray_lost() -> bool:
    """True when this process started a local Ray whose GCS or raylet has exited. Not while Ray's own
    teardown kills them (ray.shutdown, :func:`kill_local_ray`: they hold the node's removal lock while a
    killed process is still listed), so a call of ray.shutdown can be watched too. After a SIGTERM to the
    process group (Ray 2.60) the GCS closes its port at once but its process may linger, and the raylet
    exits ~10 s later (under load it can outlast the core worker's 60 s): a refused connection to the
    GCS's port, or either process gone, shows the loss."""
    try:
        from ray._private import worker

        node = worker._global_node
        if node is None or not node.head:
            return False
        lock = getattr(node, "removal_lock", None)
        if lock is not None and not lock.acquire(blocking=False):
            return False  # Ray is killing its processes itself
        try:
            if any(kind in ("gcs_server", "raylet") for kind, _ in node.dead_processes()):
                return True
            return _refuses_connections(node.gcs_address)
        finally:
            if lock is not None:
                lock.release()
    except Exception:  # a Ray without these internals: assume alive (the plain stop path)
        return False


def _refuses_connections(address: str) -> bool:
    """True when nothing listens at ``address`` ("host:port") any more: a GCS sent SIGTERM closes its
    port at once, while its process lingers and the raylet takes 10 s (on a loaded machine over the
    core worker's 60 s) to exit. A refused connection is definitive; a timeout (a frozen GCS) is not."""
    import socket

    host, _, port = address.rpartition(":")
    try:
        # Ray writes an IPv6 address as "[::1]:6379".
        socket.create_connection((host.strip("[]"), int(port)), timeout=1.0).close()
    except ConnectionRefusedError:
        return True
    except OSError:
        return False
    return False


def kill_local_ray() -> None:
    """SIGKILL what is left of the local Ray this process started (and reap it), without a Ray call."""
    try:
        from ray._private import worker

        node = worker._global_node
        if node is not None:
            node.kill_all_processes(check_alive=False, allow_graceful=False, wait=True)
    except Exception:  # best effort: the run's reaper (asyncrl.lifetime) takes the rest on exit
        pass


def exit_now(code: int, error: BaseException | None = None) -> None:
    """End the process now with os._exit (Ray's atexit shutdown would wait on the dead GCS until Ray's
    core worker aborts the process, exit code 1), after reporting ``error`` the way ``asyncrl.cli.main``
    would (its message and exit code: 2 for a user error, 1 for a role error, else the traceback and 1)
    and flushing stdout, stderr and the logging handlers (a role's log file)."""
    try:
        if error is not None:
            from asyncrl.cli import ROLE_ERRORS, USER_ERRORS

            if isinstance(error, USER_ERRORS + ROLE_ERRORS):
                print(f"asyncrl: error: {error}", file=sys.stderr)
                code = 2 if isinstance(error, USER_ERRORS) else 1
            else:
                import traceback

                traceback.print_exception(error)
                code = 1
        logging.shutdown()  # flushes every handler; os._exit skips logging's own atexit flush
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)
