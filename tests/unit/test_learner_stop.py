"""How long `asyncrl run` waits for its learner to stop (learner.stop_grace_s) before it SIGKILLs it.

A real model's final checkpoint can take longer than the 60 s the stop used to allow, fixed in code."""

from __future__ import annotations

import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

from asyncrl import orchestrator, run_teardown
from asyncrl.config import ConfigError, load_config
from asyncrl.launch import stop_process


def test_stop_grace_is_a_validated_config_field() -> None:
    assert load_config().learner.stop_grace_s == 60.0
    assert load_config(overrides=["learner.stop_grace_s=900"]).learner.stop_grace_s == 900.0
    for bad in ("-1", "0"):  # 0 would SIGKILL every learner in the middle of its final checkpoint
        with pytest.raises(ConfigError, match=rf"^learner\.stop_grace_s={bad}(\.0)? is out of range"):
            load_config(overrides=[f"learner.stop_grace_s={bad}"])


def test_the_run_teardown_gives_the_learner_the_configured_grace(tmp_path, monkeypatch) -> None:
    seen = []
    monkeypatch.setattr(run_teardown, "stop_process", lambda proc, grace_s: seen.append((proc, grace_s)) or 7)
    learner = object()
    cfg = load_config(overrides=["learner.stop_grace_s=900"])
    sup = SimpleNamespace(cfg=cfg, learner=learner, redis_srv=None, rdir=tmp_path)
    assert orchestrator._teardown(None, sup, None) == 7  # the learner's exit code
    assert seen == [(learner, 900.0)]


def _child(ignore_term: bool) -> subprocess.Popen:
    code = "import signal, sys, time\n"
    if ignore_term:
        code += "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
    code += "print('up', flush=True)\ntime.sleep(60)\n"
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, start_new_session=True)
    assert proc.stdout is not None and proc.stdout.readline() == b"up\n"  # its handler is installed
    return proc


def test_stop_process_kills_a_learner_still_running_after_the_grace() -> None:
    proc = _child(ignore_term=True)
    t0 = time.monotonic()
    assert stop_process(proc, 0.5) == -9
    assert 0.5 <= time.monotonic() - t0 < 10
    proc.stdout.close()
    proc = _child(ignore_term=False)
    assert stop_process(proc, 30.0) == -15  # it exits on SIGTERM: no wait for the grace
    proc.stdout.close()
