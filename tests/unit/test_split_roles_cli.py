"""A user's walkthrough of the split-role deployment (`asyncrl serve-actors` + `asyncrl learn` on their own
Redis), at the command line: overrides anywhere on it, a fresh `asyncrl learn` over a run with weights
refused in a second, status of a kill -9'd actor and of a split run that is not up, serve-actors' console
quieted, a closed stdout. The learner's own lines and summary.json: tests/e2e/test_roles.py."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from asyncrl.buffer import ReplayBuffer
from asyncrl.cli import main
from asyncrl.config import Config

REPO = Path(__file__).resolve().parents[2]
QUIET = ("VLLM_LOGGING_LEVEL", "VLLM_LOGGING_STREAM", "HF_HUB_DISABLE_PROGRESS_BARS")


def _cli(*args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "asyncrl.cli", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=120, **kw)  # fmt: skip


def _dead_url() -> str:
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        return f"redis://127.0.0.1:{s.getsockname()[1]}/0"


def test_overrides_are_taken_after_flags_too(capsys):
    """`asyncrl learn -c f.yaml redis.url=U --resume run.max_steps=3000` was refused: "unrecognized
    arguments: run.max_steps=3000"."""
    assert main(["config", "run.name=x", "--explain", "run.max_steps=3000", "learner.lr=0.5"]) == 0
    out = capsys.readouterr().out
    assert "run.name = 'x'" in out and "run.max_steps = 3000" in out and "learner.lr = 0.5" in out
    # in command-line order: the later one wins, as it does within one run of overrides
    assert main(["config", "run.max_steps=1", "--explain", "run.max_steps=2"]) == 0
    assert "run.max_steps = 2 " in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:  # an unknown flag is still an error
        main(["config", "run.name=x", "--bogus", "run.max_steps=3"])
    assert e.value.code == 2 and "unrecognized arguments: --bogus run.max_steps=3" in capsys.readouterr().err


def test_a_fresh_learn_over_a_run_with_weights_is_refused_before_the_learner_starts(
    tmp_path, redis_url, run_name
):
    """Before, `asyncrl learn` without --resume loaded DeepSpeed and the weights, then ended in a
    `[rank0]: Traceback ... RuntimeError: ... already has published weights`."""
    with ReplayBuffer.connect(redis_url, run_name) as buf:
        try:
            buf.set_version(3)  # weights published in the run's Redis, no checkpoint on this disk
            t0 = time.monotonic()
            # the overrides after --allow-config-change: taken as well (item 2 of the walkthrough)
            r = _cli("learn", f"redis.url={redis_url}", "--allow-config-change", "learner.lr",
                     f"run.name={run_name}", f"run.dir={tmp_path / 'run'}")  # fmt: skip
            assert time.monotonic() - t0 < 30
            assert r.returncode == 2, r.stderr[-3000:]
            assert r.stderr.strip().splitlines()[-1] == (
                f"asyncrl: error: run {run_name!r} already has published weights or a checkpoint in "
                f"{tmp_path / 'run'}; resume it (asyncrl learn --resume) or use a new run name and directory"
            ), r.stderr[-3000:]
            assert "Traceback" not in r.stderr and "deepspeed" not in r.stderr.lower()
        finally:
            buf.delete_run()
    ckpt = tmp_path / "ckpt"  # a checkpoint on disk, nothing in Redis
    (ckpt / "checkpoints").mkdir(parents=True)
    (ckpt / "checkpoints" / "latest.json").write_text(
        json.dumps({"tag": "step00000004", "step": 4, "version": 4})
    )
    from asyncrl.config import load_config, to_yaml
    from asyncrl.launch import redacted

    saved = to_yaml(redacted(load_config(None, [f"run.name={run_name}-2", f"run.dir={ckpt}"])))
    (ckpt / "config.yaml").write_text(saved)  # the run's saved config, as it started
    r = _cli("learn", f"redis.url={redis_url}", f"run.name={run_name}-2", f"run.dir={ckpt}", "learner.lr=0.5",
             "--allow-config-change", "learner.lr")  # fmt: skip
    assert r.returncode == 2 and "already has published weights or a checkpoint" in r.stderr, r.stderr[-3000:]
    assert "Traceback" not in r.stderr
    # Refused before anything in the run dir changed: the saved config is not replaced by one never run.
    assert (ckpt / "config.yaml").read_text() == saved


def test_status_does_not_count_a_dead_actor_as_live():
    """A kill -9'd actor stayed "actors 1 / actor-0 ... last seen 51s ago" for ever."""
    cfg = Config()
    cfg.actors.heartbeat_timeout_s = 40.0
    now = 1000.0
    st = {"buffer": {}, "learner": {},
          "actors": {"actor-0": {"version": 3, "groups_written": 5, "in_flight": 1, "time": now - 51},
                     "actor-1": {"version": 3, "groups_written": 6, "in_flight": 1, "time": now - 1},
                     "actor-2": {"version": 3, "groups_written": 6, "in_flight": 0, "time": now - 20}}}  # fmt: skip
    from asyncrl.status import format_status

    lines = format_status(cfg, st, now=now).splitlines()
    assert "actors   3 seen, 1 live" in lines
    (a0,) = [ln for ln in lines if "actor-0" in ln]
    assert "last seen 51s ago   DEAD: no heartbeat for 51s > actors.heartbeat_timeout_s=40" in a0
    (a2,) = [ln for ln in lines if "actor-2" in ln]
    assert "SILENT: no heartbeat for 20s (a live actor beats every 2s)" in a2
    (a1,) = [ln for ln in lines if "actor-1" in ln]
    assert a1.endswith("last seen 1s ago")
    st["actors"] = {"actor-1": st["actors"]["actor-1"]}  # all live: the count alone, as before
    assert "actors   1" in format_status(cfg, st, now=now).splitlines()


def _split_summary(rdir: Path, status: str) -> None:
    """A run dir as a split run's `asyncrl learn` leaves it (asyncrl.learn_role._learn_summary)."""
    from asyncrl.run_summary import write_summary

    rdir.mkdir(parents=True)
    recs = [{"step": s, "version": s, "time": float(s), "reward_mean": 0.5, "staleness_max": 0, "tokens": 10}
            for s in range(1, 4)]  # fmt: skip
    write_summary(rdir, recs, 0.0, 30.0, {"finished": status == "finished", "status": status, "error": "",
                                          "started_by": "asyncrl learn"})  # fmt: skip


def test_status_of_a_split_run_that_is_not_up(tmp_path, capsys):
    """`asyncrl status redis.url=U` of an ended split run said "start it again (asyncrl run)"."""
    url = _dead_url()
    rdir = tmp_path / "split"
    # no summary.json: the advice names the split roles too, not `asyncrl run` alone
    rdir.mkdir()
    assert main(["status", f"redis.url={url}", f"run.dir={rdir}", "run.name=split"]) == 2
    err = capsys.readouterr().err
    assert "run split is not up" in err and "asyncrl learn --resume" in err and "serve-actors" in err, err
    rdir.rmdir()
    # an interrupted split run: its summary.json, and how to resume it with the split roles
    _split_summary(rdir, "interrupted")
    assert main(["status", f"redis.url={url}", f"run.dir={rdir}", "run.name=split"]) == 0
    out, err = capsys.readouterr()
    assert "is not up; its summary.json" in err
    assert "interrupted: not running" in out and "steps    3" in out
    assert "asyncrl learn --resume" in out and "asyncrl run" not in out, out


@pytest.mark.parametrize("verbose", [False, True])
def test_serve_actors_quiets_vllm_before_anything_starts_it(tmp_path, monkeypatch, redis_url, verbose):
    """serve-actors flooded the console with vLLM's INFO lines (`asyncrl eval` already quieted them; the
    e2e test of the roles checks a real pool's console). The pool's actors take the VLLM_* variables of
    this process's environment as the pool starts (asyncrl.actors.pool.actor_env): what they see is
    recorded there, and the environment is put back when the command returns."""
    from asyncrl.actors import serve

    for var in QUIET:
        monkeypatch.setenv(var, "")  # restored after the test
        monkeypatch.delenv(var)
    seen: list[dict] = []
    monkeypatch.setattr(
        serve, "serve_actors", lambda cfg, rdir: seen.append({k: os.environ.get(k) for k in QUIET})
    )
    args = ["serve-actors", f"redis.url={redis_url}", f"run.dir={tmp_path}", *(["-v"] if verbose else [])]
    assert main(args) == 0
    assert seen[-1]["VLLM_LOGGING_LEVEL"] == (None if verbose else "WARNING")
    assert seen[-1]["VLLM_LOGGING_STREAM"] == "ext://sys.stderr"
    assert all(os.environ.get(k) is None for k in QUIET)  # put back: main() ran in this process
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "DEBUG")  # the user's own choice wins
    assert main(args[:3]) == 0 and seen[-1]["VLLM_LOGGING_LEVEL"] == "DEBUG"


def test_a_closed_stdout_ends_the_command_quietly(tmp_path):
    """`asyncrl status ... | head` ended in a BrokenPipeError traceback."""
    _split_summary(tmp_path / "run", "finished")
    r, w = os.pipe()
    os.close(r)  # the reader is gone before anything is written (`head` done)
    try:
        p = subprocess.run([sys.executable, "-m", "asyncrl.cli", "status", f"run.dir={tmp_path / 'run'}"],
                           cwd=REPO, stdout=w, stderr=subprocess.PIPE, text=True, timeout=60)  # fmt: skip
    finally:
        os.close(w)
    assert p.returncode == 141 and p.stderr == "", p.stderr


def test_role_logging_shows_the_learner_s_lines_and_keeps_them_in_learner_log(tmp_path):
    """`asyncrl learn` configured no logging: its INFO step lines went nowhere (the e2e test of the roles
    checks a real learner's console)."""
    code = ("import logging, sys\nfrom pathlib import Path\nfrom asyncrl.console import role_logging\n"
            "role_logging(Path(sys.argv[1]))\n"
            "logging.getLogger('asyncrl.learner.loop').info('step 1 v1 reward 0.500')\n")  # fmt: skip
    log_file = tmp_path / "run" / "learner.log"
    p = subprocess.run(
        [sys.executable, "-c", code, str(log_file)], capture_output=True, text=True, timeout=60
    )
    assert p.returncode == 0, p.stderr
    assert "INFO asyncrl.learner.loop: step 1 v1 reward 0.500" in p.stderr
    assert "INFO asyncrl.learner.loop: step 1 v1 reward 0.500" in log_file.read_text()
    # stderr already is learner.log (`asyncrl run`'s learner): each line once
    log_file.unlink()
    with open(log_file, "ab") as f:
        p = subprocess.run([sys.executable, "-c", code, str(log_file)], stderr=f, timeout=60)
    assert p.returncode == 0
    assert log_file.read_text().count("step 1 v1") == 1


def test_a_learn_start_that_trained_nothing_keeps_a_finished_summary(tmp_path):
    """`asyncrl learn --resume` of a finished run that fails before its first step (Redis unreachable)
    must not replace its "finished" summary.json with "failed" (the run would look unfinished and
    `asyncrl run` would no longer refuse to start over it); one that trained a step writes its own."""
    from asyncrl.learn_role import _finished_before
    from asyncrl.run_summary import write_summary

    recs = [{"step": s, "version": s, "step_time": 100.0 + s, "reward_mean": 0.5, "staleness_max": 0,
             "tokens": 10} for s in (1, 2)]  # fmt: skip
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    assert not _finished_before(tmp_path, 200.0)  # no summary yet
    write_summary(tmp_path, recs, 100.0, 103.0, {"finished": True, "status": "finished"})
    assert _finished_before(tmp_path, 200.0)  # this start (at 200) wrote no record: keep it
    assert not _finished_before(tmp_path, 101.5)  # a record after this start: it trained, write its own
    write_summary(tmp_path, recs, 100.0, 103.0, {"finished": False, "status": "interrupted"})
    assert not _finished_before(tmp_path, 200.0)
