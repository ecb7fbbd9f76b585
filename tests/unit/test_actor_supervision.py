"""The actor supervisor judges only its own pool's actors (real Redis registry, no Ray).

Several ``asyncrl serve-actors`` pools of one run share the registry and their slot indices; a live
slot 0 of pool 1 must not vouch for a dead slot 0 of pool 0 (or the other way round)."""

from __future__ import annotations

import time
from types import SimpleNamespace

from asyncrl.actors.supervision import ActorSupervisor, slot_actor_id


def _pool(pool_index: int, n: int) -> SimpleNamespace:
    cfg = SimpleNamespace(actors=SimpleNamespace(pool_index=pool_index))
    return SimpleNamespace(cfg=cfg, actors=[None] * n, run_refs=[None] * n)


def test_slot_actor_ids() -> None:
    assert slot_actor_id(0, 3) == "actor-3" and slot_actor_id(2, 0) == "actor-2-0"


def test_heartbeats_of_other_pools_do_not_count(buffer) -> None:
    now = time.time()
    buffer.heartbeat("actor-0", {"actor_id": "actor-0", "index": 0, "time": now - 500, "pid": 1})
    buffer.heartbeat("actor-1-0", {"actor_id": "actor-1-0", "index": 0, "time": now, "pid": 2})
    buffer.heartbeat("actor-1-1", {"actor_id": "actor-1-1", "index": 1, "time": now - 5, "pid": 3})
    pool0 = ActorSupervisor(_pool(0, 2), buffer, heartbeat_timeout_s=60, max_restarts=1)._heartbeats()
    pool1 = ActorSupervisor(_pool(1, 2), buffer, heartbeat_timeout_s=60, max_restarts=1)._heartbeats()
    # Pool 0's slot 0 is judged by its own stale heartbeat, not pool 1's fresh one of the same index.
    assert set(pool0) == {0} and pool0[0]["pid"] == 1
    assert {i: hb["pid"] for i, hb in pool1.items()} == {0: 2, 1: 3}
