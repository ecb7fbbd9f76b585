"""The Redis replay buffer: the only object actors and the learner share.

Actors ``put`` groups (after ``try_admit``), heartbeat, and subscribe to weight versions;
the learner ``read``s, ``ack``s, ``credit``s dropped groups and ``publish_weights``.

Delivery contract (DESIGN.md, "Delivery semantics"):

* Groups are read through a consumer group. A consumer gets its OWN pending (delivered,
  unacknowledged) entries first, then new ones. A restarted consumer (new instance, same
  consumer name) therefore re-reads what it had not acknowledged: nothing is lost. A live
  instance walks its pending list once and never re-delivers an entry it returned.
* ``ack`` acknowledges and deletes entries in one MULTI, so the stream holds only work not
  yet done. Its length is then bounded by admission, not by ``maxlen``.
* Entries that do not decode (bad msgpack, schema violations) never reach the caller: they
  are moved to the dead-letter stream with the reason, acknowledged, deleted, and return an
  admission credit so a bad producer cannot deadlock admission.
* Redis errors propagate; nothing here retries or swallows them.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import redis

from asyncrl.buffer.admission import Admission, admission_bound_formula, check_admission_args
from asyncrl.buffer.connection import redis_options
from asyncrl.buffer.layout import DEFAULT_CONSUMER_GROUP, ROLLOUT_FIELD, Keys
from asyncrl.buffer.records import Group, RecordError, decode, encode
from asyncrl.buffer.registry import RunRegistry

__all__ = ["Entry", "ReplayBuffer", "DEAD_MAXLEN", "DEAD_DATA_LIMIT"]

log = logging.getLogger(__name__)

#: The dead-letter stream is capped (approximately) so a broken producer cannot fill Redis.
DEAD_MAXLEN = 10_000
#: Raw bytes kept per dead letter; the original size is recorded separately.
DEAD_DATA_LIMIT = 64 * 1024


@dataclass(frozen=True)
class Entry:
    """One delivered group and the stream id to acknowledge it with."""

    entry_id: str
    group: Group


def _s(b: bytes | str) -> str:
    return b.decode() if isinstance(b, bytes) else b


class ReplayBuffer(RunRegistry):
    """Replay buffer of one run on one Redis. Thread-safe; one instance per process is enough.

    ``client`` must return bytes (``decode_responses=False``). ``maxlen`` enables approximate
    trimming on ``put``; it can drop entries nobody has read yet, so leave it None unless
    Redis memory matters more than groups (admission is what bounds the stream).
    ``max_staleness`` / ``groups_per_step`` are defaults for ``try_admit``,
    ``admission_bound`` and the ``bound`` field of ``stats``.
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
    ) -> None:
        if client.connection_pool.connection_kwargs.get("decode_responses"):
            raise ValueError("ReplayBuffer needs a redis client with decode_responses=False")
        if maxlen is not None and maxlen < 1:
            raise ValueError(f"maxlen must be None or >= 1, got {maxlen}")
        if max_staleness is not None and groups_per_step is not None:
            check_admission_args(max_staleness, groups_per_step)
        self.keys = Keys(run)
        self.run = run
        self.group_name = group
        self._client = client
        self._owns_client = owns_client
        self._maxlen = maxlen
        self._max_staleness = max_staleness
        self._groups_per_step = groups_per_step
        self._admission = Admission(client, self.keys)
        # consumer -> last pending id returned, or None once its pending list was walked.
        self._pending_cursor: dict[str, str | None] = {}
        self._consumer_locks: dict[str, threading.Lock] = {}
        self._locks_guard = threading.Lock()
        # A blocking XREADGROUP longer than the client's socket timeout would fail with a
        # TimeoutError; cap each block below it (read() loops until its own deadline).
        timeout = client.connection_pool.connection_kwargs.get("socket_timeout")
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
        **redis_kwargs: Any,
    ) -> ReplayBuffer:
        """Connect to ``url`` (``redis://`` or ``rediss://``) with AUTH/TLS passed to redis-py.

        ``tls=True`` upgrades a ``redis://`` URL to TLS; ``tls_ca`` is the CA bundle used to
        verify the server, ``tls_cert``/``tls_key`` a client certificate for mutual TLS.
        ``socket_timeout`` must exceed any ``block_ms`` given to ``read`` (None = no timeout).
        """
        url, opts = redis_options(
            url, password, username, tls, tls_ca, tls_cert, tls_key, socket_timeout, redis_kwargs
        )
        client = redis.Redis.from_url(url, **opts)
        return cls(
            client,
            run,
            group,
            maxlen=maxlen,
            max_staleness=max_staleness,
            groups_per_step=groups_per_step,
            owns_client=True,
        )

    @classmethod
    def from_config(cls, cfg: Any, url: str | None = None, **kwargs: Any) -> ReplayBuffer:
        """Connect with a run's config (redis AUTH/TLS, run name, admission and maxlen settings)."""
        r = cfg.redis
        return cls.connect(
            url or r.url, cfg.run.name, password=r.password or None, tls=r.tls, tls_ca=r.tls_ca_certs or None,
            max_staleness=cfg.buffer.max_staleness, groups_per_step=cfg.buffer.groups_per_step, **kwargs,
        )  # fmt: skip

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
        """
        if not owner:
            return self.put_raw(encode(group))
        kw: dict[str, Any] = {"maxlen": self._maxlen, "approximate": True} if self._maxlen else {}
        pipe = self._client.pipeline(transaction=True)
        pipe.xadd(self.keys.rollouts, {ROLLOUT_FIELD: encode(group)}, **kw)
        pipe.hincrby(self.keys.inflight, owner, -1)
        return _s(pipe.execute()[0])

    def put_raw(self, data: bytes) -> str:
        """Append pre-encoded bytes as-is (custom producers, tests). Not validated here."""
        kw: dict[str, Any] = {"maxlen": self._maxlen, "approximate": True} if self._maxlen else {}
        return _s(self._client.xadd(self.keys.rollouts, {ROLLOUT_FIELD: data}, **kw))

    # ------------------------------------------------------------------ consuming

    def _lock_for(self, consumer: str) -> threading.Lock:
        with self._locks_guard:
            return self._consumer_locks.setdefault(consumer, threading.Lock())

    def read(self, consumer: str, n: int, block_ms: int | None = 1000) -> list[Entry]:
        """Up to ``n`` valid groups for ``consumer``: its pending entries first, then new ones.

        Blocks up to ``block_ms`` (None or 0: not at all) only while nothing valid was found.
        Invalid entries are dead-lettered and skipped (see module docstring).
        """
        if not isinstance(consumer, str) or not consumer:
            raise ValueError("consumer must be a non-empty string")
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        deadline = time.monotonic() + (block_ms or 0) / 1000.0
        out: list[Entry] = []
        stream = self.keys.rollouts
        with self._lock_for(consumer):
            # 1) Walk this consumer's pending list once, in id order, from the saved cursor.
            cursor = self._pending_cursor.get(consumer, "0")
            while cursor is not None and len(out) < n:
                resp = self._client.xreadgroup(
                    self.group_name, consumer, {stream: cursor}, count=n - len(out)
                )
                entries = resp[0][1] if resp else []
                if not entries:
                    cursor = None  # walked; from now on only new entries (">")
                else:
                    cursor = _s(entries[-1][0])
                    out.extend(self._accept(entries))
                # Saved per iteration so a Redis error mid-walk never re-delivers.
                self._pending_cursor[consumer] = cursor
            # 2) New entries; block only while we have nothing to return.
            while len(out) < n:
                remaining_ms = int((deadline - time.monotonic()) * 1000)
                block = min(remaining_ms, self._max_block_ms) if (not out and remaining_ms > 0) else None
                resp = self._client.xreadgroup(
                    self.group_name, consumer, {stream: ">"}, count=n - len(out), block=block
                )
                entries = resp[0][1] if resp else []
                if entries:
                    out.extend(self._accept(entries))
                elif block is None or time.monotonic() >= deadline:
                    break
        return out

    def _accept(self, entries: list[tuple[bytes, dict[bytes, bytes] | None]]) -> list[Entry]:
        """Decode entries; dead-letter the invalid ones in one MULTI and return the rest."""
        good: list[Entry] = []
        bad: list[tuple[str, str, bytes]] = []
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
            try:
                good.append(Entry(entry_id, decode(data)))
            except RecordError as exc:
                bad.append((entry_id, str(exc), data))
        if bad:
            self._dead_letter(bad)
        return good

    def _dead_letter(self, bad: list[tuple[str, str, bytes]]) -> None:
        k = self.keys
        now = repr(time.time())
        pipe = self._client.pipeline(transaction=True)
        for entry_id, reason, data in bad:
            log.warning("run %s: dead-lettering rollout %s: %s", self.run, entry_id, reason)
            fields = {
                "id": entry_id,
                "reason": reason,
                "data": data[:DEAD_DATA_LIMIT],
                "size": len(data),
                "time": now,
            }
            pipe.xadd(k.dead, fields, maxlen=DEAD_MAXLEN, approximate=True)
        ids = [entry_id for entry_id, _, _ in bad]
        pipe.xack(k.rollouts, self.group_name, *ids)
        pipe.xdel(k.rollouts, *ids)
        # One credit per dropped group: it was admitted but will never be trained on.
        pipe.incrby(k.credits, len(bad))
        pipe.execute()

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
        pipe.mget([k.version, k.admitted, k.credits, k.staleness_bound])
        depth, pending, dead, (version, admitted, credits, adaptive) = pipe.execute()
        version, admitted, credits = int(version or 0), int(admitted or 0), int(credits or 0)
        bound = eta = None
        if self._max_staleness is not None and self._groups_per_step is not None:
            # The staleness bound admission applies (the adaptive one can only tighten max_staleness).
            eta = self._max_staleness if adaptive is None else min(self._max_staleness, int(adaptive))
            bound = admission_bound_formula(version, eta, self._groups_per_step, credits)
        return {
            "depth": int(depth),
            "pending": int(pending["pending"]),
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

    def credit(self, n: int = 1, owner: str | None = None) -> int:
        """Return ``n`` admission credits (one per group dropped by the learner, or aborted by ``owner``)."""
        return self._admission.credit(n, owner)

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
            self._pending_cursor.clear()

    def close(self) -> None:
        """Close the connection pool if this instance created it (``connect``)."""
        if self._owns_client:
            self._client.close()

    def __enter__(self) -> ReplayBuffer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
