"""The actor pool against the real stack: vLLM CPU engine in a Ray actor, real Redis, local Ray.

The tests share ONE pool (conftest ``actor_run``) and run in file order; each one moves the
learner version forward to let the actor admit exactly the groups it needs, so every count below
is exact. Admission bound: admitted < (V + 1 + 1) * 2 (+ credits), i.e. 2 more groups per version.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pytest

pytestmark = pytest.mark.timeout(600)

TOL = 1e-4  # |engine logprob - HF fp32 recompute|, per token


def _bound(version: int) -> int:
    return (version + 2) * 2


GROUP_SIZE, TEMPERATURE = 4, 0.8  # as configured by the actor_run fixture (conftest)


def _check_group_shape(g) -> None:
    assert len(g.completions) == GROUP_SIZE
    assert g.meta["temperature"] == pytest.approx(TEMPERATURE) and g.meta["task"] == "copy"
    for c in g.completions:
        n = c.num_tokens
        assert n > 0 and c.logprobs.shape == (n,) and c.versions.shape == (n,)
        assert c.finish_reason in ("stop", "length")
        assert n <= 160 and (c.finish_reason == "stop" or n == 160)


def _check_logprobs_by_version(run: Any, g) -> list[int]:
    """Every token's logprob matches HF recompute under the weights of ITS version; returns the
    versions seen. Also checks the reward against the task on HF-decoded text."""
    tok = run_tokenizer(run)
    prompt = next(p for p in run_task(run).prompts if p.prompt_id == g.prompt_id)
    assert list(g.prompt_token_ids) == tok(prompt.text)["input_ids"]
    seen = set()
    for c in g.completions:
        assert np.all(np.diff(c.versions.astype(np.int64)) >= 0)
        for v in np.unique(c.versions):
            mask = c.versions == v
            ref = run.hf_logprobs(int(v), g.prompt_token_ids, c.token_ids)
            err = np.abs(ref[mask] - c.logprobs[mask])
            assert err.max() < TOL, f"v{v}: max |mu - hf| = {err.max():.2e}"
            seen.add(int(v))
        text = tok.decode(c.token_ids.tolist(), skip_special_tokens=True)
        assert c.reward == pytest.approx(run_task(run).reward(prompt, text))
    return sorted(seen)


_CACHE: dict = {}


def run_task(run: Any):
    if "task" not in _CACHE:
        from asyncrl.tasks import make_task

        _CACHE["task"] = make_task(run.cfg.task, run.cfg.run.seed)
    return _CACHE["task"]


def run_tokenizer(run: Any):
    if "tok" not in _CACHE:
        from transformers import AutoTokenizer

        _CACHE["tok"] = AutoTokenizer.from_pretrained(run.model_dir)
    return _CACHE["tok"]


def _alive(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _wait_gone(pids: list[int], timeout: float = 30.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.5)
    return [p for p in pids if _alive(p)]


def test_written_groups_decode_and_match_hf_logprobs(actor_run: Any):
    groups = actor_run.wait_groups(_bound(0))
    assert len(groups) == 4
    for g in groups:
        _check_group_shape(g)
        assert _check_logprobs_by_version(actor_run, g) == [0]
        assert g.meta["version_start"] == g.meta["version_end"] == 0
    # The prompt order is the deterministic shard order (1 actor = the whole epoch permutation).
    order = run_task(actor_run).source(0, 0, 1).take(4)
    assert sorted(g.prompt_id for g in groups) == sorted(p.prompt_id for p in order)


def test_admission_bound_holds_until_the_version_advances(actor_run: Any):
    buf = actor_run.buffer
    wait0 = actor_run.stats()["admission_wait_s"]
    time.sleep(2.0)
    st = buf.stats()
    assert (st["admitted"], st["depth"]) == (4, 4)  # held at the bound (V=0) for 2 s
    st_actor = actor_run.stats()
    assert st_actor["admission_wait_s"] > wait0 + 1.0  # the workers were waiting ...
    assert st_actor["admission_blocked"] == 2 and st_actor["in_flight"] == 0  # ... both of them
    buf.set_version(1)
    assert len(actor_run.wait_groups(_bound(1))) == 6
    time.sleep(1.5)
    st = buf.stats()
    assert (st["admitted"], st["depth"]) == (6, 6)


def test_in_flight_swap_attributes_every_token_to_its_weights(actor_run: Any):
    run = actor_run
    manifest = run.prepare(2)
    run.buffer.set_version(2)  # admits 2 more groups, sampled by the v0 weights
    # Publish as soon as both groups generate: the v0 completions here run 16-40 tokens unless they
    # hit max_tokens, and on a fast VM a 50 ms poll after 40 tokens in flight let the swap land at token
    # 39, when all but the two longest had finished (2 spanning, not 4). Polled every 5 ms.
    run.wait_stats(lambda s: s["in_flight"] == 2 and s["in_flight_tokens"] >= 8, what="tokens in flight",
                   poll_s=0.005)  # fmt: skip
    run.buffer.publish_weights(manifest)  # perturbed weights while both groups are mid-generation
    new = run.wait_groups(_bound(2))[6:]
    assert len(new) == 2
    spanning = 0
    for g in new:
        _check_group_shape(g)
        assert _check_logprobs_by_version(run, g) == [0, 2]
        assert (g.meta["version_start"], g.meta["version_end"], g.meta["swaps"]) == (0, 2, 1)
        for c in g.completions:
            if c.versions[0] == 0 and c.versions[-1] == 2:
                spanning += 1
                post = c.versions == 2
                # The post-swap tokens really differ from what the old weights would give.
                old = run.hf_logprobs(0, g.prompt_token_ids, c.token_ids)[post]
                assert np.abs(old - c.logprobs[post]).mean() > 1e-2
    assert spanning >= 4
    st = run.stats()
    assert st["version"] == 2 and st["swaps"] == 1 and 0 < st["swap_pause_s"][-1] < 5.0


def test_between_groups_swap_drains_first(actor_run: Any):
    run = actor_run
    run.pool.actors[0].set_swap_mode.remote("between_groups")
    manifest = run.prepare(3)
    run.buffer.set_version(3)
    run.wait_stats(lambda s: s["in_flight"] == 2 and s["in_flight_tokens"] >= 40, what="tokens in flight")
    run.buffer.publish_weights(manifest)
    drained = run.wait_groups(_bound(3))[8:]
    for g in drained:  # finished entirely on the old weights, no swap inside
        _check_group_shape(g)
        assert _check_logprobs_by_version(run, g) == [2]
        assert g.meta["swaps"] == 0
    run.wait_stats(lambda s: s["version"] == 3, what="swap to v3")
    run.buffer.set_version(4)
    after = run.wait_groups(_bound(4))[10:]
    assert len(after) == 2
    for g in after:
        assert _check_logprobs_by_version(run, g) == [3]
    assert run.stats()["swaps"] == 2


def test_tampered_weights_are_refused_and_restart_resumes_on_latest(actor_run: Any):
    import psutil

    run = actor_run
    run.publish(5, tamper=True)  # V=5: admits 2 groups; the actor must keep v3
    groups = run.wait_groups(_bound(5))[12:]
    for g in groups:
        assert _check_logprobs_by_version(run, g) == [3]
    st = run.stats()
    assert st["weight_rejects"] == 1 and st["version"] == 3
    # Each group claimed its prompt position in Redis as it was admitted: 14 so far, none pending.
    assert run.buffer.prompts_claimed() == 14
    # Crash the actor (SIGKILL from Ray) while it idles at the bound; Ray restarts it.
    old_pid = st["pid"]
    engine_pids = [p.pid for p in psutil.Process(old_pid).children(recursive=True)]
    assert engine_pids  # vLLM runs its engine core in child processes
    run.pool.kill_actor(0, restart=True)
    run.publish(6)  # V=6 while it is down: the new instance must start on v6
    groups = run.wait_groups(_bound(6), timeout=300)[14:]
    assert len(groups) == 2
    for g in groups:
        assert _check_logprobs_by_version(run, g) == [6]
        assert g.meta["version_start"] == 6
    st = run.stats()
    assert st["pid"] != old_pid and st["reconstructed"] and st["version"] == 6
    # It went on with the run's prompt order (positions 14, 15) instead of restarting the epoch.
    order = [p.prompt_id for p in run_task(run).source(0, 0, 1).take(16)]
    assert sorted(g.prompt_id for g in groups) == sorted(order[14:16])
    assert sorted(g.meta["prompt_seq"] for g in groups) == [14, 15] and run.buffer.prompts_claimed() == 16
    # The killed instance left no engine processes behind.
    assert _wait_gone([old_pid, *engine_pids]) == []


def test_stop_aborts_in_flight_groups_and_leaves_no_processes(actor_run: Any):
    import psutil

    run = actor_run
    run.buffer.set_version(7)  # 2 more groups
    # Polled every 5 ms: the abort must land while both groups still generate, also on a fast VM.
    st = run.wait_stats(
        lambda s: s["in_flight"] == 2 and s["in_flight_tokens"] >= 20, what="tokens in flight", poll_s=0.005
    )
    pids = [st["pid"], *[p.pid for p in psutil.Process(st["pid"]).children(recursive=True)]]
    final = run.pool.stop(abort=True)
    assert final[0]["groups_aborted"] == 2 and final[0]["state"] == "stopped"
    bs = run.buffer.stats()
    # Aborted groups are not written and give their admission slot back.
    assert bs["depth"] == 16 and bs["admitted"] == 18 and bs["credits"] == 2
    assert run.buffer.actors()["actor-0"]["state"] == "stopped"
    assert _wait_gone(pids) == []
