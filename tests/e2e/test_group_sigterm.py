"""`asyncrl run` stopped by a SIGTERM to its whole process group (``timeout N asyncrl run``,
``kill -TERM -- -PGID``, systemd's default KillMode, Slurm's scancel).

The signal reaches Ray's GCS and raylet too (they are in the group): the orchestrator's teardown used to
wait on the dead GCS until Ray's core worker aborted the process (~60 s, exit code 1, no summary.json,
a stale redis.url). It must end like a SIGTERM to the pid: an interrupted, resumable stop.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import uuid

import pytest

from tests.e2e.procs import ROOT, asyncrl_cmd, marked_env, read_jsonl, wait_for, wait_no_orphans

pytestmark = pytest.mark.slow


def test_a_sigterm_to_the_process_group_stops_the_run_like_one_to_its_pid(tmp_path):
    rdir, marker, log = tmp_path / "run", uuid.uuid4().hex, tmp_path / "run.log"
    cmd = asyncrl_cmd("run", "--config", str(ROOT / "configs" / "default.yaml"), f"run.dir={rdir}",
                      "run.max_steps=5000", "run.max_wall_s=600", "run.progress=false")  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=marked_env(marker), stdout=log.open("wb"),
                            stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
    try:
        wait_for(lambda: read_jsonl(rdir / "metrics.jsonl"), 420, "the first learner step", proc, log)
        os.killpg(proc.pid, signal.SIGTERM)
        t0 = time.monotonic()
        try:
            rc = proc.wait(30)
        except subprocess.TimeoutExpired:
            pytest.fail(f"still running 30 s after the group SIGTERM\n{log.read_text()[-3000:]}")
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    # 0: what run_all returns for an interrupted stop (SIGINT, or SIGTERM to the pid alone).
    assert rc == 0, (took, log.read_text()[-3000:])
    summary = json.loads((rdir / "summary.json").read_text())
    assert summary["status"] == "interrupted" and not summary["finished"], summary
    assert summary["steps"] >= 1
    # The summary written before the learner's stop (the local Ray was lost) was rewritten after it: the
    # learner stopped within its grace (exit code 0, not SIGKILLed) and the driver was not ended by Ray's
    # core worker on the way (its GCS reconnect timeout covers learner.stop_grace_s).
    assert summary["learner_exit_code"] == 0, summary
    assert "Failed to connect to GCS" not in log.read_text()
    assert not (rdir / "redis.url").exists(), "the embedded Redis's URL outlived it"
    assert not wait_no_orphans(marker)
