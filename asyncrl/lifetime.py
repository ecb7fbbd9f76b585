"""Child processes that die with the process that started them, however it dies (even ``kill -9``).

``asyncrl run`` owns its learner, its embedded redis-server and a local Ray cluster with the vLLM
engines; a SIGKILL of the command runs none of its cleanup (finally blocks, atexit), so all of them
must go on their own. Two mechanisms:

* :func:`die_with_parent` for the direct children (learner, redis-server): instant, and independent
  of the child's environment (redis-server overwrites its own with its process title);
* :func:`arm_reaper` for everything started later, however deep (Ray's raylet, workers and agents,
  vLLM engine processes): every process inherits a token in its environment, and a small reaper
  process SIGKILLs every process carrying it once its owner is gone. Needed because Ray's dashboard
  and runtime-env agents, orphaned by a dead raylet, spend ~60 s reporting to the dead GCS first.

:func:`die_with_parent`: the child is started through a two-line launcher that sets ``PR_SET_PDEATHSIG = SIGKILL`` and
then ``execv`` s the real command (the setting survives exec). Not ``preexec_fn``: that runs Python
between fork and exec, which can deadlock in a process with threads (Ray's). Linux semantics: the
signal follows the *thread* that spawned the child, so spawn from a thread that lives as long as the
process (the main thread; the orchestrator's supervision loop runs there). Elsewhere than Linux the
command is returned unchanged.
"""

from __future__ import annotations

import os
import sys

__all__ = ["die_with_parent", "arm_reaper", "OWNER_ENV"]

#: Environment variable holding the reaper's token (inherited by every process started after arming).
OWNER_ENV = "ASYNCRL_OWNER"

# If the parent is already gone (it died between fork and prctl), exit instead of running orphaned.
_LAUNCHER = (
    "import ctypes, os, signal, sys\n"
    "ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL), 0, 0, 0)\n"  # 1 = PR_SET_PDEATHSIG
    "os.getppid() == int(sys.argv[1]) or os._exit(1)\n"
    "os.execv(sys.argv[2], sys.argv[2:])\n"
)


def die_with_parent(cmd: list[str]) -> list[str]:
    """``cmd`` (argv[0] a path) wrapped so that the child is SIGKILLed when this process dies."""
    if not sys.platform.startswith("linux"):
        return cmd
    return [sys.executable, "-c", _LAUNCHER, str(os.getpid()), *cmd]


# The reaper: waits (without holding anything of the owner's) until its owner is gone, then SIGKILLs
# every process whose environment carries the token, sweeping again while any is found (a dying tree
# may still fork) for at most 10 s.
_REAPER = (
    "import os, signal, sys, time\n"
    "owner, needle = int(sys.argv[1]), sys.argv[2].encode()\n"
    "while os.getppid() == owner:\n"
    "    time.sleep(0.5)\n"
    "end = time.monotonic() + 10\n"
    "while time.monotonic() < end:\n"
    "    hit = 0\n"
    "    for pid in filter(str.isdigit, os.listdir('/proc')):\n"
    "        if int(pid) == os.getpid():\n"
    "            continue\n"
    "        try:\n"
    "            if needle in open(f'/proc/{pid}/environ', 'rb').read().split(b'\\0'):\n"
    "                os.kill(int(pid), signal.SIGKILL)\n"
    "                hit += 1\n"
    "        except OSError:\n"
    "            pass\n"
    "    if not hit:\n"
    "        break\n"
    "    time.sleep(0.5)\n"
)
_armed: str | None = None


def arm_reaper() -> str:
    """Once per process: tag the environment of everything this process starts from now on with a
    token, and start the reaper that SIGKILLs those processes when this process is gone (any exit,
    including ``kill -9``; after a clean exit it finds nothing). Returns the token. Linux only (a
    no-op elsewhere). The reaper runs in its own session, so a Ctrl-C in the terminal leaves it to
    do its job after the owner's orderly shutdown."""
    global _armed
    if _armed is not None or not sys.platform.startswith("linux"):
        return _armed or ""
    import subprocess
    import uuid

    token = uuid.uuid4().hex
    os.environ[OWNER_ENV] = token
    subprocess.Popen(
        [sys.executable, "-c", _REAPER, str(os.getpid()), f"{OWNER_ENV}={token}"],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True,
    )  # fmt: skip
    _armed = token
    return token
