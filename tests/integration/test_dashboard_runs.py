"""Two runs scraped by one real Prometheus: every dashboard panel query, with ``$run`` set to one run,
returns that run's series only, and with All, one series set per run (no panel sums the runs together).

Each run is its own /metrics endpoint serving what a learner process and an actor serve
(asyncrl.metrics_export: every declared series, 0 until set), labelled ``run`` by the scrape config
as ``asyncrl run``'s prometheus_targets.json labels its targets. A few seconds.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time

import pytest

from asyncrl.metrics_export import LearnerExporter, actor_collector, learner_collectors, serve
from tests.integration.learner_helpers import free_port
from tests.unit.test_dashboards import ROOT, dashboard_queries, grafana_expr, prom_query, start_prometheus

RUNS = ("run-a", "run-b.2")  # a regex metacharacter in a name: the substitution must escape it


@pytest.fixture(scope="module")
def prometheus_with_two_runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("two-runs")
    stops, targets = [], []
    for i, run in enumerate(RUNS):
        exporter = LearnerExporter(max_staleness=1)
        exporter({"step": 3 + i, "version": 3 + i, "wait_s_total": 1.5, "step_s": 0.2, "published": True})
        collectors = [*learner_collectors(exporter, lambda: {"depth": 4}), actor_collector("0", lambda: {})]
        port, stop = serve(collectors)
        stops.append(stop)
        targets.append(f"{{targets: ['127.0.0.1:{port}'], labels: {{run: '{run}'}}}}")
    prom_port = free_port()
    scrape = f"  - job_name: asyncrl\n    static_configs: [{', '.join(targets)}]\n"
    prom = start_prometheus(tmp, prom_port, scrape, scrape_interval="200ms")
    try:
        deadline = time.monotonic() + 30
        while True:  # three scrapes of each run: rate() and histogram_quantile() have two samples
            try:
                seen = prom_query(prom_port, 'count_over_time(up{job="asyncrl"}[1m]) >= 3')
            except OSError:
                seen = []
            if {r["metric"]["run"] for r in seen} == set(RUNS):
                break
            assert prom.poll() is None and time.monotonic() < deadline, (tmp / "prometheus.log").read_text()
            time.sleep(0.2)
        yield prom_port
    finally:
        prom.terminate()
        prom.wait(30)
        for stop in stops:
            stop()


def test_each_panel_query_returns_only_the_selected_runs_series(prometheus_with_two_runs):
    port = prometheus_with_two_runs
    for q in dashboard_queries():
        for run in RUNS:
            result = prom_query(port, grafana_expr(q, [run]))
            assert result, f"no data for run {run}: {q}"
            assert {r["metric"].get("run") for r in result} == {run}, (q, result)
        everything = prom_query(port, grafana_expr(q))
        assert {r["metric"].get("run") for r in everything} == set(RUNS), f"runs mixed: {q}"
        both = prom_query(port, grafana_expr(q, list(RUNS)))
        assert len(both) == len(everything), q


def test_shipped_prometheus_config_discovers_every_run(tmp_path):
    """dashboards/prometheus.yml as shipped, next to runs/ as in the repo: every run's targets, as `asyncrl
    run` writes them (write_targets: the run dir's file and its copy in runs/_prometheus/), are scraped
    as job asyncrl with their labels; a finished run's (clear_targets) are dropped."""
    from asyncrl.run_targets import clear_targets, write_targets

    prom_bin = shutil.which("prometheus")
    assert prom_bin, "prometheus missing: run `bash scripts/setup.sh --test` (apt package prometheus)"
    (tmp_path / "dashboards").mkdir()
    for name in ("prometheus.yml", "alerts.yml"):
        shutil.copy(ROOT / "dashboards" / name, tmp_path / "dashboards" / name)
    runs = tmp_path / "runs"
    stops, want = [], set()
    for run in ("demo", "other.1", "done"):
        port, stop = serve([actor_collector("0", lambda: {})])
        stops.append(stop)
        (runs / run).mkdir(parents=True)
        write_targets(runs / run, run, {"metrics_addr": f"127.0.0.1:{port}"}, {}, num_actors=1)
        if run == "done":
            clear_targets(runs / run)
        else:
            want.add((run, "learner", f"{run}/learner"))  # the instance: its role in the run, not the port
    assert json.loads((runs / "_prometheus" / "done.json").read_text()) == []
    prom_port = free_port()
    prom = subprocess.Popen(
        [prom_bin, f"--config.file={tmp_path / 'dashboards' / 'prometheus.yml'}",
         f"--storage.tsdb.path={tmp_path / 'tsdb'}", f"--web.listen-address=127.0.0.1:{prom_port}"],
        stdout=(tmp_path / "prometheus.log").open("wb"), stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                up = prom_query(prom_port, 'up{job="asyncrl"} == 1')
            except OSError:
                up = []
            seen = {(r["metric"]["run"], r["metric"]["role"], r["metric"]["instance"]) for r in up}
            if seen == want:
                break
            assert prom.poll() is None and time.monotonic() < deadline, (
                seen,
                (tmp_path / "prometheus.log").read_text()[-3000:],
            )
            time.sleep(0.3)
    finally:
        prom.terminate()
        prom.wait(30)
        for stop in stops:
            stop()
