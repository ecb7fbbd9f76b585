"""The actor supervisor judges only its own pool's actors (real Redis registry, no Ray).

Several ``asyncrl serve-actors`` pools of one run share the registry and their slot indices; a live
slot 0 of pool 1 must not vouch for a dead slot 0 of pool 0 (or the other way round)."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

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


class _Replacing(SimpleNamespace):
    """The pool side of a replacement: run the supervisor's reclaim, then "spawn" (nothing to spawn here)."""

    def replace_actor(self, i: int, before_spawn) -> bool:
        before_spawn()
        return True


def test_a_slot_without_heartbeat_reclaims_its_own_pools_id(buffer, ray_one_cpu) -> None:
    ray = ray_one_cpu
    # Pool 0's live actor-1 holds two admission slots; pool 2's slot 1 held one and died during
    # engine start-up, before any heartbeat (so the registry has no actor id for it).
    for owner in ("actor-1", "actor-1", "actor-2-1"):
        assert buffer.try_admit(max_staleness=1, groups_per_step=4, owner=owner)
    cfg = SimpleNamespace(actors=SimpleNamespace(pool_index=2))
    # A ready ref whose value is None: each slot's run call "returned although the run was not stopping".
    pool = _Replacing(cfg=cfg, actors=[None, None], run_refs=[ray.put(None), ray.put(None)])
    sup = ActorSupervisor(pool, buffer, heartbeat_timeout_s=60, max_restarts=1)
    done = sup.poll()
    assert len(done) == 2 and "(actor-2-0)" in done[0] and "(actor-2-1)" in done[1]
    assert "1 admission slots reclaimed" in done[1]
    # Pool 0's actor-1 still holds both of its slots: nothing of it became a credit.
    assert buffer.reclaim_inflight("actor-1") == 2


def test_replace_actor_replaces_only_a_confirmed_death(ray_one_cpu) -> None:
    """ActorPool.replace_actor on real Ray actors: the reclaim hook runs and a new incarnation starts
    once the killed actor's run call has failed (it can no longer write). While that call is not
    resolved at the timeout neither happens, since the new incarnation would reclaim the slot's
    in-flight slots itself as it starts; a later call, once the death is confirmed, replaces it.
    (Unconfirmed is made deterministic by handing the pool a run call of another, live actor: a kill
    itself is confirmed within milliseconds here, even at timeout 0.)"""
    ray = ray_one_cpu
    from asyncrl.actors.pool import ActorPool

    @ray.remote(num_cpus=0)
    class Looping:
        def run(self, _arg) -> None:
            while True:
                time.sleep(0.05)

    bystander = Looping.remote()
    try:
        pool = ActorPool.__new__(ActorPool)
        pool._spawn = lambda i, generation: Looping.remote()
        pool.actors = [Looping.remote()]
        pool.run_refs = [pool.actors[0].run.remote(None)]
        pool.generations = [0]
        ray.wait(pool.run_refs, timeout=0.5)  # running (it never returns)
        calls: list[int] = []
        first = pool.actors[0]
        assert pool.replace_actor(0, before_spawn=lambda: calls.append(1), timeout=30.0) is True
        assert calls == [1] and pool.generations == [1] and pool.actors[0] is not first
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(first.run.remote(None), timeout=30)
        second, second_ref = pool.actors[0], pool.run_refs[0]
        unresolved = bystander.run.remote(None)
        pool.run_refs[0] = unresolved
        assert pool.replace_actor(0, before_spawn=lambda: calls.append(2), timeout=1.0) is False
        assert calls == [1] and pool.generations == [1]
        assert pool.actors[0] is second and pool.run_refs[0] is unresolved  # killed, not replaced
        # Confirmed at a later check (its own run call has failed): replaced then.
        pool.run_refs[0] = second_ref
        assert pool.replace_actor(0, before_spawn=lambda: calls.append(3), timeout=30.0) is True
        assert calls == [1, 3] and pool.generations == [2] and pool.actors[0] is not second
        assert ray.wait([pool.run_refs[0]], timeout=0.5)[0] == []  # the new incarnation runs
    finally:
        ray.kill(bystander)
