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

from asyncrl.buffer.admission import DEDUP_TTL_S, wake_lua
from asyncrl.buffer.consumer import DEAD_MAXLEN, _s
from asyncrl.buffer.layout import ROLLOUT_FIELD
from asyncrl.buffer.records import Group, RecordError, encode

__all__ = ["StreamProducer", "PUT_LUA", "ABANDON_LUA"]

log = logging.getLogger(__name__)

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
        dedup, keys, args = self._put_call(group, owner)
        try:
            return _s(self._put_script(keys=keys, args=args))
        except (redis.ConnectionError, redis.TimeoutError):
            # It may still run later (a frozen server); settled (tombstoned if it has not) before this
            # client's next admission, credit or reclaim, so a reclaim never counts its slot twice.
            self._admission.uncertain("put", dedup, owner)
            raise

    def _put_call(self, group: Group, owner: str | None) -> tuple[str, list[Any], list[Any]]:
        """(dedup key, KEYS, ARGV) of ``group``'s PUT_LUA call; encoding validates (RecordError)."""
        k = self.keys
        dedup = k.request(f"put:{group.group_id}")
        args = [ROLLOUT_FIELD, encode(group), owner or "", self._maxlen or 0, DEDUP_TTL_S]
        return dedup, [k.rollouts, k.inflight, dedup], args

    def put_many(self, groups: list[Group], owner: str | None = None) -> list[str | BaseException]:
        """``put`` of several groups in one round trip: per group, its entry id, or the exception that
        group alone raised (a :class:`RecordError` from its validation, a Redis error reply).

        Each group is still its own deduplicated script call (pipelined, not a transaction), so this
        is exactly ``put`` for each, in order; a group that fails validation is not sent. A connection
        or timeout failure of the round trip (past the client's retries, which resend every call:
        the dedup makes that safe) marks every sent group uncertain, as ``put`` does, and raises.
        Why: groups that finish together (a synchronous step's) are written, and the learner waiting
        for them is woken, once instead of once per group.
        """
        out: list[str | BaseException | None] = [None] * len(groups)
        sent: list[tuple[int, str, list[Any], list[Any]]] = []
        # EVALSHA directly: a pipeline that registers the script first asks SCRIPT EXISTS, one more
        # round trip per batch. A server without the script (restarted) answers NOSCRIPT for a call
        # that did nothing; that group is then put alone (the script object loads it).
        pipe = self._client.pipeline(transaction=False)
        for i, group in enumerate(groups):
            try:
                dedup, keys, args = self._put_call(group, owner)
            except RecordError as e:  # this group's own error; the others are written
                out[i] = e
                continue
            pipe.evalsha(self._put_script.sha, len(keys), *keys, *args)
            sent.append((i, dedup, keys, args))
        if not sent:
            return out  # type: ignore[return-value]
        try:
            replies = pipe.execute(raise_on_error=False)
            for (i, _, keys, args), reply in zip(sent, replies, strict=True):
                if isinstance(reply, redis.exceptions.NoScriptError):
                    reply = self._put_script(keys=keys, args=args)
                out[i] = reply if isinstance(reply, BaseException) else _s(reply)
        except (redis.ConnectionError, redis.TimeoutError):
            # As put: any of them may still run later; settled before this client's next admission.
            for i, dedup, _, _ in sent:
                if out[i] is None:
                    self._admission.uncertain("put", dedup, owner)
            raise
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
