"""asyncrl.lifetime.die_with_parent on real processes: a SIGKILLed parent takes its child along."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from asyncrl.lifetime import OWNER_ENV, die_with_parent

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux")

# The parent: spawns `sleep 300` (wrapped or not) in its own session, prints the child's pid, waits.
_PARENT = """
import subprocess, sys, time
from asyncrl.lifetime import die_with_parent
cmd = ["/bin/sleep", "300"]
p = subprocess.Popen(die_with_parent(cmd) if sys.argv[1] == "1" else cmd, start_new_session=True)
print(p.pid, flush=True)
time.sleep(300)
"""


def _child_after_parent_sigkill(wrapped: bool) -> psutil.Process:
    parent = subprocess.Popen(
        [sys.executable, "-c", _PARENT, "1" if wrapped else "0"], stdout=subprocess.PIPE, text=True
    )
    child = psutil.Process(int(parent.stdout.readline()))
    deadline = time.monotonic() + 10
    while child.name() != "sleep" and time.monotonic() < deadline:  # the launcher execs into it
        time.sleep(0.05)
    assert child.name() == "sleep" and child.ppid() == parent.pid
    os.kill(parent.pid, signal.SIGKILL)
    parent.wait(10)
    return child


def test_child_dies_with_a_sigkilled_parent():
    child = _child_after_parent_sigkill(wrapped=True)
    child.wait(10)  # psutil.TimeoutExpired if it outlives its parent (same pid: the launcher exec'd it)
    assert not child.is_running()


def test_without_it_the_child_is_orphaned():  # the control: what `asyncrl run` children did before
    child = _child_after_parent_sigkill(wrapped=False)
    try:
        time.sleep(0.5)
        assert child.is_running() and child.status() != psutil.STATUS_ZOMBIE
    finally:
        child.kill()


def test_command_is_only_wrapped_on_linux(monkeypatch):
    assert die_with_parent(["/bin/true"])[-1] == "/bin/true"
    monkeypatch.setattr(sys, "platform", "darwin")
    assert die_with_parent(["/bin/true"]) == ["/bin/true"]


# An owner that arms the reaper, then starts a middle process that starts `sleep 300` in a new session
# and exits: the sleep is a grandchild reparented to init, out of reach of any parent-death signal.
_OWNER = """
import subprocess, sys, time
from asyncrl.lifetime import arm_reaper
arm_reaper()
mid = subprocess.Popen([sys.executable, "-c",
    "import subprocess; print(subprocess.Popen(['/bin/sleep', '300'], start_new_session=True).pid)"],
    stdout=subprocess.PIPE, text=True)
print(mid.stdout.readline().strip(), flush=True)
time.sleep(300)
"""


def test_reaper_kills_the_owners_whole_tree_after_a_sigkill():
    owner = subprocess.Popen([sys.executable, "-c", _OWNER], stdout=subprocess.PIPE, text=True)
    orphan = psutil.Process(int(owner.stdout.readline()))
    try:
        # The reaper was started before the middle process (arm_reaper runs first): its argv holds the
        # token. (Reading it from the orphan's /proc environ right after its exec once came back without
        # it on a loaded CI machine, hence the polling below; the real check is the orphan's death.)
        reaper = next(
            p for p in psutil.Process(owner.pid).children()
            if any(a.startswith(f"{OWNER_ENV}=") for a in p.cmdline())
        )  # fmt: skip
        token = next(a for a in reaper.cmdline() if a.startswith(f"{OWNER_ENV}=")).split("=", 1)[1]
        deadline = time.monotonic() + 5
        while orphan.environ().get(OWNER_ENV) != token and time.monotonic() < deadline:
            time.sleep(0.05)
        assert orphan.environ().get(OWNER_ENV) == token, "the grandchild does not carry the owner's token"
        time.sleep(1.0)
        assert orphan.is_running() and reaper.is_running()  # the owner lives: nothing is reaped
        os.kill(owner.pid, signal.SIGKILL)
        owner.wait(10)
        orphan.wait(10)  # psutil.TimeoutExpired if the reaper missed it
        reaper.wait(15)  # and the reaper is gone too
    finally:
        if orphan.is_running():
            orphan.kill()
