"""End-to-end helpers (imported by the e2e tests): run `asyncrl` commands as real OS processes and find anything they leave behind."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from asyncrl.learner.records import read_jsonl  # noqa: F401 - re-exported for the e2e tests

ROOT = Path(__file__).resolve().parents[2]
MARKER = "ASYNCRL_E2E_MARKER"


#: torch.distributed launcher variables. An in-process learner test of this pytest process sets them
#: (asyncrl.learner.engine.init_distributed) and keeps MASTER_PORT bound: a command under test that
#: inherited them would join that address and fail EADDRINUSE, depending on test order.
LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without the launcher variables, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
    env.update(extra)
    return env


def marked_env(marker: str, **extra: str) -> dict[str, str]:
    """The environment of a command under test: every descendant inherits ``marker``."""
    env = clean_env()
    env[MARKER] = marker
    env.update(extra)
    return env


def processes_with_marker(marker: str) -> list[str]:
    """Live processes (pid + cmdline) whose environment carries ``marker``: orphans if the command ended."""
    found = []
    needle = f"{MARKER}={marker}".encode()
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes()
            if needle in env.split(b"\0"):
                state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
                if state != "Z":
                    cmd = (
                        Path(f"/proc/{pid}/cmdline")
                        .read_bytes()
                        .replace(b"\0", b" ")
                        .decode(errors="replace")
                    )
                    found.append(f"{pid}: {cmd[:160]}")
        except (FileNotFoundError, PermissionError, ProcessLookupError):
            continue
    return found


def wait_no_orphans(marker: str, timeout: float = 30.0) -> list[str]:
    """Processes still alive ``timeout`` seconds after the command ended (Ray's reaper takes a moment)."""
    deadline = time.time() + timeout
    while True:
        left = processes_with_marker(marker)
        if not left or time.time() > deadline:
            return left
        time.sleep(1.0)


def asyncrl_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "asyncrl.cli", *args]


def wait_for(pred, timeout: float, what: str, proc: subprocess.Popen | None = None, log: Path | None = None):
    deadline = time.time() + timeout
    while time.time() < deadline:
        v = pred()
        if v:
            return v
        if proc is not None and proc.poll() is not None:
            tail = log.read_text()[-4000:] if log and log.exists() else ""
            pytest.fail(f"process exited ({proc.returncode}) while waiting for {what}\n{tail}")
        time.sleep(1.0)
    tail = log.read_text()[-4000:] if log and log.exists() else ""
    pytest.fail(f"timed out after {timeout:.0f}s waiting for {what}\n{tail}")
