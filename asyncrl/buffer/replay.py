"""The Redis replay buffer: the only object actors and the learner share.

Actors ``put`` groups (after ``try_admit``), heartbeat, and subscribe to weight versions;
the learner ``read``s, ``ack``s, ``credit``s dropped groups and ``publish_weights``.

Split by what the code holds: the producer side (put, abandon) in :mod:`asyncrl.buffer.producer`, the
consumer side and its delivery contract (read, ack, drop, dead letters) in :mod:`asyncrl.buffer.consumer`,
weights/heartbeats in :mod:`asyncrl.buffer.registry`, admission in :mod:`asyncrl.buffer.admission`; this
module holds the connection, statistics, version and admission entry points and pool leases.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import redis

from asyncrl.buffer.admission import (
    Admission,
    AdmissionEvents,
    admission_bound_formula,
    check_admission_args,
)
from asyncrl.buffer.cluster import cluster_client, connection_kwargs, split_cluster_url
from asyncrl.buffer.connection import DEFAULT_RETRY_BUDGET_S, redis_options
from asyncrl.buffer.consumer import DEAD_DATA_LIMIT, DEAD_MAXLEN, DROP_LUA, Entry, StreamConsumer, _s
from asyncrl.buffer.layout import DEFAULT_CONSUMER_GROUP, Keys
from asyncrl.buffer.producer import ABANDON_LUA, PUT_MANY_LUA, StreamProducer
from asyncrl.buffer.registry import PUBLISH_WEIGHTS_LUA, RunRegistry

__all__ = ["Entry", "ReplayBuffer", "DEAD_MAXLEN", "DEAD_DATA_LIMIT", "RENEW_POOL_LUA", "RELEASE_POOL_LUA"]

# Pool leases (``pool:<n>``, value = the holder's token) are compared and changed in one script: with
# a GET then a PEXPIRE/DEL, a lease that expired between the two and was taken by another pool would
# be extended or deleted under that pool (two live pools with one number share actor ids).
# KEYS: pool lease. ARGV: token, ttl ms. 1 if the lease is (now) ours: extended, or free and taken.
RENEW_POOL_LUA = """
local cur = redis.call('GET', KEYS[1])
if cur == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
if cur then return 0 end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return 1
"""
# KEYS: pool lease. ARGV: token. Deletes the lease only if it is still ours.
RELEASE_POOL_LUA = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""

log = logging.getLogger(__name__)


class ReplayBuffer(StreamProducer, StreamConsumer, RunRegistry):
    """Replay buffer of one run on one Redis. Thread-safe; one instance per process is enough.

    ``client`` must return bytes (``decode_responses=False``). ``maxlen`` enables approximate
    trimming on ``put``; it can drop entries nobody has read yet, so leave it None unless
    Redis memory matters more than groups (admission is what bounds the stream).
    ``max_staleness`` / ``groups_per_step`` are defaults for ``try_admit``,
    ``admission_bound`` and the ``bound`` field of ``stats``. ``max_deliveries``: quarantine
    (dead-letter) a pending entry delivered more often than this (None = never).
    """

    def __init__(
        self,
        client: redis.Redis,
        run: str,
        group: str = DEFAULT_CONSUMER_GROUP,
        *,
        maxlen: int | None = None,
        max_staleness: int | None = None,
        groups_per_step: int | None = None,
        owns_client: bool = False,
        max_deliveries: int | None = None,
    ) -> None:
        if connection_kwargs(client).get("decode_responses"):
            raise ValueError("ReplayBuffer needs a redis client with decode_responses=False")
        if maxlen is not None and maxlen < 1:
            raise ValueError(f"maxlen must be None or >= 1, got {maxlen}")
        if max_staleness is not None and groups_per_step is not None:
            check_admission_args(max_staleness, groups_per_step)
        if max_deliveries is not None and max_deliveries < 1:
            raise ValueError(f"max_deliveries must be None or >= 1, got {max_deliveries}")
        self.max_deliveries = max_deliveries
        self.keys = Keys(run)
        self.run = run
        self.group_name = group
        self._client = client
        self._owns_client = owns_client
        self._maxlen = maxlen
        self._max_staleness = max_staleness
        self._groups_per_step = groups_per_step
        self._admission = Admission(client, self.keys)
        self._put_many_script = client.register_script(PUT_MANY_LUA)
        self._renew_pool = client.register_script(RENEW_POOL_LUA)
        self._release_pool = client.register_script(RELEASE_POOL_LUA)
        self._drop_script = client.register_script(DROP_LUA)
        self._abandon_script = client.register_script(ABANDON_LUA)
        self._publish_weights_script = client.register_script(PUBLISH_WEIGHTS_LUA)
        # consumer -> highest entry id this instance returned (or disposed of); "0" = none yet.
        self._cursor: dict[str, str] = {}
        self._consumer_locks: dict[str, threading.Lock] = {}
        self._locks_guard = threading.Lock()
        # A blocking XREADGROUP longer than the client's socket timeout would fail with a
        # TimeoutError; cap each block below it (read() loops until its own deadline).
        timeout = connection_kwargs(client).get("socket_timeout")
        self._max_block_ms = 2**31 if timeout is None else max(int(timeout * 1000) - 500, 1)
        self._ensure_group()

    @classmethod
    def connect(
        cls,
        url: str,
        run: str,
        password: str | None = None,
        tls: bool = False,
        tls_ca: str | None = None,
        *,
        username: str | None = None,
        tls_cert: str | None = None,
        tls_key: str | None = None,
        group: str = DEFAULT_CONSUMER_GROUP,
        maxlen: int | None = None,
        max_staleness: int | None = None,
        groups_per_step: int | None = None,
        socket_timeout: float | None = None,
        retry_budget_s: float = DEFAULT_RETRY_BUDGET_S,
        max_deliveries: int | None = None,
        **redis_kwargs: Any,
    ) -> ReplayBuffer:
        """Connect to ``url`` (``redis://`` or ``rediss://``) with AUTH/TLS passed to redis-py.

        ``tls=True`` upgrades a ``redis://`` URL to TLS; ``tls_ca`` is the CA bundle used to
        verify the server, ``tls_cert``/``tls_key`` a client certificate for mutual TLS,
        ``username`` a Redis ACL user. ``socket_timeout`` (None = connection.DEFAULT_SOCKET_TIMEOUT_S)
        bounds each blocking read of ``read``; ``retry_budget_s`` is how long a command keeps
        retrying through a Redis outage (connection.py).
        """
        cluster, url = split_cluster_url(url)  # redis+cluster:// -> a RedisCluster client (cluster.py)
        url, opts = redis_options(
            url, password, username, tls, tls_ca, tls_cert, tls_key, socket_timeout, redis_kwargs,
            retry_budget_s=retry_budget_s,
        )  # fmt: skip
        client = cluster_client(url, opts) if cluster else redis.Redis.from_url(url, **opts)
        return cls(
            client,
            run,
            group,
            maxlen=maxlen,
            max_staleness=max_staleness,
            groups_per_step=groups_per_step,
            owns_client=True,
            max_deliveries=max_deliveries,
        )

    @classmethod
    def from_config(
        cls, cfg: Any, url: str | None = None, password: str | None = None, **kwargs: Any
    ) -> ReplayBuffer:
        """Connect with a run's config (redis URL, AUTH/ACL user, TLS incl. client certificate,
        timeouts and retry budget, run name, admission settings); ``kwargs`` override."""
        r = cfg.redis
        opts: dict[str, Any] = {
            "password": password or r.password or None,
            "username": r.username or None,
            "tls": r.tls,
            "tls_ca": r.tls_ca_certs or None,
            "tls_cert": r.tls_certfile or None,
            "tls_key": r.tls_keyfile or None,
            "socket_timeout": r.socket_timeout_s,
            "retry_budget_s": r.retry_budget_s,
            "max_staleness": cfg.buffer.max_staleness,
            # Admission counts groups per *version*: with publish_every = k the learner consumes k steps of
            # groups between two bumps of V, so the window must widen by that much per version (else it
            # closes after ~(eta + 1) * k / (k - 1) steps and the run deadlocks).
            "groups_per_step": cfg.buffer.groups_per_step * cfg.learner.publish_every,
            **kwargs,
        }
        return cls.connect(url or r.url, cfg.run.name, **opts)

    @property
    def client(self) -> redis.Redis:
        return self._client

    def _ensure_group(self) -> None:
        # Id 0: a consumer group created after producers started still sees every entry.
        try:
            self._client.xgroup_create(self.keys.rollouts, self.group_name, id="0", mkstream=True)
        except redis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    # ------------------------------------------------------------------ producing

    # ------------------------------------------------------------------ consuming

    def lease_pool(self, token: str, ttl_s: float = 15.0, max_pools: int = 1024) -> int:
        """Claim the lowest free actor-pool number of this run for ``token`` (one per live
        ``asyncrl serve-actors``), so concurrent pools never share actor ids. A number whose lease
        is held is waited on for one lease period: a pool that died releases it then and a restart
        gets its old number (and actor ids) back, so its dead incarnation's slots are reclaimed.
        Keep it with :meth:`renew_pool` more often than ``ttl_s``; free it with :meth:`release_pool`."""
        ms = max(int(ttl_s * 1000), 1)
        for n in range(max_pools):
            key = self.keys.pool_lease(n)
            deadline = time.monotonic() + ttl_s + 1.0
            while True:
                if self._client.set(key, token, nx=True, px=ms) or _s(self._client.get(key) or b"") == token:
                    return n
                if time.monotonic() > deadline:
                    break  # renewed all along: a live pool holds it
                time.sleep(0.5)
        raise RuntimeError(f"run {self.run}: {max_pools} actor pools already hold a lease")

    def renew_pool(self, n: int, token: str, ttl_s: float = 15.0) -> bool:
        """Extend pool ``n``'s lease; False if it is no longer ours (expired and taken)."""
        ms = max(int(ttl_s * 1000), 1)
        return bool(self._renew_pool(keys=[self.keys.pool_lease(n)], args=[token, ms]))

    def release_pool(self, n: int, token: str) -> None:
        """Free pool ``n``'s lease if it is still ours (never another pool's that took it since)."""
        self._release_pool(keys=[self.keys.pool_lease(n)], args=[token])

    def inflight_owners(self) -> dict[str, int]:
        """Actor id -> admission slots it holds in flight (admitted, neither written nor credited back)."""
        return {_s(k): int(v) for k, v in self._client.hgetall(self.keys.inflight).items()}

    def pool_leases_held(self, pools: list[int]) -> list[bool]:
        """Whether each of ``pools`` has a live lease (one EXISTS per key, not one multi-key: cluster-safe)."""
        pipe = self._client.pipeline(transaction=False)
        for n in pools:
            pipe.exists(self.keys.pool_lease(n))
        return [bool(x) for x in pipe.execute()]

    def reclaim_pool(self, n: int, token: str, owners: list[str], ttl_s: float = 15.0) -> int | None:
        """Credit back the in-flight slots of ``owners`` (the actor ids of pool ``n``, which died for
        good and left its lease to lapse) under pool ``n``'s lease, taken for ``token`` for the duration
        (SET NX): a pool restarting with that number waits for it in :meth:`lease_pool` instead of
        running those ids meanwhile. None, and nothing reclaimed, if the lease is held."""
        ms = max(int(ttl_s * 1000), 1)
        if not self._client.set(self.keys.pool_lease(n), token, nx=True, px=ms):
            return None
        try:
            return sum(self.reclaim_inflight(owner) for owner in owners)
        finally:
            self.release_pool(n, token)

    def stats(self) -> dict[str, Any]:
        """depth (stream length), pending, dead (the dead-letter stream's length: trimmed at about
        DEAD_MAXLEN), dead_total (dead letters ever written: never trimmed), admitted, credits, version,
        bound and staleness_bound (the staleness admission applies: max_staleness or the adaptive bound;
        both None when the buffer was opened without admission settings), version_skew (the learner's forks and
        unpublished steps, admission.py)."""
        k = self.keys
        pipe = self._client.pipeline(transaction=True)
        pipe.xlen(k.rollouts)
        pipe.xpending(k.rollouts, self.group_name)
        pipe.xlen(k.dead)
        for key in (k.dead_total, k.version, k.admitted, k.credits, k.staleness_bound, k.version_skew):
            pipe.get(key)  # GETs, not MGET: a cluster pipeline refuses MGET (same slot and MULTI, so atomic)
        depth, pending, dead, dead_total, version, admitted, credits, adaptive, skew = pipe.execute()
        version, admitted, credits = int(version or 0), int(admitted or 0), int(credits or 0)
        bound = eta = None
        if self._max_staleness is not None and self._groups_per_step is not None:
            # The staleness bound admission applies (the adaptive one can only tighten max_staleness).
            eta = self._max_staleness if adaptive is None else min(self._max_staleness, int(adaptive))
            bound = admission_bound_formula(version, eta, self._groups_per_step, credits)
        return {
            "depth": int(depth),
            # (a cluster pipeline returns XPENDING's summary unparsed: [count, min, max, consumers])
            "pending": int(pending["pending"] if isinstance(pending, dict) else pending[0]),
            "dead": int(dead),
            "dead_total": int(dead_total or 0),
            "admitted": admitted,
            "credits": credits,
            "version": version,
            "bound": bound,
            "staleness_bound": eta,
            "version_skew": int(skew or 0),
        }

    # ------------------------------------------------------------------ version + admission

    def version(self) -> int:
        """The learner's current policy version V (0 until set)."""
        return int(self._client.get(self.keys.version) or 0)

    def set_version(self, version: int) -> None:
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            raise ValueError(f"version must be an int >= 0, got {version!r}")
        self._client.set(self.keys.version, version)
        self._admission.wake("version")

    def set_version_skew(self, skew: int, groups_per_version: int) -> int:
        """The learner's forks in total (admission.py, "Forks"): keeps the admission window on the new
        version axis. Returns the change applied."""
        return self._admission.set_version_skew(skew, groups_per_version)

    def subscribe_admission(self, confirm_timeout: float = 5.0) -> AdmissionEvents:
        """Wake-up hints for a refused admission (credits, versions, bounds); active once it returns."""
        return AdmissionEvents(self._client, self.keys, confirm_timeout)

    def _admission_args(self, max_staleness: int | None, groups_per_step: int | None) -> tuple[int, int]:
        s = self._max_staleness if max_staleness is None else max_staleness
        g = self._groups_per_step if groups_per_step is None else groups_per_step
        if s is None or g is None:
            raise ValueError("max_staleness and groups_per_step must be given here or to the constructor")
        return s, g

    def try_admit(
        self,
        max_staleness: int | None = None,
        groups_per_step: int | None = None,
        sampler_version: int | None = None,
        owner: str | None = None,
    ) -> bool:
        """Atomically admit one new group if ``admitted < (V+s+1)*g + credits`` (and, when
        ``sampler_version`` is given, only if ``V - sampler_version <= max_staleness``).
        ``owner`` (an actor id) tracks the slot so :meth:`reclaim_inflight` can recover it."""
        args = self._admission_args(max_staleness, groups_per_step)
        return self._admission.try_admit(*args, sampler_version, owner)

    def reclaim_inflight(self, owner: str) -> int:
        """A (re)started actor returns the slots its previous incarnation held when it died."""
        return self._admission.reclaim(owner)

    def credit(self, n: int = 1, owner: str | None = None, request_id: str | None = None) -> int:
        """Return ``n`` admission credits (one per group dropped by the learner, or aborted by ``owner``).
        Retry-safe; ``request_id`` (e.g. the group id) also makes repeated calls count once."""
        return self._admission.credit(n, owner, request_id)

    def admission_bound(self, max_staleness: int | None = None, groups_per_step: int | None = None) -> int:
        return self._admission.bound(*self._admission_args(max_staleness, groups_per_step))

    def set_staleness_bound(self, bound: int | None) -> None:
        """The adaptive admission bound (asyncrl.learner.adaptive); None = max_staleness as configured."""
        self._admission.set_staleness_bound(bound)

    def staleness_bound(self, max_staleness: int | None = None) -> int:
        """The staleness bound admission applies now (<= max_staleness)."""
        return self._admission.staleness_bound(self._admission_args(max_staleness, 1)[0])

    # ------------------------------------------------------------------ lifecycle

    def delete_run(self) -> None:
        """Delete every key of this run (tests, ``asyncrl`` cleanup). Irreversible."""
        self._client.delete(*self.keys.all_keys())
        with self._locks_guard:
            self._cursor.clear()
            self.__dict__.pop("_clean_reads_by", None)

    def close(self) -> None:
        """Close the connection pool if this instance created it (``connect``)."""
        if self._owns_client:
            self._client.close()

    def __enter__(self) -> ReplayBuffer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
