"""The Redis replay buffer: the only object actors and the learner share.

Actors ``put`` groups (after ``try_admit``), heartbeat, and subscribe to weight versions;
the learner ``read``s, ``ack``s, ``credit``s dropped groups and ``publish_weights``.

Delivery contract (DESIGN.md, "Delivery semantics"):

* Groups are read through a consumer group. A consumer gets its OWN pending (delivered,
  unacknowledged) entries first, then new ones. A restarted consumer (new instance, same
  consumer name) therefore re-reads what it had not acknowledged: nothing is lost. A live
  instance never re-delivers an entry it returned: it keeps a cursor (the highest id it
  returned) and re-walks only its pending entries above it. Those exist only when an
  XREADGROUP's reply was lost (a connection cut, or a frozen Redis that served a request the
  client had already timed out and resent): without the re-walk they would stay pending forever.
* ``ack`` acknowledges and deletes entries in one MULTI, so the stream holds only work not
  yet done. Its length is then bounded by admission, not by ``maxlen``.
* Entries that do not decode (bad msgpack, schema violations) never reach the caller: they
  are moved to the dead-letter stream with the reason, acknowledged, deleted, and return an
  admission credit so a bad producer cannot deadlock admission. So are entries delivered more
  than ``max_deliveries`` times (the consumer group's delivery count): a group whose step keeps
  crashing the learner is quarantined instead of being read first again after every restart.
* Retries (connection.py) are safe: ``put`` is deduplicated by group id in the same script as
  its XADD; drops and dead letters credit exactly the entries their XACK acknowledged, so a
  repeat acknowledges and credits nothing; acks are idempotent. Errors that outlast the retry
  budget propagate; nothing here swallows them.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import redis

from asyncrl.buffer.admission import (
    DEDUP_TTL_S,
    Admission,
    AdmissionEvents,
    admission_bound_formula,
    check_admission_args,
    wake_lua,
)
from asyncrl.buffer.cluster import cluster_client, connection_kwargs, split_cluster_url
from asyncrl.buffer.connection import DEFAULT_RETRY_BUDGET_S, redis_options
from asyncrl.buffer.layout import DEFAULT_CONSUMER_GROUP, ROLLOUT_FIELD, Keys
from asyncrl.buffer.records import Group, RecordError, decode, encode
from asyncrl.buffer.registry import RunRegistry

__all__ = ["Entry", "ReplayBuffer", "DEAD_MAXLEN", "DEAD_DATA_LIMIT"]

log = logging.getLogger(__name__)

#: The dead-letter stream is capped (approximately) so a broken producer cannot fill Redis.
DEAD_MAXLEN = 10_000
#: Raw bytes kept per dead letter; the original size is recorded separately.
DEAD_DATA_LIMIT = 64 * 1024

# KEYS: rollouts, inflight, dedup. ARGV: field, data, owner ('' = none), maxlen (0 = none), dedup ttl.
# Returns the entry id; a repeat of the same group id returns the first id and appends nothing.
PUT_LUA = """
local prev = redis.call('GET', KEYS[3])
if prev then return prev end
local id
if tonumber(ARGV[4]) > 0 then
  id = redis.call('XADD', KEYS[1], 'MAXLEN', '~', ARGV[4], '*', ARGV[1], ARGV[2])
else
  id = redis.call('XADD', KEYS[1], '*', ARGV[1], ARGV[2])
end
if ARGV[3] ~= '' then
  redis.call('HINCRBY', KEYS[2], ARGV[3], -1)
end
redis.call('SET', KEYS[3], id, 'EX', tonumber(ARGV[5]))
return id
"""

# KEYS: rollouts, credits, dead. ARGV: consumer group, time, dead maxlen, admission channel, then per
# entry the four values id, reason ('' = no dead letter), data, size. Acknowledges and deletes every
# entry; only the entries this call acknowledged (were pending) get a dead letter and a credit, so a
# repeat of the same call changes nothing. Returns how many were acknowledged (= credited).
DROP_LUA = f"""
local n = 0
for i = 5, #ARGV, 4 do
  local id = ARGV[i]
  if redis.call('XACK', KEYS[1], ARGV[1], id) == 1 then
    n = n + 1
    if ARGV[i + 1] ~= '' then
      redis.call('XADD', KEYS[3], 'MAXLEN', '~', ARGV[3], '*', 'id', id, 'reason', ARGV[i + 1],
                 'data', ARGV[i + 2], 'size', ARGV[i + 3], 'time', ARGV[2])
    end
  end
  redis.call('XDEL', KEYS[1], id)
end
if n > 0 then
  redis.call('INCRBY', KEYS[2], n)
  {wake_lua("ARGV[4]", "credit")}
end
return n
"""


@dataclass(frozen=True)
class Entry:
    """One delivered group and the stream id to acknowledge it with."""

    entry_id: str
    group: Group


# KEYS: credits, inflight, dedup, dead. ARGV: owner ('' = none), dedup ttl, group id, reason, time, dead maxlen,
# admission channel.
# An actor gives up a group it was admitted for (its reward failed): credit, in-flight tally, dead letter,
# once per group id (shares the dedup key of ``credit(request_id=group_id)``). Returns 1, or 0 if repeated.
ABANDON_LUA = f"""
if redis.call('EXISTS', KEYS[3]) == 1 then
  return 0
end
redis.call('INCRBY', KEYS[1], 1)
if ARGV[1] ~= '' then
  redis.call('HINCRBY', KEYS[2], ARGV[1], -1)
end
redis.call('SET', KEYS[3], '1', 'EX', tonumber(ARGV[2]))
redis.call('XADD', KEYS[4], 'MAXLEN', '~', ARGV[6], '*', 'id', ARGV[3], 'reason', ARGV[4], 'data', '',
           'size', 0, 'time', ARGV[5])
{wake_lua("ARGV[7]", "credit")}
return 1
"""


def _s(b: bytes | str) -> str:
    return b.decode() if isinstance(b, bytes) else b


def _id_key(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


class ReplayBuffer(RunRegistry):
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
        self._put_script = client.register_script(PUT_LUA)
        self._drop_script = client.register_script(DROP_LUA)
        self._abandon_script = client.register_script(ABANDON_LUA)
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

    def put(self, group: Group, owner: str | None = None) -> str:
        """Encode (validating) and append ``group``; returns the stream entry id.

        ``owner``: the actor id the group was admitted for (``try_admit(owner=...)``); its in-flight
        tally drops by one in the same transaction as the append.

        The append is deduplicated by ``group.group_id`` (for :data:`DEDUP_TTL_S`): a retried or
        repeated put of the same group returns the first entry id and appends nothing, so a lost
        reply can neither train a group twice nor unbalance the admission tally.
        """
        k = self.keys
        dedup = k.request(f"put:{group.group_id}")
        try:
            return _s(
                self._put_script(
                    keys=[k.rollouts, k.inflight, dedup],
                    args=[ROLLOUT_FIELD, encode(group), owner or "", self._maxlen or 0, DEDUP_TTL_S],
                )
            )
        except (redis.ConnectionError, redis.TimeoutError):
            # It may still run later (a frozen server); settled (tombstoned if it has not) before this
            # client's next admission, credit or reclaim, so a reclaim never counts its slot twice.
            self._admission.uncertain("put", dedup, owner)
            raise

    def put_raw(self, data: bytes) -> str:
        """Append pre-encoded bytes as-is (custom producers, tests). Not validated here, and not
        deduplicated: a retry after a lost reply may append twice (use ``put`` for real groups)."""
        kw: dict[str, Any] = {"maxlen": self._maxlen, "approximate": True} if self._maxlen else {}
        return _s(self._client.xadd(self.keys.rollouts, {ROLLOUT_FIELD: data}, **kw))

    # ------------------------------------------------------------------ consuming

    def _lock_for(self, consumer: str) -> threading.Lock:
        with self._locks_guard:
            return self._consumer_locks.setdefault(consumer, threading.Lock())

    def read(self, consumer: str, n: int, block_ms: int | None = 1000) -> list[Entry]:
        """Up to ``n`` valid groups for ``consumer``: its pending entries first, then new ones.

        Blocks up to ``block_ms`` (None or 0: not at all) only while nothing valid was found.
        Invalid and quarantined entries are dead-lettered and skipped (see module docstring).
        """
        if not isinstance(consumer, str) or not consumer:
            raise ValueError("consumer must be a non-empty string")
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        deadline = time.monotonic() + (block_ms or 0) / 1000.0
        out: list[Entry] = []
        stream = self.keys.rollouts
        with self._lock_for(consumer):
            # The cursor moves only when this call returns: if a Redis error ends it early, the
            # entries it had collected stay pending above the cursor and the next call returns them.
            cursor = self._cursor.get(consumer, "0")
            # 1) This consumer's pending entries above the cursor, in id order: after a restart all
            #    that an earlier incarnation was given; later only deliveries whose reply was lost.
            while len(out) < n:
                resp = self._client.xreadgroup(
                    self.group_name, consumer, {stream: cursor}, count=n - len(out)
                )
                entries = resp[0][1] if resp else []
                if not entries:
                    break
                cursor = _s(entries[-1][0])
                out.extend(self._accept(entries, consumer, redelivered=True))
            # 2) New entries; block only while we have nothing to return.
            while len(out) < n:
                remaining_ms = int((deadline - time.monotonic()) * 1000)
                block = min(remaining_ms, self._max_block_ms) if (not out and remaining_ms > 0) else None
                resp = self._client.xreadgroup(
                    self.group_name, consumer, {stream: ">"}, count=n - len(out), block=block
                )
                entries = resp[0][1] if resp else []
                if entries:
                    if _id_key(_s(entries[-1][0])) > _id_key(cursor):
                        cursor = _s(entries[-1][0])
                    out.extend(self._accept(entries, consumer))
                elif block is None or time.monotonic() >= deadline:
                    break
            self._cursor[consumer] = cursor
        return out

    def _delivery_counts(self, consumer: str, first: str, last: str, n: int) -> dict[str, int]:
        rows = self._client.xpending_range(
            self.keys.rollouts, self.group_name, min=first, max=last, count=n, consumername=consumer
        )
        return {_s(r["message_id"]): int(r["times_delivered"]) for r in rows}

    def _accept(
        self,
        entries: list[tuple[bytes, dict[bytes, bytes] | None]],
        consumer: str = "",
        redelivered: bool = False,
    ) -> list[Entry]:
        """Decode entries; dead-letter the invalid (and, when ``redelivered``, the over-delivered)
        ones in one script and return the rest."""
        good: list[Entry] = []
        bad: list[tuple[str, str, bytes]] = []
        counts: dict[str, int] = {}
        if redelivered and self.max_deliveries is not None and entries:
            counts = self._delivery_counts(consumer, _s(entries[0][0]), _s(entries[-1][0]), len(entries))
        for raw_id, fields in entries:
            entry_id = _s(raw_id)
            if not fields:
                # A pending entry whose data was trimmed (maxlen) or deleted before its ack.
                bad.append((entry_id, "entry: deleted from the stream before it was acknowledged", b""))
                continue
            data = fields.get(ROLLOUT_FIELD)
            if data is None:
                names = sorted(_s(k) for k in fields)
                bad.append((entry_id, f"entry: no {ROLLOUT_FIELD.decode()!r} field (fields: {names})", b""))
                continue
            delivered = counts.get(entry_id, 0)
            if self.max_deliveries is not None and delivered > self.max_deliveries:
                bad.append(
                    (
                        entry_id,
                        f"quarantined: delivered {delivered} times (> max_deliveries={self.max_deliveries}); "
                        "the learner kept failing before it could commit a step with it",
                        data,
                    )
                )
                continue
            try:
                good.append(Entry(entry_id, decode(data)))
            except RecordError as exc:
                bad.append((entry_id, str(exc), data))
        if bad:
            self.dead_letter(bad)
        return good

    def dead_letter(self, bad: Iterable[tuple[str, str, bytes]]) -> int:
        """Move delivered entries ``(entry_id, reason, data)`` to the dead-letter stream with their
        reason, acknowledge and delete them, and return one admission credit each: they were
        admitted but will never be trained on. Idempotent (see DROP_LUA); returns how many it moved."""
        rows = list(bad)
        for entry_id, reason, _data in rows:
            if not reason:
                raise ValueError(f"dead letter {entry_id}: a reason is required")
            log.warning("run %s: dead-lettering rollout %s: %s", self.run, entry_id, reason)
        return self._drop(rows)

    def drop(self, entry_ids: Iterable[str]) -> int:
        """Acknowledge and delete delivered entries the learner will not train on (too stale,
        filtered) and credit each one admission slot, atomically. Idempotent: a repeat or retry
        credits nothing more. Returns how many were acknowledged (= credited)."""
        return self._drop([(entry_id, "", b"") for entry_id in entry_ids])

    def _drop(self, rows: list[tuple[str, str, bytes]]) -> int:
        if not rows:
            return 0
        k = self.keys
        args: list[Any] = [self.group_name, repr(time.time()), DEAD_MAXLEN, k.admission_channel]
        for entry_id, reason, data in rows:
            args += [entry_id, reason, data[:DEAD_DATA_LIMIT], len(data)]
        return int(self._drop_script(keys=[k.rollouts, k.credits, k.dead], args=args))

    def ack(self, entry_ids: Iterable[str]) -> int:
        """Acknowledge and delete entries (atomically); returns how many were pending."""
        ids = list(entry_ids)
        if not ids:
            return 0
        pipe = self._client.pipeline(transaction=True)
        pipe.xack(self.keys.rollouts, self.group_name, *ids)
        pipe.xdel(self.keys.rollouts, *ids)
        acked, _deleted = pipe.execute()
        return int(acked)

    def abandon(self, group_id: str, owner: str | None, reason: str) -> bool:
        """An admitted group that will never be written (e.g. its reward raised or timed out): return
        its admission slot (and ``owner``'s in-flight tally) and record it in the dead-letter stream
        (``original_id`` = the group id, no data) with ``reason``. Idempotent per group id; returns
        False for a repeat."""
        k = self.keys
        log.warning("run %s: group %s dropped by %s: %s", self.run, group_id, owner or "?", reason)
        dedup = k.request(f"credit:{group_id}")
        try:
            return bool(
                self._abandon_script(
                    keys=[k.credits, k.inflight, dedup, k.dead],
                    args=[
                        owner or "",
                        DEDUP_TTL_S,
                        group_id,
                        reason,
                        repr(time.time()),
                        DEAD_MAXLEN,
                        k.admission_channel,
                    ],  # fmt: skip
                )
            )
        except (redis.ConnectionError, redis.TimeoutError):
            self._admission.uncertain("credit", dedup, owner)
            raise

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
        key = self.keys.pool_lease(n)
        if _s(self._client.get(key) or b"") != token:
            return bool(self._client.set(key, token, nx=True, px=max(int(ttl_s * 1000), 1)))
        return bool(self._client.pexpire(key, max(int(ttl_s * 1000), 1)))

    def release_pool(self, n: int, token: str) -> None:
        key = self.keys.pool_lease(n)
        if _s(self._client.get(key) or b"") == token:
            self._client.delete(key)

    def dead_letters(self, count: int = 100) -> list[dict[str, Any]]:
        """The newest ``count`` dead letters, oldest first."""
        rows = self._client.xrevrange(self.keys.dead, count=count)
        out = []
        for dead_id, f in reversed(rows):
            out.append(
                {
                    "entry_id": _s(dead_id),
                    "original_id": _s(f.get(b"id", b"")),
                    "reason": _s(f.get(b"reason", b"")),
                    "data": f.get(b"data", b""),
                    "size": int(f.get(b"size", 0)),
                    "time": float(f.get(b"time", 0.0)),
                }
            )
        return out

    def stats(self) -> dict[str, Any]:
        """depth (stream length), pending, dead, admitted, credits, version, bound and staleness_bound
        (the staleness admission applies: max_staleness or the adaptive bound; both None when the
        buffer was opened without admission settings)."""
        k = self.keys
        pipe = self._client.pipeline(transaction=True)
        pipe.xlen(k.rollouts)
        pipe.xpending(k.rollouts, self.group_name)
        pipe.xlen(k.dead)
        for key in (k.version, k.admitted, k.credits, k.staleness_bound):
            pipe.get(key)  # GETs, not MGET: a cluster pipeline refuses MGET (same slot and MULTI, so atomic)
        depth, pending, dead, version, admitted, credits, adaptive = pipe.execute()
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
            "admitted": admitted,
            "credits": credits,
            "version": version,
            "bound": bound,
            "staleness_bound": eta,
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

    def close(self) -> None:
        """Close the connection pool if this instance created it (``connect``)."""
        if self._owns_client:
            self._client.close()

    def __enter__(self) -> ReplayBuffer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
