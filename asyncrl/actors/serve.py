"""``asyncrl serve-actors``: one actor pool of a run, under a leased pool number, until stopped.

    serve_actors(cfg, run_dir)   # blocks until Ctrl-C / SIGTERM / stop_event; returns the final counters

The pool number (actor ids ``actor-<pool>-<i>``) is leased in Redis (:class:`PoolLease`) for the life of
the process: two pools of one run never share actor ids, and ``asyncrl run`` holds number 0 the same way
for its own pool. Moved out of :mod:`asyncrl.actors.pool` (the pool's Ray mechanics) so each module holds
one thing.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

from .pool import ActorPool
from .ray_loss import RayLost, exit_now, local_ray_lost
from .ray_setup import StartStopped, stop_check
from .supervision import PoolLeaseLost

__all__ = ["PoolLease", "serve_actors"]

log = logging.getLogger(__name__)


def serve_actors(
    cfg: Any,
    run_dir: str | os.PathLike,
    stop_event: threading.Event | None = None,
    *,
    redis_url: str | None = None,
    redis_password: str | None = None,
    poll_s: float = 1.0,
) -> list[dict[str, Any]]:
    """Run the actor pool until ``stop_event`` is set or the process gets SIGINT/SIGTERM.

    In-flight groups are aborted on stop (never written; their admission slots are credited back)
    and every engine is shut down. A stop during the pool's start (Ray's start, bounded by
    ``ray.start_timeout_s``; a placement group waiting for a node) gives the start up at once, as in
    `asyncrl run`: the Ray it started is shut down (an unfinished ray.init: killed, then os._exit(0)). A SIGTERM to the whole process group (it kills the local Ray's GCS
    and raylet too) abandons the stop once the loss shows, kills what is left of Ray and ends the
    process with os._exit (:func:`asyncrl.actors.ray_loss.exit_now`): exit code 0, or the CLI's for an
    error that ended the pool. A GCS or raylet of its own local Ray that exits without a signal (OOM
    killer, a crash) ends it the same way with exit code 1 and one line that says so, within seconds
    (before, Ray's core worker aborted the process 60 s later). A failed, dead or silent actor is replaced (see
    :mod:`asyncrl.actors.supervision`); raises ``ActorSupervisionError`` once a slot has failed more
    than ``run.max_restarts`` times. Returns the final counters.
    """
    stop_event = stop_event or threading.Event()
    previous: dict[int, Any] = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            previous[sig] = signal.signal(sig, lambda *_: stop_event.set())
    from asyncrl.buffer import ReplayBuffer

    from .supervision import ActorSupervisionError, ActorSupervisor, LapsedPoolReclaimer

    # Renewed from its own thread from here on (pool.start() can take minutes); a lost lease stops the pool.
    lease = PoolLease(cfg, redis_url, redis_password, on_lost=stop_event.set)
    pool = ActorPool(cfg, run_dir, redis_url=redis_url, redis_password=redis_password)
    # A short socket timeout: a frozen Redis must not freeze the supervision loop with it.
    buf = ReplayBuffer.from_config(cfg, redis_url, redis_password, socket_timeout=5.0)
    error: BaseException | None = None
    try:
        try:
            # Given up at the stop too, as `asyncrl run`'s: a signal during the start (model build, Ray's
            # start, a placement group waiting for a node) was seen only once it was done, 120 s later for
            # a group that could not be placed.
            pool.start(check=stop_check(stop_event, lease.check))
        except StartStopped:  # the finally-block stops what was started: exit code 0, as for any stop
            log.info("actor pool %d: stopped while starting", lease.n)
            return []
        log.info("actor pool %d: %d actors writing to run %r", cfg.actors.pool_index, cfg.actors.num_actors,
                 cfg.run.name)  # fmt: skip
        # The same supervision as `asyncrl run`: a failed, dead or silent actor (heartbeat older than
        # actors.heartbeat_timeout_s) is replaced in its slot, its admission slots reclaimed, at most
        # run.max_restarts times per slot; then ActorSupervisionError ends the process non-zero.
        supervisor = ActorSupervisor(pool, buf, cfg.actors.heartbeat_timeout_s, cfg.run.max_restarts)
        # A pool of this run that died for good (never restarted) would keep its admission slots taken.
        lapsed = LapsedPoolReclaimer(buf, lease.n, lease.token, lease.TTL_S)
        next_lapsed_check = 0.0
        while not stop_event.wait(poll_s):
            lease.check()  # no replacement spawned under ids that may be another pool's
            for msg in supervisor.poll():
                log.warning("%s", msg)
            if pool.owns_local_ray and local_ray_lost():  # no actor can run or be replaced without them
                if not stop_event.wait(2.0):  # a SIGTERM to the process group (it killed them) sets it first
                    raise ActorSupervisionError(
                        "the local Ray's GCS or raylet exited (no actor can run or be replaced; Ray's logs: "
                        "/tmp/ray/session_latest/logs)"
                    )
                break
            if time.monotonic() >= next_lapsed_check:
                lapsed.poll()
                next_lapsed_check = time.monotonic() + lease.TTL_S / 3
        lease.check()  # stopped because the lease was lost: exit non-zero (after the pool stopped)
    except BaseException as e:  # re-raised; reported by exit_now if the process must end below
        error = e
        raise
    finally:
        lost: RayLost | None = None
        try:
            # Bounded: a SIGTERM to the process group (timeout, kill -- -PGID, systemd, scancel) also
            # kills the local Ray's GCS and raylet, and the plain stop then waited on the dead GCS.
            results = pool.stop_bounded()
        except RayLost as e:  # abandoned, Ray's processes killed
            lost, results = e, []
        finally:
            _release(buf, lease, previous, quiet=pool.ray_lost)
        if lost is not None or pool.ray_lost:
            # Ray's atexit shutdown would wait on the dead GCS until Ray's core worker aborts the
            # process (exit code 1), or meet the ray.init the start gave up on: end here, with the exit
            # code the command would have had.
            log.warning(
                "actor pool %d: %s; exiting", lease.n, lost or "the local Ray was lost or its start given up"
            )
            exit_now(0, error)
    return results


def _release(buf: Any, lease: PoolLease, previous: dict[int, Any], quiet: bool) -> None:
    """Close the buffer, free the pool number and put the signal handlers back; ``quiet`` (the process
    ends next, with os._exit): an error is logged instead of raised."""
    try:
        try:
            buf.close()
            lease.release()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
    except Exception as e:
        if not quiet:
            raise
        log.warning("actor pool %d: release: %s: %s", lease.n, type(e).__name__, e)


class PoolLease:
    """Leases this process's actor-pool number in Redis and puts it in ``cfg.actors.pool_index`` (actor
    ids ``actor-<pool>-<i>``), so two ``asyncrl serve-actors`` of one run never share actor ids, while a
    restarted one gets its number back and reclaims its dead incarnation's admission slots.

    A daemon thread renews it every ``TTL_S / 3`` from the moment it is taken: the pool's start (Ray,
    the model, a placement group waiting for a node) and a supervision pass (a replacement waits up to
    30 s) both outlast the TTL, and a lease that lapses meanwhile hands the number to the next pool.
    Should it be lost anyway (another token holds it), ``lost`` says so, ``on_lost()`` is called once
    and :meth:`check` raises :class:`PoolLeaseLost`."""

    TTL_S = 15.0

    def __init__(
        self,
        cfg: Any,
        redis_url: str | None,
        redis_password: str | None,
        on_lost: Callable[[], None] | None = None,
    ) -> None:
        import uuid

        from asyncrl.buffer import ReplayBuffer

        self.token = f"{os.uname().nodename}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        # Short timeouts: a renewal stuck in a long Redis retry outlives the lease anyway, and the release
        # at exit must not hold a tear-down (asyncrl run's, with its Redis already gone) for minutes.
        self.buffer = ReplayBuffer.from_config(cfg, redis_url or cfg.redis.url, password=redis_password,
                                               socket_timeout=5.0, retry_budget_s=self.TTL_S / 3)  # fmt: skip
        self.n = self.buffer.lease_pool(self.token, self.TTL_S)
        cfg.actors.pool_index = self.n
        self.lost: str | None = None
        self._on_lost = on_lost
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._keep, name=f"asyncrl-pool-lease-{self.n}", daemon=True)
        self._thread.start()

    def _keep(self) -> None:
        while not self._done.wait(self.TTL_S / 3):
            if not self.renew():
                self.lost = (f"actor pool {self.n} lost its Redis lease to another process, which may run "
                             f"the same actor ids; stopping this pool")  # fmt: skip
                log.error("%s", self.lost)
                if self._on_lost is not None:
                    self._on_lost()
                return

    def renew(self) -> bool:
        """Extend the lease; False only when another token holds it (a Redis error is not a loss)."""
        try:
            return self.buffer.renew_pool(self.n, self.token, self.TTL_S)
        except Exception as e:  # a Redis outage past the retry budget: the actors ride it out themselves
            log.warning("actor pool %d: lease not renewed: %s", self.n, e)
            return True

    def check(self) -> None:
        """Raise :class:`PoolLeaseLost` once the lease is lost."""
        if self.lost:
            raise PoolLeaseLost(self.lost)

    def release(self) -> None:
        """Stop renewing and free the number (if still ours) at once, for the next pool to take."""
        self._done.set()
        self._thread.join(timeout=self.TTL_S)
        try:
            self.buffer.release_pool(self.n, self.token)
        finally:
            self.buffer.close()
