"""The learner's publish: register + prune + notify in one script call, storage freed at the next publish.

Real redis-server (tests/conftest.py), the real file and shm transports. Before, the publish made three
round trips (register and notify, HKEYS, HDEL) and deleted files after the notification had woken the
actors, whose swap shared the learner's cores with that work in a synchronous run.
"""

from __future__ import annotations

import random
import uuid
from pathlib import Path

import pytest
import redis
import torch
from safetensors.torch import load_file

from asyncrl.buffer import ReplayBuffer
from asyncrl.learner.publisher import FilesystemTransport, Publisher, ShmTransport


def _weights(v: int) -> dict[str, torch.Tensor]:
    return {"w": torch.full((4, 8), float(v)), "b": torch.arange(3, dtype=torch.float32) + v}


def _manifest(tmp_path: Path, v: int):
    return FilesystemTransport(tmp_path / f"m{v}").publish(v, _weights(v), "float32")


def test_publish_prunes_like_prune_manifests_in_the_same_call(buffer, tmp_path) -> None:
    """Against the reference (register, then prune_manifests) on random histories: the same registry
    and the same dropped versions, ascending; a key that is not a decimal version is left alone."""
    rng = random.Random(7)
    client = buffer._client
    for trial in range(12):
        buffer.prune_manifests([])  # empty registry
        client.hset(buffer.keys.weights, "not-a-version", b"x")
        keep = rng.randint(1, 4)
        v, held = rng.randint(0, 3), []
        for _ in range(rng.randint(1, 9)):
            v += rng.randint(1, 11)  # gaps (versions a crash never published); 9 -> 10 sorts as numbers
            m = _manifest(tmp_path, v)
            receivers, dropped = buffer.publish_weights_pruned(m, keep)
            held.append(v)
            assert receivers == 0 and dropped == held[:-keep], (trial, keep, held)
            held = held[-keep:]
            assert buffer.manifest_versions() == held and buffer.version() == v
            assert buffer.manifest(v).sha256 == m.sha256
        assert client.hget(buffer.keys.weights, "not-a-version") == b"x"
    with pytest.raises(ValueError, match="keep_versions"):
        buffer.publish_weights_pruned(_manifest(tmp_path, 999), -1)
    n = len(buffer.manifest_versions())  # publish_weights: keep 0, nothing pruned
    assert buffer.publish_weights(_manifest(tmp_path, 1000)) == 0 and len(buffer.manifest_versions()) == n + 1


def test_a_notified_subscriber_finds_the_registry_pruned(buffer, tmp_path) -> None:
    """What a woken actor reads: the new version and the kept ones only (the script is atomic, so
    this checks the prune happened in the call that notified, not its order inside the script)."""
    sub = buffer.subscribe_versions()
    try:
        for v in range(1, 6):
            assert buffer.publish_weights_pruned(_manifest(tmp_path, v), 2)[0] == 1  # one subscriber
            assert sub.get(timeout=5.0) == v
            assert buffer.manifest_versions() == list(range(max(1, v - 1), v + 1))
    finally:
        sub.close()


class _Counting(redis.Redis):
    """The run's client, recording the name of every command it sends."""

    sent: list[str]

    def execute_command(self, *args, **options):
        self.sent.append(str(args[0]).lower())
        return super().execute_command(*args, **options)


@pytest.mark.parametrize("kind", ["file", "shm"])
def test_a_publish_is_one_round_trip_and_frees_storage_at_the_next(
    redis_client, run_name, tmp_path, kind
) -> None:
    if kind == "file":
        transport = FilesystemTransport(tmp_path / "weights")
    else:
        transport = ShmTransport(Path("/dev/shm") / f"asyncrl-test-prune-{uuid.uuid4().hex[:8]}")
    client = _Counting(connection_pool=redis_client.connection_pool)
    client.sent = []
    buffer = ReplayBuffer(client, run_name)
    pub = Publisher(buffer, transport, keep_versions=2, dtype="float32")
    exists = lambda v: (transport.version_dir(v) / "model.safetensors").exists()  # noqa: E731
    try:
        for v in range(3):
            client.sent.clear()
            pub.publish(v, _weights(v))
            # One script call (redis-py's EVALSHA, or SCRIPT LOAD + EVALSHA the first time) and nothing
            # else; the publisher's first publish then reads the registry once (its sweep), after it.
            want = ["evalsha", "hkeys"] if v == 0 else ["evalsha"]
            assert [c for c in client.sent if c != "script load"] == want, client.sent
        # v0 left the registry at the publish of v2; its storage waits for the next publish.
        assert buffer.manifest_versions() == [1, 2] and exists(0) and exists(1) and exists(2)
        pub.publish(3, _weights(3))
        assert buffer.manifest_versions() == [2, 3] and not exists(0) and exists(1)
        assert bool(load_file(transport.fetch(buffer.manifest(3)))["w"].eq(3.0).all())
        # Versions that left the registry without this publisher's script (another client pruned
        # them; or a retried call's lost reply) are still its own: freed once beyond the newest kept.
        buffer.prune_manifests(1)  # leaves [3]
        pub.publish(4, _weights(4))
        assert buffer.manifest_versions() == [3, 4] and not exists(1) and exists(2)
        pub.publish(5, _weights(5))
        assert buffer.manifest_versions() == [4, 5] and not exists(2) and exists(3) and exists(4)
    finally:
        pub.close()
        buffer.delete_run()
    if kind == "file":  # close frees the unregistered version (shm: close removes everything)
        assert not exists(3) and exists(4) and exists(5)
    else:
        assert not transport.root.exists()


def test_the_first_publish_frees_what_a_killed_learner_left_unregistered(buffer, tmp_path) -> None:
    """A learner killed between a publish and the free of what it unregistered (or a retried script
    whose first reply was lost) leaves versions stored that no registry lists and no process remembers:
    the next learner's first publish frees those older than the version it registers, and only those."""
    root = tmp_path / "weights"
    old = Publisher(buffer, FilesystemTransport(root), keep_versions=2, dtype="float32")
    for v in range(4):
        old.publish(v, _weights(v))
    # kill -9 here: v1 is unregistered with its storage pending; v0 was freed at the publish of v3.
    assert buffer.manifest_versions() == [2, 3] and sorted(d.name for d in root.iterdir()) == [
        "v1",
        "v2",
        "v3",
    ]
    (root / "v9").mkdir()  # an unregistered version newer than any registered one: not ours to judge
    (root / ".tmp-v4-1-abc").mkdir()  # a publish's temporary directory is no version
    transport = FilesystemTransport(root)
    assert transport.stored_versions() == [1, 2, 3, 9]
    new = Publisher(buffer, transport, keep_versions=2, dtype="float32")
    new.publish(4, _weights(4))
    assert buffer.manifest_versions() == [3, 4]
    new.free_unregistered()
    assert transport.stored_versions() == [3, 4, 9]
    new.publish(5, _weights(5))  # the sweep ran once: later publishes free only what they drop
    new.free_unregistered()
    assert transport.stored_versions() == [4, 5, 9]
