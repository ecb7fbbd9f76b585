"""Dashboards and alerts only use declared metrics, and every declared metric is on some panel.

Also the helpers the live-Prometheus tests share: :func:`dashboard_queries` (as stored, with Grafana
variables), :func:`grafana_expr` (those variables substituted as Grafana does), :func:`start_prometheus`
and :func:`prom_query`.
"""

import json
import re
import shutil
import subprocess
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import yaml

from asyncrl.metrics import ALL_METRICS, LEARNER_METRICS, metric_names

ROOT = Path(__file__).resolve().parents[2]
NAME = re.compile(r"\basyncrl_[a-z0-9_]+\b")


def dashboard() -> dict:
    return json.loads((ROOT / "dashboards" / "asyncrl.json").read_text())


def dashboard_queries() -> list[str]:
    """Every panel query as stored (``$run`` not substituted: see :func:`grafana_expr`)."""
    return [t["expr"] for p in dashboard()["panels"] if p["type"] != "row" for t in p["targets"]]


def grafana_expr(expr: str, runs: list[str] | None = None) -> str:
    """``expr`` as Grafana sends it to Prometheus: ``$run`` (a multi-value variable) becomes the regex
    alternation of ``runs`` (regex-escaped, backslashes doubled for the PromQL string), or the variable's
    All value ``.*`` when ``runs`` is None; Grafana's interval variables get fixed values. Every query of
    a live-Prometheus test goes through here; a variable it does not know fails the test."""
    if runs is None:
        value = next(v for v in dashboard()["templating"]["list"] if v["name"] == "run")["allValue"]
    else:
        escaped = [re.sub(r"([\\^$.|?*+()\[\]{}])", r"\\\\\1", r) for r in runs]
        value = escaped[0] if len(escaped) == 1 else "(" + "|".join(escaped) + ")"
    fixed = {"run": value, "__rate_interval": "1m", "__interval": "15s", "__range": "1h"}
    # KeyError: a variable not handled here
    return re.sub(r"\$(?:\{(\w+)\}|(\w+))", lambda m: fixed[m[1] or m[2]], expr)


def prom_query(port: int, expr: str) -> list:
    """An instant query through Prometheus's HTTP API on 127.0.0.1:``port``; the result vector."""
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    with urllib.request.urlopen(url, timeout=10) as r:
        body = json.loads(r.read())
    assert body["status"] == "success", body
    return body["data"]["result"]


def start_prometheus(
    tmp: Path, port: int, scrape_configs: str, scrape_interval: str = "1s", rules: bool = False
) -> subprocess.Popen:
    """A real Prometheus on 127.0.0.1:``port`` (config, TSDB and log under ``tmp``) scraping
    ``scrape_configs`` (YAML, the list under that key), evaluating dashboards/alerts.yml if ``rules``."""
    prom_bin = shutil.which("prometheus")
    assert prom_bin, "prometheus missing: run `bash scripts/setup.sh --test` (apt package prometheus)"
    rule_files = f"rule_files: ['{ROOT / 'dashboards' / 'alerts.yml'}']\n" if rules else ""
    (tmp / "prometheus.yml").write_text(
        f"global: {{scrape_interval: {scrape_interval}, evaluation_interval: 1s}}\n{rule_files}"
        f"scrape_configs:\n{scrape_configs}"
    )
    return subprocess.Popen(
        [prom_bin, f"--config.file={tmp / 'prometheus.yml'}", f"--storage.tsdb.path={tmp / 'tsdb'}",
         f"--web.listen-address=127.0.0.1:{port}"],
        stdout=(tmp / "prometheus.log").open("wb"), stderr=subprocess.STDOUT,
    )  # fmt: skip


def alert_queries() -> list[str]:
    rules = yaml.safe_load((ROOT / "dashboards" / "alerts.yml").read_text())
    return [r["expr"] for g in rules["groups"] for r in g["rules"]]


def referenced(exprs: list[str]) -> set[str]:
    names = set()
    for e in exprs:
        for n in NAME.findall(e):
            names.add(
                re.sub(r"_(bucket|sum|count)$", "", n) if n.endswith(("_bucket", "_sum", "_count")) else n
            )
    return names


def test_every_query_uses_declared_metrics():
    declared = metric_names()
    unknown = referenced(dashboard_queries() + alert_queries()) - declared
    assert not unknown, f"dashboards/alerts reference undeclared metrics: {sorted(unknown)}"


def test_every_declared_metric_is_on_a_panel():
    missing = metric_names() - referenced(dashboard_queries())
    assert not missing, f"declared metrics on no panel: {sorted(missing)}"


def test_metric_names_follow_the_convention():
    for m in ALL_METRICS:
        assert re.fullmatch(r"asyncrl_(actor|buffer|learner)_[a-z0-9_]+", m.name), m.name
        if m.kind == "counter":
            assert m.name.endswith("_total"), m.name
    assert len({m.name for m in ALL_METRICS}) == len(ALL_METRICS)


def test_histogram_queries_use_buckets():
    hist = {m.name for m in ALL_METRICS if m.kind == "histogram"}
    for e in dashboard_queries():
        for n in NAME.findall(e):
            assert n not in hist, f"histogram {n} must be queried through _bucket/_sum/_count: {e}"


#: Counters kept in Redis and served by whichever learner process runs: run-wide, never reset.
REDIS_COUNTERS = {"asyncrl_buffer_dead_letters_total"}


def test_counters_are_queried_through_rate_or_increase():
    """A counter restarts at 0 when its process does (a restarted learner, actor): its raw value is no
    quantity to plot or alert on, only its rate() or increase() over a range (which handle the reset),
    or, for a run-wide counter that lives in Redis (never reset), over the run's one series
    (``increase((max by (run) (c))[10m:15s])``: a restarted exporter's new series then adds nothing)."""
    counters = {m.name for m in ALL_METRICS if m.kind == "counter"}
    counters |= {
        f"{m.name}_{s}" for m in ALL_METRICS if m.kind == "histogram" for s in ("bucket", "sum", "count")
    }
    for e in dashboard_queries() + alert_queries():
        for m in SELECTOR.finditer(e):
            if m[1] in counters:
                before, after = e[: m.start()].rstrip(), e[m.end() :].lstrip()
                plain = re.search(r"\b(rate|irate|increase)\s*\($", before) and after.startswith("[")
                run_wide = m[1] in REDIS_COUNTERS and before.endswith("increase((max by (run) (")
                assert plain or (run_wide and after.startswith("))[")), (m[1], e)


def test_alert_rules_pass_promtool():
    promtool = shutil.which("promtool")
    assert promtool, "promtool missing: run `bash scripts/setup.sh --test` (installs the prometheus package)"
    r = subprocess.run([promtool, "check", "rules", str(ROOT / "dashboards" / "alerts.yml")],
                       capture_output=True, text=True)  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SUCCESS: 8 rules found" in r.stdout


def test_shipped_prometheus_config_passes_promtool():
    """dashboards/prometheus.yml loads (a file_sd glob outside a path's last element is refused at start)."""
    promtool = shutil.which("promtool")
    if not promtool:
        pytest.skip("promtool missing: run `bash scripts/setup.sh --test` (installs the prometheus package)")
    r = subprocess.run([promtool, "check", "config", str(ROOT / "dashboards" / "prometheus.yml")],
                       capture_output=True, text=True)  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SUCCESS: 8 rules found" in r.stdout  # its rule_files: the alerts


def test_dashboard_has_a_run_variable():
    """Several runs scraped by one Prometheus: the user picks one, several or All (the default)."""
    (var,) = [v for v in dashboard()["templating"]["list"] if v["name"] == "run"]
    assert var["type"] == "query" and var["multi"] and var["includeAll"], var
    assert var["allValue"] == ".*" and var["current"]["value"] == ["$__all"], var
    m = re.fullmatch(r"label_values\((asyncrl_[a-z0-9_]+), run\)", var["query"]["query"])
    assert m and m[1] in {x.name for x in LEARNER_METRICS}, var["query"]  # every run has a learner


SELECTOR = re.compile(r"\b(asyncrl_[a-z0-9_]+)\b(\{[^}]*\})?")
AGGREGATION = re.compile(r"\b(sum|avg|min|max|count|topk|bottomk|quantile)\b\s*(?:by\s*\(([^)]*)\))?\s*\(")


def test_every_query_selects_the_run_variable_and_keeps_the_run_label():
    for q in dashboard_queries():
        for name, labels in SELECTOR.findall(q):
            assert 'run=~"$run"' in labels, f'{name} without run=~"$run": {q}'
        for op, by in AGGREGATION.findall(q):
            assert "run" in {x.strip() for x in by.split(",")}, f"{op} does not keep run: {q}"
    targets = [t for p in dashboard()["panels"] if p["type"] != "row" for t in p["targets"]]
    assert all(t["legendFormat"].startswith("{{run}}") for t in targets)


def test_grafana_expr_substitutes_the_run_variable():
    q = 'sum by (run) (rate(asyncrl_learner_steps_total{run=~"$run"}[$__rate_interval]))'
    assert grafana_expr(q, ["a-1"]) == 'sum by (run) (rate(asyncrl_learner_steps_total{run=~"a-1"}[1m]))'
    assert 'run=~"(a|b\\\\.c)"' in grafana_expr(q, ["a", "b.c"])
    assert 'run=~".*"' in grafana_expr(q)


def test_dashboard_json_is_the_generators_output():
    """asyncrl.json is what scripts/make_dashboard.py writes (a hand edit is lost at the next generation)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_dashboard", ROOT / "scripts" / "make_dashboard.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.build() == dashboard(), "run .venv/bin/python scripts/make_dashboard.py"


def test_alert_rules_pass_their_promtool_unit_tests():
    """tests/unit/alerts_test.yml: e.g. AsyncrlLearnerStarved for a learner blocked in its wait (the wait
    counter flat or absent: it advances only when a step ends), and not during start-up."""
    promtool = shutil.which("promtool")
    assert promtool, "promtool missing: run `bash scripts/setup.sh --test` (installs the prometheus package)"
    r = subprocess.run([promtool, "test", "rules", str(ROOT / "tests" / "unit" / "alerts_test.yml")],
                       capture_output=True, text=True)  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
