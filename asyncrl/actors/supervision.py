"""Supervision of an actor pool (`asyncrl run` and `asyncrl serve-actors`): detect a dead, failed or
silent actor and replace it.

Ray already restarts a crashed actor *process* (``actors.max_restarts``) and retries its ``run`` call.
What Ray cannot see is an actor whose loop raised (the process is fine, the work stopped), one that
Ray gave up on, or one that hangs (a stuck engine, a stopped process). :class:`ActorSupervisor`
checks every slot once per call to :meth:`poll`:

* its ``run`` call ended (an exception, Ray's restarts exhausted, or a return nobody asked for);
* its heartbeat in the run registry (``asyncrl.buffer.registry``) is older than
  ``actors.heartbeat_timeout_s``, measured from the latest of the heartbeat, the slot's last spawn and
  the end of the last Redis outage (heartbeats start once the vLLM engine is up, so the timeout must
  exceed an engine start-up; while Redis is unreachable nobody can heartbeat, so nothing is judged).

Such a slot is replaced: the actor is killed for good, the admission slots its incarnation held are
turned into credits (``reclaim_inflight``) once it can no longer write, and a new actor takes the slot
(the same actor id, so it resumes the prompt cursor of the last heartbeat). Each slot may be replaced
``run.max_restarts`` times; one more failure raises :class:`ActorSupervisionError`, which stops the run
with a non-zero exit instead of leaving the learner waiting for data that never comes. An actor that
failed with an :class:`ActorFatalError` (a failure every replacement would repeat) is not replaced:
the run fails at once with its message.
"""

from __future__ import annotations

import logging
import time
from typing import Any

__all__ = [
    "ActorFatalError",
    "ActorSupervisor",
    "ActorSupervisionError",
    "LapsedPoolReclaimer",
    "PoolLeaseLost",
    "actor_pool",
    "slot_actor_id",
]

log = logging.getLogger(__name__)


def slot_actor_id(pool_index: int, index: int) -> str:
    """The actor id of slot ``index`` of pool ``pool_index`` (pool 0: ``asyncrl run`` and the first
    ``serve-actors``; later pools lease their number, see :class:`asyncrl.actors.serve.PoolLease`)."""
    return f"actor-{index}" if pool_index == 0 else f"actor-{pool_index}-{index}"


def actor_pool(actor_id: str) -> int | None:
    """The pool number of an actor id made by :func:`slot_actor_id` (None for any other id)."""
    parts = actor_id.split("-")
    if parts[0] != "actor" or not all(p.isdigit() for p in parts[1:]):
        return None
    if len(parts) == 2:
        return 0
    return int(parts[1]) if len(parts) == 3 else None


class LapsedPoolReclaimer:
    """Reclaims the admission slots of ``serve-actors`` pools that died for good (run by every live pool).

    A dead actor's in-flight slots come back only when an actor with its id starts again, or when its
    own pool's supervisor replaces it; a pool killed and never restarted kept them taken for good (at
    ``max_staleness`` 0 the learner then waits for data forever). So each :meth:`poll` looks for pool
    numbers whose actor ids hold in-flight slots while nobody holds the number's lease; one that stays
    so for ``grace_s`` (continuously, as seen by this pool with Redis reachable) is reclaimed under its
    lease (:meth:`ReplayBuffer.reclaim_pool`). The grace exceeds a lease period: a live pool renews
    every TTL/3 (also right after a Redis outage, which may have let every lease expire), so only a
    pool that is gone leaves its lease lapsed that long."""

    def __init__(
        self, buffer: Any, own_pool: int, token: str, ttl_s: float = 15.0, grace_s: float | None = None
    ) -> None:
        self.buffer = buffer
        self.own_pool = own_pool
        self.token = token
        self.ttl_s = ttl_s
        self.grace_s = 2 * ttl_s if grace_s is None else grace_s
        self.lapsed_since: dict[int, float] = {}  # pool -> when it was first seen lapsed (monotonic)

    def poll(self) -> list[str]:
        import redis

        try:
            return self._poll()
        except redis.RedisError as e:  # an outage: every observation starts over once it ends
            self.lapsed_since.clear()
            log.warning("lapsed-pool check skipped: %s", e)
            return []

    def _poll(self) -> list[str]:
        owners: dict[int, list[str]] = {}
        for owner, n in self.buffer.inflight_owners().items():
            pool = actor_pool(owner)
            if n > 0 and pool is not None and pool != self.own_pool:
                owners.setdefault(pool, []).append(owner)
        pools = sorted(owners)
        now = time.monotonic()
        held = dict(zip(pools, self.buffer.pool_leases_held(pools), strict=True))
        self.lapsed_since = {p: self.lapsed_since.get(p, now) for p in pools if not held[p]}
        done: list[str] = []
        for pool, since in list(self.lapsed_since.items()):
            if now - since < self.grace_s:
                continue
            n = self.buffer.reclaim_pool(pool, self.token, owners[pool], self.ttl_s)
            del self.lapsed_since[pool]
            if n is not None:
                msg = (f"actor pool {pool} left its lease to lapse for {now - since:.0f}s with "
                       f"{len(owners[pool])} actor id(s) in flight: {n} admission slots reclaimed")  # fmt: skip
                log.warning("%s", msg)
                done.append(msg)
        return done


class ActorSupervisionError(RuntimeError):
    """An actor slot failed more often than ``run.max_restarts`` allows, or failed with an
    :class:`ActorFatalError`."""


class ActorFatalError(RuntimeError):
    """A failure that a restart would only repeat (user code wrong for every input: a reward function
    that failed for ``task.reward_failure_limit`` groups in a row, never working or broken for good);
    ``str(exc)`` is the one line to show.

    The actor's loop does not restart on it and :class:`ActorSupervisor` fails the run at once instead of
    replacing the actor: each replacement costs an engine start (~45 s on CPU) and retried
    ``actors.loop_restarts`` times per incarnation, ``run.max_restarts`` replacements ran for minutes
    to fail the same way, with 0 learner steps."""


class RayConnectError(RuntimeError):
    """Ray refused or could not reach the cluster (``asyncrl.actors.pool.init_ray``); Ray-free, for the CLI."""


class PoolLeaseLost(RuntimeError):
    """Another process holds this pool's number (``asyncrl.actors.serve.PoolLease``): the two would run
    the same actor ids, so this pool stops. Defined here, free of Ray, so the CLI can report it."""


def _fatal_cause(e: BaseException) -> ActorFatalError | None:
    """The :class:`ActorFatalError` ``e`` is or wraps: Ray raises a RayTaskError that is also an instance
    of the actor's exception type (``as_instanceof_cause``) and carries it as ``cause``."""
    for x in (getattr(e, "cause", None), e):
        if isinstance(x, ActorFatalError):
            return x
    return None


class ActorSupervisor:
    """Watches the slots of an :class:`~asyncrl.actors.pool.ActorPool` (see the module docstring)."""

    def __init__(self, pool: Any, buffer: Any, heartbeat_timeout_s: float, max_restarts: int) -> None:
        self.pool = pool
        self.buffer = buffer
        self.timeout = heartbeat_timeout_s
        self.max_restarts = max_restarts
        now = time.time()
        self.spawned = [now] * len(pool.actors)
        self.restarts = [0] * len(pool.actors)
        self.events: list[str] = []  # one line per replacement, for the run's summary
        self.redis_back = 0.0  # end of the last Redis outage seen by poll()
        self._redis_down = False

    def _pool_index(self) -> int:
        """This pool's leased number (0 for ``asyncrl run`` and the first ``serve-actors``)."""
        return int(getattr(getattr(getattr(self.pool, "cfg", None), "actors", None), "pool_index", 0) or 0)

    def _heartbeats(self) -> dict[int, dict[str, Any]]:
        """Slot index -> newest heartbeat of this pool's actor of that slot.

        Only this pool's actor ids count: several ``serve-actors`` pools of one run share the registry
        and their slot indices (a live slot 0 of another pool must not vouch for a dead one here)."""
        pool_index = self._pool_index()
        out: dict[int, dict[str, Any]] = {}
        for actor_id, hb in self.buffer.actors().items():
            i = hb.get("index")
            aid = hb.get("actor_id", actor_id)
            if not isinstance(i, int) or aid != slot_actor_id(pool_index, i):
                continue
            if i not in out or hb.get("time", 0) > out[i].get("time", 0):
                out[i] = {**hb, "actor_id": aid}
        return out

    def _ended(self, i: int) -> str | None:
        """Why slot ``i``'s run call ended, or None while it runs."""
        import ray

        ref = self.pool.run_refs[i]
        done, _ = ray.wait([ref], timeout=0)
        if not done:
            return None
        try:
            ray.get(done[0])
        except Exception as e:  # the actor's loop raised, or Ray gave up restarting it
            fatal = _fatal_cause(e)
            if fatal is not None:  # a replacement would fail the same way: the run fails now
                lines = str(fatal).strip().splitlines()  # one line; a RayTaskError's own text ends with it
                text = lines[-1] if lines else type(fatal).__name__
                raise ActorSupervisionError(f"actor slot {i}: {text}") from None
            first = str(e).strip().splitlines()
            return f"{type(e).__name__}: {first[-1] if first else ''}"[:300]
        return "its loop returned although the run was not stopping"

    def poll(self) -> list[str]:
        """Check every slot, replace the broken ones; returns what was done (empty when all is well)."""
        import redis

        try:
            beats = self._heartbeats()
        except redis.RedisError:
            self._redis_down = True  # heartbeats cannot be judged (nor written) now
            return []
        now = time.time()
        if self._redis_down:
            self._redis_down, self.redis_back = False, now
        done: list[str] = []
        for i in range(len(self.pool.actors)):
            why = self._ended(i)
            hb = beats.get(i)
            if why is None:
                last = max(float(hb.get("time", 0.0)) if hb else 0.0, self.spawned[i], self.redis_back)
                if now - last > self.timeout:
                    why = f"no heartbeat for {now - last:.0f}s (actors.heartbeat_timeout_s={self.timeout:g})"
            if why is None:
                continue
            self.restarts[i] += 1
            if self.restarts[i] > self.max_restarts:
                raise ActorSupervisionError(
                    f"actor slot {i} failed {self.restarts[i]} times (run.max_restarts={self.max_restarts}); "
                    f"last: {why}"
                )
            # A slot that died before its first heartbeat (during engine start-up) has no id on record:
            # its id is still this pool's, never pool 0's ``actor-{i}``, whose in-flight admission slots
            # reclaiming would turn into credits while that actor is alive (admission too wide for good).
            actor_id = (hb or {}).get("actor_id") or slot_actor_id(self._pool_index(), i)
            reclaimed: list[int] = []

            def reclaim(actor_id: str = actor_id, box: list[int] = reclaimed) -> None:
                box.append(self.buffer.reclaim_inflight(actor_id))

            dead = self.pool.replace_actor(i, before_spawn=reclaim)
            self.spawned[i] = time.time()
            if dead:
                msg = (f"actor slot {i} ({actor_id}) {why}: replaced ({self.restarts[i]}/{self.max_restarts}), "
                       f"{sum(reclaimed)} admission slots reclaimed")  # fmt: skip
            else:  # no replacement beside a possibly live predecessor (ActorPool.replace_actor)
                msg = (f"actor slot {i} ({actor_id}) {why}: killed, but its death is not confirmed: not "
                       f"replaced yet, its admission slots stay taken; tried again at a later check "
                       f"({self.restarts[i]}/{self.max_restarts})")  # fmt: skip
            # The caller shows and records it too (asyncrl run: console + supervision.log).
            (log.info if dead else log.warning)(msg)
            self.events.append(msg)
            done.append(msg)
        return done
