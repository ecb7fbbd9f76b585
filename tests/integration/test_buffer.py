"""ReplayBuffer against a real redis-server: delivery, dead letters, admission, registry."""

from __future__ import annotations

import random
import threading
import time
from collections import Counter

import msgpack
import numpy as np
import pytest
import redis
from prometheus_client import CollectorRegistry, generate_latest

from asyncrl.buffer import (
    EmbeddedRedis,
    ReplayBuffer,
    WeightIntegrityError,
    build_manifest,
    encode,
    verify,
)
from asyncrl.buffer.admission import admission_bound_formula, slot_version
from asyncrl.buffer.connection import redis_options as _redis_options
from asyncrl.buffer.consumer import DEAD_MAXLEN
from asyncrl.metrics_export import LearnerExporter, learner_collectors
from tests.conftest import small_group


def _new(redis_server: EmbeddedRedis, run: str, **kw) -> ReplayBuffer:
    """A second, independent instance (own connection pool), as another process would have."""
    return ReplayBuffer(redis_server.client(socket_timeout=30.0), run, owns_client=True, **kw)


def _corrupt(**changes) -> bytes:
    doc = msgpack.unpackb(encode(small_group()), raw=False)
    for path, value in changes.items():
        target = doc
        *parents, last = path.split("__")
        for p in parents:
            target = target[int(p)] if p.isdigit() else target[p]
        target[last] = value
    return msgpack.packb(doc, use_bin_type=True)


# --------------------------------------------------------------------------- basics


def test_put_read_ack_and_stats(buffer: ReplayBuffer) -> None:
    groups = [small_group() for _ in range(5)]
    ids = [buffer.put(g) for g in groups]
    assert len(set(ids)) == 5
    s = buffer.stats()
    assert (s["depth"], s["pending"], s["dead"], s["admitted"], s["credits"], s["version"]) == (
        5,
        0,
        0,
        0,
        0,
        0,
    )
    assert s["bound"] is None
    got = buffer.read("c", 3, block_ms=0)
    assert [e.entry_id for e in got] == ids[:3]
    assert [e.group for e in got] == groups[:3]
    assert buffer.stats()["pending"] == 3
    assert buffer.ack([e.entry_id for e in got]) == 3
    assert buffer.ack([got[0].entry_id]) == 0  # already acknowledged
    s = buffer.stats()
    assert (s["depth"], s["pending"]) == (2, 0)  # acked entries are deleted from the stream
    assert [e.group for e in buffer.read("c", 10, block_ms=0)] == groups[3:]


def test_read_blocks_until_timeout_or_put(buffer: ReplayBuffer) -> None:
    t0 = time.monotonic()
    assert buffer.read("c", 4, block_ms=300) == []
    assert 0.25 <= time.monotonic() - t0 < 3.0
    g = small_group()
    timer = threading.Timer(0.2, buffer.put, args=(g,))
    timer.start()
    t0 = time.monotonic()
    got = buffer.read("c", 4, block_ms=5000)
    timer.join()
    assert [e.group for e in got] == [g]
    assert time.monotonic() - t0 < 3.0


# --------------------------------------------------------------------------- dead letters


def test_malformed_entries_dead_lettered(buffer: ReplayBuffer, redis_client: redis.Redis) -> None:
    f32 = np.dtype("<f4")
    bad = {
        "garbage": (b"\x00not msgpack", "record: not valid msgpack"),
        "nan": (
            _corrupt(completions__1__logprobs=np.array([-1, -1, np.nan, -1], f32).tobytes()),
            "completions[1].logprobs: non-finite value at 2",
        ),
        "schema": (_corrupt(schema=99), "schema: unsupported schema version 99"),
        "finish": (_corrupt(completions__0__finish="eos"), "completions[0].finish_reason"),
    }
    good, bad_ids, expected_reasons = [], {}, {}
    for name, (data, reason) in bad.items():
        g = small_group()
        good.append((buffer.put(g), g))
        bad_ids[name] = buffer.put_raw(data)
        expected_reasons[bad_ids[name]] = reason
    # An entry without the group field at all (a foreign producer writing the wrong field).
    no_field = redis_client.xadd(buffer.keys.rollouts, {b"x": b"1"}).decode()
    expected_reasons[no_field] = "entry: no 'g' field"
    g = small_group()
    good.append((buffer.put(g), g))

    got = buffer.read("c", 100, block_ms=0)
    assert [(e.entry_id, e.group) for e in got] == good
    dead = buffer.dead_letters()
    assert len(dead) == 5
    for d in dead:
        assert expected_reasons[d["original_id"]] in d["reason"], d
    garbage = next(d for d in dead if d["original_id"] == bad_ids["garbage"])
    assert garbage["data"] == b"\x00not msgpack" and garbage["size"] == 12 and garbage["time"] > 0
    s = buffer.stats()
    assert (s["dead"], s["credits"], s["pending"], s["depth"]) == (5, 5, len(good), len(good))
    assert buffer.read("c", 100, block_ms=0) == []
    # A fresh instance with the same consumer must not see dead letters in its pending list.
    again = ReplayBuffer(redis_client, buffer.run)
    assert [e.entry_id for e in again.read("c", 100, block_ms=0)] == [i for i, _ in good]


def test_pending_entry_deleted_before_ack_is_dead_lettered(buffer: ReplayBuffer, redis_client) -> None:
    ids = [buffer.put(small_group()) for _ in range(3)]
    assert len(buffer.read("c", 3, block_ms=0)) == 3
    redis_client.xdel(buffer.keys.rollouts, ids[1])  # e.g. trimmed by maxlen while pending
    restarted = ReplayBuffer(redis_client, buffer.run)
    assert [e.entry_id for e in restarted.read("c", 10, block_ms=0)] == [ids[0], ids[2]]
    (dead,) = buffer.dead_letters()
    assert dead["original_id"] == ids[1] and "deleted" in dead["reason"]
    assert buffer.stats()["credits"] == 1 and buffer.stats()["pending"] == 2


# --------------------------------------------------------------------------- delivery


def test_concurrent_producers_consumers_exactly_once(
    redis_server: EmbeddedRedis, buffer: ReplayBuffer
) -> None:
    per_producer, n_producers = 1000, 2
    total = per_producer * n_producers
    received: list[list[str]] = [[], []]
    errors: list[BaseException] = []
    done = threading.Event()

    def produce(p: int) -> None:
        try:
            buf = _new(redis_server, buffer.run)
            for i in range(per_producer):
                buf.put(small_group(group_id=f"p{p}-{i}", n_completions=1, n_tokens=2))
            buf.close()
        except BaseException as exc:  # surfaced in the main thread
            errors.append(exc)

    def consume(c: int) -> None:
        try:
            buf = _new(redis_server, buffer.run)
            while not done.is_set():
                entries = buf.read(f"consumer-{c}", 50, block_ms=100)
                received[c].extend(e.group.group_id for e in entries)
                buf.ack([e.entry_id for e in entries])
                if sum(map(len, received)) >= total:
                    done.set()
            buf.close()
        except BaseException as exc:
            errors.append(exc)
            done.set()

    threads = [threading.Thread(target=produce, args=(p,)) for p in range(n_producers)]
    threads += [threading.Thread(target=consume, args=(c,)) for c in range(2)]
    for t in threads:
        t.start()
    done.wait(timeout=25)
    done.set()
    for t in threads:
        t.join(timeout=10)
    assert not errors, errors
    counts = Counter(received[0] + received[1])
    expected = {f"p{p}-{i}" for p in range(n_producers) for i in range(per_producer)}
    assert set(counts) == expected
    assert max(counts.values()) == 1, [k for k, v in counts.items() if v > 1][:5]
    s = buffer.stats()
    assert (s["pending"], s["depth"], s["dead"]) == (0, 0, 0)


def test_restarted_consumer_rereads_unacked(redis_client: redis.Redis, buffer: ReplayBuffer) -> None:
    ids = [buffer.put(small_group()) for _ in range(10)]
    first = buffer.read("learner-0", 4, block_ms=0)
    second = buffer.read("learner-0", 3, block_ms=0)
    # A live instance never re-delivers what it returned, acked or not.
    assert [e.entry_id for e in first + second] == ids[:7]
    buffer.ack([first[0].entry_id])
    # The consumer "dies"; a new instance with the same consumer name takes over.
    restarted = ReplayBuffer(redis_client, buffer.run)
    a = restarted.read("learner-0", 4, block_ms=0)
    assert [e.entry_id for e in a] == ids[1:5]  # pending first, in order
    b = restarted.read("learner-0", 4, block_ms=0)
    assert [e.entry_id for e in b] == ids[5:9]  # rest of pending (2), then new ones (2)
    c = restarted.read("learner-0", 4, block_ms=0)
    assert [e.entry_id for e in c] == ids[9:]
    assert restarted.read("learner-0", 4, block_ms=0) == []  # no re-delivery in this instance
    # Another consumer never gets learner-0's pending entries.
    assert ReplayBuffer(redis_client, buffer.run).read("other", 10, block_ms=0) == []
    assert restarted.ack([e.entry_id for e in a + b + c]) == 9
    assert buffer.stats()["pending"] == 0


# --------------------------------------------------------------------------- admission


def test_admission_bound_under_concurrency(buffer: ReplayBuffer) -> None:
    s, g = 2, 4

    def hammer(n_threads: int = 8, tries: int = 60) -> int:
        wins = [0] * n_threads

        def run(i: int) -> None:
            for _ in range(tries):
                wins[i] += buffer.try_admit(s, g)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(n_threads)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return sum(wins)

    assert buffer.admission_bound(s, g) == 12  # (0 + 2 + 1) * 4
    assert hammer() == 12
    assert buffer.stats()["admitted"] == 12
    assert buffer.credit(3) == 3
    assert hammer() == 3  # credits unblock exactly as many groups
    buffer.set_version(2)
    assert buffer.admission_bound(s, g) == (2 + 2 + 1) * 4 + 3
    assert hammer() == 8  # raising V raises the bound by groups_per_step per version
    assert buffer.stats()["admitted"] == 23
    assert buffer.try_admit(0, g) is False  # max_staleness 0: (2 + 1) * 4 + 3 = 15 < 23
    with pytest.raises(ValueError, match="groups_per_step"):
        buffer.try_admit(1, 0)


@pytest.mark.parametrize("give_credits", [True, False])
def test_admission_with_drops_progresses_only_with_credits(
    redis_client, run_name, give_credits: bool
) -> None:
    """A small actor/learner loop that drops every third group: credits keep it alive,
    and no trained group is ever staler than max_staleness."""
    s, g, target = 1, 4, 12
    buf = ReplayBuffer(redis_client, run_name, max_staleness=s, groups_per_step=g)
    try:
        trained_in_step, n_seen, max_seen_staleness = 0, 0, 0
        for _ in range(200):
            v = buf.version()
            while buf.try_admit():
                buf.put(small_group(n_completions=1, n_tokens=2, version=v))
            entries = buf.read("learner", 100, block_ms=0)
            if not entries:
                break  # stalled: nothing admitted, nothing to train
            for e in entries:
                n_seen += 1
                if n_seen % 3 == 0:
                    if give_credits:
                        buf.credit()
                    continue
                max_seen_staleness = max(max_seen_staleness, e.group.staleness(v))
                trained_in_step += 1
                if trained_in_step == g:
                    trained_in_step, v = 0, v + 1
                    buf.set_version(v)
            buf.ack([e.entry_id for e in entries])
            if v >= target:
                break
        stats = buf.stats()
        assert stats["admitted"] <= stats["bound"]
        if give_credits:
            assert buf.version() == target
            assert max_seen_staleness <= s
        else:
            assert buf.version() < 4  # deadlocks early without credits
    finally:
        buf.delete_run()


# --------------------------------------------------------------------------- weights registry


def test_a_notification_whose_manifest_is_unreadable_still_wakes_the_subscriber(
    buffer: ReplayBuffer, tmp_path
) -> None:
    """The note's manifest is an optimisation: none, an unreadable one, or one of another version is
    dropped (None: the subscriber reads the registry) and the note still carries its version."""
    d = tmp_path / "v5"
    d.mkdir()
    (d / "model.safetensors").write_bytes(b"\x05" * 100)
    other = build_manifest(4, d, "float32")
    sub = buffer.subscribe_versions()
    channel = buffer.keys.versions_channel
    for extra in ({}, {"manifest": b"\xc1 not msgpack"}, {"manifest": other.to_bytes()}):
        note = {"schema": 1, "version": 5, "path": str(d / "model.safetensors"), "sha256": "x", **extra}
        buffer._client.publish(channel, msgpack.packb(note, use_bin_type=True))
        got = sub.get_notification(timeout=2.0)
        assert got is not None and got["version"] == 5 and got["manifest"] is None, (extra, got)
    buffer._client.publish(channel, msgpack.packb({"schema": 1, "version": -1}, use_bin_type=True))
    assert sub.get_notification(timeout=0.2) is None  # no valid version: skipped
    sub.close()


def test_weights_registry_and_notifications(buffer: ReplayBuffer, tmp_path) -> None:
    sub = buffer.subscribe_versions()
    manifests = {}
    for v in (1, 2, 3):
        d = tmp_path / f"v{v}"
        d.mkdir()
        (d / "model.safetensors").write_bytes(bytes([v]) * (1000 + v))
        (d / "config.json").write_text("{}")
        manifests[v] = build_manifest(v, d, "bfloat16")
        assert buffer.publish_weights(manifests[v]) == 1
    assert [sub.get(timeout=2.0) for _ in range(3)] == [1, 2, 3]
    assert sub.get(timeout=0.05) is None
    buffer.publish_weights(manifests[3])
    assert sub.get_notification(timeout=2.0) == {
        "version": 3,
        "path": manifests[3].path,
        "sha256": manifests[3].sha256,
        "manifest": manifests[3],  # as registered: a subscriber acting on it reads no registry
    }
    for v in (1, 2, 3):
        buffer.publish_weights(manifests[v])
    # The newest of the notes queued by then (on a loaded machine note 3 may arrive after a first call
    # has returned note 2: the CI saw that); never an older one after a newer one.
    seen = [sub.latest_note(timeout=2.0)]
    while seen[-1] is not None and seen[-1]["version"] < 3 and len(seen) < 10:
        seen.append(sub.latest_note(timeout=2.0))
    assert seen[-1]["manifest"] == manifests[3], seen
    versions = [n["version"] for n in seen]
    assert versions == sorted(set(versions)), versions
    sub.close()
    assert buffer.version() == 3
    assert buffer.manifest(2) == manifests[2]
    assert buffer.manifest(7) is None
    assert buffer.latest_manifest() == manifests[3]
    assert buffer.manifest(1).files["model.safetensors"].size == 1001
    assert buffer.prune_manifests(2) == [1]
    assert buffer.manifest_versions() == [2, 3]
    assert buffer.prune_manifests([3]) == [2]
    assert buffer.latest_manifest() == manifests[3]

    verify(manifests[3])
    (tmp_path / "v3" / "model.safetensors").write_bytes(b"\x03" * 1003)  # same size, same bytes
    verify(manifests[3])
    (tmp_path / "v3" / "model.safetensors").write_bytes(b"\x04" * 1003)
    with pytest.raises(WeightIntegrityError, match="model.safetensors sha256 .* != expected"):
        verify(manifests[3])
    (tmp_path / "v3" / "model.safetensors").write_bytes(b"\x03" * 10)
    with pytest.raises(WeightIntegrityError, match="model.safetensors size 10 != expected 1003"):
        verify(manifests[3])
    single = tmp_path / "w.bin"
    single.write_bytes(b"abc")
    m = build_manifest(9, single, "float32")
    assert m.sha256 == "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
    verify(m)
    single.write_bytes(b"abd")
    with pytest.raises(WeightIntegrityError, match="sha256"):
        verify(m)


def test_heartbeats_and_learner_status(buffer: ReplayBuffer) -> None:
    buffer.heartbeat("actor-0", {"version": 3, "groups": 10})
    buffer.heartbeat("actor-1", {"version": 2, "groups": 4, "time": 5.0})
    actors = buffer.actors()
    assert set(actors) == {"actor-0", "actor-1"}
    assert actors["actor-0"]["groups"] == 10 and actors["actor-0"]["time"] > 1e9
    assert actors["actor-1"] == {"version": 2, "groups": 4, "time": 5.0}
    buffer.remove_actor("actor-1")
    assert set(buffer.actors()) == {"actor-0"}
    buffer.set_learner_status({"step": 7, "loss": 0.25, "state": "training"})
    t0 = time.time()
    buffer.set_learner_status({"step": 8})
    status = buffer.learner_status()
    assert t0 <= status.pop("updated") <= time.time()  # every write stamps unix time
    assert status == {"step": 8, "loss": 0.25, "state": "training"}


# --------------------------------------------------------------------------- connection


def test_connect_with_password(tmp_path, run_name: str) -> None:
    with EmbeddedRedis(tmp_path / "auth", password="s3cret") as server:
        assert server.url.startswith("redis://:s3cret@127.0.0.1:")
        url = f"redis://127.0.0.1:{server.port}/0"
        with pytest.raises(redis.AuthenticationError):
            ReplayBuffer.connect(url, run_name)
        with ReplayBuffer.connect(url, run_name, password="s3cret") as buf:
            buf.put(small_group())
            assert buf.stats()["depth"] == 1


def test_tls_options() -> None:
    url, opts = _redis_options("redis://h:1/0", "pw", None, True, "/ca.pem", None, None, None, {})
    assert url == "rediss://h:1/0" and opts["ssl_ca_certs"] == "/ca.pem" and opts["password"] == "pw"
    client = redis.Redis.from_url(url, **opts)
    assert client.connection_pool.connection_class is redis.SSLConnection
    url, opts = _redis_options("rediss://h:1/0", None, None, False, None, None, None, None, {})
    assert url == "rediss://h:1/0"
    with pytest.raises(ValueError, match="tls_ca"):
        _redis_options("redis://h:1/0", None, None, False, "/ca.pem", None, None, None, {})
    with pytest.raises(ValueError, match="redis url"):
        _redis_options("http://h:1/0", None, None, False, None, None, None, None, {})


def test_rejects_decode_responses_and_bad_run_name(redis_server: EmbeddedRedis) -> None:
    with pytest.raises(ValueError, match="decode_responses"):
        ReplayBuffer(redis_server.client(decode_responses=True), "r")
    with pytest.raises(ValueError, match="run name"):
        ReplayBuffer(redis_server.client(), "bad name!")


def test_admission_refuses_samplers_whose_weights_are_too_stale(buffer):
    buffer.set_version(5)
    # Weights of v3 with max_staleness 1: the group would be dropped at train time, so it never starts
    # and uses no slot; v4 (staleness 1) and v5 are admitted.
    assert buffer.try_admit(1, 4, sampler_version=3) is False
    assert buffer.stats()["admitted"] == 0
    assert buffer.try_admit(1, 4, sampler_version=4) is True
    assert buffer.try_admit(1, 4, sampler_version=5) is True
    assert buffer.try_admit(0, 4, sampler_version=4) is False
    assert buffer.try_admit(1, 4) is True  # no sampler version: only the count bound applies
    assert buffer.stats()["admitted"] == 3


def test_admission_refuses_weights_that_would_be_too_stale_at_the_slots_training_version(
    buffer, redis_client
) -> None:
    """A publish opens the last groups_per_step slots of the window, trained at V + eta: a worker still
    on v < V would sample a group that is dropped there (measured: a third of the demo's groups at
    max_staleness 1). The script refuses it without using a slot; fresh weights take the slot."""
    gps, eta = 4, 1
    assert all(buffer.try_admit(eta, gps, sampler_version=0) for _ in range(4 + 4))  # slots 1-8: v0, v1
    buffer.set_version(1)  # bound 12; slot 9 is trained at version 2
    assert buffer.try_admit(eta, gps, sampler_version=0) is False
    assert buffer.stats()["admitted"] == 8
    assert buffer.try_admit(eta, gps, sampler_version=1) is True
    buffer.credit(4)  # 4 dropped groups gave their slots back: slot 10 - 4 = 6 is trained at version 1
    assert buffer.try_admit(eta, gps, sampler_version=0) is True
    assert buffer.try_admit(eta, gps) is True  # no sampler version: only the count bound applies
    # The script and slot_version agree on random states (the simulator uses slot_version).
    rng = random.Random(7)
    for _ in range(200):
        version, eta, gps = rng.randrange(0, 6), rng.randrange(0, 4), rng.randrange(1, 5)
        admitted, credits = rng.randrange(0, 40), rng.randrange(0, 6)
        sampler = rng.randrange(max(0, version - eta - 1), version + 1)
        redis_client.mset({buffer.keys.admitted: admitted, buffer.keys.credits: credits})
        buffer.set_version(version)
        under = admitted < admission_bound_formula(version, eta, gps, credits)
        fresh = version - sampler <= eta and slot_version(admitted + 1, gps, credits) - sampler <= eta
        assert buffer.try_admit(eta, gps, sampler_version=sampler) is (under and fresh), (
            version, eta, gps, admitted, credits, sampler
        )  # fmt: skip


def test_a_learner_fork_keeps_the_admission_window_on_the_new_version_axis(buffer) -> None:
    """A learner resumed from the checkpoint of v2 while v3 was published forks to v4 (a jump of 2): the
    slots still count step 2, so without the skew debit the window would be 2 versions wider for good."""
    gps, eta = 4, 1
    buffer.set_version(2)  # the checkpoint's version (the steps the slots count): bound (2+1+1)*4 = 16
    assert all(buffer.try_admit(eta, gps, sampler_version=2) for _ in range(16))
    window = buffer.admission_bound(eta, gps)
    assert window == 16 and buffer.try_admit(eta, gps, sampler_version=2) is False
    assert buffer.set_version_skew(2, gps) == 2  # fork 2 -> 4: debit before publishing v4
    buffer.set_version(4)
    st = buffer.stats()
    assert (st["version_skew"], st["credits"], st["admitted"]) == (2, -8, 16)
    assert buffer.admission_bound(eta, gps) == window  # same window, counted on the new axis
    assert buffer.try_admit(eta, gps, sampler_version=4) is False
    # Slot 17 (step 5's first) is trained at v4 before the fork, v6 on the new axis.
    assert slot_version(17, gps, 0) == 4 and slot_version(17, gps, st["credits"]) == 6
    assert buffer.set_version_skew(2, gps) == 0 and buffer.stats()["credits"] == -8  # idempotent
    # A later resume from a checkpoint that predates the fork sets its own total: the debit is undone.
    assert buffer.set_version_skew(0, gps) == -2 and buffer.stats()["credits"] == 0
    with pytest.raises(ValueError, match="version skew must be an int"):
        buffer.set_version_skew(1.5, gps)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="groups per version must be an int >= 1"):
        buffer.set_version_skew(1, 0)


def test_steps_without_a_publication_advance_the_window_per_step(buffer) -> None:
    """learner.publish_policy=taken: a step that publishes nothing lowers the skew by one, which gives
    groups_per_step credits back, so the window moves per learner step although V does not; the slot
    check then counts in steps (over-estimates the training version: only refuses more), and the
    current weights V always pass."""
    gps, eta = 3, 1
    buffer.set_version(0)
    assert sum(buffer.try_admit(eta, gps, sampler_version=0) for _ in range(10)) == 6  # (0+1+1)*3
    for steps in range(1, 5):  # the learner trains step `steps` (3 groups) and does not publish
        assert buffer.set_version_skew(-steps, gps) == -1
        st = buffer.stats()
        assert (st["version"], st["version_skew"], st["credits"]) == (0, -steps, gps * steps)
        assert buffer.admission_bound(eta, gps) == (steps + eta + 1) * gps  # the window of step `steps`
        # The next slot trains at step `steps` + 1 or later, i.e. at most that many versions on: a
        # sampler on v0 is refused once that would exceed eta, the served V = 0 always passes.
        assert slot_version(st["admitted"] + 1, gps, st["credits"]) == eta  # V + eta: the next step's
        admitted = sum(buffer.try_admit(eta, gps, sampler_version=0) for _ in range(10))
        assert admitted == gps and buffer.stats()["admitted"] == (steps + eta + 1) * gps
    # A publication after 4 silent steps: V = 1, skew 1 - 5 steps = -4 when step 5 did publish.
    buffer.set_version(1)
    assert buffer.admission_bound(eta, gps) == (1 + eta + 1) * gps + 4 * gps  # = step 5's window
    assert buffer.try_admit(eta, gps, sampler_version=1) is True
    assert buffer.set_version_skew(-4, gps) == 0  # idempotent (a retried call)


def test_slots_of_a_crashed_actor_are_reclaimed_as_credits(buffer, make_group):
    g = 2
    assert all(buffer.try_admit(0, g, owner="actor-0") for _ in range(2))
    assert buffer.try_admit(0, g, owner="actor-1") is False  # bound (0+0+1)*2 reached
    buffer.put(make_group(), owner="actor-0")  # one written, one still in flight when it "dies"
    assert buffer.reclaim_inflight("actor-1") == 0
    # The restarted actor-0 turns its dead incarnation's slot into a credit: admission reopens by one.
    assert buffer.reclaim_inflight("actor-0") == 1
    assert buffer.stats()["credits"] == 1
    assert buffer.try_admit(0, g, owner="actor-0") is True
    assert buffer.try_admit(0, g, owner="actor-0") is False
    # An aborted group credited by its owner leaves nothing to reclaim (no double credit).
    buffer.credit(1, owner="actor-0")
    assert buffer.reclaim_inflight("actor-0") == 0
    assert buffer.stats()["credits"] == 2


def _ledger(buffer) -> tuple[int, int]:
    """(admitted, credits + in flight + in the stream): equal while every slot counts once (no skew,
    nothing trained in these tests)."""
    st = buffer.stats()
    return st["admitted"], st["credits"] + sum(buffer.inflight_owners().values()) + st["depth"]


def test_a_reclaimed_owners_late_write_credit_or_abandon_counts_its_slot_once(buffer, make_group):
    """The fence: a reclaim (restarted actor, supervisor, a live pool reclaiming a lapsed one) credits
    everything an owner holds; a write, credit or abandon of that owner arriving after it (a pool frozen
    past two lease periods, then resumed) must not count the slot again. Before, each credited it once
    more (the tally going negative) and the admission window stayed that much wider for good."""
    g = 8  # bound (0 + 0 + 1) * 8 + credits
    # A new incarnation with the same id admits before its predecessor's late write lands: whichever
    # write comes first takes the tally's slot, the other takes the reclaim's credit back.
    assert buffer.try_admit(0, g, owner="actor-2-0") and buffer.try_admit(0, g, owner="actor-2-0")
    assert buffer.reclaim_inflight("actor-2-0") == 2
    assert buffer.try_admit(0, g, owner="actor-2-0")  # the new incarnation
    buffer.put(make_group(group_id="old-0"), owner="actor-2-0")  # the old incarnation's late write
    buffer.put(make_group(group_id="new-0"), owner="actor-2-0")
    st = buffer.stats()
    assert (st["admitted"], st["credits"], st["depth"]) == (3, 1, 2)  # the old one's other slot: 1 credit
    assert buffer.inflight_owners().get("actor-2-0", 0) == 0 and _ledger(buffer) == (3, 3)
    # A frozen pool's actor: reclaimed with 4 slots, then a late write, an aborted group, an abandoned one.
    assert all(buffer.try_admit(0, g, owner="actor-1-0") for _ in range(4))
    assert buffer.reclaim_inflight("actor-1-0") == 4
    buffer.put(make_group(group_id="late-0"), owner="actor-1-0")  # its credit taken back: in the stream
    assert buffer.credit(1, owner="actor-1-0", request_id="late-1") == 4  # already credited: no change
    assert buffer.abandon("late-2", "actor-1-0", "reward raised")  # dead-lettered, not credited again
    st = buffer.stats()
    assert (st["admitted"], st["credits"], st["depth"], st["dead_total"]) == (7, 4, 3, 1)
    assert buffer.inflight_owners().get("actor-1-0", 0) == 0 and _ledger(buffer) == (7, 7)
    assert sum(buffer.try_admit(0, g, owner="actor-0") for _ in range(10)) == 5  # 8 + 4 - 7 slots open


def test_lagging_actors_are_the_live_ones_behind_the_version(buffer) -> None:
    """publish_policy=taken waits only for live actors that serve an older version: not for dead ones
    (heartbeat past the timeout), stopping ones, or ones that serve nothing yet."""
    now = time.time()
    beats = {
        "a-current": {"version": 3, "state": "running", "time": now - 1},
        "a-behind": {"version": 2, "state": "running", "time": now - 1},
        "a-ahead-of-nothing": {"version": -1, "state": "waiting_for_weights", "time": now},
        "a-dead": {"version": 1, "state": "running", "time": now - 61},
        "a-stopping": {"version": 1, "state": "stopping", "time": now},
        "b-behind": {"version": 0, "state": "running", "time": now - 59},
    }
    for actor_id, info in beats.items():
        buffer.heartbeat(actor_id, info)
    assert buffer.lagging_actors(3, timeout_s=60, now=now) == ["a-behind", "b-behind"]
    assert buffer.lagging_actors(2, timeout_s=60, now=now) == ["b-behind"]
    assert buffer.lagging_actors(0, timeout_s=60, now=now) == []
    buffer.heartbeat("a-behind", {"version": 3, "state": "running"})  # its heartbeat after the swap
    buffer.heartbeat("b-behind", {"version": 3, "state": "running"})
    assert buffer.lagging_actors(3, timeout_s=60) == []


def test_a_registry_entry_that_does_not_parse_is_refused_and_older_versions_still_serve(
    buffer: ReplayBuffer, redis_client: redis.Redis, tmp_path
) -> None:
    """A newer learner's manifest ({"schema": 2}) or a key that is no version must not stop an actor
    from finding the versions it can serve: ``manifest_versions`` skips non-numeric keys, and the
    actor's registry scan refuses the unreadable entry once (remembered) and goes on to older ones."""
    from asyncrl.actors.version_watch import UNREADABLE, VersionWatching
    from asyncrl.buffer.paths import weight_roots

    run_dir = tmp_path / "run"
    roots = weight_roots(run_dir, buffer.keys.run)
    manifests = {}
    for v in (1, 2):
        d = roots[0] / f"v{v}"
        d.mkdir(parents=True)
        (d / "model.safetensors").write_bytes(bytes([v]) * 100)
        manifests[v] = build_manifest(v, d, "float32")
        buffer.publish_weights(manifests[v])
    redis_client.hset(buffer.keys.weights, "3", msgpack.packb({"schema": 2, "version": 3}))
    redis_client.hset(buffer.keys.weights, "latest", b"x")
    assert buffer.manifest_versions() == [1, 2, 3]
    with pytest.raises(ValueError, match="schema"):
        buffer.manifest(3)

    watcher = VersionWatching()
    watcher.buffer, watcher.weight_roots = buffer, roots
    found, refused = watcher._scan_manifests(0, set())
    assert found == manifests[2]
    assert [(key, type(e)) for key, e in refused] == [((3, UNREADABLE), ValueError)]
    found, refused = watcher._scan_manifests(0, {(3, UNREADABLE)})  # remembered: not refused again
    assert found == manifests[2] and refused == []
    # Fixed in place (a re-publish of v3 that parses): served, the remembered refusal does not stick.
    d = roots[0] / "v3"
    d.mkdir()
    (d / "model.safetensors").write_bytes(b"\3" * 100)
    buffer.publish_weights(build_manifest(3, d, "float32"))
    assert watcher._scan_manifests(0, {(3, UNREADABLE)})[0].version == 3


def test_dead_letter_counter_counts_every_dead_letter_past_the_streams_cap(buffer, redis_client):
    """The dead-letter stream is trimmed at about DEAD_MAXLEN, so its length stops growing (and drops at
    each trim): stats()["dead_total"] (exported as asyncrl_buffer_dead_letters_total) counts every dead
    letter ever written, by both writers (the consumer's and an actor's abandon), and a repeat of an
    idempotent dead letter counts nothing."""
    bad = DEAD_MAXLEN + 250
    pipe = redis_client.pipeline(transaction=False)
    for i in range(bad):  # a foreign producer writing garbage
        pipe.xadd(buffer.keys.rollouts, {b"g": b"\x00not msgpack %d" % i})
    pipe.execute()
    while buffer.read("c", 1000, block_ms=0):
        pass
    for i in range(7):
        assert buffer.abandon(f"g-{i}", "actor-0", "reward raised")
    assert not buffer.abandon("g-0", "actor-0", "reward raised")  # a repeat: no second dead letter
    first = redis_client.xrange(buffer.keys.dead, count=1)[0]
    assert buffer.dead_letter([(first[1][b"id"].decode(), "again", b"")]) == 0  # already acknowledged

    s = buffer.stats()
    assert s["dead_total"] == bad + 7
    assert s["dead"] < bad + 7  # the stream was trimmed: its length undercounts
    assert s["depth"] == s["pending"] == 0

    registry = CollectorRegistry(auto_describe=False)
    for c in learner_collectors(LearnerExporter(max_staleness=1), buffer.stats):
        registry.register(c)
    body = generate_latest(registry).decode()
    assert f"asyncrl_buffer_dead_letters_total {float(bad + 7)}" in body.splitlines()
