"""The learner's /metrics while its Redis is away (stopped, or frozen by SIGSTOP), on a real redis-server:
a scrape answers within ~2 s with the learner's own series, without the buffer's (never zeros), and the
buffer's series come back with Redis. Before, the scrape-time buffer read retried for
redis.retry_budget_s (120 s) and Prometheus' scrape timed out: the learner's series were lost too."""

from __future__ import annotations

import logging
import os
import signal
import time
import urllib.request

import pytest

from asyncrl.buffer import EmbeddedRedis
from asyncrl.config import Config
from asyncrl.metrics_export import LearnerExporter, learner_collectors, scrape_buffer, serve


def _scrape(port: int) -> tuple[float, dict[str, float]]:
    """(seconds the scrape took, unlabelled series -> value)."""
    t0 = time.monotonic()
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=15) as r:
        assert r.status == 200
        body = r.read().decode()
    series = {}
    for line in body.splitlines():
        if line and not line.startswith("#") and "{" not in line:
            name, value = line.rsplit(" ", 1)
            series[name] = float(value)
    return time.monotonic() - t0, series


@pytest.mark.timeout(120)
def test_the_learner_s_scrape_survives_a_redis_outage(tmp_path, run_name, caplog) -> None:
    srv = EmbeddedRedis(tmp_path / "redis").start()
    cfg = Config()
    cfg.run.name = run_name
    buf = scrape_buffer(cfg, srv.url)
    exporter = LearnerExporter(max_staleness=1)
    exporter({"step": 5, "version": 5, "step_time": time.time(), "step_s": 0.1})
    port, stop = serve(learner_collectors(exporter, buf.stats))
    try:
        took, up = _scrape(port)
        assert up["asyncrl_learner_steps_total"] == 1 and up["asyncrl_buffer_depth_groups"] == 0
        assert up["asyncrl_buffer_staleness_bound_steps"] == cfg.buffer.max_staleness

        pid = srv.pid
        os.kill(pid, signal.SIGSTOP)  # frozen: accepts connections, answers nothing
        try:
            with caplog.at_level(logging.INFO, logger="asyncrl.metrics_export"):
                for _ in range(2):
                    took, frozen = _scrape(port)
                    assert took < 2.5, took
                    assert frozen["asyncrl_learner_steps_total"] == 1
                    assert frozen["asyncrl_learner_policy_version"] == 5
                    assert not any(name.startswith("asyncrl_buffer_") for name in frozen), frozen
        finally:
            os.kill(pid, signal.SIGCONT)
        srv.stop()  # gone: connection refused
        for _ in range(2):
            took, down = _scrape(port)
            assert took < 2.0, took
            assert down["asyncrl_learner_steps_total"] == 1
            assert not any(name.startswith("asyncrl_buffer_") for name in down), down
        warned = [r for r in caplog.records if "buffer metrics not exported" in r.getMessage()]
        assert len(warned) == 1, [r.getMessage() for r in caplog.records]  # once per outage

        srv.start()  # same port and data dir: the scrape's client reconnects
        deadline = time.monotonic() + 10
        while "asyncrl_buffer_depth_groups" not in (back := _scrape(port)[1]):
            assert time.monotonic() < deadline, back
            time.sleep(0.2)
        assert back["asyncrl_learner_steps_total"] == 1
    finally:
        stop()
        buf.close()
        srv.stop()
