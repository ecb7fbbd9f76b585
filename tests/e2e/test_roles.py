"""The two roles as separate OS processes sharing only a Redis URL, a run name and the weights dir.

Before the learner starts, the one actor is frozen (SIGSTOP) and serve-actors must replace it.

The actors start first (they must wait for weight version 0), the learner second (it publishes v0 and
waits for data). With ``max_staleness=0`` admission lets the actors run exactly one step ahead, so the
training is synchronous on-policy: every trained token has staleness 0.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
import uuid

import psutil
import pytest

from asyncrl.buffer import EmbeddedRedis, ReplayBuffer
from tests.e2e.procs import ROOT, asyncrl_cmd, marked_env, read_jsonl, wait_for, wait_no_orphans

pytestmark = pytest.mark.slow

STEPS = 6
#: > an engine start-up on a loaded 2-core box (a replacement is judged from its spawn time).
HEARTBEAT_TIMEOUT_S = 60


def test_serve_actors_and_learn_as_two_processes_on_policy(tmp_path):
    marker = uuid.uuid4().hex
    rdir = tmp_path / "run"
    name = f"roles-{marker[:8]}"
    with EmbeddedRedis(tmp_path / "redis") as srv:
        common = ["--config", str(ROOT / "configs" / "default.yaml"), f"redis.url={srv.url}", f"run.name={name}",
                  f"run.dir={rdir}", f"run.max_steps={STEPS}", "buffer.max_staleness=0",
                  f"actors.heartbeat_timeout_s={HEARTBEAT_TIMEOUT_S}"]  # fmt: skip
        env = marked_env(marker)
        alog, llog = tmp_path / "actors.log", tmp_path / "learner.log"
        actors = subprocess.Popen(asyncrl_cmd("serve-actors", *common), env=env, stdout=alog.open("wb"),
                                  stderr=subprocess.STDOUT)  # fmt: skip
        try:
            buf = ReplayBuffer.connect(srv.url, name)
            # The pool is up and waiting for v0: heartbeats arrive, nothing is written without weights.
            wait_for(lambda: buf.actors(), 240, "an actor heartbeat", actors, alog)
            time.sleep(2)
            assert buf.stats()["depth"] == 0 and buf.version() == 0 and buf.latest_manifest() is None
            # serve-actors supervises its pool like `asyncrl run`: an actor frozen by SIGSTOP (its run call
            # never ends; only the heartbeat age tells) is replaced in its slot, under the same actor id.
            frozen = buf.actors()["actor-0"]["pid"]
            os.kill(frozen, signal.SIGSTOP)
            try:
                wait_for(lambda: buf.actors().get("actor-0", {}).get("pid") not in (None, frozen),
                         HEARTBEAT_TIMEOUT_S + 240, "a replacement actor's heartbeat", actors, alog)  # fmt: skip
            finally:
                if psutil.pid_exists(frozen):
                    os.kill(frozen, signal.SIGCONT)  # (already killed by the replacement: no-op)
            assert "replaced (1/" in alog.read_text(), alog.read_text()[-3000:]
            learner = subprocess.Popen(asyncrl_cmd("learn", *common), env=env, stdout=llog.open("wb"),
                                       stderr=subprocess.STDOUT)  # fmt: skip
            rc = learner.wait(timeout=600)
            assert rc == 0, llog.read_text()[-4000:]
            assert actors.poll() is None, "serve-actors must keep running while the learner is done"
            # A second learner without --resume: one error line in a second or two, before DeepSpeed loads
            # (before: a [rank0] traceback once the weights had loaded); the overrides after a flag taken.
            t0 = time.monotonic()
            again = subprocess.run(asyncrl_cmd("learn", common[0], common[1], "--allow-config-change",
                                               "learner.lr", *common[2:]),
                                   env=env, capture_output=True, text=True, timeout=120)  # fmt: skip
            assert again.returncode == 2 and time.monotonic() - t0 < 60, again.stderr[-3000:]
            assert (
                again.stderr.strip()
                .splitlines()[-1]
                .startswith(f"asyncrl: error: run '{name}' already has published weights or a checkpoint")
            ), again.stderr[-3000:]
            actors.send_signal(signal.SIGTERM)
            assert actors.wait(timeout=180) == 0, alog.read_text()[-4000:]
            heartbeats = buf.actors()
            buf.close()
        finally:
            for p in (actors,):
                if p.poll() is None:
                    p.kill()
    # `asyncrl learn` shows its lines (it configured no logging: the step lines went nowhere) and keeps them
    # in the run dir's learner.log, as `asyncrl run`'s learner does.
    for out in (llog.read_text(), (rdir / "learner.log").read_text()):
        assert "asyncrl.learner.loop: step 1 v" in out and f"asyncrl.learner.loop: step {STEPS} v" in out, (
            out[-3000:]
        )
        assert f"reached run.max_steps={STEPS}: done" in out, out[-3000:]
    # serve-actors' console: vLLM's INFO lines off it (as `asyncrl eval`'s), its own lines on it
    assert not re.search(r"\bINFO \d\d-\d\d \d\d:\d\d:\d\d\b", alog.read_text()), alog.read_text()[-3000:]
    assert "INFO asyncrl.actors.serve: actor pool" in alog.read_text(), alog.read_text()[-3000:]
    # The split run's summary.json, written by `asyncrl learn` as `asyncrl run` writes its own; status with
    # the URL of the Redis now gone shows it (before: "start it again (asyncrl run)").
    summary = json.loads((rdir / "summary.json").read_text())
    assert summary["finished"] is True and summary["status"] == "finished" and summary["steps"] == STEPS
    assert summary["started_by"] == "asyncrl learn"
    st = subprocess.run(asyncrl_cmd("status", *common), env=env, capture_output=True, text=True, timeout=60)
    assert st.returncode == 0 and "finished: not running" in st.stdout, st.stdout + st.stderr
    recs = read_jsonl(rdir / "metrics.jsonl")
    assert [r["step"] for r in recs] == list(range(1, STEPS + 1))
    for r in recs:
        assert r["staleness_max"] == 0 and set(r["staleness_hist"]) <= {"0"}, r
        assert r["dropped_stale"] == 0
        assert r["ratio_mean"] == pytest.approx(1.0, abs=1e-4), "on-policy, fp32: ratio 1 at every step"
    assert all(info["version"] >= STEPS - 1 for info in heartbeats.values()), heartbeats
    # The learner started on its own saved the run's config (redacted), as `asyncrl run` does: export,
    # eval, plan --from and a resume's config check read it (before: "not a run directory").
    from asyncrl.cli import main

    saved = (rdir / "config.yaml").read_text()
    assert f"name: {name}" in saved and "max_staleness: 0" in saved
    assert main(["export", str(rdir), str(tmp_path / "exported")]) == 0
    assert (tmp_path / "exported" / "model.safetensors").exists()
    left = wait_no_orphans(marker)
    assert not left, "processes left behind:\n" + "\n".join(left)
