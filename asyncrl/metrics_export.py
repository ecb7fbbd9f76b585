"""Prometheus export of the metrics declared in :mod:`asyncrl.metrics`: histograms, collectors, /metrics.

A role keeps plain counters in a stats dict (a :class:`ThreadSafeStats`, with :class:`Hist` for the
cumulative histograms); a :class:`SnapshotCollector` turns one snapshot of it into metric families at
scrape time, and :func:`serve` serves the collectors on /metrics. The learner's step records reach
its snapshot through :class:`LearnerExporter`. Every declared series is exported, 0 when its source
key is missing (the invariant of :mod:`asyncrl.metrics`).
"""

from __future__ import annotations

import logging
import math
import socket
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client.core import (
    CollectorRegistry,
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
)

from asyncrl.metrics import ACTOR_METRICS, ALL_METRICS, BUFFER_METRICS, LEARNER_METRICS, Metric

log = logging.getLogger(__name__)


class Hist:
    """Bucketed observations kept as (value, count) pairs per distinct bucket edge: O(buckets) memory."""

    def __init__(self, buckets: tuple[float, ...]):
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)
        self.total = 0.0

    def observe(self, v: float, n: int = 1) -> None:
        i = next((k for k, b in enumerate(self.buckets) if v <= b), len(self.buckets))
        self.counts[i] += n
        self.total += v * n

    def to_dict(self) -> dict[str, Any]:
        """Plain data (picklable, JSON-able) for a stats snapshot that crosses a process boundary."""
        return {"buckets": list(self.buckets), "counts": list(self.counts), "sum": self.total}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Hist:
        h = cls(tuple(d["buckets"]))
        h.counts = [int(c) for c in d["counts"]]
        h.total = float(d["sum"])
        return h


def histogram_for(key: str) -> Hist:
    """An empty cumulative histogram with the buckets of the declared histogram fed by ``key``: a role
    keeps it in its stats and observes into it (a window of recent values would shrink between scrapes,
    and Prometheus reads any decrease of a bucket or count as a counter reset)."""
    m = next(m for m in ALL_METRICS if m.key == key and m.kind == "histogram")
    return Hist(m.buckets)


def _hist(values: Any, buckets: tuple[float, ...]) -> tuple[list[tuple[str, float]], float]:
    """Cumulative buckets from a Hist (or its to_dict()), raw observations (list) or a {value: count} map."""
    if isinstance(values, dict) and "counts" in values:
        values = Hist.from_dict(values)
    if isinstance(values, Hist):
        cum, out = 0, []
        for b, c in zip((*[repr(float(b)) for b in values.buckets], "+Inf"), values.counts, strict=True):
            cum += c
            out.append((b, float(cum)))
        return out, values.total
    if isinstance(values, dict):
        items = [(float(k), float(c)) for k, c in values.items()]
    else:
        items = [(float(v), 1.0) for v in (values or [])]
    out = []
    for b in buckets:
        out.append((repr(float(b)), sum(c for v, c in items if v <= b)))
    out.append(("+Inf", sum(c for _, c in items)))
    return out, sum(v * c for v, c in items)


class SnapshotCollector:
    """Exports ``metrics`` from ``snapshot()`` (a dict) at scrape time, with constant labels.
    ``omit_empty``: an empty snapshot (its source could not be read) exports nothing, not zeros."""

    def __init__(
        self,
        metrics: Iterable[Metric],
        snapshot: Callable[[], dict],
        labels: dict[str, str] | None = None,
        omit_empty: bool = False,
    ):
        self.metrics = tuple(metrics)
        self.snapshot = snapshot
        self.labels = dict(labels or {})
        self.omit_empty = omit_empty

    def collect(self):
        snap = self.snapshot() or {}
        if self.omit_empty and not snap:
            return
        names, values = list(self.labels), list(self.labels.values())
        for m in self.metrics:
            if m.kind == "counter":
                fam = CounterMetricFamily(m.name, m.doc, labels=names)
                fam.add_metric(values, float(snap.get(m.key, 0) or 0))
            elif m.kind == "gauge" and m.label:
                fam = GaugeMetricFamily(m.name, m.doc, labels=[*names, m.label])
                for lv, key in m.series:
                    fam.add_metric([*values, lv], float(snap.get(key, 0) or 0))
            elif m.kind == "gauge":
                fam = GaugeMetricFamily(m.name, m.doc, labels=names)
                fam.add_metric(values, float(snap.get(m.key, 0) or 0))
            else:
                fam = HistogramMetricFamily(m.name, m.doc, labels=names)
                buckets, total = _hist(snap.get(m.key), m.buckets)
                fam.add_metric(values, buckets, total)
            yield fam


def serve(
    collectors: Iterable[SnapshotCollector], host: str = "127.0.0.1", port: int = 0
) -> tuple[int, Callable]:
    """Serve /metrics for ``collectors`` on (host, port); port 0 picks a free one. Returns (port, stop)."""
    from prometheus_client import start_http_server

    registry = CollectorRegistry(auto_describe=False)
    for c in collectors:
        registry.register(c)
    if port == 0:
        with socket.socket() as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
    server, thread = start_http_server(port, addr=host, registry=registry)

    def stop() -> None:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)

    return port, stop


#: Bind hosts meaning "every interface": advertised as this node's address (nobody can connect to 0.0.0.0).
WILDCARD_HOSTS = ("0.0.0.0", "::", "")


def node_address() -> str:
    """This machine's address on the network: the source address of its default route (a UDP
    connect sends no packet), else its resolved host name."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 1))
            return s.getsockname()[0]
        except OSError:
            return socket.gethostbyname(socket.gethostname())


def metrics_endpoint(host: str, node_ip: str | None = None) -> tuple[str, str]:
    """(bind host, advertised host) for ``metrics.host``: ``node`` binds and advertises this node's
    address, a wildcard binds every interface and advertises this node's address, anything else is
    used for both. ``node_ip``: the node's address as the caller knows it (Ray's, in an actor)."""
    if host == "node":
        ip = node_ip or node_address()
        return ip, ip
    if host in WILDCARD_HOSTS:
        return host or "0.0.0.0", node_ip or node_address()
    return host, host


class ThreadSafeStats(dict):
    """A dict a role updates from its loop while the scrape thread snapshots it."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.lock = threading.Lock()

    def snapshot(self) -> dict:
        with self.lock:
            return {k: (list(v) if isinstance(v, list) else dict(v) if isinstance(v, dict) else v)
                    for k, v in self.items()}  # fmt: skip


#: The learner's counters (the snapshot keys of the ``counter`` entries of LEARNER_METRICS) -> the step
#: record's per-step field that adds to them (None: one per record). A record's ``*_total`` fields and
#: ``step`` are run-wide (restored from the checkpoint on resume); a Prometheus counter counts what its
#: process did, from 0. Summing the per-step fields is exact: asyncrl.learner.loop adds exactly these
#: fields to the run-wide totals, one record per step (a redone step after a resume counts again).
PROCESS_COUNTERS: dict[str, str | None] = {
    "step": None,
    "tokens_total": "tokens",
    "groups_total": "groups",
    "wait_s_total": "wait_s",
    "dropped_stale_total": "dropped_stale",
    "skipped_nonfinite": "skipped",
    "weights_delete_failures_total": "weights_delete_failures",
}


#: The step record's eval results (asyncrl.learner.tracking.attach_eval): exported once an eval exists.
EVAL_RESULTS = ("eval_reward_mean", "eval_pass_at_k", "eval_length_mean")


class LearnerExporter:
    """Mirrors the learner's step records (an ``on_step`` callback) into a scrape snapshot.

    Per-step fields are exported as last values; step and publish times and per-token staleness are
    accumulated into histograms here, because a record only describes one step. Counters count this
    learner process's steps from 0 (:data:`PROCESS_COUNTERS`), not the run-wide totals of the records
    (those stay in metrics.jsonl): a resumed learner exporting its restored totals made Prometheus
    count the whole run again as new increase (rates doubled, AsyncrlNonfiniteSkips fired after every
    resume of a run that ever skipped a step). A restart is a counter reset, which rate() handles.
    """

    def __init__(self, max_staleness: int = 0):
        self.stats = ThreadSafeStats(max_staleness=max_staleness)
        by_key = {m.key: m for m in LEARNER_METRICS}
        self.stats["step_s"] = Hist(by_key["step_s"].buckets)
        self.stats["publish_s"] = Hist(by_key["publish_s"].buckets)
        self.stats["staleness_hist"] = Hist(by_key["staleness_hist"].buckets)
        # Until the first step, "last step" is this exporter's start, not 0: a 0 made AsyncrlNoLearnerStep
        # (time() - this > 600) fire during every learner start-up and restart (checkpoint load, DeepSpeed).
        self.stats["step_time"] = time.time()
        self.stats["waiting_since"] = 0.0
        self.counts: dict[str, float] = dict.fromkeys(PROCESS_COUNTERS, 0)
        # No eval yet (eval_version -1): its results are NaN ("not measured"), not a reward of 0.
        self.stats["eval_version"] = -1
        self.stats.update(dict.fromkeys(EVAL_RESULTS, math.nan))

    def waiting(self, since: float) -> None:
        """The learner loop's ``on_wait``: unix time it began waiting for a batch, 0.0 once it has one."""
        with self.stats.lock:
            self.stats["waiting_since"] = float(since)

    def __call__(self, record: Any) -> None:
        d = record.to_dict() if hasattr(record, "to_dict") else dict(record)
        if int(d.get("eval_version", -1)) < 0:  # a record's eval results default to 0 before any eval
            d = {k: v for k, v in d.items() if k not in EVAL_RESULTS}
        with self.stats.lock:
            for k, v in d.items():
                if v in ("nan", "inf", "-inf"):  # to_dict's JSON-safe non-finite floats: NaN = not measured
                    v = float(v)
                if k not in ("step_s", "publish_s", "staleness_hist") and isinstance(v, int | float):
                    self.stats[k] = v
            self.stats["step_s"].observe(float(d.get("step_s", 0.0)))
            if d.get("published"):
                self.stats["publish_s"].observe(float(d.get("publish_s", 0.0)))
            for value, n in (d.get("staleness_hist") or {}).items():
                self.stats["staleness_hist"].observe(float(value), int(n))
            for key, field in PROCESS_COUNTERS.items():
                self.counts[key] += 1 if field is None else float(d.get(field, 0) or 0)

    def snapshot(self) -> dict:
        with self.stats.lock:
            return {**self.stats, **self.counts}


#: Socket and connect timeout of the learner's scrape-time read of the buffer's stats (no retry): a Redis
#: that is away (restarting, frozen) costs a scrape about this long, well within Prometheus'
#: scrape_timeout (10 s by default). With the learner's own Redis settings (retry_budget_s, 120 s) the
#: scrape timed out and the learner's own series were lost with the buffer's.
SCRAPE_REDIS_TIMEOUT_S = 1.0


def scrape_buffer(cfg: Any, url: str | None = None) -> Any:
    """A ReplayBuffer client of its own for the learner's scrape: short timeouts, no retry."""
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    from asyncrl.buffer import ReplayBuffer

    t = SCRAPE_REDIS_TIMEOUT_S
    return ReplayBuffer.from_config(
        cfg, url, socket_timeout=t, socket_connect_timeout=t, retry=Retry(NoBackoff(), 0)
    )


class BufferStats:
    """The buffer's stats for a scrape: ``read()``, or {} when it raises (Redis away), which the buffer
    collector exports as no series at all: zeros would read as an empty buffer, as a drop of the dead
    letters (AsyncrlDeadLettersGrowing on their return) and as a reset of a counter kept in Redis.
    Failures are counted; the first of an outage is logged, and the recovery."""

    def __init__(self, read: Callable[[], dict]):
        self.read = read
        self.failures = 0
        self.down = False

    def __call__(self) -> dict:
        try:
            stats = self.read()
        except Exception as e:  # the learner's own series are served whatever happens here
            self.failures += 1
            if not self.down:
                self.down = True
                log.warning("buffer metrics not exported: reading the buffer's stats failed (%s: %s); the "
                            "learner's own metrics are served meanwhile", type(e).__name__, e)  # fmt: skip
            return {}
        if self.down:
            self.down = False
            log.info("buffer metrics exported again (after %d failed scrapes)", self.failures)
        return stats


def learner_collectors(
    exporter: LearnerExporter, buffer_stats: Callable[[], dict]
) -> list[SnapshotCollector]:
    """The learner process serves its own metrics and the buffer's (read from Redis at scrape time,
    through :class:`BufferStats`: best effort; give it a :func:`scrape_buffer` client's ``stats``)."""
    return [
        SnapshotCollector(LEARNER_METRICS, exporter.snapshot),
        SnapshotCollector(BUFFER_METRICS, BufferStats(buffer_stats), omit_empty=True),
    ]


def actor_collector(actor_id: str, stats: Callable[[], dict]) -> SnapshotCollector:
    return SnapshotCollector(ACTOR_METRICS, stats, labels={"actor": actor_id})
