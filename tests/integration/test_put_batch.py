"""Batched puts against a real redis-server: ``ReplayBuffer.put_many`` and the actors' PutBatcher.

``put_many`` must be exactly ``put`` per group (dedup, owner tally, order, per-group errors) in one
round trip; the batcher must group the puts queued together and hand each caller its own result.
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from asyncrl.actors.put_batch import PutBatcher
from asyncrl.buffer import EmbeddedRedis, RecordError, ReplayBuffer
from tests.conftest import small_group


def _bad_group():
    g = small_group()
    g.completions[0].logprobs[:] = 1.0  # a positive logprob: encode refuses it
    return g


def _stream_ids(client: redis.Redis, buf: ReplayBuffer) -> list[str]:
    return [i.decode() for i, _ in client.xrange(buf.keys.rollouts)]


def test_put_many_is_put_per_group_in_one_round_trip(buffer: ReplayBuffer, redis_client) -> None:
    groups = [small_group() for _ in range(3)]
    assert all(buffer.try_admit(0, 8, owner="actor-0") for _ in groups)
    ids = buffer.put_many(groups, owner="actor-0")
    assert all(isinstance(i, str) for i in ids) and len(set(ids)) == 3
    assert _stream_ids(redis_client, buffer) == ids  # appended in the order given
    assert buffer.reclaim_inflight("actor-0") == 0  # each put took its slot off the owner's tally
    # A repeat (a retried batch) returns the first ids and appends nothing, as put does.
    assert buffer.put_many(groups, owner="actor-0") == ids
    assert buffer.put(groups[1]) == ids[1]
    assert len(_stream_ids(redis_client, buffer)) == 3
    # What the learner reads back is the groups themselves.
    got = buffer.read("learner", 3, block_ms=None)
    assert [e.group.group_id for e in got] == [g.group_id for g in groups]
    assert buffer.put_many([]) == []


def test_a_reader_blocked_on_the_stream_gets_the_whole_batch_in_one_read(
    buffer: ReplayBuffer, redis_client
) -> None:
    # The learner waits in a blocking XREADGROUP. put_many's calls run in one MULTI/EXEC, so Redis
    # serves the waiting reader once, after EXEC, with every group of the batch. In a plain pipeline
    # Redis reads a batch of real-size groups in 16 KB chunks and served the reader between two of
    # them: one group, and the learner read again for the rest.
    replies: list = []

    def blocked_read() -> None:  # the learner's XREADGROUP, one call (ReplayBuffer.read would top up)
        replies.extend(redis_client.xreadgroup(buffer.group_name, "learner", {buffer.keys.rollouts: ">"},
                                               count=4, block=10_000))  # fmt: skip

    buffer.stats()  # the stream and its consumer group exist
    reader = threading.Thread(target=blocked_read)
    reader.start()
    deadline = time.monotonic() + 10.0
    while int(redis_client.info("clients")["blocked_clients"]) < 1:
        assert time.monotonic() < deadline, "the reader never blocked"
        time.sleep(0.005)
    groups = [small_group(n_completions=8, n_tokens=2000) for _ in range(4)]  # ~190 KB each
    ids = buffer.put_many(groups, owner="actor-0")
    reader.join(10.0)
    assert not reader.is_alive() and len(replies) == 1
    assert [i.decode() for i, _ in replies[0][1]] == ids  # all four, in one reply


def test_put_many_gives_each_group_its_own_error(buffer: ReplayBuffer, redis_client) -> None:
    good1, bad, good2 = small_group(), _bad_group(), small_group()
    out = buffer.put_many([good1, bad, good2])
    assert isinstance(out[1], RecordError) and "positive value" in str(out[1])
    assert isinstance(out[0], str) and isinstance(out[2], str)
    assert _stream_ids(redis_client, buffer) == [out[0], out[2]]  # the bad one was never sent
    assert buffer.put_many([_bad_group()])[0].__class__ is RecordError


def test_put_many_after_the_script_cache_is_flushed(buffer: ReplayBuffer, redis_client) -> None:
    # A restarted server has no scripts: the pipelined EVALSHA answers NOSCRIPT (and did nothing),
    # so each group is put again through the script object, which loads it.
    redis_client.script_flush()
    groups = [small_group() for _ in range(2)]
    ids = buffer.put_many(groups)
    assert all(isinstance(i, str) for i in ids)
    assert _stream_ids(redis_client, buffer) == ids
    assert buffer.put_many(groups) == ids


def _buffer_on_a_killed_server(tmp_path, run_name: str) -> ReplayBuffer:
    """A buffer whose own redis-server was just SIGKILLed (no retries: the next call fails at once)."""
    srv = EmbeddedRedis(tmp_path / "redis").start()
    buf = ReplayBuffer(srv.client(retry=Retry(NoBackoff(), 0)), run_name, owns_client=True)
    buf.put(small_group())  # connected and working before the fault
    srv.kill()
    return buf


def test_put_many_that_cannot_reach_redis_marks_its_groups_uncertain(tmp_path, run_name: str) -> None:
    buf = _buffer_on_a_killed_server(tmp_path, run_name)
    try:
        with pytest.raises(redis.ConnectionError):
            buf.put_many([small_group(), _bad_group(), small_group()], owner="actor-0")
        # The two that were sent may still have run; the invalid one never left (put's contract).
        uncertain = buf._admission._uncertain
        assert [(kind, owner) for kind, _, owner in uncertain] == [("put", "actor-0")] * 2
    finally:
        buf.close()


def test_batcher_sends_the_puts_queued_together_in_one_batch(buffer: ReplayBuffer, redis_client) -> None:
    async def main() -> None:
        b = PutBatcher(buffer, "actor-0")
        first = await b.put(small_group())
        assert b.batches == 1
        groups = [small_group() for _ in range(4)] + [_bad_group()]
        res = await asyncio.gather(*(b.put(g) for g in groups), return_exceptions=True)
        assert b.batches == 2  # the five queued in one loop pass went together
        assert all(isinstance(r, str) for r in res[:4]) and isinstance(res[4], RecordError)
        assert _stream_ids(redis_client, buffer) == [first, *res[:4]]

    asyncio.run(main())


def test_batcher_lingers_for_groups_still_being_scored_and_no_longer(
    buffer: ReplayBuffer, redis_client
) -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        # Two groups finished together; the first is scored: its batch waits for the second.
        b = PutBatcher(buffer, "actor-0", linger_s=5.0)
        b.expect(), b.expect()
        first = asyncio.ensure_future(b.put(small_group(), True))
        await asyncio.sleep(0.1)
        assert not first.done() and b.batches == 0 and b.expected == 1
        second = await b.put(small_group(), True)
        assert b.batches == 1 and b.expected == 0  # one write for both
        assert _stream_ids(redis_client, buffer)[-2:] == [await first, second]
        # A group that will not be put after all (its reward failed): the batch leaves at once.
        b.expect(), b.expect()
        t0 = loop.time()
        third = asyncio.ensure_future(b.put(small_group(), True))
        await asyncio.sleep(0.05)
        b.unexpect()
        await asyncio.wait_for(third, 2.0)
        assert b.batches == 2 and loop.time() - t0 < 2.0 and b.expected == 0
        # A group scored for longer than linger_s (a slow reward): the others leave after linger_s.
        slow = PutBatcher(buffer, "actor-0", linger_s=0.2)
        slow.expect(), slow.expect()
        t0 = loop.time()
        await slow.put(small_group(), True)
        assert 0.2 <= loop.time() - t0 < 2.0 and slow.batches == 1
        # linger_s = 0: never waits.
        eager = PutBatcher(buffer, "actor-0")
        eager.expect(), eager.expect()
        t0 = loop.time()
        await eager.put(small_group(), True)
        assert loop.time() - t0 < 0.15 and eager.batches == 1

    asyncio.run(main())


def test_batcher_fails_every_put_of_a_batch_that_fails_as_a_whole(tmp_path, run_name: str) -> None:
    buf = _buffer_on_a_killed_server(tmp_path, run_name)

    async def main() -> None:
        b = PutBatcher(buf, "actor-0")
        res = await asyncio.gather(*(b.put(small_group()) for _ in range(3)), return_exceptions=True)
        assert b.batches == 1 and all(isinstance(r, redis.ConnectionError) for r in res)

    try:
        asyncio.run(main())
    finally:
        buf.close()


def test_batcher_leaves_no_awaiter_hanging_when_its_flusher_is_cancelled(buffer: ReplayBuffer) -> None:
    # Only the loop's teardown cancels the flusher; even before its first step, every queued put's
    # awaiter must end (cancelled), and a later put gets a new flusher.
    async def main() -> None:
        b = PutBatcher(buffer, "actor-0")
        tasks = [asyncio.ensure_future(b.put(small_group())) for _ in range(3)]
        await asyncio.sleep(0)  # the puts are queued and the flusher created, not yet started
        b._flusher.cancel()
        res = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 5.0)
        assert all(isinstance(r, asyncio.CancelledError) for r in res), res
        assert b.batches == 0
        assert isinstance(await b.put(small_group()), str) and b.batches == 1

    asyncio.run(main())


def test_an_actor_gets_a_new_batcher_for_a_new_buffer_client_or_event_loop(buffer: ReplayBuffer) -> None:
    from asyncrl.actors.group_worker import GroupProduction
    from asyncrl.config import Config

    class Worker(GroupProduction):
        actor_id = "actor-0"
        cfg = Config()

    w = Worker()
    w.buffer = buffer

    async def twice() -> tuple[PutBatcher, PutBatcher]:
        return w._put_batcher(), w._put_batcher()

    a1, a2 = asyncio.run(twice())
    b1, _ = asyncio.run(twice())  # a restart in a new loop: the old flusher may never run again
    assert a1 is a2 and b1 is not a1 and b1.loop is not a1.loop
    assert a1.linger_s == Config().actors.put_linger_ms / 1000.0 > 0

    async def new_client() -> tuple[PutBatcher, PutBatcher]:
        before = w._put_batcher()
        w.buffer = ReplayBuffer(buffer._client, buffer.run)  # a new client (a restart), same loop
        return before, w._put_batcher()

    before, after = asyncio.run(new_client())
    assert after is not before and after.buffer is w.buffer and after.loop is before.loop


def test_a_dead_letter_written_after_its_worker_was_cancelled_is_still_counted(buffer: ReplayBuffer) -> None:
    """A stop (abort) cancels a group worker while it awaits its (shielded) dead-letter write: the write
    still lands, and its counter must count it (the counters are checked against the dead-letter
    stream). Counted after the caller's await, it was lost: 12 dead letters against 11 counted, a CI
    failure of test_prompts_the_engine_refuses_are_dead_lettered_without_failing_the_loop."""
    import threading

    from asyncrl.actors.group_worker import GroupProduction
    from asyncrl.config import Config

    class Worker(GroupProduction):
        actor_id = "actor-0"
        cfg = Config()

    w = Worker()
    w.buffer = buffer
    w.counters = {"groups_rejected": 0}
    w._writes = set()
    release = threading.Event()

    def slow_abandon(group_id: str, owner: str, reason: str) -> bool:
        assert release.wait(10.0)
        return buffer.abandon(group_id, owner, reason)

    async def main() -> None:
        task = asyncio.create_task(
            w._write(slow_abandon, "g-1", "actor-0", "refused", count="groups_rejected")
        )
        await asyncio.sleep(0.05)  # the write runs in its thread, blocked
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert w.counters["groups_rejected"] == 0  # not landed yet
        release.set()
        await w._writes_done()  # what the actor's stop awaits

    asyncio.run(main())
    reasons = [d["reason"] for d in buffer.dead_letters(count=10)]
    assert reasons == ["refused"] and w.counters["groups_rejected"] == 1
