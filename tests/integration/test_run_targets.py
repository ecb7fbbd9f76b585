"""`asyncrl run`'s Prometheus targets file (prometheus_targets.json) on real Redis: only the endpoints
this start runs, and none once the run is torn down (a finished run's dead ephemeral ports, reused by
another process, were scraped under its labels)."""

from __future__ import annotations

import json
import time

from asyncrl.config import Config
from asyncrl.orchestrator import Supervisor, _teardown
from asyncrl.run_targets import TARGETS_FILE, write_targets


def test_targets_list_only_this_run_s_actor_slots(buffer, tmp_path) -> None:
    """A previous start with 3 actors left slot 2's heartbeat in the registry; another pool's actor
    (actor-1-0) heartbeats there too. With actors.num_actors = 2 only slots 0 and 1 are targets."""
    for aid, index, port in (("actor-0", 0, 9100), ("actor-1", 1, 9101), ("actor-2", 2, 9102),
                             ("actor-1-0", 0, 9103)):  # fmt: skip
        buffer.heartbeat(aid, {"actor_id": aid, "index": index, "metrics_addr": f"127.0.0.1:{port}"})
    buffer.set_learner_status({"metrics_addr": "127.0.0.1:9000"})
    groups = write_targets(tmp_path, "demo", buffer.learner_status(), buffer.actors(), num_actors=2)
    # Each endpoint's instance is its role in the run, not its (ephemeral) address: a restarted process
    # continues its series (a counter reset) instead of starting one whose first sample is never counted.
    assert groups == [
        {
            "targets": ["127.0.0.1:9000"],
            "labels": {"run": "demo", "role": "learner", "instance": "demo/learner"},
        },
        {
            "targets": ["127.0.0.1:9100"],
            "labels": {"run": "demo", "role": "actor", "instance": "demo/actor-0"},
        },
        {
            "targets": ["127.0.0.1:9101"],
            "labels": {"run": "demo", "role": "actor", "instance": "demo/actor-1"},
        },
    ]
    assert json.loads((tmp_path / TARGETS_FILE).read_text()) == groups
    # The supervisor calls this every second: unchanged targets are not rewritten (same inode, mtime).
    files = [tmp_path / TARGETS_FILE, tmp_path.parent / "_prometheus" / f"{tmp_path.name}.json"]
    before = [(f.stat().st_ino, f.stat().st_mtime_ns) for f in files]
    time.sleep(0.02)
    assert write_targets(tmp_path, "demo", buffer.learner_status(), buffer.actors(), num_actors=2) == groups
    assert [(f.stat().st_ino, f.stat().st_mtime_ns) for f in files] == before
    buffer.heartbeat("actor-1", {"actor_id": "actor-1", "index": 1, "metrics_addr": "127.0.0.1:9201"})
    write_targets(tmp_path, "demo", buffer.learner_status(), buffer.actors(), num_actors=2)
    for f in files:
        assert "127.0.0.1:9201" in f.read_text() and (f.stat().st_ino, f.stat().st_mtime_ns) not in before
    # A run whose own pool leased number 1 (a serve-actors of its external Redis held 0): its actors are
    # actor-1-<i>, and only those are its targets.
    groups = write_targets(tmp_path, "demo", buffer.learner_status(), buffer.actors(), num_actors=2, pool=1)
    assert [g["labels"]["instance"] for g in groups] == ["demo/learner", "demo/actor-1-0"]


def test_teardown_empties_the_targets(tmp_path) -> None:
    """The run's tear-down (real embedded Redis, stopped by it) leaves ``[]`` in the targets file."""
    cfg = Config()
    cfg.run.name = "targets"
    rdir = tmp_path / "run"
    rdir.mkdir()
    sup = Supervisor(cfg, rdir, rdir / "config.yaml", time.time(), lambda msg: None)
    sup.start_redis()
    write_targets(rdir, "targets", {"metrics_addr": "127.0.0.1:9000"}, {}, num_actors=1)
    assert json.loads((rdir / TARGETS_FILE).read_text()) != []
    assert _teardown(None, sup, None) == 0
    assert json.loads((rdir / TARGETS_FILE).read_text()) == []
    assert not sup.redis_srv.running and not (rdir / "redis.url").exists()
