"""Stale torch-extension build locks (asyncrl.learner.ext_locks): a learner stopped while DeepSpeed
loaded its CPU op left ``<torch_extensions>/<py>_cpu/<op>/lock`` behind, and every later learner on
the machine waited on it for ever (torch's FileBaton polls while the file exists). Real processes
holding and dying with real FileBaton locks."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from asyncrl.learner.ext_locks import clear_stale_extension_locks

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")

# Takes the op's build lock as torch.utils.cpp_extension does, says so, then sleeps (killed with it held).
_HOLDER = (
    "import sys, time\n"
    "from torch.utils.file_baton import FileBaton\n"
    "assert FileBaton(sys.argv[1]).try_acquire()\n"
    "print('HELD', flush=True)\n"
    "time.sleep(600)\n"
)


def _hold(lock) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", _HOLDER, str(lock)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline() == "HELD\n"
    return proc


def _age(path, seconds: float) -> None:
    t = time.time() - seconds
    os.utime(path, (t, t))


def test_a_lock_left_by_a_killed_loader_is_removed_and_the_next_load_proceeds(tmp_path) -> None:
    """kill -9 of the process holding the lock: the file stays (the hang); the check removes it, and
    a FileBaton (what DeepSpeed's next load takes) acquires at once instead of waiting for ever."""
    from torch.utils.file_baton import FileBaton

    lock = tmp_path / "py311_cpu" / "deepspeed_shm_comm" / "lock"
    lock.parent.mkdir(parents=True)
    proc = _hold(lock)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert lock.exists()  # what every later learner waited on
    _age(lock, 60)
    assert clear_stale_extension_locks(tmp_path) == [lock]
    baton = FileBaton(str(lock))
    assert baton.try_acquire()
    baton.release()


def test_a_lock_held_by_a_live_loader_is_kept(tmp_path) -> None:
    """A loader still building or loading (its descriptor open) keeps its lock, however old."""
    lock = tmp_path / "op" / "lock"  # TORCH_EXTENSIONS_DIR layout: one level
    lock.parent.mkdir()
    proc = _hold(lock)
    try:
        _age(lock, 3600)
        assert clear_stale_extension_locks(tmp_path) == []
        assert lock.exists()
    finally:
        proc.kill()
        proc.wait()


def test_a_young_unheld_lock_is_waited_for_then_removed(tmp_path) -> None:
    """An unheld lock younger than min_age_s (FileBaton.release closes before it removes; a learner
    restarted right after its predecessor died) is removed only once it is that old."""
    lock = tmp_path / "py311_cpu" / "op" / "lock"
    lock.parent.mkdir(parents=True)
    lock.touch()
    t0 = time.monotonic()
    assert clear_stale_extension_locks(tmp_path, min_age_s=1.5) == [lock]
    took = time.monotonic() - t0
    assert 1.0 <= took < 5.0, took
    assert not lock.exists()
    assert clear_stale_extension_locks(tmp_path) == []  # nothing left: returns at once


def test_on_a_shared_file_system_an_unheld_lock_gets_the_long_age(tmp_path, monkeypatch) -> None:
    """On NFS & co. a lock may be held by a process on another machine (data-parallel ranks sharing a home
    directory), which this /proc does not show: it is removed only at NETWORK_MIN_AGE_S (600 s; 3 s
    here), longer than any op build, and the wait is logged. On a local disk the same lock goes at once."""
    import asyncrl.learner.ext_locks as ext_locks

    lock = tmp_path / "py311_cpu" / "op" / "lock"
    lock.parent.mkdir(parents=True)
    lock.touch()
    _age(lock, 1.5)
    monkeypatch.setattr(ext_locks, "NETWORK_MIN_AGE_S", 3.0)
    monkeypatch.setattr(ext_locks, "_fs_type", lambda path: "nfs4")
    t0 = time.monotonic()
    assert clear_stale_extension_locks(tmp_path, min_age_s=1.0) == [lock]
    assert time.monotonic() - t0 >= 1.0  # waited until the lock was 3 s old
    lock.touch()
    _age(lock, 1.5)
    monkeypatch.setattr(ext_locks, "_fs_type", lambda path: "ext4")
    t0 = time.monotonic()
    assert clear_stale_extension_locks(tmp_path, min_age_s=1.0) == [lock]
    assert time.monotonic() - t0 < 0.5


def test_the_file_system_type_is_that_of_the_longest_mount_above_the_path(tmp_path) -> None:
    from asyncrl.learner.ext_locks import _fs_type

    assert _fs_type(tmp_path / "does-not-exist-yet") == _fs_type(tmp_path) != ""
    assert _fs_type(__import__("pathlib").Path("/proc/self")) == "proc"
