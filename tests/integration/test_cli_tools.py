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


def _ended_run(rdir, status: str, steps: int = 10, error: str = "") -> None:
    """A run dir as `asyncrl run` leaves it when it stops: config.yaml, metrics.jsonl, a committed
    checkpoint, summary.json (asyncrl.orchestrator.write_summary), no redis.url."""
    from asyncrl.config import load_config, to_yaml
    from asyncrl.orchestrator import write_summary

    rdir.mkdir(parents=True)
    (rdir / "config.yaml").write_text(
        to_yaml(load_config(overrides=[f"run.name={rdir.name}", "run.max_steps=60"]))
    )
    recs = [{"step": s, "version": s, "time": float(s), "step_time": 100.0 + s, "reward_mean": s / 20,
             "staleness_max": 1, "tokens": 100} for s in range(1, steps + 1)]  # fmt: skip
    with open(rdir / "metrics.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in recs)
    (rdir / "checkpoints").mkdir()
    (rdir / "checkpoints" / "latest.json").write_text(json.dumps({"tag": f"step{steps:08d}", "step": steps,
                                                                  "version": steps}))  # fmt: skip
    extra = {"finished": status == "finished", "status": status, "error": error, "learner_exit_code": 0,
             "buffer": {"depth": 8, "pending": 0, "dead": 2}, "restarts": {"redis": 0, "learner": 1, "actors": [0]}}  # fmt: skip
    write_summary(rdir, recs, 100.0, 100.0 + 95.0, extra)


def test_status_of_an_ended_run_shows_its_summary(tmp_path, capsys):
    """A user's walkthrough: `asyncrl status` after the run ended told them to start a Redis (the run's
    embedded one is gone with it). It now shows the run dir's summary.json, exit code as the run's."""
    done = tmp_path / "done"
    _ended_run(done, "finished")
    r = _cli(
        "status", f"run.dir={done}"
    )  # the command line names the dir only: name and max_steps are the run's
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert out.startswith("run done   finished: not running, ended ") and "summary.json" in out, out
    assert "steps    10 / 60 (run.max_steps)   policy version v10" in out
    assert "reward   0.100 -> 0.450" in out and "running  95 s" in out and "trained tokens 1000" in out
    assert f"checkpoint  step 10 (v10)   {done / 'checkpoints' / 'step00000010'}" in out
    assert "dead letters 2 (at the end)" in out and "restarts redis 0   learner 1   actors 0" in out
    assert f"asyncrl export {done}" in out and "redis-server" not in r.stdout + r.stderr

    from asyncrl.cli import main

    stopped = tmp_path / "stopped"
    _ended_run(stopped, "interrupted", steps=4)
    assert main(["status", f"run.name={stopped.name}", f"run.dir={stopped}"]) == 0
    out = capsys.readouterr().out
    assert "interrupted: not running" in out and "steps    4 / 60" in out
    assert "again to resume it" in out and "error" not in out

    failed = tmp_path / "failed"
    _ended_run(failed, "failed", steps=3, error="learner failed 4 times")
    assert main(["status", f"run.dir={failed}"]) == 1  # as `asyncrl run` exited
    assert "error    learner failed 4 times" in capsys.readouterr().out

    # Resumed, then killed (kill -9: its redis.url stays, its Redis is gone): the summary is the earlier
    # start's, so the crash advice, not "interrupted ... 4 steps" as if that start had ended cleanly.
    import socket
    import time

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]  # nothing listens once closed
    time.sleep(0.01)
    (stopped / "redis.url").write_text(f"redis://127.0.0.1:{dead}/0\n")
    assert (
        main(
            [
                "status",
                f"run.dir={stopped}",
            ]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert "crashed or was killed" in err and "summary.json:" not in err, err

    assert main(["status", f"run.dir={tmp_path / 'nope'}"]) == 2  # no such run: said so, not "start a Redis"
    assert "no run dir" in capsys.readouterr().err
    (tmp_path / "starting").mkdir()
    assert main(["status", f"run.dir={tmp_path / 'starting'}"]) == 2
    assert "has left no summary.json" in capsys.readouterr().err
