"""The Redis Lua sources of staleness admission (asyncrl.buffer.admission runs them).

Each script does its check and its write in one atomic step (Redis runs a script without interleaving
other commands); the invariants they keep, and why, are in asyncrl.buffer.admission's module doc. The
shared pieces (:data:`TAKE_SLOT_LUA`, :func:`wake_lua`) are also spliced into the producer's and the
consumer's scripts. Every script that can raise the bound PUBLISHes a wake hint in the same step.
"""

from __future__ import annotations

__all__ = [
    "ADMIT_LUA",
    "CREDIT_LUA",
    "RECLAIM_LUA",
    "SETTLE_LUA",
    "SKEW_LUA",
    "TAKE_SLOT_LUA",
    "WAKE_SCHEMA",
    "wake_lua",
]

#: Schema of the admission channel's messages ({schema, event}); subscribers treat them as hints only.
WAKE_SCHEMA = 1


def wake_lua(channel_arg: str, event: str) -> str:
    """Lua that publishes an admission hint on the channel in ``channel_arg`` (e.g. ``ARGV[4]``)."""
    return (
        f"redis.call('PUBLISH', {channel_arg}, cmsgpack.pack({{schema = {WAKE_SCHEMA}, event = '{event}'}}))"
    )


#: Lua ``take_slot(inflight, owner)``: resolve one of ``owner``'s slots in the in-flight tally (the hash
#: ``inflight``); false when the tally holds none ('' = an untracked owner: always true). Why (the fence): a reclaim (a restarted actor, its pool's supervisor, a live pool
#: reclaiming a lapsed one) turns everything the owner holds into credits and zeroes its tally; a write,
#: credit or give-back of that owner that arrives after it (a pool frozen past two lease periods, then
#: resumed) resolves a slot the reclaim already credited. Such a call must not credit it again (the
#: window would stay one slot wider for good), and a write of its group must take that credit back (the
#: group is now in the stream, which the ledger counts): the callers check this and do so. The tally never
#: goes below zero. Invariant kept: admitted = credits + skew * gpv + in flight + in the stream + trained.
TAKE_SLOT_LUA = """
local function take_slot(inflight, owner)
  if owner == '' then
    return true
  end
  if tonumber(redis.call('HGET', inflight, owner) or '0') <= 0 then
    return false
  end
  redis.call('HINCRBY', inflight, owner, -1)
  return true
end
"""

# KEYS: admitted, credits, version, inflight, dedup, staleness_bound (always last: the script reads KEYS[#KEYS]).
# ARGV: max_staleness, groups_per_step, sampler_version (-1 = any), owner ('' = untracked), dedup ttl.
# Returns {admitted_flag, admitted_after, bound}; flag -1 = refused because the caller's weights are
# already staler than max_staleness (it must swap first). Missing keys count as 0. A repeated request
# (same dedup key) that was admitted returns {1, ...} again without a second INCR.
ADMIT_LUA = """
local prev = redis.call('GET', KEYS[5])
if prev then
  return {prev == '1' and 1 or 0, tonumber(redis.call('GET', KEYS[1]) or '0'), -1}
end
local admitted = tonumber(redis.call('GET', KEYS[1]) or '0')
local credits = tonumber(redis.call('GET', KEYS[2]) or '0')
local version = tonumber(redis.call('GET', KEYS[3]) or '0')
-- The learner's adaptive bound (the last key; unset = off) can only tighten max_staleness.
local eta = tonumber(ARGV[1])
local adaptive = redis.call('GET', KEYS[#KEYS])
if adaptive then
  eta = math.min(eta, tonumber(adaptive))
end
local bound = (version + eta + 1) * tonumber(ARGV[2]) + credits
local sampler = tonumber(ARGV[3] or '-1')
if sampler >= 0 and version - sampler > eta then
  return {-1, admitted, bound}
end
-- The slot this admission would take is trained at version ceil((admitted + 1 - credits) / gps) - 1
-- (slot_version): refuse weights that would be staler than eta *there*, not only now (see slot_version).
if sampler >= 0 and admitted < bound and math.ceil((admitted + 1 - credits) / tonumber(ARGV[2])) - 1 - sampler > eta then
  return {-1, admitted, bound}
end
if admitted < bound then
  admitted = redis.call('INCR', KEYS[1])
  if ARGV[4] and ARGV[4] ~= '' then
    redis.call('HINCRBY', KEYS[4], ARGV[4], 1)
  end
  redis.call('SET', KEYS[5], '1', 'EX', tonumber(ARGV[5]))
  return {1, admitted, bound}
end
return {0, admitted, bound}
"""


# KEYS: inflight, credits. ARGV: owner, admission channel. Turns everything the owner still holds into credits.
RECLAIM_LUA = f"""
local n = tonumber(redis.call('HGET', KEYS[1], ARGV[1]) or '0')
redis.call('HDEL', KEYS[1], ARGV[1])
if n > 0 then
  redis.call('INCRBY', KEYS[2], n)
  {wake_lua("ARGV[2]", "reclaim")}
end
return n
"""

# KEYS: credits, inflight, dedup. ARGV: n, owner ('' = none), dedup ttl, admission channel.
# Returns total credits. A repeated request (same dedup key) changes nothing. An owner's credit counts only
# the slots its tally still holds (TAKE_SLOT_LUA: the rest a reclaim already credited).
CREDIT_LUA = (
    TAKE_SLOT_LUA
    + f"""
if redis.call('EXISTS', KEYS[3]) == 1 then
  return tonumber(redis.call('GET', KEYS[1]) or '0')
end
local n = 0
if ARGV[2] ~= '' then
  for _ = 1, tonumber(ARGV[1]) do
    if take_slot(KEYS[2], ARGV[2]) then
      n = n + 1
    end
  end
else
  n = tonumber(ARGV[1])
end
local total = redis.call('INCRBY', KEYS[1], n)
redis.call('SET', KEYS[3], '1', 'EX', tonumber(ARGV[3]))
if n > 0 then
  {wake_lua("ARGV[4]", "credit")}
end
return total
"""
)


# KEYS: dedup, credits, inflight. ARGV: owner ('' = none), dedup ttl, kind ('admit' or other),
# admission channel. Settles a request whose outcome the client never learned: not run -> tombstone (it
# never will); an admission that ran -> given back (credit, in-flight tally). Returns 1 if it gave a slot back.
SETTLE_LUA = (
    TAKE_SLOT_LUA
    + f"""
local prev = redis.call('GET', KEYS[1])
if not prev then
  redis.call('SET', KEYS[1], 'cancelled', 'EX', tonumber(ARGV[2]))
  return 0
end
if prev == '1' and ARGV[3] == 'admit' then
  redis.call('SET', KEYS[1], 'undone', 'EX', tonumber(ARGV[2]))
  if not take_slot(KEYS[3], ARGV[1]) then
    return 0  -- a reclaim already credited it
  end
  redis.call('INCRBY', KEYS[2], 1)
  {wake_lua("ARGV[4]", "credit")}
  return 1
end
return 0
"""
)

# KEYS: credits, version_skew. ARGV: total skew, groups per version, admission channel. Sets the skew and
# moves the credits by -(change * groups per version) (see "Forks" in the module doc); returns the change.
SKEW_LUA = f"""
local old = tonumber(redis.call('GET', KEYS[2]) or '0')
local change = tonumber(ARGV[1]) - old
if change ~= 0 then
  redis.call('INCRBY', KEYS[1], -change * tonumber(ARGV[2]))
  redis.call('SET', KEYS[2], ARGV[1])
  {wake_lua("ARGV[3]", "skew")}
end
return change
"""
