"""`asyncrl status` (asyncrl.status) against a real redis-server: what it collects and prints."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from asyncrl.buffer import ReplayBuffer
from asyncrl.config import Config, load_config
from asyncrl.status import collect_status, format_status, print_status


@pytest.fixture
def cfg(run_name: str) -> Config:
    # publish_every 2: admission counts groups per *version*, twice groups_per_step here.
    return load_config(overrides=[f"run.name={run_name}", "buffer.groups_per_step=4", "buffer.max_staleness=1",
                                  "learner.publish_every=2"])  # fmt: skip


@pytest.fixture
def run_buffer(cfg: Config, redis_url: str) -> Iterator[ReplayBuffer]:
    """The buffer the run itself would use (same settings as the actors' admission)."""
    buf = ReplayBuffer.from_config(cfg, redis_url)
    try:
        yield buf
    finally:
        buf.delete_run()
        buf.close()


def _fill(buf: ReplayBuffer, n: int) -> int:
    admitted = 0
    while admitted < n and buf.try_admit():
        admitted += 1
    return admitted


def test_status_reports_the_bound_admission_enforces(cfg: Config, redis_url: str, run_buffer: ReplayBuffer):
    run_buffer.set_version(0)
    # Admission fills up to its real bound: (V + max_staleness + 1) * groups_per_step * publish_every = 16.
    assert _fill(run_buffer, 100) == 16
    st = collect_status(cfg, redis_url)
    assert st["buffer"]["bound"] == run_buffer.admission_bound() == 16
    assert st["buffer"]["admitted"] == 16
    text = format_status(cfg, st, now=0.0)
    assert "admission admitted 16 / bound 16" in text
    assert "8 groups per version = groups_per_step 4 x publish_every 2" in text
    assert "adaptive" not in text


def test_status_follows_version_credits_and_adaptive_bound(
    cfg: Config, redis_url: str, run_buffer: ReplayBuffer
):
    run_buffer.set_version(3)
    run_buffer.credit(2)
    run_buffer.set_staleness_bound(0)  # the adaptive controller tightened admission to eta 0
    st = collect_status(cfg, redis_url)
    # (3 + 0 + 1) * 8 + 2 credits
    assert st["buffer"]["bound"] == run_buffer.admission_bound() == 34
    assert _fill(run_buffer, 100) == 34  # exactly what the status said admission would let in
    text = format_status(cfg, collect_status(cfg, redis_url), now=0.0)
    assert "policy version v3" in text
    assert "admission admitted 34 / bound 34   credits 2" in text
    assert "max_staleness 1, adaptive bound 0;" in text


def test_status_lists_learner_and_actors(cfg: Config, redis_url: str, run_buffer: ReplayBuffer, capsys):
    text = format_status(cfg, collect_status(cfg, redis_url), now=100.0)
    assert "learner  not seen" in text and "actors   0" in text
    # As the learner writes it: "time" is seconds since its start; the registry stamps "updated".
    run_buffer.set_learner_status({"step": 7, "version": 3, "time": 90.0})
    stamped = float(run_buffer.learner_status()["updated"])
    assert abs(stamped - time.time()) < 5
    run_buffer.heartbeat("actor-1", {"version": 3, "groups": 12, "in_flight": 2, "time": 95.0})
    run_buffer.heartbeat("actor-0", {"version": 2, "groups_written": 5, "in_flight": 0, "time": 99.0})
    lines = format_status(cfg, collect_status(cfg, redis_url), now=100.0).splitlines()
    assert lines[0] == f"run {cfg.run.name}   policy version v0"
    learner = format_status(cfg, collect_status(cfg, redis_url), now=stamped + 10.0).splitlines()
    assert "learner  step 7   version v3   last seen 10s ago" in learner
    assert lines[-3] == "actors   2"
    assert lines[-2].split() == [
        "actor-0",
        "v2",
        "groups",
        "5",
        "in",
        "flight",
        "0",
        "last",
        "seen",
        "1s",
        "ago",
    ]
    assert lines[-1].split()[:4] == ["actor-1", "v3", "groups", "12"]
    assert print_status(cfg, redis_url) == 0
    out = capsys.readouterr().out
    assert "actors   2" in out and "bound 16" in out


def test_status_of_a_config_without_publish_every(run_name: str, redis_url: str):
    # The default (publish_every 1): groups per version is groups_per_step.
    cfg = Config()
    cfg.run.name = run_name
    try:
        text = format_status(cfg, collect_status(cfg, redis_url), now=0.0)
    finally:
        with ReplayBuffer.from_config(cfg, redis_url) as buf:
            buf.delete_run()
    g, s = cfg.buffer.groups_per_step, cfg.buffer.max_staleness
    assert f"bound {(s + 1) * g}" in text and f"{g} groups per version" in text


def test_status_of_a_run_whose_redis_is_gone_fails_fast_naming_it(cfg: Config):
    """A crashed run leaves <run dir>/redis.url behind; `asyncrl status` waited ~120 s (the roles' retry
    budget) on the closed port and then printed a traceback."""
    import socket

    from asyncrl.config import ConfigError

    with socket.socket() as s:  # a port nothing listens on: bound, then released, never listened on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"redis://:hunter2@127.0.0.1:{port}/0"
    t0 = time.monotonic()
    with pytest.raises(ConfigError) as e:
        print_status(cfg, url)
    elapsed = time.monotonic() - t0
    assert elapsed < 10.0, elapsed
    msg = str(e.value)
    assert msg.startswith(f"no Redis answers at redis://127.0.0.1:{port}/0 (") and "hunter2" not in msg
    assert f"run {cfg.run.name} is not up" in msg and "redis.url" in msg


def test_status_of_a_frozen_redis_says_so_and_does_not_advise_a_restart(cfg: Config, tmp_path):
    """A SIGSTOPped redis-server accepts connections and never answers: status said the run "is not up"
    and to start it again, while its roles were alive and riding the outage out."""
    import os
    import signal

    from asyncrl.buffer.embedded import EmbeddedRedis
    from asyncrl.config import ConfigError

    server = EmbeddedRedis(tmp_path / "redis", password="hunter2").start()
    try:
        os.kill(server.pid, signal.SIGSTOP)
        t0 = time.monotonic()
        with pytest.raises(ConfigError) as e:
            print_status(cfg, server.url)
        assert time.monotonic() - t0 < 15.0
        msg = str(e.value)
        assert "did not answer within 5 s" in msg and "frozen or overloaded" in msg and "hunter2" not in msg
        assert "not up" not in msg and "start it again" not in msg
    finally:
        os.kill(server.pid, signal.SIGCONT)
        server.stop()


def test_status_shows_the_learner_s_state_and_since_when(
    cfg: Config, redis_url: str, run_buffer: ReplayBuffer
):
    """A live learner waiting for data and a frozen one both read "last seen 78s ago"; the state the
    learner wrote as it began (waiting, training, stopped) and its "since" tell them apart."""

    def line(status: dict, now: float) -> str:
        run_buffer.set_learner_status(status)
        text = format_status(cfg, collect_status(cfg, redis_url), now=now)
        return next(ln for ln in text.splitlines() if ln.startswith("learner"))

    now = time.time()
    base = {"step": 7, "version": 3, "time": 90.0}
    waiting = line({**base, "state": "waiting", "since": now - 78.0}, now)
    assert waiting.startswith("learner  step 7   version v3   waiting for data for 78s   last seen ")
    training = line({**base, "state": "training", "since": now - 78.0}, now)
    assert training.startswith("learner  step 7   version v3   training step 8 for 78s   last seen ")
    stopped = line({**base, "state": "stopped", "since": now - 5.0}, now)
    assert stopped.startswith("learner  step 7   version v3   stopped 5s ago   last seen ")


HEARTBEAT_CHILD = """
import sys, time
from asyncrl.buffer import ReplayBuffer
from asyncrl.buffer.registry import LearnerHeartbeat
from asyncrl.config import load_config
buf = ReplayBuffer.from_config(load_config(overrides=[f"run.name={sys.argv[2]}"]), sys.argv[1])
buf.set_learner_status({"step": 4, "version": 2, "state": "waiting", "since": time.time()})
LearnerHeartbeat(buf, interval_s=0.2)
print("beating", flush=True)
time.sleep(600)
"""


def test_status_calls_a_killed_learner_silent_and_a_live_waiting_one_not(
    cfg: Config, redis_url: str, run_buffer: ReplayBuffer, tmp_path
):
    """A learner killed (kill -9) while it waited for data kept reading "waiting for data for Ns" with
    nothing to tell it from a live one. Its heartbeat thread stamps "alive" every interval; a learner
    silent for LEARNER_SILENT_S that did not stop is called SILENT. Real process, real Redis."""
    import os
    import signal
    import subprocess
    import sys

    from asyncrl.buffer.registry import LEARNER_SILENT_S

    def line(now: float) -> str:
        text = format_status(cfg, collect_status(cfg, redis_url), now=now)
        return next(ln for ln in text.splitlines() if ln.startswith("learner"))

    child = subprocess.Popen([sys.executable, "-c", HEARTBEAT_CHILD, redis_url, cfg.run.name],
                             stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert child.stdout.readline().strip() == "beating"
        first = run_buffer.learner_status()["alive"]
        deadline = time.monotonic() + 10
        while run_buffer.learner_status()["alive"] == first:
            assert time.monotonic() < deadline, "the heartbeat never refreshed 'alive'"
            time.sleep(0.05)
        # Alive: its state as written, no verdict; "last seen" is the newest stamp, not the state's.
        st = run_buffer.learner_status()
        live = line(st["alive"] + 1.0)
        assert "waiting for data" in live and "last seen 1s ago" in live and "SILENT" not in live
        assert st["updated"] < st["alive"]
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.wait(10)
    dead = run_buffer.learner_status()
    time.sleep(0.5)
    assert run_buffer.learner_status()["alive"] == dead["alive"]  # nothing beats any more
    later = dead["alive"] + LEARNER_SILENT_S + 5.0
    gone = line(later)
    assert f"last seen {LEARNER_SILENT_S + 5.0:.0f}s ago   SILENT: no heartbeat for" in gone, gone
    assert "killed, or its process frozen" in gone
    assert "SILENT" not in line(dead["alive"] + LEARNER_SILENT_S - 1.0)
    # A learner that stopped on purpose stops beating too: no verdict.
    run_buffer.set_learner_status({"state": "stopped", "since": dead["alive"]})
    assert "SILENT" not in line(later) and "stopped" in line(later)
