"""asyncrl.proc_identity.start_time on real processes: a child's start time is stable for its life (a new
comm included), a later process's is later, a zombie counts as gone unless asked for, a free pid has
none, and a comm holding spaces, ``) (``, a ``Z`` and a non-UTF-8 byte is parsed from the last ``)``."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from asyncrl.proc_identity import start_time

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs /proc (Linux)")

#: Waits for a line, renames itself (its comm, field 2 of /proc/<pid>/stat) to the hex bytes of argv[1],
#: says so, then exits at the end of its stdin.
CHILD = """
import sys
sys.stdin.readline()
with open("/proc/self/comm", "wb") as f:
    f.write(bytes.fromhex(sys.argv[1]))
print("renamed", flush=True)
sys.stdin.read()
"""

#: At most 15 bytes (the comm's limit). With the fields counted from the first ')', the state would read 'Z'.
TRAP_COMM = b"a) Z (b\xff) 1 2 "


def _child(comm: bytes = b"x") -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", CHILD, comm.hex()], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )


def _wait_for(cond, timeout: float = 10.0) -> bool:
    end = time.monotonic() + timeout
    while not cond() and time.monotonic() < end:
        time.sleep(0.01)
    return cond()


def test_a_childs_start_time_is_stable_and_a_later_process_starts_later() -> None:
    first = _child()
    try:
        start = start_time(first.pid)
        assert isinstance(start, int) and start > 0
        time.sleep(3 / os.sysconf("SC_CLK_TCK"))  # the field counts clock ticks: be some ticks later
        second = _child()
        try:
            assert start_time(second.pid) > start
            assert start_time(first.pid) == start
            assert start_time(os.getpid()) < start  # this process began before its children
        finally:
            second.communicate(b"\n")
    finally:
        first.communicate(b"\n")


def test_a_comm_with_spaces_parens_and_odd_bytes_is_parsed_from_the_last_paren() -> None:
    child = _child(TRAP_COMM)
    try:
        before = start_time(child.pid)
        child.stdin.write(b"\n")
        child.stdin.flush()
        assert child.stdout.readline() == b"renamed\n"
        stat = Path(f"/proc/{child.pid}/stat").read_bytes()
        assert b"(" + TRAP_COMM + b")" in stat
        assert stat.split(b")")[1].split()[0] == b"Z"  # the trap a first-')' parse falls into
        assert start_time(child.pid) == before  # running, not a zombie; same field 22
    finally:
        child.communicate(b"")


def test_a_zombie_counts_only_when_asked_and_a_reaped_or_free_pid_has_none() -> None:
    child = _child()
    start = start_time(child.pid)
    child.stdin.close()  # it exits; not waited for yet, so it stays a zombie holding its pid
    assert _wait_for(lambda: start_time(child.pid) is None), "the child never exited"
    assert start_time(child.pid, zombies=True) == start
    child.wait()
    child.stdout.close()
    # The pid is free now; if another process took it meanwhile, that one started later.
    assert (now := start_time(child.pid, zombies=True)) is None or now > start
    pid_max = int(Path("/proc/sys/kernel/pid_max").read_text())
    assert start_time(pid_max + 1) is None
    assert start_time(pid_max + 1, zombies=True) is None


def test_the_module_imports_without_torch() -> None:
    code = "import sys, asyncrl.proc_identity; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
