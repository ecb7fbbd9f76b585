"""The replay buffer, the admission script and the run registry on a real Redis Cluster (3 masters on
loopback, `redis-cli --cluster create`), selected by a ``redis+cluster://`` URL, through a master's
SIGKILL and restart on its data dir."""

from __future__ import annotations

import hashlib
import threading
import time
import uuid
from pathlib import Path

import pytest
import redis

from asyncrl.buffer import ReplayBuffer
from asyncrl.buffer.cluster import BudgetedCluster, split_cluster_url
from asyncrl.buffer.weights import WeightManifest
from tests.conftest import small_group
from tests.integration.redis_cluster import LocalRedisCluster

ETA, GPS = 1, 3


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with LocalRedisCluster(tmp_path_factory.mktemp("redis-cluster")) as c:
        yield c


def _buffer(cluster: LocalRedisCluster, run: str) -> ReplayBuffer:
    return ReplayBuffer.connect(cluster.url, run, max_staleness=ETA, groups_per_step=GPS, retry_budget_s=60)


def _manifest(tmp: Path, version: int) -> WeightManifest:
    f = tmp / f"w{version}.bin"
    f.write_bytes(bytes([version]) * 64)
    return WeightManifest(version=version, path=str(f), sha256=hashlib.sha256(f.read_bytes()).hexdigest(),
                          size=64, dtype="float32", created=time.time())  # fmt: skip


def test_a_run_lives_in_one_slot_and_every_buffer_operation_works_on_the_cluster(cluster, tmp_path) -> None:
    assert split_cluster_url("rediss+cluster://h:7000/0") == (True, "rediss://h:7000/0")
    run = f"cl-{uuid.uuid4().hex[:8]}"
    buf = _buffer(cluster, run)
    try:
        assert isinstance(buf.client, BudgetedCluster)
        node = redis.Redis(port=cluster.ports[0])
        slots = {int(node.execute_command("CLUSTER KEYSLOT", k)) for k in buf.keys.all_keys()}
        assert len(slots) == 1, "the {run} hash tag keeps every key of a run in one slot"

        # Admission: racing admitters never overshoot (V + eta + 1) * gps, in one Lua script.
        admitted: list[bool] = []

        def admit() -> None:
            for _ in range(10):
                admitted.append(buf.try_admit(None, None, 0, f"a{threading.get_ident()}"))

        threads = [threading.Thread(target=admit) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert sum(admitted) == (0 + ETA + 1) * GPS
        assert buf.try_admit(None, None, 0, "a") is False

        # Registry: publish moves V (the bound widens) and notifies a subscriber.
        sub = buf.subscribe_versions()
        assert buf.publish_weights(_manifest(tmp_path, 1)) >= 1
        assert sub.latest(5.0) == 1 and buf.version() == 1 and buf.latest_manifest().version == 1
        assert buf.try_admit(None, None, 1, "a") is True
        buf.heartbeat("actor-0", {"groups": 3})
        assert buf.actors()["actor-0"]["groups"] == 3

        # Data path: put, read through the consumer group, ack (deleted), credit a drop.
        groups = [small_group(group_id=f"{run}-g{i}") for i in range(4)]
        first = buf.put(groups[0], "a")
        rest = buf.put_many(groups[1:])  # one script call: the run's keys share a slot ("a" held one slot)
        assert all(isinstance(i, str) for i in rest) and len({first, *rest}) == 4
        got = buf.read("learner-0", 4, block_ms=1000)
        assert [e.group.group_id for e in got] == [g.group_id for g in groups]
        assert buf.ack([e.entry_id for e in got[:3]]) == 3
        st = buf.stats()
        assert (st["depth"], st["pending"], st["version"]) == (1, 1, 1)
        # Admission hints (the credit script PUBLISHes from inside Lua; the channel has the run's tag).
        wake = buf.subscribe_admission()
        assert not wake.wait(0.1)
        assert buf.credit(1) == 1 and buf.stats()["bound"] == (1 + ETA + 1) * GPS + 1
        assert wake.wait(5.0)
        wake.close()
        sub.close()
    finally:
        buf.delete_run()
        buf.close()


def test_buffer_rides_out_a_master_kill_and_restart_on_its_data_dir(cluster, tmp_path) -> None:
    run = f"cl-{uuid.uuid4().hex[:8]}"
    buf = _buffer(cluster, run)
    try:
        sub = buf.subscribe_versions()
        buf.publish_weights(_manifest(tmp_path, 1))
        assert sub.latest(5.0) == 1
        before = [small_group(group_id=f"{run}-before{i}") for i in range(2)]
        for g in before:
            assert buf.try_admit(None, None, 1, "a")
            buf.put(g, "a")
        port = cluster.master_of(buf.keys.version)

        cluster.kill(port)  # SIGKILL: no shutdown save, only the AOF (appendfsync always) survives
        t0 = time.monotonic()
        restarter = threading.Timer(2.0, cluster.restart, args=(port,))
        restarter.start()
        # Issued while the slot's master is dead: retried with backoff until it is back.
        assert buf.try_admit(None, None, 1, "a") is True
        outage = time.monotonic() - t0
        restarter.join()
        assert outage >= 1.5, f"the admit cannot have succeeded while the master was down ({outage:.1f}s)"
        cluster.wait_ok()

        after = small_group(group_id=f"{run}-after")
        buf.put(after, "a")
        got = buf.read("learner-0", 10, block_ms=1000)
        assert [e.group.group_id for e in got] == [g.group_id for g in [*before, after]], "nothing lost"
        st = buf.stats()
        assert (st["version"], st["admitted"], st["depth"]) == (1, 3, 3)
        # Pub/sub reconnects to the restarted node (a notice sent during the outage may be missed;
        # subscribers also poll the registry), and the registry kept its manifests.
        deadline = time.monotonic() + 20
        got_v = None
        v = 2
        while got_v is None and time.monotonic() < deadline:
            buf.publish_weights(_manifest(tmp_path, v))
            got_v = sub.latest(1.0)
            v += 1
        assert got_v is not None and got_v >= 2
        assert buf.manifest_versions()[0] == 1
        sub.close()
    finally:
        buf.delete_run()
        buf.close()
