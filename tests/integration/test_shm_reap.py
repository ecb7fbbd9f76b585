"""Shared-memory weights of a learner killed with kill -9 are freed by the next learner on the host.

Before, a shm root stayed in /dev/shm (``learner.keep_versions`` model copies of RAM) until its own run
was resumed, and for good if it never was. Every ShmTransport now writes its owner (pid, start time,
pid namespace) and removes this user's roots whose owner is gone. Real processes: one publishes into
its root and is killed with SIGKILL, one stays alive.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from asyncrl.buffer.weights import shm_root
from asyncrl.learner.shm_transport import OWNER_FILE, ShmTransport

LEARNER = """
import sys, time, torch
from asyncrl.buffer.weights import shm_root
from asyncrl.learner.shm_transport import ShmTransport
tr = ShmTransport(shm_root(sys.argv[1], sys.argv[2]))
tr.publish(1, {"w": torch.ones(256, 256)}, "float32")
print("published", flush=True)
time.sleep(600)
"""


def _learner(run_dir, name: str) -> subprocess.Popen:
    p = subprocess.Popen(
        [sys.executable, "-c", LEARNER, str(run_dir), name], stdout=subprocess.PIPE, text=True
    )
    assert p.stdout.readline().strip() == "published"
    return p


@pytest.mark.skipif(not os.path.exists("/proc/self/ns/pid"), reason="needs /proc (Linux)")
def test_a_killed_learners_shm_weights_are_reaped_and_live_ones_kept(tmp_path) -> None:
    killed_root, live_root = shm_root(tmp_path / "a", "reap-a"), shm_root(tmp_path / "b", "reap-b")
    no_owner = shm_root(tmp_path / "c", "reap-c")
    reused_pid = shm_root(tmp_path / "d", "reap-d")
    other_ns = shm_root(tmp_path / "e", "reap-e")
    own = shm_root(tmp_path / "f", "reap-f")
    killed = _learner(tmp_path / "a", "reap-a")
    live = _learner(tmp_path / "b", "reap-b")
    tr = None
    try:
        killed.send_signal(signal.SIGKILL)
        killed.wait()
        assert (killed_root / "v1").is_dir()  # kill -9: no clean-up ran, its weights stay in RAM
        no_owner.mkdir()
        ns = os.readlink("/proc/self/ns/pid")
        reused_pid.mkdir()  # this pid, but another start time: the pid was reused
        (reused_pid / OWNER_FILE).write_text(f"{os.getpid()} 1 {ns}")
        other_ns.mkdir()  # a learner of another pid namespace (a container): not judged
        (other_ns / OWNER_FILE).write_text(f"{killed.pid} 1 pid:[1]")
        tr = ShmTransport(own)
        assert not killed_root.exists() and not reused_pid.exists()
        assert (live_root / "v1").is_dir() and no_owner.is_dir() and other_ns.is_dir()
        assert (own / OWNER_FILE).read_text().split()[0] == str(os.getpid())
    finally:
        if tr is not None:
            tr.cleanup()
        live.kill()
        live.wait()
        for root in (killed_root, live_root, no_owner, reused_pid, other_ns):
            subprocess.run(["rm", "-rf", str(root)], check=True)
