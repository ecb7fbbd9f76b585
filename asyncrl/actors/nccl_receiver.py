"""The actor's side of ``learner.weight_transport=nccl``: join the learner's group, take part in rounds.

The engine runs vLLM's ``nccl`` weight-transfer engine in its workers; this class answers the
learner's rounds on Redis (protocol in :mod:`asyncrl.buffer.broadcast`):

* a new session: release the old group's communicator (``shutdown_weight_transfer_engine``) if our
  workers were in one, claim ``tp * pp`` consecutive NCCL ranks, ``init_weight_transfer_engine`` with
  that rank offset (blocks until the learner and every other worker rendezvous), report ``joined``;
* a ``start`` round for version v: check the announced tensor names, shapes and dtypes against the
  served checkpoint (a mismatch is reported as ``error`` before anyone enters the collective), then,
  in the engine's swap sequence (scheduler paused, ``start_weight_update``), report ``started``, wait for
  the ``update`` round, ``update_weights`` (NCCL receive, concurrent with the learner's
  broadcast); the engine then runs ``finish_weight_update(weight_version=str(v))`` (the label every
  later token carries), resets the KV of running requests and resumes; report ``done``.

Any failure is reported as ``error`` with its reason (the learner raises it) and re-raised: the
group may be mid-collective, so the actor's supervision restarts the engine, which joins the next
group the learner forms. A receive that outlasts the round's deadline (``learner.nccl_timeout_s``;
the learner died mid-broadcast) is such a failure: :class:`ReceiveStalled`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from asyncrl.buffer.broadcast import BroadcastError, BroadcastSession, MemberState, Round

from .swap_prepare import EngineError
from .tensor_specs import TensorSpec, check_names, check_specs, checkpoint_specs

__all__ = ["NcclReceiver", "NCCL_BACKEND", "ReceiveStalled", "check_names", "check_round", "expected_names"]

log = logging.getLogger(__name__)
NCCL_BACKEND = "nccl"  # vLLM's dense NCCL weight-transfer engine


def check_round(expected: Mapping[str, TensorSpec] | set[str], info: Mapping[str, Any]) -> str:
    """'' if the tensors a ``start`` round announces (``names``, ``dtype_names``, ``shapes``) are the
    served checkpoint's, else why not. A wrong shape would raise inside ``load_weights`` after earlier
    layers were replaced (a half-reloaded model); refused here, no NCCL call is made and nobody pauses.
    ``expected`` a set of names (no specs known): names only."""
    names = list(info.get("names", []))
    why = check_names(expected, names)
    if why or not isinstance(expected, Mapping):
        return why
    dtypes, shapes = list(info.get("dtype_names", [])), list(info.get("shapes", []))
    if len(dtypes) != len(names) or len(shapes) != len(names):
        return f"the round announces {len(names)} names, {len(dtypes)} dtypes and {len(shapes)} shapes"
    got = {
        n: (tuple(int(d) for d in shape), str(dt)) for n, dt, shape in zip(names, dtypes, shapes, strict=True)
    }
    return check_specs(expected, got)


class _Abandoned(BroadcastError):
    """The learner gave up on a round before its broadcast began (no NCCL call was made)."""


class ReceiveStalled(EngineError):
    """The NCCL receive outlasted the round's deadline (the learner died mid-broadcast): the engine is
    stuck inside the collective, paused, and is replaced (an engine failure, not an abandoned round)."""


def _retrieve(f: asyncio.Future) -> None:
    if not f.cancelled():
        f.exception()  # a stalled swap's late error: already reported as ReceiveStalled


class NcclReceiver:
    """One actor engine's membership in the learner's broadcast group (see the module doc).

    ``engine``: an :class:`asyncrl.actors.engine.Engine` (or anything with ``llm`` and
    ``swap_with(version, mode, load)``). ``ranks``: its vLLM workers (tensor x pipeline parallel).
    """

    def __init__(
        self,
        engine: Any,
        session: BroadcastSession,
        actor_id: str,
        expected_names: Mapping[str, TensorSpec] | set[str],
        ranks: int,
        *,
        timeout_s: float = 120.0,
        poll_s: float = 0.002,
    ) -> None:
        self.engine = engine
        self.session = session
        self.actor_id = actor_id
        self.expected = expected_names
        self.ranks = ranks
        self.timeout_s = timeout_s
        self.poll_s = poll_s
        self.joined: str | None = None  # session id of the group our workers are in
        self.rank_offset: int | None = None
        self._seq = -1  # last round taken part in
        self._refused: str | None = None  # a session whose ranks we could not claim

    def _report(self, version: int, seq: int, stage: str, reason: str = "") -> None:
        assert self.joined is not None
        self.session.report(self.actor_id, MemberState(self.joined, version, seq, stage, reason))

    async def join(self) -> bool:
        """Join the current session if our workers are not in it yet; True if joined now."""
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        info = await asyncio.to_thread(self.session.session)
        if info is None or info.id in (self.joined, self._refused):
            return False
        if self.joined is not None:
            # The learner re-formed the group: release our workers' communicator of the old one first.
            # vLLM's init_weight_transfer_engine overwrites it without closing it, and a
            # PyNcclCommunicator is never freed otherwise (no __del__): one leaked per re-formed group.
            old, self.joined, self.rank_offset = self.joined, None, None
            try:
                await self.engine.llm.shutdown_weight_transfer_engine()
            except Exception as e:  # the old group is gone either way; joining the new one matters
                log.warning("%s: releasing weight broadcast %s: %s", self.actor_id, old, e)
        try:
            offset = await asyncio.to_thread(self.session.claim, info.id, self.actor_id, self.ranks)
        except BroadcastError as e:
            # Typically a restarted engine whose previous incarnation holds this actor's ranks: that
            # group is broken (its next round fails naming us), and the learner forms a new one,
            # which we join. Until then: serve the weights we have, without asking again.
            self._refused = info.id
            log.warning("%s: not joining weight broadcast %s: %s", self.actor_id, info.id, e)
            return False
        self.joined, self.rank_offset, self._seq = info.id, offset, -1
        try:
            await self.engine.llm.init_weight_transfer_engine(
                WeightTransferInitRequest(init_info=info.worker_init_info(offset))
            )
        except Exception as e:
            await asyncio.to_thread(self._report, -1, -1, "error", f"init_weight_transfer_engine: {e}")
            raise
        await asyncio.to_thread(self._report, -1, -1, "joined")
        log.info("%s: joined weight broadcast %s as ranks %d..%d of %d", self.actor_id, info.id, offset,
                 offset + self.ranks - 1, info.world_size)  # fmt: skip
        return True

    async def poll(self, mode: str) -> Any:
        """Join a new group, or take part in a new round; the engine's ``SwapResult`` or None."""
        await self.join()
        rnd = await asyncio.to_thread(self.session.current_round)
        if rnd is None or rnd.session != self.joined or rnd.seq <= self._seq or rnd.stage != "start":
            return None
        self._seq = rnd.seq
        why = check_round(self.expected, rnd.update_info or {})
        if why:
            await asyncio.to_thread(self._report, rnd.version, rnd.seq, "error", why)
            log.error("%s: refusing broadcast v%d: %s", self.actor_id, rnd.version, why)
            return None
        receiving = asyncio.Event()
        swap = asyncio.ensure_future(
            self.engine.swap_with(rnd.version, mode, lambda: self._receive(rnd, receiving))
        )
        try:
            res = await self._bounded(swap, receiving, rnd)
        except _Abandoned as e:  # before any NCCL call: the old weights serve on, the group is intact
            await asyncio.to_thread(self._report, rnd.version, rnd.seq, "error", str(e))
            log.warning("%s: broadcast v%d abandoned: %s", self.actor_id, rnd.version, e)
            return None
        except Exception as e:
            await asyncio.to_thread(self._report, rnd.version, rnd.seq, "error", f"{type(e).__name__}: {e}")
            raise
        await asyncio.to_thread(self._report, rnd.version, rnd.seq, "done")
        return res

    async def _bounded(self, swap: asyncio.Future, receiving: asyncio.Event, rnd: Round) -> Any:
        """``swap``'s result, or :class:`ReceiveStalled` once its NCCL receive (from ``receiving``) outlasts
        ``timeout_s``. The swap is left running, not cancelled: the receive is a collective RPC that
        blocks the engine core's loop until the collective ends, so the swap's own clean-up (the
        resume) would block behind it too; the actor's supervision replaces the whole engine."""
        swap.add_done_callback(_retrieve)
        started = asyncio.ensure_future(receiving.wait())
        try:
            await asyncio.wait((swap, started), return_when=asyncio.FIRST_COMPLETED)
            if not swap.done():
                await asyncio.wait((swap,), timeout=self.timeout_s)
            if not swap.done():
                raise ReceiveStalled(f"no weights of v{rnd.version} received within {self.timeout_s:.0f} s of "
                                     "the broadcast's start (the learner died mid-broadcast?)")  # fmt: skip
            return swap.result()
        except asyncio.CancelledError:
            # As when the swap was awaited directly: a begun reload runs to its end (run_whole) before
            # the caller goes on, bounded like the receive.
            swap.cancel()
            await asyncio.wait((swap,), timeout=self.timeout_s)
            raise
        finally:
            started.cancel()

    async def _receive(self, rnd: Round, receiving: asyncio.Event) -> None:
        """Inside the engine's paused window, after ``start_weight_update``: report, receive."""
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        await asyncio.to_thread(self._report, rnd.version, rnd.seq, "started")
        deadline = time.monotonic() + self.timeout_s
        while True:
            cur = await asyncio.to_thread(self.session.current_round)
            why = ""
            if cur is None or cur.session != rnd.session or cur.seq != rnd.seq or cur.stage == "abort":
                why = f"round {rnd.seq} of v{rnd.version} was abandoned by the learner"
            elif cur.stage == "update":
                break
            elif time.monotonic() > deadline:
                why = f"no update for v{rnd.version} within {self.timeout_s:.0f} s"
            if why:
                # Close the reload start_weight_update opened: nothing was loaded, so finalizing puts
                # every layer's current tensors back (no version label: the old one stays).
                await self.engine.llm.finish_weight_update()
                raise _Abandoned(why)
            await asyncio.sleep(self.poll_s)
        receiving.set()  # from here the receive is bounded by _bounded
        await self.engine.llm.update_weights(WeightTransferUpdateRequest(update_info=cur.update_info or {}))


def expected_names(model_path: str | Path) -> dict[str, TensorSpec]:
    """name -> (shape, dtype) of the checkpoint the engine was started from: what every broadcast must
    carry (its keys are the names; the specs are compared with each round's announcement)."""
    return checkpoint_specs(model_path)
