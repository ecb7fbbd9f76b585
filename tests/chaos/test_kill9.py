"""`kill -9` of `asyncrl run` itself: it runs no cleanup, so its children must die on their own.

The learner and the embedded redis-server are started through asyncrl.lifetime.die_with_parent
(PR_SET_PDEATHSIG), Ray's local cluster fate-shares with its driver, and the vLLM engines are the Ray
workers' children. Checked on the whole process tree taken just before the kill (redis-server
rewrites its process title over its environment, so the per-run environment marker alone would miss
it) and on the marker (anything started later).
"""

from __future__ import annotations

import os
import signal
import time

import psutil
import pytest

from tests.chaos.chaos_helpers import ChaosRun, kill
from tests.e2e.procs import processes_with_marker

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(900)]


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_kill9_of_asyncrl_run_leaves_no_process_behind(tmp_path, faults):
    run = ChaosRun(tmp_path, 500)
    tree: list[psutil.Process] = []
    try:
        run.wait_progress(1, 600, "the first learner step")
        # The first step can come before the actor's first "running" heartbeat (2 s apart): wait for it.
        apid = run.wait(run.actor_pid, 60, "the actor's heartbeat")
        named = {"learner": run.learner_pid(), "redis": run.redis_pid(), "actor": apid}
        assert all(named.values()), named
        tree = psutil.Process(run.proc.pid).children(recursive=True)
        assert {p.pid for p in tree} >= set(named.values())
        faults.injected("kill -9 asyncrl run")
        kill(run.proc.pid)
        assert run.proc.wait(10) == -signal.SIGKILL
        # The roles that hold the run's state (learner, embedded redis-server, the actor) go at once.
        roles = [p for p in tree if p.pid in set(named.values())]
        deadline = time.monotonic() + 10
        while (alive := [p for p in roles if _alive(p)]) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not alive, f"roles alive 10 s after `asyncrl run` was killed: {alive}"
        # Everything else too. The reaper normally takes Ray's agents within a second, but the CI
        # machine once saw its DashboardAgent and RuntimeEnvAgent outlive 30 s (they exit on their own
        # ~60 s after their raylet, when their GCS reports time out): allow for that, not for a leak.
        deadline = time.monotonic() + 90
        while (
            left := [p for p in tree if _alive(p)] + processes_with_marker(run.marker)
        ) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not left, f"alive 100 s after `asyncrl run` was killed (of {len(tree)}): {left}"
        faults.survived("kill -9 asyncrl run")
    finally:  # never leak a failed case's processes
        for p in tree:
            if _alive(p):
                p.kill()
        for line in processes_with_marker(run.marker):
            try:
                os.kill(int(line.split(":")[0]), signal.SIGKILL)
            except ProcessLookupError:
                pass
        run.close()
