"""The rollout actor's group workers: admission -> prompt -> G completions -> rewards -> buffer.

A mixin of :class:`asyncrl.actors.actor.RolloutActor`. Each of ``actors.groups_in_flight`` workers loops:
take one admission slot (waiting, woken by admission hints, while the staleness bound is reached), take
the next prompt, sample its group on the engine, score it off the event loop, and write it.

Invariants: a group that was admitted but not written (aborted, failed, reward failure) returns its
slot (credit or abandon with a dead letter), so admission cannot leak; a buffer write, once started,
runs to its end under cancellation and is awaited before a reclaim or shutdown (:meth:`_write`).

A prompt the engine refuses (longer than ``model.max_model_len``, ...) is dead-lettered once per run and
recorded in Redis (``asyncrl:{R}:poison_prompts``): later epochs, the other actors and pools and a resumed
run pass over its positions without asking the engine (``prompts_skipped``); every prompt refused ends
the actor (:mod:`asyncrl.actors.refused_prompts`).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import Any

from asyncrl.log_throttle import throttle
from asyncrl.tasks import Prompt, prompt_token_ids
from asyncrl.tasks.render_check import render_failure

from .groups import build_group, swaps_seen, version_span
from .put_batch import PutBatcher
from .refused_prompts import RefusedPrompts
from .rewards import RewardFailure
from .seeding import request_seed
from .supervision import ActorFatalError

__all__ = ["GroupProduction"]

# Repeats rate-limited: one warning per dropped group is a flood when every group fails (log_throttle).
log = throttle(logging.getLogger(__name__))


def _reward_name(task: Any) -> str:
    """The user's reward function as ``name (file:line)`` (a data task's ``reward_fn``, else its
    ``reward`` method): what the breaker's message names."""
    fn = getattr(task, "reward_fn", None) or getattr(task, "reward", None)
    name = getattr(fn, "__qualname__", None) or type(fn).__name__
    code = getattr(fn, "__code__", None)
    return f"{name} at {code.co_filename}:{code.co_firstlineno}" if code is not None else name


class GroupProduction(RefusedPrompts):
    """Group workers of one rollout actor (mixin of RolloutActor; see the module doc)."""

    cfg: Any
    engine: Any
    buffer: Any
    counters: dict[str, Any]
    timeline: Any
    _swap_hint: asyncio.Event | None
    # The reward circuit breaker's state (_reward_failed): for the process's life, across loop restarts.
    _reward_failures_in_a_row: int = 0
    _reward_groups_scored: int = 0  # groups whose rewards succeeded (any: the count of failures restarts)
    _reward_failing_since: float = 0.0  # time.monotonic() of the streak's first failure

    async def _admit(self, info: dict[str, Any] | None = None) -> bool:
        """Take one admission slot, waiting while the staleness bound is reached; False on stop.

        The wait is added to ``admission_wait_s`` as it happens (not only when it ends), so a
        long stall is visible while it lasts; ``admission_blocked`` counts the waiting workers.
        ``info`` (the timeline's record) gets ``blocked``: whether the slot was refused at least once.
        """
        last = time.monotonic()
        blocked = False
        try:
            while True:
                if self._stop_requested:
                    return False
                if self._max_groups is not None and self._started >= self._max_groups:
                    return False
                # Pass the version we sample with: weights already too stale are refused until the
                # version watcher has swapped (exactly synchronous training at max_staleness = 0).
                engine = self.engine
                version = engine.version if engine is not None else None
                if not self.cfg.actors.refuse_stale_weights:
                    version = None
                # Taken before the attempt: a hint that arrives while it runs is not lost (admission_wake),
                # nor is a swap that begins meanwhile.
                hint = self._waker.event if self._waker is not None else None
                begun = engine.swap_begun if engine is not None and version is not None else None
                if await self._try_admit(version):
                    return self._admitted(info, blocked)
                if not blocked:
                    blocked = True
                    self.counters["admission_blocked"] += 1
                    swap_hint = self._swap_hint
                    if swap_hint is not None:  # actors.swap_min_lag > 1: a waiting worker makes a swap due
                        swap_hint.set()
                # Refused while a swap prepares newer weights: ask for a slot sampled by those. At
                # max_staleness 0 this takes the round trip during the prepare, not after the swap; the
                # group is submitted only once the engine serves them (every token still theirs). It was
                # refused first, so it counts as blocked (the timeline's calibration relies on that: its
                # wait for the swap is not an admission round trip, asyncrl.plan.handoff.group_starts).
                ahead = engine.swapping_to if engine is not None and version is not None else None
                if ahead is not None and ahead > version:
                    if await self._try_admit(ahead):
                        if await self._await_swap(ahead):
                            return self._admitted(info, blocked)
                        continue  # the swap did not serve it: the slot went back; ask again
                await self._sleep(self.cfg.actors.admission_poll_s, hint, begun)
                now = time.monotonic()
                self.counters["admission_wait_s"] += now - last
                last = now
        finally:
            if blocked:
                self.counters["admission_blocked"] -= 1

    async def _try_admit(self, version: int | None) -> bool:
        """One admission attempt (a Redis script, in a thread). Cancelled meanwhile (a stop with abort):
        the attempt runs to its end and a slot it took goes back as a credit, tracked like a write so
        that shutdown and a restart's reclaim wait for it (admission cannot leak)."""
        attempt = asyncio.ensure_future(
            asyncio.to_thread(self.buffer.try_admit, None, None, version, self.actor_id)
        )
        try:
            return await asyncio.shield(attempt)
        except asyncio.CancelledError:

            async def give_back() -> None:
                if await attempt:
                    await asyncio.to_thread(self.buffer.credit, 1, self.actor_id)

            fut = asyncio.ensure_future(give_back())
            self._writes.add(fut)
            fut.add_done_callback(self._writes.discard)
            raise

    def _admitted(self, info: dict[str, Any] | None, blocked: bool) -> bool:
        self._started += 1
        if info is not None:
            info["blocked"] = blocked
        return True

    async def _await_swap(self, version: int) -> bool:
        """Admitted for ``version`` while a swap prepared it: wait until the swap settles. True if the
        engine then serves ``version`` or newer; else (the swap was refused or failed) the slot goes back
        as a credit, ``preadmissions_returned`` counts it, and False. Cancelled (a stop with abort)
        while waiting: the slot goes back too (admission cannot leak)."""
        assert self.engine is not None
        try:
            await self.engine.swap_settled.wait()
        except BaseException:
            self._give_back()
            raise
        if self.engine.version is not None and self.engine.version >= version:
            self.counters["preadmissions"] += 1
            return True
        await self._write(self.buffer.credit, 1, self.actor_id, count="preadmissions_returned")
        return False

    def _start_write(self, fn: Any, *args: Any, count: str | None = None) -> asyncio.Future:
        """Start a buffer write (a blocking call, run in a thread, or the put batcher's coroutine, run
        as a task) that nothing cancels: it runs to its end (retries included), and is awaited by
        :meth:`_writes_done` before a reclaim or shutdown. ``count`` names the counter the write
        increments when it succeeds: counted here, on the write's own completion, not after the
        caller's await, because a stop (abort) cancels that await while the shielded write still lands
        (a dead letter without its count: the counters must keep matching the buffer's streams)."""
        # A coroutine function (the put batcher) runs as a task; a plain one (a Redis call) in a thread.
        coro = fn(*args) if asyncio.iscoroutinefunction(fn) else asyncio.to_thread(fn, *args)
        fut = asyncio.ensure_future(coro)
        self._writes.add(fut)

        def done(f: asyncio.Future) -> None:
            self._writes.discard(f)
            if count is not None and not f.cancelled() and f.exception() is None:
                self.counters[count] += 1

        fut.add_done_callback(done)
        return fut

    async def _write(self, fn: Any, *args: Any, count: str | None = None) -> Any:
        """:meth:`_start_write`, awaited; shielded from the worker's cancellation."""
        return await asyncio.shield(self._start_write(fn, *args, count=count))

    def _give_back(self, group_id: str | None = None) -> None:
        """Credit an admission slot from a cancellation or failure path without blocking the event loop:
        a write started (:meth:`_start_write`) and not awaited; the caller re-raises at once. Called
        inline, a Redis outage held the loop (every worker, the version watcher, the heartbeat) for the
        whole retry budget, and a credit that then failed replaced the CancelledError being raised."""
        args = (1, self.actor_id) if group_id is None else (1, self.actor_id, group_id)

        def failed(f: asyncio.Future) -> None:
            if not f.cancelled() and f.exception() is not None:
                # Nobody awaits it to raise; the slot stays in this actor's in-flight tally, which the
                # next incarnation's start-up reclaim (or the supervisor's) turns into a credit.
                log.warning("%s: admission credit not returned (%s); reclaimed at the actor's next start",
                            self.actor_id, f.exception())  # fmt: skip

        self._start_write(self.buffer.credit, *args).add_done_callback(failed)

    def _put_batcher(self) -> PutBatcher:
        """This actor's put batcher (groups finishing together share one round trip; put_batch.py)."""
        b = self.__dict__.get("_puts")
        loop = asyncio.get_running_loop()
        # A new buffer client or a new event loop (a restart): a new batcher; the old one's flusher
        # belonged to the old loop and may never run again.
        if b is None or b.buffer is not self.buffer or b.loop is not loop:
            linger_s = self.cfg.actors.put_linger_ms / 1000.0
            b = self.__dict__["_puts"] = PutBatcher(self.buffer, self.actor_id, linger_s)
        return b

    async def _writes_done(self) -> None:
        if self._writes:
            await asyncio.gather(*list(self._writes), return_exceptions=True)

    def _reward_failed(self, reason: str) -> None:
        """The reward circuit breaker (``task.reward_failure_limit``): after that many groups in a row
        whose rewards failed (a group whose rewards succeed restarts the count), raise
        :class:`ActorFatalError` naming the reward and ``reason`` (the last failure).

        Why: a reward returning a verl-style dict dead-lettered every group for ever (32,078 in 257 s, 0
        learner steps), the run never ending. So did one that worked and then broke for good (its
        external verifier went away, a code path that always raises after some data): the breaker once
        spared a reward that had succeeded at all, and such a run generated and dead-lettered every
        group for as long as it was let run. A reward that fails sometimes (a flaky verifier, odd
        completions) is not a broken one: a success between its failures restarts the count, so only
        its failing groups are dropped. One that has worked must also have failed for
        ``task.reward_failure_window_s``: at ~100 groups/s, 64 groups are under a second of a verifier's
        restart, and a group fails when any of its completions' rewards does."""
        now = time.monotonic()
        if self._reward_failures_in_a_row == 0:
            self._reward_failing_since = now
        self._reward_failures_in_a_row += 1
        limit, window = self.cfg.task.reward_failure_limit, self.cfg.task.reward_failure_window_s
        scored, span = self._reward_groups_scored, now - self._reward_failing_since
        if not limit or self._reward_failures_in_a_row < limit or (scored and span < window):
            return
        n = self._reward_failures_in_a_row
        since = (f"over {span:.0f} s since its last success ({scored} group{'s' * (scored != 1)} scored before)"
                 if scored else "and never once succeeded")  # fmt: skip
        raise ActorFatalError(
            f"{self.actor_id}: the reward of task {self.task.name!r} ({_reward_name(self.task)}) failed for "
            f"{n} groups in a row {since} (task.reward_failure_limit={limit}"
            + (f", task.reward_failure_window_s={window:g}" if scored else "")
            + f"); last failure: {reason}"
        )

    def _encode_prompt(self, prompt: Prompt) -> list[int]:
        ids = self._prompt_ids.get(prompt.prompt_id)
        if ids is None:
            # The chat template (when the model has one) is applied here, once: these ids are what the
            # engine samples from and what the record carries to the learner.
            ids = self._prompt_ids[prompt.prompt_id] = prompt_token_ids(
                self._tokenizer, prompt.text, self.cfg.model.chat_template, self.cfg.task.system_prompt
            )
        return ids

    async def _group_worker(self) -> None:
        # Here, not at the top: importing the actor modules must not load vLLM (asyncrl.actors.engine).
        from vllm.exceptions import VLLMClientError

        a = self.cfg.actors
        assert self.engine is not None
        assert self.source is not None
        while True:
            rec: dict[str, Any] = {"t_try": time.time()}  # the group's timeline (asyncrl.actors.timeline)
            if not await self._admit(rec):
                break
            rec["t_admit"] = time.time()
            group_id = f"{self.actor_id}-{uuid.uuid4().hex[:12]}"
            try:
                # The prompt's position in the run's one order, claimed in Redis (every actor of every
                # pool draws from it: no two groups share a prompt position or a sampling seed, whatever
                # the number of actors and pools, across restarts and a changed actors.num_actors). It
                # names the group independently of timing: it seeds its sampling and orders it in the
                # learner's batch (asyncrl.actors.seeding). Positions of prompts the engine refused
                # earlier in the run are passed over (_claim_prompt).
                seq, prompt = await self._claim_prompt()
            except BaseException:
                # Cancelled (stop with abort), Redis gone, or every prompt refused (ActorFatalError):
                # the slot goes back.
                self._give_back(group_id)
                self.counters["groups_aborted"] += 1
                raise
            seed = request_seed(self.cfg.run.seed, 0, seq) if a.seeded_sampling else None
            try:
                prompt_ids = self._encode_prompt(prompt)
            except Exception as e:
                # The chat template refuses this prompt (one a start-up check of the first prompt could
                # not see: asyncrl.tasks.render_check): poison for this prompt, as an engine-refused one
                # below. Raised, it failed the loop, and every restart and replacement failed alike.
                reason = render_failure(self.cfg, prompt.prompt_id, e)
                log.warning("%s: group %s dropped: %s", self.actor_id, group_id, reason)
                await self._write(
                    self.buffer.abandon, group_id, self.actor_id, reason, count="groups_rejected"
                )
                continue
            v_start = self.engine.version
            rec["t_gen0"] = time.time()
            try:
                seqs = await self.engine.generate_group(
                    prompt_ids, a.group_size, a.temperature, a.top_p, a.max_tokens, group_id, seed=seed
                )
            except VLLMClientError as e:
                # The request itself is bad (vLLM's client-error class: a prompt longer than
                # model.max_model_len, ...): poison for this prompt, not a failure of the actor. Before,
                # it failed the generation loop, whose restarts cancelled every group in flight and
                # would end the actor after actors.loop_restarts (a task with a few long prompts).
                reason = f"prompt {prompt.prompt_id!r} ({len(prompt_ids)} tokens) refused by the engine: {e}"
                await self._refused(prompt, group_id, reason)
                continue
            except BaseException:
                # Cancelled (stop with abort) or failed: nothing is written, the slot goes back.
                self._give_back(group_id)
                self.counters["groups_aborted"] += 1
                raise
            rec["t_gen1"] = time.time()
            self.counters["generated_tokens"] += sum(len(s.token_ids) for s in seqs)
            if any(s.finish_reason == "abort" for s in seqs):
                await self._write(self.buffer.credit, 1, self.actor_id, group_id)
                self.counters["groups_aborted"] += 1
                continue
            assert v_start is not None and self.engine.version is not None
            first, last = version_span(seqs, int(v_start), int(self.engine.version))
            meta = {
                "temperature": float(a.temperature),  # the learner divides logits by it
                "top_p": float(a.top_p),
                "max_tokens": int(a.max_tokens),
                "task": self.task.name,
                "actor_index": self.index,
                "version_start": first,
                "version_end": last,
                "swaps": swaps_seen(seqs),
                "swap_mode": self.swap_mode,
                "prompt_seq": seq,
            }
            # Announced to the put batcher while it is scored: a batch about to leave waits for it, so
            # the groups that finished generating together are written (and wake the learner) together.
            puts = self._put_batcher()
            puts.expect()
            try:  # off the event loop, within task.reward_timeout_s (asyncrl.actors.rewards)
                rewards = await self.rewards.score(prompt, [s.text for s in seqs])
                group = build_group(group_id, rewards, prompt, prompt_ids, seqs, self.actor_id, meta)
            except asyncio.CancelledError:
                puts.unexpect()
                # A stop with abort while it was scored: not written, the slot goes back (as above).
                self._give_back(group_id)
                self.counters["groups_aborted"] += 1
                raise
            except RewardFailure as e:
                puts.unexpect()
                log.warning("%s: group %s dropped: %s", self.actor_id, group_id, e)
                # Counted once its dead letter is written (count=): a write that fails past the Redis
                # retry budget fails the loop (the restart reclaims the group's credit), and the
                # counter must keep matching the dead-letter stream.
                await self._write(
                    self.buffer.abandon, group_id, self.actor_id, str(e), count="groups_reward_failed"
                )
                self._reward_failed(str(e))
                continue
            except BaseException:
                puts.unexpect()
                raise
            self._reward_failures_in_a_row = 0
            self._reward_groups_scored += 1
            await self._write(puts.put, group, True, count="groups_written")
            self.timeline.record("group", **rec, t_written=time.time(), tokens=sum(len(s.token_ids) for s in seqs),
                                 v_start=first, v_end=last)  # fmt: skip
