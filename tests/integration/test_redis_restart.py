"""A Redis crash (SIGKILL) and restart on the same data dir keeps the buffer (AOF, fsync always)."""

from __future__ import annotations

from pathlib import Path

import pytest

from asyncrl.buffer import EmbeddedRedis, EmbeddedRedisError, ReplayBuffer, WeightManifest
from tests.conftest import small_group


def test_kill9_restart_keeps_unacked_groups_version_and_manifests(tmp_path: Path) -> None:
    data_dir = tmp_path / "redis"
    server = EmbeddedRedis(data_dir, appendfsync="always").start()
    try:
        buf = ReplayBuffer(server.client(socket_timeout=10.0), "restart", owns_client=True)
        groups = [small_group() for _ in range(10)]
        ids = [buf.put(g) for g in groups]
        delivered = buf.read("learner-0", 6, block_ms=0)
        buf.ack([e.entry_id for e in delivered[:2]])  # 2 acked, 4 pending, 4 never delivered
        manifest = WeightManifest(version=5, path="/w/v5", sha256="ab" * 32, size=123, dtype="bfloat16")
        buf.publish_weights(manifest)
        assert buf.try_admit(0, 10)
        buf.credit(2)
        buf.close()
        server.kill()  # SIGKILL: no SHUTDOWN, no final AOF rewrite

        server = EmbeddedRedis(data_dir, appendfsync="always").start()
        buf = ReplayBuffer(server.client(socket_timeout=10.0), "restart", owns_client=True)
        s = buf.stats()
        assert (s["version"], s["depth"], s["pending"], s["admitted"], s["credits"]) == (5, 8, 4, 1, 2)
        assert buf.manifest(5) == manifest and buf.latest_manifest() == manifest
        got = buf.read("learner-0", 100, block_ms=0)
        assert [e.entry_id for e in got] == ids[2:]  # unacked pending first, then the rest
        assert [e.group for e in got] == groups[2:]
        assert buf.ack([e.entry_id for e in got]) == 8
        buf.close()
    finally:
        server.stop()


def test_second_server_on_same_data_dir_refused(tmp_path: Path) -> None:
    with EmbeddedRedis(tmp_path) as first:
        with pytest.raises(EmbeddedRedisError, match=f"pid {first.pid}"):
            EmbeddedRedis(tmp_path).start()
        assert first.client().ping()


def test_startup_failure_reports_log(tmp_path: Path) -> None:
    with EmbeddedRedis(tmp_path / "a") as first:
        # A fixed port that is taken: the error must carry the server's own explanation.
        with pytest.raises(EmbeddedRedisError, match="(?s)exited with code.*(Address already in use|bind)"):
            EmbeddedRedis(tmp_path / "b", port=first.port).start()
