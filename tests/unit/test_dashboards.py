"""Dashboards and alerts only use declared metrics, and every declared metric is on some panel."""

import json
import re
import shutil
import subprocess
from pathlib import Path

import yaml

from asyncrl.metrics import ALL_METRICS, metric_names

ROOT = Path(__file__).resolve().parents[2]
NAME = re.compile(r"\basyncrl_[a-z0-9_]+\b")


def dashboard_queries() -> list[str]:
    dash = json.loads((ROOT / "dashboards" / "asyncrl.json").read_text())
    return [t["expr"] for p in dash["panels"] if p["type"] != "row" for t in p["targets"]]


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


def test_alert_rules_pass_promtool():
    promtool = shutil.which("promtool")
    assert promtool, "promtool missing: run `bash scripts/setup.sh --test` (installs the prometheus package)"
    r = subprocess.run([promtool, "check", "rules", str(ROOT / "dashboards" / "alerts.yml")],
                       capture_output=True, text=True)  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SUCCESS: 5 rules found" in r.stdout
