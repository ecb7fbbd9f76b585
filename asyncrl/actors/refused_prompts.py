"""Prompts the engine refuses for their length, refused once per run (a mixin of the group workers).

The first refusal of a prompt at least ``model.max_model_len`` tokens long is dead-lettered and recorded
in Redis (``asyncrl:{R}:poison_prompts``, per ``model.max_model_len``); later epochs, the other actors and
pools and a resumed run pass over its positions without an engine request (``prompts_skipped``), while
the prompt, rendered now, is still too long. An epoch of positions passed over in a row ends the actor.
Uses the group worker's ``_write`` and ``_encode_prompt`` (:class:`asyncrl.actors.group_worker.GroupProduction`).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from asyncrl.tasks import Prompt

from .supervision import ActorFatalError

# The group workers' logger (filters and tests name it; the code moved out of group_worker): the same
# object, whose repeat throttle asyncrl.actors.group_worker adds once.
log = logging.getLogger("asyncrl.actors.group_worker")


#: See RefusedPrompts._epoch_len.
_UNKNOWN_EPOCH = 1024


class _PoisonPrompts:
    """An actor's copy of the run's refused prompts (``asyncrl:{R}:poison_prompts``) and its log state."""

    def __init__(self, ids: set[str]) -> None:
        self.ids = ids  # the task's prompt ids (an epoch's length when the source has none)
        self.known: dict[str, str] = {}  # prompt id -> reason
        self.epoch = -1  # the newest epoch of the prompt order at whose turn the record was read
        self.loading: asyncio.Future | None = None
        self.merged: asyncio.Future | None = None  # the read whose result is in ``known``
        self.loop: asyncio.AbstractEventLoop | None = None
        self.logged: set[str] = set()  # prompts whose skip was logged
        self.skipped_in_row = 0  # positions passed over since this actor last claimed one to generate


class RefusedPrompts:
    """The group workers' record of refused prompts (mixin: see the module doc)."""

    cfg: Any
    buffer: Any
    source: Any
    task: Any
    counters: dict[str, Any]
    actor_id: str

    def _poison(self) -> _PoisonPrompts:
        """This actor's view of the run's refused prompts (made on first use: the mixin has no __init__)."""
        p = self.__dict__.get("_poison_prompts")
        if p is None:
            prompts = getattr(self.task, "prompts", ())  # a list; never iterate a generator here
            ids = {x.prompt_id for x in prompts} if isinstance(prompts, (list, tuple)) else set()
            p = self.__dict__["_poison_prompts"] = _PoisonPrompts(ids)
        return p

    async def _poison_known(self, seq: int) -> dict[str, str]:
        """Prompt id -> reason of the prompts refused in this run (the Redis record, read again when this
        actor reaches a new epoch of the prompt order, plus its own refusals since). A prompt comes once
        an epoch: a refusal recorded during epoch e is known to every actor by its next turn in epoch
        e + 1 (but for a refusal still in flight then: asked again, it is not dead-lettered twice)."""
        p = self._poison()
        epoch = seq // self._epoch_len()
        loop = asyncio.get_running_loop()
        fut = p.loading
        failed = fut is not None and fut.done() and (fut.cancelled() or fut.exception() is not None)
        if fut is None or failed or epoch > p.epoch or p.loop is not loop:
            p.epoch, p.loop = max(p.epoch, epoch), loop
            limit = int(self.cfg.model.max_model_len)
            fut = p.loading = asyncio.ensure_future(asyncio.to_thread(self.buffer.poison_prompts, limit))
        if not fut.done():
            await asyncio.shield(fut)  # every worker waits for it: none asks the engine meanwhile
        if fut.exception() is not None:  # Redis gone past the retry budget: the loop fails, as a claim's
            raise fut.exception()
        # Merged here by the first worker to see it done, not in a done-callback: a callback runs a loop
        # turn after the future is done, and a worker seeing it done in between asked the engine for a
        # recorded prompt (a CI failure of test_other_actors_and_a_resumed_run_skip...).
        if p.merged is not fut:
            p.known.update(fut.result())
            p.merged = fut
        return p.known

    async def _claim_prompt(self) -> tuple[int, Prompt]:
        """The next position of the run's prompt order and its prompt, passing over the positions of
        prompts the engine refused earlier in the run (by any actor of any pool, before a resume too) for
        being too long, while they still are (:meth:`_still_too_long`): each such position is counted
        in ``prompts_skipped`` (the first per prompt logged) and costs one Redis INCR, not an engine
        request, a group slot or a dead letter. A whole epoch of the prompt order passed over in a row
        (every prompt refused): an :class:`ActorFatalError` (the run ends with the reason; it would
        otherwise claim positions for ever, generating nothing)."""
        p = self._poison()
        while True:
            seq = await asyncio.to_thread(self.buffer.claim_prompt_seq)
            prompt = self.source.at(seq)
            known = await self._poison_known(seq)
            reason = known.get(prompt.prompt_id)
            if reason is None or not self._still_too_long(prompt):
                p.skipped_in_row = 0
                return seq, prompt
            self.counters["prompts_skipped"] += 1
            p.skipped_in_row += 1
            if prompt.prompt_id not in p.logged:
                p.logged.add(prompt.prompt_id)
                log.warning("%s: prompt position %d skipped, as are the prompt's later turns in this run "
                            "(logged once); refused earlier: %s", self.actor_id, seq, reason)  # fmt: skip
            if p.skipped_in_row >= self._epoch_len():
                limit = self.cfg.model.max_model_len
                raise ActorFatalError(
                    f"{self.actor_id}: every prompt of task {self.task.name!r} ({self._epoch_len()}) was refused "
                    f"by the engine (model.max_model_len={limit}): nothing to generate; e.g. {reason}"
                )

    def _epoch_len(self) -> int:
        """Positions in one epoch of the prompt order: the source's length, else the task's prompt list's,
        else ``_UNKNOWN_EPOCH`` (a source of unknown size: the record is re-read, and an all-refused
        data set ends the actor, after that many positions)."""
        n = len(self.source) if hasattr(self.source, "__len__") else len(self._poison().ids)
        return n if n > 0 else _UNKNOWN_EPOCH

    def _still_too_long(self, prompt: Prompt) -> bool:
        """Whether ``prompt``, as this actor renders it now, is at least ``model.max_model_len`` tokens:
        a record is followed only then. A record made before a resume that changed the data (prompt ids
        are row positions), ``task.system_prompt`` or ``model.chat_template`` may name a prompt that fits
        now; one the chat template refuses goes on to the render failure's own path."""
        try:
            return len(self._encode_prompt(prompt)) >= int(self.cfg.model.max_model_len)
        except Exception:
            return False

    async def _refused(self, prompt: Prompt, group_id: str, reason: str) -> None:
        """The engine refused ``prompt`` (the request itself is bad): recorded for the run in Redis, so
        that no actor asks again (:meth:`_claim_prompt`), and dead-lettered with ``reason`` the first
        time (``groups_rejected``); refused again (another actor asked before it knew), its slot goes
        back without a second dead letter (``prompts_skipped``). The record and the slot's return are one
        write (:meth:`_write`): a stop with abort between them cannot keep the slot."""
        limit = int(self.cfg.model.max_model_len)
        if not self._still_too_long(prompt):
            # Refused for something else than its length (the sampling settings, the engine): not a
            # property of the prompt, so not recorded; dead-lettered as every such group.
            log.warning("%s: group %s dropped: %s", self.actor_id, group_id, reason)
            await self._write(self.buffer.abandon, group_id, self.actor_id, reason, count="groups_rejected")
            return

        async def record() -> None:
            first = await asyncio.to_thread(self.buffer.mark_poison_prompt, prompt.prompt_id, limit, reason)
            self._poison().known[prompt.prompt_id] = reason
            if first:
                log.warning("%s: group %s dropped: %s", self.actor_id, group_id, reason)
                await asyncio.to_thread(self.buffer.abandon, group_id, self.actor_id, reason)
                self.counters["groups_rejected"] += 1  # once written (the dead-letter stream's count)
            else:
                await asyncio.to_thread(self.buffer.credit, 1, self.actor_id, group_id)
                self.counters["prompts_skipped"] += 1

        await self._write(record)
