"""How the actors' Ray is started or attached, and what reaches each actor process.

``init_ray`` starts a local Ray (or attaches to ``ray.address``) for the actor pool
(asyncrl.actors.pool) and for `asyncrl run`'s early start (asyncrl.launch.EarlyRay); for `asyncrl run`
a local head it starts carries a GCS reconnect timeout that covers the learner's stop
(:func:`driver_gcs_timeout_s`), for `asyncrl serve-actors` Ray's default.
``actor_env``/``actor_runtime_env`` say which environment travels with an actor and by which path.
Moved out of asyncrl.actors.pool (still importable from there); ray loads only inside the calls.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import signal
import threading
from collections.abc import Callable, Iterator
from typing import Any

from .supervision import RayConnectError

# Environment the actor processes need: vLLM/HF settings of the launching shell travel with them
# (a remote Ray cluster does not inherit the driver's environment).
_ENV_PREFIXES = ("VLLM_", "HF_", "TRANSFORMERS_", "OMP_", "KMP_", "LD_PRELOAD")
#: What the dynamic loader reads as a process starts: only Ray's runtime_env can put these in a worker's
#: environment in time. Everything else an actor needs is read later (vLLM's and asyncrl's variables when
#: the engine is built, libgomp's when torch is first imported, after the actor's constructor began).
_LOAD_TIME = ("LD_PRELOAD",)


def actor_env() -> dict[str, str]:
    """The environment every actor process gets (on top of its worker's), set by the actor itself as its
    constructor starts (:class:`asyncrl.actors.ray_actor.RayRolloutActor`)."""
    env = {k: v for k, v in os.environ.items() if k.startswith(_ENV_PREFIXES)}
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    # vLLM's engine runs in child processes; inside a Ray actor it must spawn, never fork.
    env.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    return env


def actor_runtime_env() -> dict[str, Any]:
    """The Ray job's ``runtime_env``: the load-time variables only (``LD_PRELOAD``), empty when there are
    none. Why not every variable: Ray starts a few idle workers as its raylet comes up, with no
    runtime_env, and only an actor whose runtime_env is empty can take one; any other waits for a worker
    started for it (a bare actor's constructor ran 1.2-1.6 s after its creation instead of 0.3-0.6 s on
    the 2-core box, on the path to the first step). The rest of the environment travels in the actor's
    constructor arguments (:func:`actor_env`), as its Redis URL and password already did."""
    env = {k: v for k, v in os.environ.items() if k.startswith(_LOAD_TIME)}
    return {"env_vars": env} if env else {}


@contextlib.contextmanager
def _keep_signal_handlers() -> Iterator[None]:
    """Restore the Python SIGINT/SIGTERM handlers after the block (main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in saved.items():
            if handler is not None:
                signal.signal(sig, handler)


def init_ray(cfg: Any, gcs_reconnect_timeout_s: int | None = None) -> bool:
    """Start a local Ray for the actors (or attach to ``ray.address``); True when this call started it,
    False when Ray was already up in this process. Callable from any thread (`asyncrl run` starts Ray
    in the background while it builds the model): off the main thread the caller must re-install its
    SIGINT/SIGTERM handlers afterwards, on the main thread they are kept here.

    ``gcs_reconnect_timeout_s``: Ray's GCS reconnect timeout for a new local head (`asyncrl run`:
    :func:`driver_gcs_timeout_s`, for its learner's stop after a lost GCS); None: Ray's default (60 s),
    the time a driver that lost its GCS lives on blind (`asyncrl serve-actors`: nothing to wait for)."""
    import ray

    if ray.is_initialized():
        return False
    # ray.init's core worker installs Ray's native failure-signal handler (SIGTERM: a stack dump and an
    # abort), process-wide, from whichever thread calls it: started in the background (EarlyRay), it
    # replaced the command's Python handlers ("set the stop event") until the main thread re-installed
    # them, and a SIGTERM during the model build meanwhile aborted the process (exit -6, no teardown).
    # Ray reads its switch (RAY_DISABLE_FAILURE_SIGNAL_HANDLER) from this constant at init: set for this
    # driver only, not in the environment, so Ray's workers (the actors) keep their handler.
    from ray._private import ray_constants

    ray_constants.RAY_DISABLE_FAILURE_SIGNAL_HANDLER = True
    # ray.init (on the main thread) also sets a Python SIGTERM handler (sys.exit): keep the caller's.
    with _keep_signal_handlers():
        try:
            ray.init(
                address=cfg.ray.address or None,
                num_cpus=(cfg.ray.num_cpus or None) if not cfg.ray.address else None,
                include_dashboard=False,
                runtime_env=actor_runtime_env() or None,
                logging_level=logging.WARNING,
                # asyncrl run: the actors write to <run_dir>/logs (asyncrl.console); -v forwards.
                log_to_driver=not cfg.console.log_dir,
                _system_config=local_head_system_config(cfg, gcs_reconnect_timeout_s),
            )
        except (ray.exceptions.AuthenticationError, ConnectionError) as e:
            raise RayConnectError(ray_connect_message(cfg.ray.address, e)) from e
    return True


#: Ray's setting: how long (s) its core worker waits for a lost GCS before it ends the process
#: (std::_Exit(1)); 60 by default.
GCS_RECONNECT_KEY = "gcs_rpc_server_reconnect_timeout_s"
#: What the teardown after a lost GCS needs beside the learner's grace (its SIGKILL wait, the pool
#: stop's abandonment, Redis's stop, the summary, and the supervision pass that was running).
GCS_LOSS_MARGIN_S = 120


def driver_gcs_timeout_s(cfg: Any) -> int:
    """Ray's ``gcs_rpc_server_reconnect_timeout_s`` for the local head `asyncrl run` starts (it passes
    this to :func:`init_ray`): long enough for its teardown after a SIGTERM to its process group (which
    kills the GCS) to stop the learner with its full ``learner.stop_grace_s``; at Ray's default (60 s)
    the core worker ended the driver in the middle of a long final checkpoint, without summary.json,
    the learner SIGKILLed with it (it dies with its parent, asyncrl.lifetime). Never below Ray's
    default."""
    return max(60, math.ceil(cfg.learner.stop_grace_s) + GCS_LOSS_MARGIN_S)


def local_head_system_config(cfg: Any, gcs_reconnect_timeout_s: int | None = None) -> dict[str, Any] | None:
    """Ray's ``_system_config`` for :func:`init_ray`: ``gcs_reconnect_timeout_s`` (`asyncrl run`:
    :func:`driver_gcs_timeout_s`) when this call starts a new local Ray (the config is the cluster's, set
    when its head starts); None without one, and when it attaches to a running cluster (``ray.address``,
    ``RAY_ADDRESS`` or a ``ray start --head`` on this machine), where Ray refuses one."""
    if gcs_reconnect_timeout_s is None or cfg.ray.address:
        return None
    try:
        from ray._private.services import canonicalize_bootstrap_address

        if canonicalize_bootstrap_address(None) is not None:
            return None
    except Exception:  # a Ray without this helper: leave its config alone
        return None
    return {GCS_RECONNECT_KEY: gcs_reconnect_timeout_s}


class StartStopped(Exception):
    """The command's stop (SIGINT/SIGTERM) came while Ray or the actor pool was starting: the start is
    abandoned and the command ends as for any stop (exit code 0). Raised by the stop check that `asyncrl
    run` and `asyncrl serve-actors` hand to :meth:`asyncrl.launch.EarlyRay.result` and
    :meth:`asyncrl.actors.pool.ActorPool.start`; before, the signal was only seen once the start was done
    (a placement group that could not be placed held it 120 s, an unreachable ray.address for good)."""

    def __init__(self) -> None:
        super().__init__("stopped while starting")


def stop_check(stop: threading.Event, then: Callable[[], None] | None = None) -> Callable[[], None]:
    """A start check (see :class:`StartStopped`): raises it once ``stop`` is set; ``then()`` first, when
    given (the pool lease's check)."""

    def check() -> None:
        if then is not None:
            then()
        if stop.is_set():
            raise StartStopped()

    return check


def ray_start_timeout_message(address: str | None, timeout_s: float) -> str:
    """One line for a Ray that did not come up within ``ray.start_timeout_s``: ray.init keeps retrying an
    address that refuses or drops connections (no error of its own for minutes), so name what to check."""
    env = os.environ.get("RAY_ADDRESS")
    if address or env:
        # ray.init takes RAY_ADDRESS when ray.address is empty: name the one it used and how to drop it.
        key = (
            f"ray.address={address}"
            if address
            else f"RAY_ADDRESS={env} (the environment's; ray.address is empty)"
        )
        local = "set ray.address= (empty)" if address else "unset RAY_ADDRESS"
        where = (f"{key} did not answer; check that a Ray head runs there (`ray status --address "
                 f"{address or env}` on that host), that its GCS port is reachable from here, or {local} to "
                 f"start a local Ray")  # fmt: skip
    else:
        where = ("the local Ray did not come up; see /tmp/ray/session_latest/logs (gcs_server.out, "
                 "raylet.out) and check free memory and /tmp space")  # fmt: skip
    return f"Ray did not start within ray.start_timeout_s={timeout_s:g}s: {where}"


def _where(address: str | None) -> str:
    """The cluster ray.init reaches for: ``ray.address``, else RAY_ADDRESS, else a new local one."""
    if address:
        return address
    env = os.environ.get("RAY_ADDRESS")
    return f"{env} (RAY_ADDRESS; ray.address is empty)" if env else "a new local cluster"


def ray_connect_message(address: str | None, e: BaseException) -> str:
    """One line for a Ray that refused or could not be reached, with the usual cause: a cluster started
    by ``ray start --head`` with ``~/.ray/auth_token`` present uses token authentication, and every
    driver and node must then run with RAY_AUTH_MODE=token and that token (Ray's own error names
    neither in its first line)."""
    first = next((line.strip() for line in str(e).splitlines() if line.strip()), type(e).__name__)
    return (
        f"cannot connect to Ray at {_where(address)}: {type(e).__name__}: {first[:200]} "
        f"(a cluster started by `ray start --head` with ~/.ray/auth_token present needs "
        f"`export RAY_AUTH_MODE=token` in every shell that runs `ray start` or asyncrl, and that token "
        f"file copied to every node)"
    )
