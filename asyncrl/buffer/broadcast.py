"""The Redis side of a collective weight broadcast (``learner.weight_transport=nccl``).

With the NCCL transport the weights never touch a file: the learner (rank 0 of a dedicated NCCL
group) broadcasts them into every actor's vLLM workers with vLLM's NCCL weight-transfer engine.
A broadcast is a collective, so learner and actors must step through it together; this module is
the control plane that makes them do so, over the run's Redis (learner and actors never talk to
each other directly). It imports neither torch nor vllm.

One hash, ``asyncrl:{R}:broadcast`` (``Keys.broadcast``)::

    session_id           id of the current NCCL group (a new learner incarnation forms a new one)
    session              msgpack {id, master_address, master_port, world_size, packed, ...}
    world_size           1 + total vLLM workers of all actors (the learner is rank 0)
    next_rank            first NCCL rank not yet claimed (starts at 1)
    member:<actor>       "<rank_offset>:<ranks>" claimed by that actor's engine in this session
    round                msgpack {session, version, seq, stage: start|update|abort, update_info}
    state:<actor>        msgpack {session, version, seq, stage: joined|started|done|error, reason}

Sequence (learner = :class:`asyncrl.learner.nccl_transport.RedisWeightSyncClient`, actor =
:class:`asyncrl.actors.nccl_receiver.NcclReceiver`)::

    learner                                   actor (each)
    open(session)                  ──▶        claim ranks, init_weight_transfer_engine   ─▶ joined
    round(v, start)                ──▶        pause, start_weight_update                 ─▶ started
    round(v, update, names/shapes) ──▶        update_weights (NCCL recv, concurrent with
      NCCL broadcast from rank 0                the learner's broadcast), finish_weight_update
                                               (weight_version=v), KV reset, resume      ─▶ done
    register manifest v (sets V)

Invariants: ranks are claimed atomically (a Lua script), so offsets are disjoint and contiguous
and never exceed ``world_size``; the learner only enters the broadcast after every member has
reported ``started`` (so a dead actor fails the round with its name instead of hanging inside
NCCL; the learner then announces ``abort``, and the paused actors close their reload and resume
on the old weights), and registers the manifest (which sets V) only after every member reported ``done``, so
when V = v is visible every actor already serves v. A state carries the session id and round
``seq``: a report from an older session or round is never taken for the current one.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import msgpack

from asyncrl.buffer.layout import Keys

__all__ = ["BroadcastError", "BroadcastSession", "SessionInfo", "Round", "MemberState", "STAGES"]

SCHEMA = 1
#: Actor-reported stages, in order; "error" ends a round for the learner.
STAGES = ("joined", "started", "done")

# KEYS[1] = hash; ARGV = session id, actor id, ranks. Returns {rank_offset, ranks} or {-1|-2|-3, info}.
_CLAIM_LUA = """
if redis.call('HGET', KEYS[1], 'session_id') ~= ARGV[1] then return {-1, 0} end
local member = 'member:' .. ARGV[2]
if redis.call('HEXISTS', KEYS[1], member) == 1 then return {-3, 0} end
local n = tonumber(ARGV[3])
local ws = tonumber(redis.call('HGET', KEYS[1], 'world_size'))
local first = tonumber(redis.call('HGET', KEYS[1], 'next_rank') or '1')
if first + n > ws then return {-2, first} end
redis.call('HSET', KEYS[1], 'next_rank', first + n, member, first .. ':' .. n)
return {first, n}
"""


class BroadcastError(RuntimeError):
    """A broadcast round or session handshake cannot complete (names the actors and the reason)."""


@dataclass(frozen=True)
class SessionInfo:
    """One NCCL group: where rank 0 listens and how many ranks it has (learner + all workers)."""

    id: str
    master_address: str
    master_port: int
    world_size: int
    packed: bool = True
    packed_buffer_size_bytes: int = 1 << 30
    packed_num_buffers: int = 2
    created: float = field(default_factory=time.time)

    def worker_init_info(self, rank_offset: int) -> dict[str, Any]:
        """vLLM's ``NCCLWeightTransferInitInfo`` payload for an engine whose workers start at ``rank_offset``."""
        return {
            "master_address": self.master_address,
            "master_port": self.master_port,
            "rank_offset": rank_offset,
            "world_size": self.world_size,
            "packed": self.packed,
            "packed_buffer_size_bytes": self.packed_buffer_size_bytes,
            "packed_num_buffers": self.packed_num_buffers,
        }


@dataclass(frozen=True)
class Round:
    """What the learner asks of every member now: ``stage`` ``start`` or ``update`` of ``version``."""

    session: str
    version: int
    seq: int
    stage: str
    update_info: dict[str, Any] | None = None


@dataclass(frozen=True)
class MemberState:
    session: str
    version: int
    seq: int
    stage: str
    reason: str = ""
    time: float = field(default_factory=time.time)


def _pack(obj: Any) -> bytes:
    return msgpack.packb({"schema": SCHEMA, **asdict(obj)}, use_bin_type=True)


def _unpack(cls: type, data: bytes | None) -> Any:
    if data is None:
        return None
    d = msgpack.unpackb(data, raw=False)
    if not isinstance(d, Mapping) or d.pop("schema", None) != SCHEMA:
        raise BroadcastError(f"{cls.__name__}: unsupported record {str(d)[:80]}")
    return cls(**d)


class BroadcastSession:
    """The broadcast control plane of one run on one Redis client (both sides use it)."""

    def __init__(self, client: Any, run: str) -> None:
        self._r = client
        self.key = Keys(run).broadcast
        self._claim = client.register_script(_CLAIM_LUA)

    # ------------------------------------------------------------------ learner side

    def open(self, master_address: str, master_port: int, world_size: int, **wire: Any) -> SessionInfo:
        """Start a new session (a new NCCL group): forget every member, round and state of the old one."""
        if world_size < 2:
            raise BroadcastError(f"world_size={world_size}: a broadcast needs the learner and >= 1 worker")
        info = SessionInfo(uuid.uuid4().hex[:12], master_address, int(master_port), int(world_size), **wire)
        pipe = self._r.pipeline(transaction=True)
        pipe.delete(self.key)
        pipe.hset(
            self.key,
            mapping={
                "session_id": info.id,
                "session": _pack(info),
                "world_size": info.world_size,
                "next_rank": 1,
            },
        )
        pipe.execute()
        return info

    def wait_claimed(
        self, session: str, *, timeout_s: float, poll_s: float = 0.05
    ) -> dict[str, tuple[int, int]]:
        """Block until every worker rank of ``session`` is claimed (every actor engine is up); the members."""
        deadline = time.monotonic() + timeout_s
        while True:
            members, _states, next_rank, world = self._snapshot(session)
            if next_rank == world:
                return members
            if time.monotonic() > deadline:
                raise BroadcastError(
                    f"weight broadcast: {world - next_rank} of {world - 1} worker ranks never claimed after "
                    f"{timeout_s:.0f} s (joined: {sorted(members) or 'nobody'}; session {session})"
                )
            time.sleep(poll_s)

    def announce(self, rnd: Round) -> None:
        self._r.hset(self.key, "round", _pack(rnd))

    def wait(
        self, session: str, stage: str, *, seq: int = -1, timeout_s: float, poll_s: float = 0.001
    ) -> dict[str, MemberState]:
        """Block until every claimed rank's actor reported ``stage`` (for round ``seq``); return the states.

        ``joined`` also waits until all ``world_size - 1`` worker ranks are claimed. Raises
        :class:`BroadcastError` naming the actors on an ``error`` report or at the deadline.
        """
        want = STAGES.index(stage)
        deadline = time.monotonic() + timeout_s
        while True:
            members, states, next_rank, world = self._snapshot(session)
            errors = {a: s for a, s in states.items() if s.stage == "error" and s.seq == seq}
            if errors:
                raise BroadcastError(
                    "; ".join(f"{a}: {s.reason}" for a, s in sorted(errors.items()))
                    + f" (session {session}, stage {stage})"
                )
            behind = sorted(
                a
                for a in members
                if a not in states or states[a].seq != seq or STAGES.index(states[a].stage) < want
            )
            unclaimed = world - next_rank if stage == "joined" else 0
            if not behind and unclaimed == 0:
                return {a: states[a] for a in members}
            if time.monotonic() > deadline:
                raise BroadcastError(
                    f"weight broadcast: no '{stage}' after {timeout_s:.0f} s from {behind or 'nobody'}"
                    + (f"; {unclaimed} of {world - 1} worker ranks never claimed" if unclaimed else "")
                    + f" (session {session}; an actor died or never started: the learner must re-form the group)"
                )
            time.sleep(poll_s)

    def _snapshot(self, session: str) -> tuple[dict[str, tuple[int, int]], dict[str, MemberState], int, int]:
        raw = self._r.hgetall(self.key)
        if raw.get(b"session_id", b"").decode() != session:
            raise BroadcastError(f"session {session} was replaced (another learner formed a new group)")
        members: dict[str, tuple[int, int]] = {}
        states: dict[str, MemberState] = {}
        for k, v in raw.items():
            name = k.decode()
            if name.startswith("member:"):
                off, n = v.decode().split(":")
                members[name[7:]] = (int(off), int(n))
            elif name.startswith("state:"):
                s = _unpack(MemberState, v)
                if s.session == session:
                    states[name[6:]] = s
        return members, states, int(raw[b"next_rank"]), int(raw[b"world_size"])

    def members(self, session: str) -> dict[str, tuple[int, int]]:
        """actor id -> (rank_offset, ranks) of the session."""
        return self._snapshot(session)[0]

    # ------------------------------------------------------------------ actor side

    def session(self) -> SessionInfo | None:
        return _unpack(SessionInfo, self._r.hget(self.key, "session"))

    def claim(self, session: str, actor_id: str, ranks: int) -> int:
        """Claim ``ranks`` consecutive NCCL ranks for ``actor_id``'s engine; returns the first one."""
        first, info = self._claim(keys=[self.key], args=[session, actor_id, int(ranks)])
        if first == -1:
            raise BroadcastError(f"{actor_id}: session {session} is not the current one")
        if first == -2:
            raise BroadcastError(
                f"{actor_id}: needs {ranks} NCCL ranks but only ranks up to {info - 1} of the group are "
                "left (more actor workers than the learner expects: check actors.num_actors and "
                "tensor/pipeline_parallel_size on both sides)"
            )
        if first == -3:
            raise BroadcastError(f"{actor_id}: already a member of session {session} (an old incarnation)")
        return int(first)

    def current_round(self) -> Round | None:
        return _unpack(Round, self._r.hget(self.key, "round"))

    def report(self, actor_id: str, state: MemberState) -> None:
        self._r.hset(self.key, f"state:{actor_id}", _pack(state))
