"""The consumer side of the replay buffer: read through the consumer group, ack, drop, dead letters.

A mixin of :class:`asyncrl.buffer.replay.ReplayBuffer` (it uses ``self._client``, ``self.keys``,
``self.group_name``, ``self.max_deliveries`` and the per-consumer cursors and locks).

Delivery contract (DESIGN.md, "Delivery semantics"):

* Groups are read through a consumer group. A consumer gets its OWN pending (delivered,
  unacknowledged) entries first, then new ones. A restarted consumer (new instance, same
  consumer name) therefore re-reads what it had not acknowledged: nothing is lost. A live
  instance never re-delivers an entry it returned: it keeps a cursor (the highest id it
  returned) and re-walks only its pending entries above it. Those exist only when an
  XREADGROUP's reply was lost (a connection cut, or a frozen Redis that served a request the
  client had already timed out and resent): without the re-walk they would stay pending forever.
  The re-walk is skipped (one round trip less per read) after a read that returned normally
  with no failure counted since: no delivery above the cursor can exist then.
  When the resent read itself delivered newer entries, the lost ones sit BELOW the cursor: after
  any failure the client's retry monitor counted, the next read claims back (XCLAIM) exactly the
  consumer's pending entries that it never returned (the returned, unacknowledged ones are in
  flight at the caller and are left alone).
* ``ack`` acknowledges and deletes entries in one MULTI, so the stream holds only work not
  yet done. Its length is then bounded by admission, not by ``maxlen``.
* Entries that do not decode (bad msgpack, schema violations) never reach the caller: they
  are moved to the dead-letter stream with the reason, acknowledged, deleted, and return an
  admission credit so a bad producer cannot deadlock admission. So are entries delivered more
  than ``max_deliveries`` times (the consumer group's delivery count; a lost reply found again is
  set back to its count, :meth:`StreamConsumer._restore_counts`): a group whose step keeps
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

from asyncrl.buffer.admission import wake_lua
from asyncrl.buffer.cluster import connection_kwargs
from asyncrl.buffer.layout import ROLLOUT_FIELD
from asyncrl.buffer.records import Group, RecordError, decode

__all__ = ["Entry", "StreamConsumer", "DEAD_MAXLEN", "DEAD_DATA_LIMIT", "DROP_LUA"]

log = logging.getLogger(__name__)

#: The dead-letter stream is capped (approximately) so a broken producer cannot fill Redis.
DEAD_MAXLEN = 10_000


#: Raw bytes kept per dead letter; the original size is recorded separately.
DEAD_DATA_LIMIT = 64 * 1024


# KEYS: rollouts, credits, dead, dead_total. ARGV: consumer group, time, dead maxlen, admission channel, then per
# entry the four values id, reason ('' = no dead letter), data, size. Acknowledges and deletes every
# entry; only the entries this call acknowledged (were pending) get a dead letter (counted in dead_total:
# the stream is trimmed, the count is not) and a credit, so a repeat of the same call changes nothing.
# Returns how many were acknowledged (= credited).
DROP_LUA = f"""
local n = 0
local dead = 0
for i = 5, #ARGV, 4 do
  local id = ARGV[i]
  if redis.call('XACK', KEYS[1], ARGV[1], id) == 1 then
    n = n + 1
    if ARGV[i + 1] ~= '' then
      redis.call('XADD', KEYS[3], 'MAXLEN', '~', ARGV[3], '*', 'id', id, 'reason', ARGV[i + 1],
                 'data', ARGV[i + 2], 'size', ARGV[i + 3], 'time', ARGV[2])
      dead = dead + 1
    end
  end
  redis.call('XDEL', KEYS[1], id)
end
if dead > 0 then
  redis.call('INCRBY', KEYS[4], dead)
end
if n > 0 then
  redis.call('INCRBY', KEYS[2], n)
  {wake_lua("ARGV[4]", "credit")}
end
return n
"""


# KEYS: rollouts. ARGV: consumer group, consumer, then per entry the two values id, delivery count.
# Claims (XCLAIM with RETRYCOUNT = that count) every entry still in the stream and returns {claimed
# entries (as XCLAIM returns them), the ids deleted from the stream while still pending to the consumer}.
# Why the check and the claim are one script: XCLAIM drops an entry deleted from the stream (a maxlen trim)
# from the pending list and returns nothing for it, after which no XACK can find it: its dead letter or
# drop credits nothing and its admission slot is lost for the run. With the check and the claim in two
# calls, a trim landing between them lost the entry that way. Invariant: this consumer's code never
# XCLAIMs a deleted entry, so a deleted entry stays pending until the XACK of whoever settles it.
# An id in neither list was no longer pending to the consumer: acknowledged meanwhile by another path, or
# now pending to another consumer (XCLAIM would take an entry from whichever consumer holds it, so the
# claim is guarded by XPENDING filtered to this consumer); that path did or did not credit it, this one
# must not, and it must not steal what another consumer is working on.
CLAIM_LUA = """
local claimed, gone = {}, {}
for i = 3, #ARGV, 2 do
  local id = ARGV[i]
  if #redis.call('XRANGE', KEYS[1], id, id, 'COUNT', 1) == 0 then
    if #redis.call('XPENDING', KEYS[1], ARGV[1], id, id, 1, ARGV[2]) > 0 then
      gone[#gone + 1] = id
    end
  elseif #redis.call('XPENDING', KEYS[1], ARGV[1], id, id, 1, ARGV[2]) > 0 then
    local rows = redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, id, 'RETRYCOUNT', ARGV[i + 1])
    if #rows > 0 then
      claimed[#claimed + 1] = rows[1]
    end
  end
end
return {claimed, gone}
"""


@dataclass(frozen=True)
class Entry:
    """One delivered group and the stream id to acknowledge it with."""

    entry_id: str
    group: Group


def _id_key(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


def _s(b: bytes | str) -> str:
    return b.decode() if isinstance(b, bytes) else b


class StreamConsumer:
    """Reading and disposing of rollouts (mixin of ReplayBuffer; see the module docstring)."""

    _client: Any
    keys: Any
    run: str
    group_name: str
    max_deliveries: int | None
    _cursor: dict[str, str]
    _consumer_locks: dict[str, threading.Lock]
    _locks_guard: threading.Lock
    _max_block_ms: int

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
            # 0) After a Redis failure (an outage counted by the client's retry monitor) an XREADGROUP
            #    ">" whose reply was lost and that was retried may have delivered entries BELOW a later
            #    cursor: pending to this consumer, never returned. Claim those back (only those: the
            #    entries returned and not yet acknowledged are in flight at the caller).
            outages, seen = self._outage_count(), self._outages_seen()
            # Step 1 can only find something if the last read of this consumer here did not return
            # normally (an error left collected entries above the cursor), or a Redis failure since
            # it may have lost a delivery's reply, or this process never read for it (a restart):
            # otherwise every delivery above the cursor was returned by that read. Skipping it
            # saves one round trip per read. Cleared before any I/O, set again only on return. Only
            # with asyncrl's client, whose retry monitor counts every failure; a plain client may
            # retry a lost reply unseen, so its reads always look.
            clean = self._clean_reads()
            pending_empty = clean.pop(consumer, None) == outages and self._monitored()
            complete = True
            if consumer in self._cursor and outages != seen.get(consumer, outages):
                got, complete = self._recover_lost(consumer, cursor, n)
                out.extend(got)
            if complete:  # else scan again on the next call (at most n are claimed per call)
                seen[consumer] = outages
            # 1) This consumer's pending entries above the cursor, in id order: after a restart all
            #    that an earlier incarnation was given (walked n at a time, over as many reads as it
            #    takes); once that walk ran dry here, only deliveries whose reply was lost.
            walked = self._walked()
            live = consumer in walked  # the walk ran dry in this instance: what it finds now is a lost reply
            drained = pending_empty
            while len(out) < n and not pending_empty:
                before = self._pending_counts(consumer, cursor, n - len(out)) if live else {}
                resp = self._client.xreadgroup(
                    self.group_name, consumer, {stream: cursor}, count=n - len(out)
                )
                entries = resp[0][1] if resp else []
                if not entries:
                    drained = True
                    walked.add(consumer)
                    break
                cursor = _s(entries[-1][0])
                if before:  # a lost reply found again: its re-read is no delivery to the learner
                    # (one deleted meanwhile is left pending, unclaimed, see CLAIM_LUA: its dead letter
                    # below, or the learner's drop, must still acknowledge and credit it)
                    self._restore_counts(
                        consumer, {_s(i): before[_s(i)] for i, f in entries if f and _s(i) in before}
                    )
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
            self._returned().update(e.entry_id for e in out)
            if drained:  # else pending entries may remain above the cursor (a restart's walk, n at a time)
                clean[consumer] = outages  # the count before this call's I/O: a failure during it shows
        return out

    def _walked(self) -> set[str]:
        """Consumers whose pending walk (step 1 of read) ran dry in this instance."""
        return self.__dict__.setdefault("_walked_consumers", set())

    def _clean_reads(self) -> dict[str, int]:
        """consumer -> the outage count before its last read, for reads that returned normally."""
        return self.__dict__.setdefault("_clean_reads_by", {})

    # Lost-reply recovery (step 0 of read). State lives on the instance, created on first use.
    def _returned(self) -> set[str]:
        """Entry ids returned by ``read`` and not yet acknowledged, dropped or dead-lettered."""
        return self.__dict__.setdefault("_returned_ids", set())

    def _outages_seen(self) -> dict[str, int]:
        return self.__dict__.setdefault("_outages_seen_by", {})

    def _monitor(self) -> Any:
        # The client's Retry (and its monitor) is fixed at construction: look it up once, not per read.
        if "_retry_monitor" not in self.__dict__:
            retry = connection_kwargs(self._client).get("retry")
            self.__dict__["_retry_monitor"] = getattr(retry, "monitor", None)
        return self.__dict__["_retry_monitor"]

    def _monitored(self) -> bool:
        return self._monitor() is not None

    def _outage_count(self) -> int:
        return int(getattr(self._monitor(), "outages", 0))

    def _recover_lost(self, consumer: str, cursor: str, n: int) -> tuple[list[Entry], bool]:
        """(the entries claimed back, at most ``n``; whether that was all of them)."""
        returned = self._returned()
        rows = self._client.xpending_range(
            self.keys.rollouts, self.group_name, min="-", max=cursor, count=len(returned) + n + 64,
            consumername=consumer,
        )  # fmt: skip
        lost = [_s(r["message_id"]) for r in rows if _s(r["message_id"]) not in returned]
        if not lost:
            return [], True
        complete, lost = len(lost) <= n, lost[:n]
        log.warning("run %s: %d rollouts delivered to %s during a Redis failure were never returned; "
                    "claiming them back", self.run, len(lost), consumer)  # fmt: skip
        times = {_s(r["message_id"]): int(r["times_delivered"]) for r in rows}
        # A lost entry deleted from the stream (trimmed) goes to ``_accept`` as a deleted entry, unclaimed
        # and still pending, so its dead letter acknowledges and credits it (once: DROP_LUA credits only
        # what its XACK acknowledged). The check and the claim are atomic (CLAIM_LUA): a trim cannot land
        # between them. One acknowledged meanwhile by another path is in neither result and is left alone.
        claimed, gone = self._restore_counts(consumer, {i: times[i] for i in lost})
        entries = [claimed[i] if i in claimed else (i, None) for i in lost if i in claimed or i in gone]
        return self._accept(entries, consumer, redelivered=True), complete

    def _pending_counts(self, consumer: str, after: str, n: int) -> dict[str, int]:
        """Delivery counts of ``consumer``'s first ``n`` pending entries above ``after`` (an inclusive
        range less ``after`` itself: exclusive ranges need Redis 6.2)."""
        rows = self._client.xpending_range(
            self.keys.rollouts, self.group_name, min=after, max="+", count=n + 1, consumername=consumer
        )
        counts = {_s(r["message_id"]): int(r["times_delivered"]) for r in rows}
        counts.pop(after, None)
        return dict(list(counts.items())[:n])

    def _restore_counts(self, consumer: str, counts: dict[str, int]) -> tuple[dict[str, tuple], set[str]]:
        """Set the delivery counts of ``consumer``'s pending entries back to ``counts`` by claiming them
        (XCLAIM with RETRYCOUNT, in CLAIM_LUA, one call); returns ({id: the claimed entry (id, fields)},
        the ids deleted from the stream while pending, which are left pending and unclaimed).

        Why: the quarantine (``max_deliveries``) counts the learner's attempts at a group. Finding a
        delivery whose reply was lost again, by XCLAIM (which adds one) or by re-reading the pending
        entries (also one), is not an attempt: uncorrected, each lost reply brought a group one
        failure closer to quarantine although the learner had never seen it."""
        if not counts:
            return {}, set()
        script = self.__dict__.get("_claim_script")
        if script is None:
            script = self.__dict__["_claim_script"] = self._client.register_script(CLAIM_LUA)
        args: list[Any] = [self.group_name, consumer]
        for entry_id, c in counts.items():
            args += [entry_id, c]
        rows, gone = script(keys=[self.keys.rollouts], args=args)
        claimed = {_s(i): (i, dict(zip(flat[::2], flat[1::2], strict=True))) for i, flat in rows}
        return claimed, {_s(i) for i in gone}

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
            # The range also holds this consumer's other pending entries (those in flight at the caller,
            # returned): a count of len(entries) alone cut it short and read later entries as delivered 0
            # times, so a poison group could dodge the quarantine after an outage.
            n = len(entries) + len(self._returned()) + 64
            counts = self._delivery_counts(consumer, _s(entries[0][0]), _s(entries[-1][0]), n)
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
        self._returned().difference_update(r[0] for r in rows)
        k = self.keys
        args: list[Any] = [self.group_name, repr(time.time()), DEAD_MAXLEN, k.admission_channel]
        for entry_id, reason, data in rows:
            args += [entry_id, reason, data[:DEAD_DATA_LIMIT], len(data)]
        return int(self._drop_script(keys=[k.rollouts, k.credits, k.dead, k.dead_total], args=args))

    def pending_of(self, consumer: str, entry_ids: Iterable[str]) -> set[str]:
        """The ``entry_ids`` still pending to ``consumer`` (delivered, never acknowledged): its next
        :meth:`read` returns them again. One XPENDING per id, pipelined (exact, whatever else is pending)."""
        ids = list(dict.fromkeys(entry_ids))
        if not ids:
            return set()
        pipe = self._client.pipeline(transaction=False)
        for i in ids:
            pipe.xpending_range(
                self.keys.rollouts, self.group_name, min=i, max=i, count=1, consumername=consumer
            )
        return {i for i, rows in zip(ids, pipe.execute(), strict=True) if rows}

    def ack(self, entry_ids: Iterable[str]) -> int:
        """Acknowledge and delete entries (atomically); returns how many were pending."""
        ids = list(entry_ids)
        if not ids:
            return 0
        self._returned().difference_update(ids)
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
