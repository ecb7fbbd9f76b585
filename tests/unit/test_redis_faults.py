"""The buffer rides out real Redis faults: a frozen server (SIGSTOP) longer than redis-py's default
retry budget, a kill -9 and restart on the same data dir, and lost replies of writes, without losing,
duplicating or double-counting anything. Real redis-server processes; no mocks.

The CI versions are short (a ~8 s freeze with a test budget of 30 s); that the default budget covers
>= 60 s is checked on the configuration the roles actually build.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from pathlib import Path

import pytest
import redis
from redis.backoff import ExponentialWithJitterBackoff

from asyncrl.buffer import EmbeddedRedis, ReplayBuffer
from asyncrl.buffer.connection import DeadlineRetry, redis_options, url_with_auth
from asyncrl.config import load_config
from tests.conftest import small_group

FREEZE_S = 8.0  # > redis-py's default budget (3 retries, <= 1 s backoff each; ~2 s with a 1 s timeout)


def _connect(server: EmbeddedRedis, run: str, budget_s: float = 30.0, **kw) -> ReplayBuffer:
    return ReplayBuffer.connect(
        server.url, run, max_staleness=1, groups_per_step=2, socket_timeout=1.0, retry_budget_s=budget_s, **kw
    )


def _in_thread(fn, *args):
    box: dict = {}

    def run() -> None:
        try:
            box["result"] = fn(*args)
        except BaseException as e:  # re-raised by the test
            box["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, box


def _balance(buf: ReplayBuffer) -> tuple[int, int, int, int]:
    """(admitted, written, credited, in flight); admission balances when admitted == the other three."""
    s = buf.stats()
    inflight = sum(int(v) for v in buf.client.hvals(buf.keys.inflight))
    written = s["depth"] + s["dead"]
    return s["admitted"], written, s["credits"], inflight


def test_default_policy_rides_out_a_minute() -> None:
    cfg = load_config()
    assert cfg.redis.retry_budget_s >= 60 and cfg.redis.socket_timeout_s > 0
    _url, opts = redis_options(
        "redis://127.0.0.1:1/0", None, None, False, None, None, None, None, {},
        retry_budget_s=cfg.redis.retry_budget_s,
    )  # fmt: skip
    retry = opts["retry"]
    assert isinstance(retry, DeadlineRetry) and retry.budget_s >= 60
    inner = retry._backoff.inner  # redis-py's backoff, clipped at the budget's deadline
    assert isinstance(inner, ExponentialWithJitterBackoff) and inner._cap <= 5
    assert opts["socket_timeout"] > 0 and opts["socket_connect_timeout"] > 0
    assert opts["health_check_interval"] > 0
    assert redis.ConnectionError in retry._supported_errors and redis.TimeoutError in retry._supported_errors


def test_unreachable_for_a_short_budget_raises_then_recovers(tmp_path: Path) -> None:
    """The budget is a time budget: a client with a 2 s budget gives up after ~2 s (not ~10 tries)."""
    server = EmbeddedRedis(tmp_path / "r").start()
    port = server.port
    try:
        buf = _connect(server, "short", budget_s=2.0)
        server.kill()
        t0 = time.monotonic()
        with pytest.raises(redis.ConnectionError):
            buf.version()
        # One budget, although redis-py nests two retry loops, and no backoff sleeps past it (the cap is
        # 2 s: before, the last sleep could end ~2 s after the deadline).
        assert 1.9 <= time.monotonic() - t0 < 3.0
        server = EmbeddedRedis(tmp_path / "r", port=port).start()
        assert buf.version() == 0  # the same client reconnects
        buf.close()
    finally:
        server.stop()


def test_sigstop_longer_than_default_budget(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Every buffer operation issued while Redis is frozen completes after SIGCONT, exactly once.

    A frozen server still accepts TCP connections and later executes what was sent on connections
    the client already gave up on: without request ids the admission script and the XADD would run
    twice (the control counter below shows the hazard is real)."""
    server = EmbeddedRedis(tmp_path / "r").start()
    try:
        buf = _connect(server, "frozen")
        control = redis.Redis.from_url(
            server.url, socket_timeout=1.0, retry=DeadlineRetry(30.0), retry_on_error=[redis.TimeoutError]
        )
        control.ping()  # connected before the freeze, like the buffer's pooled connections
        assert buf.try_admit(owner="actor-0") and buf.try_admit(owner="actor-0")
        first = buf.put(small_group(version=0), "actor-0")
        g = small_group(version=0)
        caplog.set_level(logging.WARNING, logger="asyncrl.buffer.connection")
        os.kill(server.pid, signal.SIGSTOP)
        try:
            calls = {
                "admit": _in_thread(buf.try_admit, None, None, None, "actor-0"),
                "put": _in_thread(buf.put, g, "actor-0"),
                "read": _in_thread(buf.read, "learner-0", 2, 500),
                "credit": _in_thread(buf.credit, 1, "actor-0"),
                "control": _in_thread(control.incr, "control"),
            }
            time.sleep(FREEZE_S)
            assert all(t.is_alive() for t, _ in calls.values()), "a call returned while Redis was frozen"
        finally:
            os.kill(server.pid, signal.SIGCONT)
        for name, (t, box) in calls.items():
            t.join(60)
            assert not t.is_alive() and "error" not in box, (name, box.get("error"))
        assert calls["admit"][1]["result"] is True
        second = calls["put"][1]["result"]
        got = buf_entry_ids(calls["read"][1]["result"]) + buf_entry_ids(buf.read("learner-0", 10, block_ms=0))
        assert sorted(got) == sorted(
            [first, second]
        )  # both groups, once each (the put may run after the read)
        assert buf.read("learner-0", 10, block_ms=0) == []  # nothing delivered twice
        s = buf.stats()
        assert (s["depth"], s["pending"], s["admitted"]) == (2, 2, 3)
        # The three calls reach the thawed server in any order: the credit returns actor-0's one slot in
        # flight when the put ran first and the admit after it (credits 0, the new admission in flight),
        # else the slot (credits 1). Either way each ran once and admission balances.
        admitted, written, credited, inflight = _balance(buf)
        assert (admitted, written) == (3, 2) and (credited, inflight) in ((1, 0), (0, 1))
        assert int(control.get("control")) >= 2, "the freeze did not re-run a plain INCR: test is vacuous"
        ours = [
            r.getMessage() for r in caplog.records if f"Redis at 127.0.0.1:{server.port}" in r.getMessage()
        ]
        gone = [m for m in ours if "unreachable" in m]
        back = [m for m in ours if "is back" in m]
        assert len(gone) == 1 and len(back) == 1, ours
        control.close()
        buf.close()
    finally:
        server.stop()


def test_kill9_and_restart_on_same_data_dir_mid_call(tmp_path: Path) -> None:
    """Calls made while Redis is down complete once it is back on its data dir; the buffer and the
    admission arithmetic survive (AOF, appendfsync always)."""
    data = tmp_path / "r"
    server = EmbeddedRedis(data, appendfsync="always").start()
    port = server.port
    try:
        buf = _connect(server, "restart")
        for _ in range(3):
            assert buf.try_admit(owner="actor-0")
        ids = [buf.put(small_group(), "actor-0") for _ in range(2)]
        delivered = buf.read("learner-0", 1, block_ms=0)
        server.kill()
        g = small_group()
        put = _in_thread(buf.put, g, "actor-0")
        read = _in_thread(buf.read, "learner-0", 5, 2000)
        time.sleep(2.0)
        assert put[0].is_alive() and read[0].is_alive()
        server = EmbeddedRedis(data, port=port, appendfsync="always").start()
        for t, box in (put, read):
            t.join(60)
            assert not t.is_alive() and "error" not in box, box.get("error")
        third = put[1]["result"]
        got = [e.entry_id for e in read[1]["result"]]
        # The live instance never re-delivers the entry it already returned; the rest arrive once.
        assert delivered[0].entry_id == ids[0]
        assert sorted(got + buf_entry_ids(buf.read("learner-0", 5, block_ms=0))) == sorted([ids[1], third])
        assert _balance(buf) == (3, 3, 0, 0)
        buf.close()
    finally:
        server.stop()


def buf_entry_ids(entries) -> list[str]:
    return [e.entry_id for e in entries]


# --------------------------------------------------------------------------- idempotent writes


def test_repeated_writes_count_once(buffer: ReplayBuffer) -> None:
    """What a retry after a lost reply does, done explicitly: the same put / credit / drop twice."""
    assert buffer.try_admit(1, 4, owner="a") and buffer.try_admit(1, 4, owner="a")
    g = small_group()
    first = buffer.put(g, "a")
    assert buffer.put(g, "a") == first  # same group id: same entry, nothing appended
    assert buffer.stats()["depth"] == 1
    assert buffer.credit(1, "a", request_id="gx") == 1
    assert buffer.credit(1, "a", request_id="gx") == 1  # same request: counted once
    assert int(buffer.client.hget(buffer.keys.inflight, "a")) == 0
    (e,) = buffer.read("c", 1, block_ms=0)
    assert buffer.drop([e.entry_id]) == 1
    assert buffer.drop([e.entry_id]) == 0  # nothing acknowledged, nothing credited
    assert buffer.stats()["credits"] == 2


def test_dead_letter_is_idempotent(buffer: ReplayBuffer) -> None:
    buffer.put(small_group())
    (e,) = buffer.read("c", 1, block_ms=0)
    assert buffer.dead_letter([(e.entry_id, "test: poison", b"x")]) == 1
    assert buffer.dead_letter([(e.entry_id, "test: poison", b"x")]) == 0
    s = buffer.stats()
    assert (s["dead"], s["credits"], s["depth"], s["pending"]) == (1, 1, 0, 0)
    assert buffer.dead_letters()[0]["reason"] == "test: poison"


def test_lost_read_reply_is_redelivered_once(buffer: ReplayBuffer, redis_client: redis.Redis) -> None:
    """Entries delivered to our consumer whose XREADGROUP reply never arrived (simulated by another
    connection reading them as the same consumer) are returned by the next read, once; entries
    already returned are not."""
    ids = [buffer.put(small_group()) for _ in range(4)]
    assert [e.entry_id for e in buffer.read("c", 1, block_ms=0)] == ids[:1]
    lost = redis_client.xreadgroup(buffer.group_name, "c", {buffer.keys.rollouts: ">"}, count=2)
    assert [x[0].decode() for x in lost[0][1]] == ids[1:3]
    assert [e.entry_id for e in buffer.read("c", 10, block_ms=0)] == ids[1:]
    assert buffer.read("c", 10, block_ms=0) == []


def test_lost_read_reply_below_a_later_cursor_is_claimed_back_after_an_outage(
    redis_url: str, run_name: str, redis_client: redis.Redis
) -> None:
    """The case the cursor alone misses (seen in the chaos run with a frozen Redis): an XREADGROUP ">"
    served but its reply lost, retried by the client, the retry delivering NEWER entries, so the
    cursor moves past the lost ones. After an outage the client's retry monitor counted, the next
    read claims back exactly the lost entries (not the ones returned and still in flight)."""
    from asyncrl.buffer.cluster import connection_kwargs

    buffer = ReplayBuffer.connect(redis_url, run_name)  # asyncrl's client: retry with an outage monitor
    ids = [buffer.put(small_group()) for _ in range(5)]
    assert [e.entry_id for e in buffer.read("c", 1, block_ms=0)] == ids[:1]  # in flight at the caller
    stream = {buffer.keys.rollouts: ">"}
    lost = redis_client.xreadgroup(buffer.group_name, "c", stream, count=2)  # served, reply lost
    assert [x[0].decode() for x in lost[0][1]] == ids[1:3]
    # The retried ">" read of that call, as the buffer would have returned it: cursor and in-flight set.
    retried = redis_client.xreadgroup(buffer.group_name, "c", stream, count=1)
    assert [x[0].decode() for x in retried[0][1]] == ids[3:4]
    buffer._cursor["c"] = ids[3]
    buffer._returned().add(ids[3])
    # Without a failure seen by the client nothing is claimed: only the new entry comes.
    assert [e.entry_id for e in buffer.read("c", 10, block_ms=0)] == ids[4:5]
    monitor = connection_kwargs(buffer.client)["retry"].monitor
    monitor.outages += 1  # what the retry monitor records when a command fails and is retried
    assert [e.entry_id for e in buffer.read("c", 10, block_ms=0)] == ids[1:3]  # exactly the lost two
    assert buffer.read("c", 10, block_ms=0) == []
    pending = {_id.decode() for _id in (r["message_id"] for r in redis_client.xpending_range(
        buffer.keys.rollouts, buffer.group_name, "-", "+", 10))}  # fmt: skip
    assert pending == {ids[0], *ids[1:5]}
    buffer.ack(ids)
    assert buffer.read("c", 10, block_ms=0) == [] and buffer.stats()["pending"] == 0
    buffer.delete_run()
    buffer.close()


def _lose_replies_below_the_cursor(buffer: ReplayBuffer, client: redis.Redis, lost: int) -> list[str]:
    """Put ``lost`` + 2 entries: the first read and in flight at the caller, the next ``lost`` delivered to
    consumer "c" with the reply lost, the last delivered by the retried read (the cursor, returned)."""
    ids = [buffer.put(small_group()) for _ in range(lost + 2)]
    assert buf_entry_ids(buffer.read("c", 1, block_ms=0)) == ids[:1]
    stream = {buffer.keys.rollouts: ">"}
    client.xreadgroup(buffer.group_name, "c", stream, count=lost)  # served, reply lost
    client.xreadgroup(buffer.group_name, "c", stream, count=1)  # the retry
    buffer._cursor["c"] = ids[-1]
    buffer._returned().add(ids[-1])
    return ids


def test_a_lost_reply_whose_entry_was_deleted_is_dead_lettered_and_credited(
    redis_url: str, run_name: str, redis_client: redis.Redis
) -> None:
    """An entry lost below a later cursor and then deleted from the stream (a maxlen trim) before the
    claim-back: XCLAIM would drop it from the pending list and return nothing, so it was never
    acknowledged, dead-lettered or credited (its admission slot lost for the run). It is dead-lettered
    with a reason and credited once; the other lost entry comes back as before."""
    from asyncrl.buffer.cluster import connection_kwargs

    buffer = ReplayBuffer.connect(redis_url, run_name)
    ids = _lose_replies_below_the_cursor(buffer, redis_client, 2)
    redis_client.xdel(buffer.keys.rollouts, ids[1])  # trimmed while pending
    connection_kwargs(buffer.client)["retry"].monitor.outages += 1
    credits = buffer.stats()["credits"]
    assert buf_entry_ids(buffer.read("c", 10, block_ms=0)) == ids[2:3]
    s = buffer.stats()
    assert s["credits"] == credits + 1 and s["dead"] == 1, s
    (dead,) = buffer.dead_letters()
    assert dead["original_id"] == ids[1] and "deleted from the stream" in dead["reason"]
    assert ids[1] not in _delivered(redis_client, buffer)
    buffer.ack([ids[0], ids[2], ids[3]])
    assert buffer.read("c", 10, block_ms=0) == [] and buffer.stats()["pending"] == 0
    buffer.delete_run()
    buffer.close()


def test_a_lost_reply_trimmed_just_before_its_claim_is_credited_once(
    redis_url: str, run_name: str, redis_client: redis.Redis
) -> None:
    """The race the deleted-entry test above misses: the lost entry is trimmed AFTER the claim-back has
    checked the stream but before its XCLAIM. XCLAIM then dropped it from the pending list and returned
    nothing, so it was neither claimed nor dead-lettered: never acknowledged by anyone, its admission
    slot never credited. Made deterministic by deleting it (another real connection) right before the
    claim command reaches Redis, whatever sends it. It must be dead-lettered and credited exactly once;
    and a lost entry acknowledged meanwhile by another path (its drop credited it) is not credited again."""
    from asyncrl.buffer.cluster import connection_kwargs

    buffer = ReplayBuffer.connect(redis_url, run_name)
    ids = _lose_replies_below_the_cursor(buffer, redis_client, 3)
    other = ReplayBuffer.connect(redis_url, run_name)  # another path settling entries (same run, same group)
    send = buffer.client.execute_command
    hooked: list[str] = []

    def trim_before_the_claim(*args, **kw):
        if not hooked and str(args[0]).upper() in ("XCLAIM", "EVALSHA", "EVAL"):
            hooked.append(str(args[0]))
            redis_client.xdel(buffer.keys.rollouts, ids[1])  # trimmed while pending, after any check
            assert other.drop([ids[3]]) == 1  # settled (and credited) by the other path
        return send(*args, **kw)

    buffer.client.execute_command = trim_before_the_claim
    connection_kwargs(buffer.client)["retry"].monitor.outages += 1
    credits = buffer.stats()["credits"]
    try:
        got = buf_entry_ids(buffer.read("c", 10, block_ms=0))
    finally:
        del buffer.client.execute_command
    assert hooked and got == ids[2:3]
    s = buffer.stats()
    # ids[3]'s drop: 1; ids[1]'s dead letter: 1 (before: 0, the slot lost). Not 3: nothing twice.
    assert s["credits"] == credits + 2 and s["dead"] == 1, s
    (dead,) = buffer.dead_letters()
    assert dead["original_id"] == ids[1] and "deleted from the stream" in dead["reason"]
    assert set(_delivered(redis_client, buffer)) == {ids[0], ids[2], ids[4]}
    buffer.ack([ids[0], ids[2], ids[4]])
    connection_kwargs(buffer.client)["retry"].monitor.outages += 1  # another claim-back finds nothing
    assert buffer.read("c", 10, block_ms=0) == [] and buffer.stats()["pending"] == 0
    assert buffer.stats()["credits"] == credits + 2
    other.close()
    buffer.delete_run()
    buffer.close()


def test_a_lost_reply_taken_over_by_another_consumer_is_left_to_it(
    redis_url: str, run_name: str, redis_client: redis.Redis
) -> None:
    """A lost entry that another consumer took over (XCLAIM, e.g. a reaper moving a dead consumer's
    entries) between the claim-back's XPENDING read and its claim: XCLAIM takes an entry from whichever
    consumer holds it, so the claim-back stole it (returned to "c", now pending to "c", while "d" works
    on it too). It is left pending to "d"; the other lost entry comes back as before."""
    from asyncrl.buffer.cluster import connection_kwargs

    buffer = ReplayBuffer.connect(redis_url, run_name)
    ids = _lose_replies_below_the_cursor(buffer, redis_client, 2)
    send = buffer.client.execute_command
    hooked: list[str] = []

    def take_over_before_the_claim(*args, **kw):
        if not hooked and str(args[0]).upper() in ("XCLAIM", "EVALSHA", "EVAL"):
            hooked.append(str(args[0]))
            redis_client.xclaim(buffer.keys.rollouts, buffer.group_name, "d", 0, [ids[1]])
        return send(*args, **kw)

    buffer.client.execute_command = take_over_before_the_claim
    connection_kwargs(buffer.client)["retry"].monitor.outages += 1
    try:
        got = buf_entry_ids(buffer.read("c", 10, block_ms=0))
    finally:
        del buffer.client.execute_command
    assert hooked and got == ids[2:3]
    rows = redis_client.xpending_range(buffer.keys.rollouts, buffer.group_name, ids[1], ids[1], 1)
    assert rows[0]["consumer"].decode() == "d"
    s = buffer.stats()
    assert s["dead"] == 0 and s["pending"] == 4, s  # all four still pending, none dead
    buffer.ack(ids)
    buffer.delete_run()
    buffer.close()


def _delivered(client: redis.Redis, buffer: ReplayBuffer) -> dict[str, int]:
    rows = client.xpending_range(buffer.keys.rollouts, buffer.group_name, "-", "+", 100)
    return {r["message_id"].decode(): int(r["times_delivered"]) for r in rows}


def test_finding_a_lost_reply_again_is_no_delivery_toward_quarantine(
    redis_url: str, run_name: str, redis_client: redis.Redis
) -> None:
    """max_deliveries counts the learner's attempts at a group. A delivery whose reply was lost, found
    again by the pending re-walk or claimed back after an outage, keeps the count its one real
    delivery gave it (before: 2 each, one failure closer to quarantine unseen by the learner); a
    restarted consumer's re-read still counts (the quarantine's purpose)."""
    from asyncrl.buffer.cluster import connection_kwargs

    buffer = ReplayBuffer.connect(redis_url, run_name, max_deliveries=2)
    ids = [buffer.put(small_group()) for _ in range(6)]
    assert buf_entry_ids(buffer.read("c", 1, block_ms=0)) == ids[:1]
    stream = {buffer.keys.rollouts: ">"}
    monitor = connection_kwargs(buffer.client)["retry"].monitor
    # 1) Lost above the cursor, found by the pending re-walk after a failure the monitor counted.
    redis_client.xreadgroup(buffer.group_name, "c", stream, count=1)  # ids[1]: served, reply lost
    monitor.outages += 1
    assert buf_entry_ids(buffer.read("c", 1, block_ms=0)) == ids[1:2]
    assert _delivered(redis_client, buffer)[ids[1]] == 1
    # 2) Lost below a later cursor, claimed back (XCLAIM).
    redis_client.xreadgroup(buffer.group_name, "c", stream, count=2)  # ids[2:4]: reply lost
    retried = redis_client.xreadgroup(buffer.group_name, "c", stream, count=1)  # the retry: ids[4]
    assert [x[0].decode() for x in retried[0][1]] == ids[4:5]
    buffer._cursor["c"] = ids[4]
    buffer._returned().add(ids[4])
    monitor.outages += 1
    assert buf_entry_ids(buffer.read("c", 10, block_ms=0)) == ids[2:4] + ids[5:6]
    counts = _delivered(redis_client, buffer)
    assert [counts[i] for i in ids] == [1, 1, 1, 1, 1, 1], counts
    # A restart (a new instance, same consumer) re-reads every pending entry and that counts: a second
    # restart finds them delivered 3 times (> max_deliveries 2) and quarantines them all.
    again = ReplayBuffer.connect(redis_url, run_name, max_deliveries=2)
    assert buf_entry_ids(again.read("c", 10, block_ms=0)) == ids
    assert set(_delivered(redis_client, again).values()) == {2}
    third = ReplayBuffer.connect(redis_url, run_name, max_deliveries=2)
    assert third.read("c", 10, block_ms=0) == [] and third.stats()["dead"] == 6
    for b in (buffer, again, third):
        b.close()
    ReplayBuffer.connect(redis_url, run_name).delete_run()


def test_a_restarted_consumer_walks_all_its_pending_entries_n_at_a_time(
    redis_url: str, run_name: str, redis_client: redis.Redis
) -> None:
    """The learner acknowledges at checkpoints, so a crash leaves up to checkpoint_every batches pending.
    The restarted consumer (asyncrl's monitored client) must get every one of them back, a batch per
    read, before new entries. Before: its first read took n and marked the consumer clean, so the next
    read skipped the pending walk and the rest stayed pending (untrained, their slots never credited)
    until some later outage or restart."""
    first = ReplayBuffer.connect(redis_url, run_name, max_deliveries=3)
    ids = [first.put(small_group()) for _ in range(7)]
    assert buf_entry_ids(first.read("learner", 6, block_ms=0)) == ids[:6]  # delivered, never acked
    first.close()  # the crash
    again = ReplayBuffer.connect(redis_url, run_name, max_deliveries=3)
    got = [buf_entry_ids(again.read("learner", 2, block_ms=0)) for _ in range(4)]
    assert got == [ids[0:2], ids[2:4], ids[4:6], ids[6:7]], got  # before: [ids[0:2], ids[6:7], [], []]
    assert again.read("learner", 2, block_ms=0) == []
    counts = _delivered(redis_client, again)
    assert [counts[i] for i in ids] == [2] * 6 + [1], counts  # the restart's re-read counts once each
    again.close()
    ReplayBuffer.connect(redis_url, run_name).delete_run()


def _xreadgroups(client: redis.Redis) -> int:
    return int(client.info("commandstats").get("cmdstat_xreadgroup", {}).get("calls", 0))


def test_pending_read_is_skipped_only_while_nothing_can_be_pending(
    redis_url: str, run_name: str, redis_client: redis.Redis
) -> None:
    """A read that follows a normal read of the same consumer, with no failure seen since, issues one
    XREADGROUP (new entries) instead of two: nothing can be pending above its cursor. The first read
    in a process, and the first after an outage, still look at the pending entries and return a lost
    delivery; a plain client (no outage monitor) always looks."""
    from asyncrl.buffer.cluster import connection_kwargs

    buffer = ReplayBuffer.connect(redis_url, run_name)
    ids = [buffer.put(small_group()) for _ in range(4)]
    before = _xreadgroups(redis_client)
    assert [e.entry_id for e in buffer.read("c", 1, block_ms=0)] == ids[:1]
    assert _xreadgroups(redis_client) - before == 2  # first read here: pending, then new
    before = _xreadgroups(redis_client)
    assert [e.entry_id for e in buffer.read("c", 1, block_ms=0)] == ids[1:2]
    assert _xreadgroups(redis_client) - before == 1  # the pending read is skipped
    # A delivery whose reply is lost comes with a failure the client's monitor counts.
    redis_client.xreadgroup(buffer.group_name, "c", {buffer.keys.rollouts: ">"}, count=1)
    connection_kwargs(buffer.client)["retry"].monitor.outages += 1
    before = _xreadgroups(redis_client)
    assert [e.entry_id for e in buffer.read("c", 5, block_ms=0)] == ids[2:]
    assert _xreadgroups(redis_client) - before == 4  # pending: ids[2], then none; new: ids[3], then none
    plain = ReplayBuffer(redis.Redis.from_url(redis_url), run_name)
    assert plain.read("d", 1, block_ms=0) == [] and plain.read("d", 1, block_ms=0) == []
    before = _xreadgroups(redis_client)
    plain.read("d", 1, block_ms=0)
    assert _xreadgroups(redis_client) - before == 2
    plain.close()
    buffer.delete_run()
    buffer.close()


def test_quarantine_after_max_deliveries(redis_server: EmbeddedRedis, run_name: str) -> None:
    """A group whose steps keep crashing the learner (read, never acknowledged, learner restarted) is
    dead-lettered once its delivery count exceeds max_deliveries, and its slot credited."""
    first = ReplayBuffer(
        redis_server.client(socket_timeout=30.0), run_name, owns_client=True, max_deliveries=2
    )
    try:
        entry = first.put(small_group())
        reads = []
        for _restart in range(3):  # three learner incarnations read it; none acknowledges
            inc = ReplayBuffer(
                redis_server.client(socket_timeout=30.0), run_name, owns_client=True, max_deliveries=2
            )
            reads.append([e.entry_id for e in inc.read("learner-0", 4, block_ms=0)])
            inc.close()
        assert reads == [[entry], [entry], []]  # delivered twice; the third delivery quarantines it
        (dead,) = first.dead_letters()
        assert dead["original_id"] == entry and dead["reason"].startswith("quarantined: delivered 3 times")
        s = first.stats()
        assert (s["depth"], s["pending"], s["dead"], s["credits"]) == (0, 0, 1, 1)
    finally:
        first.delete_run()
        first.close()


# --------------------------------------------------------------------------- actor-side drops and ids


def test_abandoned_group_is_credited_once_with_a_dead_letter(buffer: ReplayBuffer) -> None:
    """A group whose reward failed: slot credited, in-flight tally down, reason in the dead-letter stream."""
    assert buffer.try_admit(1, 4, owner="actor-0")
    assert buffer.abandon("actor-0-abc", "actor-0", "reward: timed out after 30 s (task.reward_timeout_s)")
    assert not buffer.abandon("actor-0-abc", "actor-0", "again")  # a retry or repeat counts nothing
    assert buffer.credit(1, "actor-0", request_id="actor-0-abc") == 1  # same group: no second credit
    s = buffer.stats()
    assert (s["admitted"], s["credits"], s["dead"], s["depth"]) == (1, 1, 1, 0)
    assert int(buffer.client.hget(buffer.keys.inflight, "actor-0")) == 0
    (dead,) = buffer.dead_letters()
    assert dead["original_id"] == "actor-0-abc" and dead["reason"].startswith("reward: timed out")


def test_actor_pool_leases_never_share_a_number(buffer: ReplayBuffer) -> None:
    """Two live serve-actors processes get different pool numbers (hence actor ids); a dead one's
    number (its lease expired) goes to the next pool that starts, e.g. its own restart."""
    a = buffer.lease_pool("proc-a", ttl_s=1.0)
    t0 = time.monotonic()
    stop = threading.Event()

    def keep_a() -> None:
        while not stop.wait(0.2):
            buffer.renew_pool(a, "proc-a", ttl_s=1.0)

    keeper = threading.Thread(target=keep_a, daemon=True)
    keeper.start()
    b = buffer.lease_pool("proc-b", ttl_s=1.0)
    assert (a, b) == (0, 1) and time.monotonic() - t0 >= 1.0  # waited out one lease period on pool 0
    stop.set()
    keeper.join()
    time.sleep(1.2)  # proc-a died: its lease expires
    assert buffer.lease_pool("proc-a2", ttl_s=5.0) == 0
    assert not buffer.renew_pool(0, "proc-x", ttl_s=5.0)  # held by proc-a2: not taken over
    assert buffer.renew_pool(0, "proc-a2", ttl_s=5.0)
    buffer.release_pool(0, "proc-x")  # not the holder: no effect
    assert buffer.client.get(buffer.keys.pool_lease(0)) == b"proc-a2"
    buffer.release_pool(0, "proc-a2")
    assert buffer.lease_pool("proc-c", ttl_s=5.0) == 0


# --------------------------------------------------------------------------- security options


def test_acl_user_from_config_and_url_encoded_password(tmp_path: Path) -> None:
    """redis.username (ACL) and a password full of URL metacharacters reach a real server intact."""
    password = "p@ss:w/rd%?#"
    with EmbeddedRedis(tmp_path / "r") as server:
        admin = server.client()
        admin.acl_setuser(
            "roleuser", enabled=True, passwords=[f"+{password}"], keys=["asyncrl:*"], commands=["+@all"]
        )
        cfg = load_config(overrides=["run.name=acl", "redis.username=roleuser"])
        cfg.redis.password = password
        buf = ReplayBuffer.from_config(cfg, server.url)
        assert buf.try_admit() and buf.client.acl_whoami() == "roleuser"
        buf.close()
        url = url_with_auth(f"redis://127.0.0.1:{server.port}/0", password, "roleuser")
        assert password not in url  # percent-encoded; redis-py decodes it back
        parsed = redis.Redis.from_url(url)
        assert parsed.connection_pool.connection_kwargs["password"] == password
        assert parsed.acl_whoami() == "roleuser"
        parsed.close()
        cfg.redis.password = "wrong"
        t0 = time.monotonic()
        with pytest.raises(redis.AuthenticationError):
            ReplayBuffer.from_config(cfg, server.url)
        assert time.monotonic() - t0 < 5.0  # a wrong password is not an outage: no retrying for the budget
        admin.close()


def test_tls_client_certificate_options() -> None:
    url, opts = redis_options(
        "redis://h:1/0", None, "u", True, "/ca.pem", "/client.pem", "/client.key", None, {}
    )  # fmt: skip
    assert url == "rediss://h:1/0" and opts["username"] == "u"
    assert (opts["ssl_ca_certs"], opts["ssl_certfile"], opts["ssl_keyfile"]) == (
        "/ca.pem",
        "/client.pem",
        "/client.key",
    )
    with pytest.raises(ValueError, match="needs both tls_cert and tls_key"):
        redis_options("rediss://h:1/0", None, None, True, None, "/client.pem", None, None, {})
    with pytest.raises(ValueError, match="need tls=True"):
        redis_options("redis://h:1/0", None, None, False, None, "/client.pem", "/client.key", None, {})


def test_writes_given_up_during_a_freeze_are_settled(tmp_path: Path) -> None:
    """An admission and a credit that outlast the retry budget while Redis is frozen still run when it
    thaws (the server executes what the abandoned connection sent). The next call settles them: the
    admission nobody uses is given back, so admitted - credits counts exactly the admissions the caller
    got; a put or credit that had not run yet is tombstoned and cannot run later."""
    server = EmbeddedRedis(tmp_path / "r").start()
    try:
        buf = _connect(server, "settle", budget_s=1.5)
        assert buf.try_admit(owner="a")
        os.kill(server.pid, signal.SIGSTOP)
        try:
            with pytest.raises((redis.TimeoutError, redis.ConnectionError)):
                buf.try_admit(owner="a")
            with pytest.raises((redis.TimeoutError, redis.ConnectionError)):
                buf.credit(1, "a", request_id="g-late")
        finally:
            os.kill(server.pid, signal.SIGCONT)
        given_back = buf._admission.settle()  # what the next admission/credit/reclaim does first
        assert buf.try_admit(owner="a")
        s = buf.stats()
        granted = 2  # the two admissions the caller was told about
        inflight = int(buf.client.hget(buf.keys.inflight, "a"))
        # The late admission was sent on a pooled connection before the freeze, so it ran on thaw and
        # was given back. The credit first tried to settle that admission, failed (still frozen) and so
        # never sent itself: nothing of it exists, the caller got an error, nothing to undo.
        assert given_back == 1
        assert not buf.client.exists(buf.keys.request("credit:g-late"))
        assert inflight == granted
        assert s["admitted"] - s["credits"] == inflight
        buf.close()
    finally:
        server.stop()


def test_settle_tombstones_what_has_not_run(buffer: ReplayBuffer) -> None:
    adm = buffer._admission
    k = buffer.keys
    # A put that failed before it ran: tombstoned, so the late copy appends nothing.
    g = small_group()
    dedup = k.request(f"put:{g.group_id}")
    adm.uncertain("put", dedup, "a")
    assert adm.settle() == 0 and buffer.client.get(dedup) == b"cancelled"
    buffer._put_many_script(
        keys=[k.rollouts, k.inflight, dedup], args=[b"g", "a", 0, 60, b"x"]
    )  # the late copy
    assert buffer.stats()["depth"] == 0 and buffer.client.hget(k.inflight, "a") is None
    # An admission that ran although the caller gave up: given back.
    late = k.request("late-admit")
    adm._script(
        keys=[k.admitted, k.credits, k.version, k.inflight, late, k.staleness_bound], args=[1, 4, -1, "a", 60]
    )
    adm.uncertain("admit", late, "a")
    assert adm.settle() == 1
    s = buffer.stats()
    assert (s["admitted"], s["credits"], int(buffer.client.hget(k.inflight, "a"))) == (1, 1, 0)
    assert adm.settle() == 0  # nothing left to settle


def test_a_lost_entry_past_an_in_flight_one_is_still_quarantined(
    redis_url: str, run_name: str, redis_client: redis.Redis
) -> None:
    """The claim-back reads the lost entries' delivery counts over their id range, which also holds this
    consumer's entries in flight at the caller: asked for only as many rows as lost entries, it cut the
    range short and a later lost entry read as delivered 0 times, dodging max_deliveries."""
    from asyncrl.buffer.cluster import connection_kwargs

    buffer = ReplayBuffer.connect(redis_url, run_name, max_deliveries=2)
    ids = [buffer.put(small_group()) for _ in range(5)]
    assert buf_entry_ids(buffer.read("c", 1, block_ms=0)) == ids[:1]
    stream = {buffer.keys.rollouts: ">"}
    redis_client.xreadgroup(buffer.group_name, "c", stream, count=1)  # ids[1]: served, reply lost
    assert buf_entry_ids(buffer.read("c", 1, block_ms=0)) == ids[2:3]  # in flight at the caller
    redis_client.xreadgroup(buffer.group_name, "c", stream, count=1)  # ids[3]: reply lost
    # ids[3] had been delivered to this consumer's failing learner before: 5 > max_deliveries.
    redis_client.xclaim(buffer.keys.rollouts, buffer.group_name, "c", 0, [ids[3]], retrycount=5)
    retried = redis_client.xreadgroup(buffer.group_name, "c", stream, count=1)  # the retry: ids[4]
    assert [x[0].decode() for x in retried[0][1]] == ids[4:5]
    buffer._cursor["c"] = ids[4]
    buffer._returned().add(ids[4])
    connection_kwargs(buffer.client)["retry"].monitor.outages += 1
    assert buf_entry_ids(buffer.read("c", 10, block_ms=0)) == ids[1:2]
    (dead,) = buffer.dead_letters()
    assert dead["original_id"] == ids[3] and dead["reason"].startswith("quarantined: delivered 5 times"), dead
    buffer.delete_run()
    buffer.close()
