"""`asyncrl status` against a real Redis and `asyncrl plot` on a metrics file, as a user runs them."""

from __future__ import annotations

import json
import subprocess
import sys
import time

from asyncrl.buffer import ReplayBuffer


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "asyncrl.cli", *args], capture_output=True, text=True, timeout=120
    )


def test_status_shows_buffer_admission_actors_and_learner(redis_url, run_name, make_group):
    buf = ReplayBuffer.connect(redis_url, run_name)
    try:
        buf.set_version(3)
        for _ in range(5):
            assert buf.try_admit(1, 4)
        for _ in range(3):
            buf.put(make_group())
        (e,) = buf.read("learner-0", 1, block_ms=None)  # one pending
        buf.put_raw(b"not msgpack")
        assert buf.read("learner-0", 5, block_ms=None)  # the bad one goes to the dead letters
        buf.credit(2)
        buf.heartbeat("actor-0", {"version": 3, "groups_written": 3, "in_flight": 1, "time": time.time()})
        buf.set_learner_status({"step": 7, "version": 3, "time": time.time()})
        r = _cli("status", f"redis.url={redis_url}", f"run.name={run_name}", "buffer.max_staleness=1",
                 "buffer.groups_per_step=4")  # fmt: skip
        assert r.returncode == 0, r.stderr
        out = r.stdout
        assert "policy version v3" in out
        assert "dead letters 1" in out
        assert "admitted 5 / bound 23" in out  # (3 + 1 + 1) * 4 + 3 credits (2 given, 1 for the dead letter)
        assert "depth 3   pending 3" in out
        assert "learner  step 7" in out and "actor-0" in out and "in flight 1" in out
        assert e.group.group_id
    finally:
        buf.delete_run()
        buf.close()


def test_plot_writes_a_png_from_metrics(tmp_path):
    with open(tmp_path / "metrics.jsonl", "w") as f:
        for step in range(1, 11):
            rec = {"step": step, "version": step, "time": 10.0 + step, "reward_mean": step / 20, "staleness_mean": 0.5,
                   "staleness_max": 1, "rollout_kl": 0.01, "mismatch_kl": 0.0}  # fmt: skip
            f.write(json.dumps(rec) + "\n")
    r = _cli("plot", str(tmp_path))
    assert r.returncode == 0, r.stderr
    png = tmp_path / "curve.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    missing = _cli("plot", str(tmp_path / "nope"))
    assert missing.returncode == 2 and "metrics.jsonl" in missing.stderr
