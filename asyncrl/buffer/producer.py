"""The producer side of the replay buffer: append a group (deduplicated), or give an admitted one up.

A mixin of :class:`asyncrl.buffer.replay.ReplayBuffer` (it uses ``self._client``, ``self.keys`` and
``self._admission``). Both writes are retry-safe: a put is deduplicated by group id in the same
script as its XADD, an abandon once per group id; a write whose reply never came is remembered as
uncertain and settled before the client's next admission, credit or reclaim (admission.py).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import redis

from asyncrl.buffer.admission import DEDUP_TTL_S, TAKE_SLOT_LUA, wake_lua
from asyncrl.buffer.consumer import DEAD_MAXLEN, _s
from asyncrl.buffer.layout import ROLLOUT_FIELD
from asyncrl.buffer.records import Group, RecordError, encode
from asyncrl.log_throttle import throttle

__all__ = ["StreamProducer", "PUT_MANY_LUA", "ABANDON_LUA"]

# Repeats rate-limited: abandon() logs one warning per dropped group, a flood when every group fails.
log = throttle(logging.getLogger(__name__))

# KEYS: rollouts, inflight, credits, then one dedup key per group. ARGV: field, owner ('' = none), maxlen
# (0 = none), dedup ttl, then one encoded group per dedup key. For each group in order: a repeat of its
# group id returns the first entry id and appends nothing; else append it and take it off the owner's
# in-flight tally, or, when a reclaim already credited its slot (TAKE_SLOT_LUA: a frozen pool's late
# write), take that credit back. Returns the entry ids in that order. (``put`` is this with one group.)
PUT_MANY_LUA = (
    TAKE_SLOT_LUA
    + """
local ids = {}
for i = 4, #KEYS do
  local prev = redis.call('GET', KEYS[i])
  if prev then
    ids[#ids + 1] = prev
  else
    local id
    if tonumber(ARGV[3]) > 0 then
      id = redis.call('XADD', KEYS[1], 'MAXLEN', '~', ARGV[3], '*', ARGV[1], ARGV[i + 1])
    else
      id = redis.call('XADD', KEYS[1], '*', ARGV[1], ARGV[i + 1])
    end
    if not take_slot(KEYS[2], ARGV[2]) then
      redis.call('DECRBY', KEYS[3], 1)
    end
    redis.call('SET', KEYS[i], id, 'EX', tonumber(ARGV[4]))
    ids[#ids + 1] = id
  end
end
return ids
"""
)

# KEYS: credits, inflight, dedup, dead, dead_total. ARGV: owner ('' = none), dedup ttl, group id, reason, time, dead maxlen,
# admission channel.
# An actor gives up a group it was admitted for (its reward failed): credit, in-flight tally, dead letter,
# once per group id (shares the dedup key of ``credit(request_id=group_id)``). Returns 1, or 0 if repeated.
ABANDON_LUA = (
    TAKE_SLOT_LUA
    + f"""
if redis.call('EXISTS', KEYS[3]) == 1 then
  return 0
end
if take_slot(KEYS[2], ARGV[1]) then
  redis.call('INCRBY', KEYS[1], 1)  -- else a reclaim already credited the slot
end
redis.call('SET', KEYS[3], '1', 'EX', tonumber(ARGV[2]))
redis.call('XADD', KEYS[4], 'MAXLEN', '~', ARGV[6], '*', 'id', ARGV[3], 'reason', ARGV[4], 'data', '',
           'size', 0, 'time', ARGV[5])
redis.call('INCR', KEYS[5])
{wake_lua("ARGV[7]", "credit")}
return 1
"""
)


class StreamProducer:
    """Writing rollouts (mixin of ReplayBuffer; see the module docstring)."""

    _client: Any
    keys: Any
    run: str
    _admission: Any
    _maxlen: int | None

    def put(self, group: Group, owner: str | None = None) -> str:
        """Encode (validating) and append ``group``; returns the stream entry id.

        ``owner``: the actor id the group was admitted for (``try_admit(owner=...)``); its in-flight
        tally drops by one in the same transaction as the append.

        The append is deduplicated by ``group.group_id`` (for :data:`DEDUP_TTL_S`): a retried or
        repeated put of the same group returns the first entry id and appends nothing, so a lost
        reply can neither train a group twice nor unbalance the admission tally.
        """
        (entry_id,) = self.put_many([group], owner)
        if isinstance(entry_id, BaseException):
            raise entry_id  # its validation (RecordError)
        return entry_id

    def _encoded(self, group: Group) -> tuple[str, bytes]:
        """(dedup key, record bytes) of ``group``; encoding validates (RecordError)."""
        return self.keys.request(f"put:{group.group_id}"), encode(group)

    def put_many(self, groups: list[Group], owner: str | None = None) -> list[str | BaseException]:
        """``put`` of several groups in one script call: per group, its entry id, or the
        :class:`RecordError` its validation raised (that group is not sent; the others are).

        :data:`PUT_MANY_LUA` does ``put``'s work (dedup, append, owner tally) for each group, in order (``put``
        is this call with one group), so a repeated batch returns the first ids and appends nothing. One call,
        not a pipeline of ``put`` calls, for two reasons: Redis serves a reader blocked on the stream
        (the learner) once, after the script, with the whole batch (a pipeline of real-size groups is
        read by Redis in 16 KB chunks, and the learner was woken between two of them with one group);
        and redis-py refuses pipelined EVALSHA on a Redis Cluster, where this works as ``put`` does
        (every key of a run is in one slot). A failure of the call (an error reply past the script's
        start, or a connection or timeout failure past the client's retries, which resend it: the dedup
        makes that safe) may have written some of the groups, so every sent group is marked uncertain,
        as ``put`` does for its one, and the error is raised.
        Why: groups that finish together (a synchronous step's) are written, and the learner waiting
        for them is woken, once instead of once per group.
        """
        out: list[str | BaseException | None] = [None] * len(groups)
        sent: list[tuple[int, str, bytes]] = []
        for i, group in enumerate(groups):
            try:
                dedup, data = self._encoded(group)
            except RecordError as e:  # this group's own error; the others are written
                out[i] = e
                continue
            sent.append((i, dedup, data))
        if not sent:
            return out  # type: ignore[return-value]
        k = self.keys
        keys = [k.rollouts, k.inflight, k.credits, *(dedup for _, dedup, _ in sent)]
        args = [ROLLOUT_FIELD, owner or "", self._maxlen or 0, DEDUP_TTL_S, *(data for _, _, data in sent)]
        try:
            ids = self._put_many_script(keys=keys, args=args)
        except redis.RedisError:
            # Any of them may have run, or still run later (a frozen server): settled (tombstoned if it
            # has not) before this client's next admission, credit or reclaim, so a reclaim never counts
            # a written group's slot twice.
            for _, dedup, _ in sent:
                self._admission.uncertain("put", dedup, owner)
            raise
        for (i, _, _), entry_id in zip(sent, ids, strict=True):
            out[i] = _s(entry_id)
        return out  # type: ignore[return-value]

    def put_raw(self, data: bytes) -> str:
        """Append pre-encoded bytes as-is (custom producers, tests). Not validated here, and not
        deduplicated: a retry after a lost reply may append twice (use ``put`` for real groups)."""
        kw: dict[str, Any] = {"maxlen": self._maxlen, "approximate": True} if self._maxlen else {}
        return _s(self._client.xadd(self.keys.rollouts, {ROLLOUT_FIELD: data}, **kw))

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
                    keys=[k.credits, k.inflight, dedup, k.dead, k.dead_total],
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
