"""A real rollout actor (vLLM CPU engine, real redis-server) survives what used to kill it: a reward
function that raises (every 5th call, task.reward_fault) and a Redis freeze (SIGSTOP) longer than its
retry budget, which fails its generation loop. The loop is restarted in place (same engine), writing
resumes, and the admission arithmetic balances: admitted = written + credited, nothing left in flight,
every dropped group in the dead-letter stream with its reason, no group written twice."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import time
from collections import Counter
from pathlib import Path

import pytest

from asyncrl.buffer import EmbeddedRedis, ReplayBuffer, build_manifest, decode
from asyncrl.buffer.layout import ROLLOUT_FIELD
from asyncrl.config import load_config

pytest.importorskip("vllm")


async def _until(cond, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        await asyncio.sleep(0.1)


def _actor(tmp_path: Path, overrides: list[str]):
    """A real redis-server, a buffer with weights v0 published, and a RolloutActor (not started): one
    engine, 2 groups of 2 in flight, 4-token completions, no admission bound, plus ``overrides``;
    returns (server, buffer, actor)."""
    from asyncrl.actors.actor import RolloutActor
    from asyncrl.tinymodel import resolve_model_path

    run_dir = tmp_path / "run"
    server = EmbeddedRedis(tmp_path / "redis").start()
    cfg = load_config(overrides=[
        f"run.dir={run_dir}", f"redis.url={server.url}", "actors.group_size=2", "actors.groups_in_flight=2",
        "actors.max_tokens=4", "actors.kv_cache_mib=64", "actors.refuse_stale_weights=false",
        "buffer.groups_per_step=1000", "metrics.enabled=false", *overrides,
    ])  # fmt: skip
    model_path = resolve_model_path(cfg, run_dir)
    v0 = run_dir / "weights" / "v0" / "model.safetensors"
    v0.parent.mkdir(parents=True)
    shutil.copy(model_path / "model.safetensors", v0)
    buf = ReplayBuffer.from_config(cfg)
    buf.publish_weights(build_manifest(0, v0, "float32"))
    return server, buf, RolloutActor(cfg, run_dir, 0, redis_url=server.url, model_path=model_path)


def test_actor_survives_reward_faults_and_a_redis_freeze_past_its_budget(tmp_path: Path) -> None:
    server, buf, actor = _actor(tmp_path, [
        "run.name=actor-faults", "actors.heartbeat_s=0.5", "actors.loop_restarts=4", "task.reward_fault=raise",
        "task.reward_fault_every=5", "redis.retry_budget_s=2", "redis.socket_timeout_s=1",
    ])  # fmt: skip
    c = actor.counters

    async def main() -> None:
        run = asyncio.create_task(actor.run())
        await _until(lambda: c["groups_written"] >= 6 and c["groups_reward_failed"] >= 2, 180, "first groups")
        before = c["groups_written"]
        os.kill(server.pid, signal.SIGSTOP)  # 5 s > budget (2 s) + socket timeout (1 s): the loop fails
        try:
            await asyncio.sleep(5.0)
        finally:
            os.kill(server.pid, signal.SIGCONT)
        await _until(lambda: c["loop_restarts"] >= 1 and c["groups_written"] >= before + 4, 120, "restart")
        assert not run.done()
        await actor.stop(abort=True)
        await run

    try:
        asyncio.run(main())
        s = buf.stats()
        entries = buf.client.xrange(buf.keys.rollouts)
        ids = Counter(decode(f[ROLLOUT_FIELD]).group_id for _, f in entries)
        assert ids and max(ids.values()) == 1  # no group written twice
        # A put that timed out during the freeze may still have run on thaw: that group is in the stream
        # (once) although the actor counted it as failed; one that had not run was tombstoned.
        assert c["groups_written"] <= s["depth"] <= c["groups_written"] + actor.cfg.actors.groups_in_flight
        inflight = sum(int(v) for v in buf.client.hvals(buf.keys.inflight))
        assert inflight == 0 and s["admitted"] == s["depth"] + s["credits"]
        reasons = [d["reason"] for d in buf.dead_letters(count=1000)]
        # Likewise a dead-letter write: counted once confirmed, but one that timed out in the freeze may
        # have run on thaw (at most one per group worker), with its restart reclaiming the credit.
        assert (
            2
            <= c["groups_reward_failed"]
            <= len(reasons)
            <= c["groups_reward_failed"] + actor.cfg.actors.groups_in_flight
        )
        assert all(r.startswith("reward: InjectedRewardFault: injected reward fault") for r in reasons)
        assert c["engine_errors"] >= 1 and c["loop_restarts"] >= 1
    finally:
        buf.close()
        server.stop()


def test_prompts_the_engine_refuses_are_dead_lettered_without_failing_the_loop(tmp_path: Path) -> None:
    """Copy prompts of 8-30 tokens against model.max_model_len=20: vLLM refuses the longer ones
    (VLLMValidationError). Each such group is dead-lettered with the engine's reason and its slot
    credited; the loop never fails (before: every refusal failed the generation loop, whose restarts
    cancelled the groups in flight and ended the actor after actors.loop_restarts)."""
    server, buf, actor = _actor(tmp_path, [
        "run.name=actor-long-prompts", "task.min_len=2", "task.max_len=24", "model.max_model_len=20",
        "actors.loop_restarts=1",
    ])  # fmt: skip
    c = actor.counters

    async def main() -> None:
        run = asyncio.create_task(actor.run())
        await _until(
            lambda: c["groups_written"] >= 4 and c["groups_rejected"] >= 3 or run.done(), 180, "groups"
        )
        assert not run.done()
        await actor.stop(abort=True)
        await run

    try:
        asyncio.run(main())
        assert c["loop_restarts"] == 0 and c["engine_errors"] == 0
        s = buf.stats()
        reasons = [d["reason"] for d in buf.dead_letters(count=1000)]
        assert len(reasons) == c["groups_rejected"] == s["dead"]
        assert all("refused by the engine" in r and "maximum model length of 20" in r for r in reasons), (
            reasons
        )
        inflight = sum(int(v) for v in buf.client.hvals(buf.keys.inflight))
        assert inflight == 0 and s["admitted"] == s["depth"] + s["credits"]
    finally:
        buf.close()
        server.stop()


def test_a_stop_that_aborts_groups_hung_in_their_reward_gives_their_slots_back(tmp_path: Path) -> None:
    """Every reward call hangs (task.reward_fault=hang): both groups in flight wait in scoring when the
    stop (abort) comes. It cancels them at once, nothing is written, and both admission slots are
    credited back: admitted = credits, nothing left in the actor's in-flight tally. (A cancel while a
    group was scored used to leak its slot: it was credited only on a cancel during generation.)"""
    server, buf, actor = _actor(tmp_path, [
        "run.name=actor-hung-reward", "task.reward_fault=hang", "task.reward_fault_every=1",
        "task.reward_fault_hang_s=60", "task.reward_timeout_s=600",
    ])  # fmt: skip
    c = actor.counters

    async def main() -> None:
        run = asyncio.create_task(actor.run())
        await _until(lambda: actor.rewards.running >= 2, 180, "both groups hung in their reward")
        assert buf.stats()["admitted"] == 2 and c["groups_written"] == 0
        await actor.stop(abort=True)
        await run

    try:
        asyncio.run(main())
        s = buf.stats()
        inflight = sum(int(v) for v in buf.client.hvals(buf.keys.inflight))
        assert c["groups_aborted"] == 2 and c["groups_written"] == 0 and s["depth"] == 0
        assert inflight == 0 and s["admitted"] == 2 and s["credits"] == 2, (s, inflight)
    finally:
        buf.close()
        server.stop()
