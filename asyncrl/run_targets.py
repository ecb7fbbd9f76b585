"""Prometheus ``file_sd_configs`` targets of an ``asyncrl run``: the endpoints its learner and actors
serve, written to ``<run_dir>/prometheus_targets.json`` and to ``runs/_prometheus/<run>.json`` (what
``dashboards/prometheus.yml`` discovers), emptied when the run ends. Moved out of
:mod:`asyncrl.orchestrator`; stdlib only.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

__all__ = ["TARGETS_FILE", "DISCOVERY_DIR", "write_targets", "clear_targets", "discovery_file"]

TARGETS_FILE = "prometheus_targets.json"
DISCOVERY_DIR = "_prometheus"  # beside the run dirs: every run's targets, for dashboards/prometheus.yml


def write_targets(
    rdir: Path, run: str, learner_status: dict, actors: dict, num_actors: int, pool: int = 0
) -> list[dict]:
    """Prometheus ``file_sd_configs`` targets of the endpoints this run started (atomic rewrite).

    Actors: the heartbeats of this run's slots 0 .. ``num_actors`` - 1 only. The registry keeps the
    slots a previous start with more actors left behind (their ports may serve another process now),
    and other pools' actors, which this run did not start. ``pool``: the number this run's own pool leased
    (0 unless a serve-actors of an external Redis held it first)."""
    from asyncrl.actors.supervision import slot_actor_id

    def started(actor_id: str, hb: dict) -> bool:
        i = hb.get("index")
        return (
            isinstance(i, int)
            and 0 <= i < num_actors
            and hb.get("actor_id", actor_id) == slot_actor_id(pool, i)
        )

    # One group per endpoint, its `instance` label the role's name in the run, not the address: a
    # restarted learner (or a replaced actor) serves on a new ephemeral port, and under an address label
    # it began a new series whose first sample Prometheus never counts in rate()/increase(): what the new
    # process did before its first scrape (the stale drops and steps of a resume) was lost to the
    # dashboards and alerts. Under one series a restart is a counter reset, which rate() handles.
    groups = []
    if learner_status.get("metrics_addr"):
        labels = {"run": run, "role": "learner", "instance": f"{run}/learner"}
        groups.append({"targets": [learner_status["metrics_addr"]], "labels": labels})
    for actor_id, hb in sorted(actors.items()):
        if hb.get("metrics_addr") and started(actor_id, hb):
            labels = {"run": run, "role": "actor", "instance": f"{run}/{hb.get('actor_id', actor_id)}"}
            groups.append({"targets": [hb["metrics_addr"]], "labels": labels})
    _replace_targets(rdir, groups)
    return groups


def clear_targets(rdir: Path) -> None:
    """No targets (``[]``): the run's endpoints are gone. A finished run's file listed its dead ephemeral
    ports, and a later process that got one of them was scraped under this run's labels."""
    _replace_targets(rdir, [])


def discovery_file(rdir: Path) -> Path:
    """The copy of ``rdir``'s targets that dashboards/prometheus.yml discovers: ``<runs>/_prometheus/
    <run>.json``. Prometheus takes a glob only in a path's last element (``runs/*/prometheus_targets.json``
    is refused), so every run's targets go into one directory as well (no run is named ``_prometheus``:
    run names start with a letter or a digit)."""
    return rdir.parent / DISCOVERY_DIR / f"{rdir.name}.json"


def _replace_targets(rdir: Path, groups: list[dict]) -> None:
    text = json.dumps(groups, indent=2)
    sd = discovery_file(rdir)
    sd.parent.mkdir(exist_ok=True)
    for path in (rdir / TARGETS_FILE, sd):  # atomic each: Prometheus re-reads them every 5 s
        if path.is_file() and path.read_text() == text:
            continue  # unchanged (most supervision passes): no write, rename and re-read by Prometheus
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(text)
        os.replace(tmp, path)
