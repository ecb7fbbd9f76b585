"""`asyncrl run`'s supervisor on real processes (a real redis-server, real child processes), without
the heavy roles: the embedded Redis comes back on its data dir and port after kill -9, a learner that
exits at its step target ends the run, and one that fails past ``run.max_restarts`` stops the run with
a clear error instead of hanging. (The full roles under faults: tests/chaos.)"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
import redis

from asyncrl.config import Config
from asyncrl.orchestrator import RunFailed, Supervisor


def _sup(tmp_path, max_restarts: int = 1, max_steps: int = 3) -> tuple[Supervisor, list[str]]:
    cfg = Config()
    cfg.run.dir = str(tmp_path)
    cfg.run.max_steps = max_steps
    cfg.run.max_restarts = max_restarts
    notes: list[str] = []
    return Supervisor(cfg, tmp_path, tmp_path / "config.yaml", 0.0, notes.append), notes


def _child(code: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code])


def test_killed_embedded_redis_comes_back_on_its_data_dir_port_and_password(tmp_path) -> None:
    sup, notes = _sup(tmp_path)
    url = sup.start_redis()
    assert "127.0.0.1" in url and sup.redis_srv.password and len(sup.redis_srv.password) >= 16
    sup.learner = _child("import time; time.sleep(60)")
    try:
        client = redis.Redis.from_url(url, socket_timeout=5)
        client.set("k", "kept")
        os.kill(sup.redis_srv.pid, signal.SIGKILL)
        sup.redis_srv._proc.wait(10)
        assert sup.check() is False
        assert sup.restarts["redis"] == 1 and notes and "redis" in notes[0] and "(1/1)" in notes[0]
        assert sup.redis_srv.url == url  # same port and password: every client reconnects as is
        assert redis.Redis.from_url(url, socket_timeout=5).get("k") == b"kept"  # AOF replayed
        os.kill(sup.redis_srv.pid, signal.SIGKILL)
        sup.redis_srv._proc.wait(10)
        with pytest.raises(RunFailed, match=r"redis .*restarts exhausted \(1, run.max_restarts\)"):
            sup.check()
    finally:
        sup.learner.kill()
        sup.learner.wait()
        sup.redis_srv.stop()


def test_learner_at_its_step_target_ends_the_run(tmp_path) -> None:
    sup, notes = _sup(tmp_path, max_steps=3)
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in (1, 2, 3)))
    sup.learner = _child("pass")
    sup.learner.wait(30)
    assert sup.check() is True and sup.restarts["learner"] == 0 and not notes


def test_learner_killed_between_its_final_checkpoint_and_record_still_ends_the_run(tmp_path) -> None:
    """The learner commits step 3's checkpoint, then appends step 3's record: killed in between, its
    restart resumes at step 3 = max_steps and exits 0 at once. Judged by metrics.jsonl (step 2) alone it
    was restarted until run.max_restarts failed the run, and every re-run of the command did the same."""
    from asyncrl.learner.records import CHECKPOINT_DIR, POINTER, committed_step

    sup, notes = _sup(tmp_path, max_restarts=0, max_steps=3)
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in (1, 2)))
    (tmp_path / CHECKPOINT_DIR).mkdir()
    (tmp_path / CHECKPOINT_DIR / POINTER).write_text(
        json.dumps({"tag": "step00000003", "step": 3, "version": 3})
    )
    assert committed_step(tmp_path) == 3
    sup.learner = _child("pass")
    sup.learner.wait(30)
    assert sup.check() is True and sup.restarts["learner"] == 0 and not notes


def test_learner_failing_past_its_restarts_stops_the_run_with_the_reason(tmp_path) -> None:
    sup, notes = _sup(tmp_path, max_restarts=0, max_steps=3)
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1}) + "\n")
    sup.learner = _child("import sys; sys.exit(3)")
    sup.learner.wait(30)
    with pytest.raises(RunFailed, match=r"learner exited with code 3 at step 1 .*restarts exhausted \(0"):
        sup.check()
    # An exit 0 before the step target is a failure too (the learner must not just stop).
    sup, _ = _sup(tmp_path, max_restarts=0, max_steps=3)
    sup.learner = _child("pass")
    sup.learner.wait(30)
    with pytest.raises(RunFailed, match="exited with code 0 at step 1"):
        sup.check()


def test_a_failing_display_update_is_logged_once_and_never_raises(tmp_path, capsys) -> None:
    """The run's live display is outside the run's work: a record it cannot format (before the console
    fix, a "nan" eval from metrics.jsonl) must not fail the whole `asyncrl run`."""
    from asyncrl.orchestrator import _display_failed

    sup, notes = _sup(tmp_path)
    for _ in range(3):
        try:
            f"{'nan':.3f}"
        except ValueError as e:
            _display_failed(sup, e)
    assert len(notes) == 1 and "display update failed: ValueError" in notes[0] and "Traceback" in notes[0]

    def broken(msg: str) -> None:
        raise OSError("console gone")

    sup.note = broken
    _display_failed(sup, KeyError("eval_version"))  # the console itself fails: stderr, no raise
    assert "display update failed: KeyError" in capsys.readouterr().err
