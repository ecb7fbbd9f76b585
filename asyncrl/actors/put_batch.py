"""Coalesced buffer writes: the groups an actor finishes together reach Redis in one round trip.

A synchronous step's groups finish within a fraction of a millisecond of each other. Written one by
one (a thread hop and a script round trip each), the first write wakes the learner, which then shares
the core with the front end still writing the others: on the 2-core demo the last group reached Redis
3.5 ms after generation ended, 1.4 ms of it the put's round trip. :class:`PutBatcher` queues the puts
made while a write is in flight and sends each batch with one :meth:`ReplayBuffer.put_many` (one
script call that does ``put``'s work for each group), so the learner is woken once per batch.

Lingering: the groups of a step finish generating together but are scored in turn (one reward thread
each), so the first scored used to leave alone and the others followed in a second batch, 2-3 ms
later (timelines of the sync demo). A batch therefore waits, up to ``linger_s``, while the actor still
scores groups (announced with :meth:`PutBatcher.expect`) for those to be queued: they leave together.
The wait ends as soon as nothing more is expected; a slow reward delays the others' write by
``linger_s`` at most.

Invariants: each group is written exactly as by ``put`` (same dedup, same owner tally, in the order
queued); a put's awaiter gets its own group's entry id or validation error; a batch that fails as a
whole (an error reply, or Redis unreachable past the retries) fails every put in it; one batch is in
flight at a time, and a put queued meanwhile goes in the next; no awaiter is left hanging if the
flusher is cancelled (the loop's teardown) or fails.
"""

from __future__ import annotations

import asyncio
from typing import Any

__all__ = ["PutBatcher"]


class PutBatcher:
    """Batches ``buffer.put_many(groups, owner)`` calls from one event loop, the one running when it
    is made (not thread-safe)."""

    def __init__(self, buffer: Any, owner: str | None, linger_s: float = 0.0) -> None:
        self.buffer = buffer
        self.owner = owner
        self.loop = asyncio.get_running_loop()
        self.linger_s = linger_s
        self.expected = 0  # groups announced by expect() and not yet put (being scored)
        self._more = asyncio.Event()  # a put was queued, or a group expected will not be put after all
        self._queue: list[tuple[Any, asyncio.Future]] = []
        self._flusher: asyncio.Task | None = None
        self._inflight: list[tuple[Any, asyncio.Future]] = []  # the batch being sent
        self.batches = 0  # round trips made (tests, and the batch size it implies)

    def expect(self) -> None:
        """A group will be put soon (it is being scored): a batch lingers for it (module doc). Ended
        by ``put(group, expected=True)``, or by :meth:`unexpect` when it will not be put."""
        self.expected += 1

    def unexpect(self) -> None:
        self.expected -= 1
        self._more.set()

    async def put(self, group: Any, expected: bool = False) -> str:
        """Write ``group`` (in the next batch); returns its entry id. ``expected``: announced by
        :meth:`expect`. Cancelling the awaiter does not cancel the write (the caller shields and tracks
        it, see GroupProduction._write)."""
        fut: asyncio.Future = asyncio.get_running_loop().create_future()
        self._queue.append((group, fut))
        if expected:
            self.expected -= 1
        self._more.set()
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.ensure_future(self._flush())
            self._flusher.add_done_callback(self._flusher_done)
        return await fut

    async def _flush(self) -> None:
        while self._queue:
            # One pass of the loop first: groups whose last completion arrived in the same output
            # batch of the engine are scored and queued by then, and go in this batch.
            await asyncio.sleep(0)
            await self._linger()
            self._inflight, self._queue = self._queue, []
            self.batches += 1
            batch = self._inflight
            try:
                results = await asyncio.to_thread(self.buffer.put_many, [g for g, _ in batch], self.owner)
            except Exception as e:  # the whole round trip failed: every put in it did
                for _, fut in batch:
                    if not fut.done():
                        fut.set_exception(e)
                self._inflight = []
                continue
            for (_, fut), res in zip(batch, results, strict=True):
                if fut.done():
                    continue
                if isinstance(res, BaseException):
                    fut.set_exception(res)
                else:
                    fut.set_result(res)
            self._inflight = []

    async def _linger(self) -> None:
        """Wait, up to ``linger_s``, until no group is expected any more (see the module doc)."""
        deadline = self.loop.time() + self.linger_s
        while self.expected > 0:
            left = deadline - self.loop.time()
            if left <= 0:
                return
            self._more.clear()
            try:
                await asyncio.wait_for(self._more.wait(), left)
            except TimeoutError:
                return

    def _flusher_done(self, task: asyncio.Task) -> None:
        """A flusher that ended otherwise than by emptying the queue (cancelled at the loop's teardown,
        even before it started: nobody else cancels it; or a bug) leaves no awaiter hanging. A put in
        flight may still finish in its thread; its awaiter is cancelled all the same."""
        if not task.cancelled() and task.exception() is None:
            return  # it emptied the queue; a put queued since then has its own flusher
        error = None if task.cancelled() else task.exception()
        pending = self._inflight + (self._queue if self._flusher is task else [])
        for _, fut in pending:
            if fut.done():
                continue
            if error is None:
                fut.cancel()
            else:
                fut.set_exception(error)
        self._inflight = []
        if self._flusher is task:
            self._queue = []
