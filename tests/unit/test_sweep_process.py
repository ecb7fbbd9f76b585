"""The sweep's handling of its `asyncrl run` processes, with real processes and real signals: a killed
sweep takes its run with it, a stop signal stops the run in order (a second one does not abandon it), a
run dir whose recorded process is alive is refused, and a run dir two runs wrote into is never ok.

The run is a stand-in (FAKE_RUN: writes metrics.jsonl and summary.json like `asyncrl run`, by path, one
step every 0.25 s, and on SIGTERM stops after FAKE_STOP_S seconds); the sweep is a real process
(DRIVER: run_sweep with that stand-in as its command).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from asyncrl.config import ConfigError
from asyncrl.sweep import _proc_start, disk_status, is_finished, read_marker, run_one, run_sweep
from asyncrl.sweep_runs import step_problem
from asyncrl.sweep_spec import SweepSpec, load_spec

REPO = Path(__file__).resolve().parents[2]

FAKE_RUN = """
import json, os, signal, sys, time
args = dict(a.split("=", 1) for a in sys.argv[1:])
d, n, done = args["run.dir"], int(args["run.max_steps"]), 0
def end(finished):
    with open(os.path.join(d, "summary.json"), "w") as f:
        json.dump({"steps": done, "finished": finished, "status": "finished" if finished else "stopped"}, f)
    sys.exit(0)
def term(*_):
    open(os.path.join(d, "got_sigterm"), "w").close()
    time.sleep(float(os.environ.get("FAKE_STOP_S", "0")))
    end(False)
signal.signal(signal.SIGTERM, term)
steps = [int(s) for s in os.environ["FAKE_STEPS"].split(",")] if os.environ.get("FAKE_STEPS") else range(1, n + 1)
for i in steps:
    time.sleep(float(os.environ.get("FAKE_STEP_S", "0.25")))
    with open(os.path.join(d, "metrics.jsonl"), "a") as f:
        f.write(json.dumps(dict(step=i, version=i, time=0.25 * i, reward_mean=0.1, groups=4, tokens=80,
            staleness_mean=0.0, staleness_max=1, dropped_stale=0, mismatch_kl=0.0, rollout_kl=0.0, wait_s=0.1)) + "\\n")
    done = i
end(True)
"""

DRIVER = f"""
import sys
from asyncrl.sweep_spec import SweepSpec
from asyncrl.sweep import run_sweep
SweepSpec.command = lambda self, run: [sys.executable, "-c", {FAKE_RUN!r}, *self.run_overrides(run)]
sys.exit(run_sweep(sys.argv[1]))
"""


def _sweep_file(tmp_path: Path, max_steps: int = 8) -> Path:
    p = tmp_path / "s.yaml"
    p.write_text(yaml.safe_dump({"sweep": {
        "name": "p", "dir": str(tmp_path / "out"), "grid": {"max_staleness": [1], "objective": ["full"]},
        "objectives": {"full": []}, "seeds": [0], "overrides": [f"run.max_steps={max_steps}"]}}))  # fmt: skip
    return p


def _start_sweep(p: Path, **env: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", DRIVER, str(p)], cwd=REPO, env={**os.environ, **env},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip


def _wait_for_run(sweep: subprocess.Popen, run_dir: Path, steps: int = 1, timeout: float = 60.0) -> int:
    """The pid of the sweep's run (its one child) once metrics.jsonl has ``steps`` lines."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        metrics = run_dir / "metrics.jsonl"
        if metrics.exists() and len(metrics.read_text().splitlines()) >= steps:
            return int(Path(f"/proc/{sweep.pid}/task/{sweep.pid}/children").read_text().split()[0])
        time.sleep(0.1)
    raise AssertionError(f"no run with {steps} steps in {run_dir} after {timeout} s")


def _wait_gone(pid: int, timeout: float = 5.0) -> bool:
    end = time.monotonic() + timeout
    while _proc_start(pid) is not None and time.monotonic() < end:
        time.sleep(0.05)
    return _proc_start(pid) is None


def _steps(run_dir: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_a_killed_sweep_takes_its_run_with_it_and_the_rerun_is_one_run(tmp_path: Path):
    """kill -9 of the sweep left its run writing on, into the dir the next sweep re-ran it in (two runs'
    steps in one metrics.jsonl, reported ok)."""
    p = _sweep_file(tmp_path, max_steps=16)  # 4 s: an orphan would write on well past the 2 s below
    run_dir = tmp_path / "out" / "s1-full" / "seed0"
    sweep, child = _start_sweep(p), None
    try:
        child = _wait_for_run(sweep, run_dir, steps=2)
        sweep.kill()
        sweep.wait(10)
        assert _wait_gone(child, 2.0), f"run {child} outlived its sweep"
    finally:
        if sweep.poll() is None:
            sweep.kill()
        if child is not None and _proc_start(child) is not None:
            os.killpg(child, signal.SIGKILL)
    written = _steps(run_dir)
    marker = read_marker(load_spec(p).runs()[0])
    assert 2 <= len(written) < 10 and marker["status"] == "running" and marker["pid"] == child
    r = subprocess.run(
        [sys.executable, "-c", DRIVER, str(p)], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert _steps(run_dir) == list(range(1, 17))
    assert _steps(run_dir.with_name("seed0.failed")) == written  # nothing written after the kill
    runs_csv = (tmp_path / "out" / "runs.csv").read_text().splitlines()
    assert runs_csv[1].startswith("s1-full,1,full,0,ok,0,16,"), runs_csv


def test_stop_signals_stop_the_run_in_order_and_a_second_one_waits_for_it(tmp_path: Path):
    """SIGHUP (a closed terminal) killed the sweep and left its run behind; a SIGTERM during the stop of
    the run (after a Ctrl-C) abandoned it, its marker left 'running'."""
    p = _sweep_file(tmp_path, max_steps=40)
    run_dir = tmp_path / "out" / "s1-full" / "seed0"
    for first, more in ((signal.SIGHUP, ()), (signal.SIGINT, (signal.SIGTERM, signal.SIGHUP, signal.SIGINT))):
        shutil.rmtree(tmp_path / "out", ignore_errors=True)
        sweep, child = _start_sweep(p, FAKE_STOP_S="1.5"), None
        try:
            child = _wait_for_run(sweep, run_dir)
            sweep.send_signal(first)
            time.sleep(0.5)  # the run is in its 1.5 s stop now
            for sig in more:
                sweep.send_signal(sig)
            out, _ = sweep.communicate(timeout=60)
            alive = _proc_start(child) is not None
        finally:
            if sweep.poll() is None:
                sweep.kill()
            if child is not None and _proc_start(child) is not None:
                os.killpg(child, signal.SIGKILL)
        assert sweep.returncode == 130, (first, out)
        assert not alive and (run_dir / "got_sigterm").exists(), first
        marker = read_marker(load_spec(p).runs()[0])
        assert marker["status"] == "interrupted" and marker["exit_code"] == 0 and marker["pid"] == child, (
            marker
        )
        assert "interrupted; the run is marked for a re-run" in out


def test_a_run_dir_whose_recorded_run_is_alive_is_refused(tmp_path: Path, monkeypatch):
    p = _sweep_file(tmp_path, max_steps=2)
    monkeypatch.setattr(
        SweepSpec, "command", lambda self, run: [sys.executable, "-c", FAKE_RUN, *self.run_overrides(run)]
    )
    monkeypatch.setenv("FAKE_STEP_S", "0")
    run = load_spec(p).runs()[0]
    run.dir.mkdir(parents=True)
    (run.dir / "metrics.jsonl").write_text('{"step": 1}\n')
    alive = subprocess.Popen(["sleep", "30"])
    try:
        marker = {"status": "running", "pid": alive.pid, "pid_start": _proc_start(alive.pid)}
        (run.dir / "sweep_cell.json").write_text(json.dumps(marker))
        with pytest.raises(ConfigError) as e:
            run_sweep(p)
        assert str(e.value) == (
            f"sweep run {run.dir} is still being run by process {alive.pid} (started by an earlier sweep that "
            "was killed, or by another sweep on the same dir); a re-run would mix its steps into the new run. "
            f"Let it end, or stop it (kill -TERM -- -{alive.pid}, its process group), then run the sweep again"
        )
        with pytest.raises(ConfigError, match=f"still being run by process {alive.pid}"):
            run_one(load_spec(p), run)  # what a second sweep on the dir meets when it gets there
        assert not run.dir.with_name("seed0.failed").exists() and alive.poll() is None  # both untouched
        # The same pid, another start time: a later process that got the pid; the run dir is re-run.
        (run.dir / "sweep_cell.json").write_text(json.dumps({**marker, "pid_start": marker["pid_start"] - 1}))
        assert run_sweep(p) == 0 and _steps(run.dir) == [1, 2] and alive.poll() is None
    finally:
        alive.kill()
        alive.wait()
    assert run_sweep(p) == 0  # the recorded run is gone now (reaped): nothing refused, the run skipped


def test_step_problem_against_a_reference(tmp_path: Path):
    path = tmp_path / "metrics.jsonl"
    assert step_problem(path, 4) is None  # no file yet
    for steps, limit, want in (
        ([1, 2, 3], 3, None),
        ([1, 2, 3], 0, None),
        ([2, 5, 9], 3, None),  # gaps are fine (a skipped step); a restart rewrites the file from its step on
        (
            [1, 2, 3, 1, 2],
            0,
            "metrics.jsonl has step 1 after step 3 (record 4): steps of two runs in one dir",
        ),
        ([1, 2, 2], 9, "metrics.jsonl has step 2 after step 2 (record 3): steps of two runs in one dir"),
        ([1, 2, 3, 4, 5], 4, "metrics.jsonl has 5 steps, more than run.max_steps=4"),
    ):
        path.write_text(
            "".join(json.dumps({"step": s, "time": 1.0}) + "\n" for s in steps) + '{"step": 9, "ti'
        )
        assert step_problem(path, limit) == want, steps  # the torn last line is skipped


@pytest.mark.parametrize(
    "steps, reason",
    [
        ("1,2,3,4,5,1,2", "metrics.jsonl has step 1 after step 5 (record 6): steps of two runs in one dir"),
        ("1,2,3,4,5,6", "metrics.jsonl has 6 steps, more than run.max_steps=5"),
    ],
)
def test_a_finished_run_with_two_runs_steps_is_failed_not_ok(
    tmp_path: Path, monkeypatch, capsys, steps, reason
):
    """The orphan case as the report met it: summary 'finished', exit 0, 698 steps of a 600-step run."""
    p = _sweep_file(tmp_path, max_steps=5)
    monkeypatch.setattr(
        SweepSpec, "command", lambda self, run: [sys.executable, "-c", FAKE_RUN, *self.run_overrides(run)]
    )
    monkeypatch.setenv("FAKE_STEP_S", "0")
    monkeypatch.setenv("FAKE_STEPS", steps)
    spec = load_spec(p)
    run = spec.runs()[0]
    assert run_one(spec, run) == ("failed", 0)
    marker = read_marker(run)
    assert marker["status"] == "failed" and marker["reason"] == reason and marker["max_steps"] == 5
    assert not is_finished(run) and disk_status(run) == "failed"
    # A marker that says ok (written by an older asyncrl): not finished either; the sweep re-runs it.
    (run.dir / "sweep_cell.json").write_text(json.dumps({**marker, "status": "ok", "reason": None}))
    assert not is_finished(run) and disk_status(run) == "failed"
    monkeypatch.setenv("FAKE_STEPS", "")
    capsys.readouterr()
    assert (
        run_sweep(p) == 0 and "skipped" not in capsys.readouterr().out and _steps(run.dir) == [1, 2, 3, 4, 5]
    )
