"""Every Prometheus metric of asyncrl, in one place, and the /metrics server.

Names follow ``asyncrl_<component>_<quantity>_<unit>``. Roles do not create Prometheus objects: they
keep plain counters in a stats dict (the actor's ``stats()``, the learner's step record, the buffer's
``stats()``), and a collector here turns a snapshot of that dict into metric families at scrape time.
That keeps the roles free of metrics plumbing and makes a scrape consistent (one snapshot).

Invariant: a declared series is always exported (0 when its source key is missing), so dashboard
queries and alerts never miss a series at start; labelled series (e.g. loss terms) are enumerated here.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.core import (
    CollectorRegistry,
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
)


@dataclass(frozen=True)
class Metric:
    name: str
    kind: str  # counter | gauge | histogram
    doc: str
    key: str  # key in the role's stats snapshot
    buckets: tuple[float, ...] = ()
    # For a labelled gauge: label name and {label value: snapshot key}.
    label: str = ""
    series: tuple[tuple[str, str], ...] = field(default_factory=tuple)


SECONDS_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
STALENESS_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 12, 16, 32)

ACTOR_METRICS: tuple[Metric, ...] = (
    Metric(
        "asyncrl_actor_generated_tokens_total", "counter", "Completion tokens sampled.", "generated_tokens"
    ),
    Metric(
        "asyncrl_actor_groups_written_total", "counter", "Groups written to the buffer.", "groups_written"
    ),
    Metric("asyncrl_actor_inflight_requests", "gauge", "Groups being generated now.", "in_flight"),
    Metric(
        "asyncrl_actor_admission_wait_seconds_total",
        "counter",
        "Time spent waiting for admission (the staleness bound).",
        "admission_wait_s",
    ),  # fmt: skip
    Metric("asyncrl_actor_policy_version", "gauge", "Policy version the engine samples with.", "version"),
    Metric(
        "asyncrl_actor_swap_pause_seconds",
        "histogram",
        "Generation pause per weight swap.",
        "swap_pause_hist",  # cumulative (a Hist's to_dict()), never the actor's recent-window list
        buckets=SECONDS_BUCKETS,
    ),  # fmt: skip
    Metric("asyncrl_actor_weight_swaps_total", "counter", "Weight swaps applied.", "swaps"),
    Metric(
        "asyncrl_actor_engine_errors_total", "counter", "Engine errors (failed requests).", "engine_errors"
    ),
    Metric(
        "asyncrl_actor_reward_failures_total",
        "counter",
        "Groups dropped because their reward raised or exceeded task.reward_timeout_s.",
        "groups_reward_failed",
    ),
    Metric(
        "asyncrl_actor_loop_restarts_total",
        "counter",
        "Restarts of the actor's failed generation loop (actors.loop_restarts).",
        "loop_restarts",
    ),
)

BUFFER_METRICS: tuple[Metric, ...] = (
    Metric("asyncrl_buffer_depth_groups", "gauge", "Groups in the rollouts stream.", "depth"),
    Metric(
        "asyncrl_buffer_pending_groups",
        "gauge",
        "Groups read by the learner, not yet acknowledged.",
        "pending",
    ),
    Metric(
        "asyncrl_buffer_dead_letters_groups", "gauge", "Malformed records in the dead-letter stream.", "dead"
    ),
    Metric(
        "asyncrl_buffer_admitted_groups", "gauge", "Groups admitted so far (admission counter).", "admitted"
    ),
    Metric(
        "asyncrl_buffer_credits_groups",
        "gauge",
        "Admission credits: groups given back (dropped, aborted, reclaimed, lost), less a learner fork's debit "
        "(version skew x groups per version; may be negative).",
        "credits",
    ),
    Metric(
        "asyncrl_buffer_version_skew_versions",
        "gauge",
        "Versions minus learner steps: versions skipped by forks on resume, less steps that published nothing "
        "(learner.publish_policy=taken); admission counts on this axis.",
        "version_skew",
    ),
    Metric("asyncrl_buffer_admission_bound_groups", "gauge", "Current admission bound.", "bound"),
    Metric(
        "asyncrl_buffer_staleness_bound_steps",
        "gauge",
        "Staleness bound admission applies now: max_staleness, or the adaptive controller's lower bound.",
        "staleness_bound",
    ),
)

LOSS_TERMS = (("policy", "loss_policy"), ("rollout_kl", "loss_rollout_kl"), ("entropy", "loss_entropy"),
              ("ref_kl", "loss_ref_kl"), ("total", "loss"))  # fmt: skip

# Objective diagnostics (asyncrl.learner.objectives): label value -> step-record key.
OBJECTIVE_KL = (("mu_pi_k1", "kl_mu_pi_k1"), ("mu_pi_k2", "kl_mu_pi_k2"), ("mu_pi_k3", "kl_mu_pi_k3"),
                ("pi_mu_is", "kl_pi_mu_is"))  # fmt: skip
OBJECTIVE_HELD = (("dppo_low", "dppo_masked_frac_low"), ("dppo_high", "dppo_masked_frac_high"),
                  ("m2po", "m2po_masked_frac"), ("clip_low", "clip_frac_low"), ("clip_high", "clip_frac_high"),
                  ("dual_clip", "dual_clip_frac"), ("is_truncated", "is_trunc_frac"),
                  ("is_masked", "is_masked_frac"))  # fmt: skip

LEARNER_METRICS: tuple[Metric, ...] = (
    Metric("asyncrl_learner_steps_total", "counter", "Learner steps taken (incl. skipped).", "step"),
    Metric(
        "asyncrl_learner_trained_tokens_total", "counter", "Completion tokens trained on.", "tokens_total"
    ),
    Metric("asyncrl_learner_trained_groups_total", "counter", "Groups trained on.", "groups_total"),
    Metric(
        "asyncrl_learner_step_seconds",
        "histogram",
        "Wall time of one learner step.",
        "step_s",
        buckets=SECONDS_BUCKETS,
    ),  # fmt: skip
    Metric("asyncrl_learner_wait_seconds_total", "counter", "Time blocked waiting for data.", "wait_s_total"),
    Metric(
        "asyncrl_learner_loss", "gauge", "Loss terms of the last step.", "", label="term", series=LOSS_TERMS
    ),
    Metric("asyncrl_learner_reward_mean", "gauge", "Mean reward of the last step's groups.", "reward_mean"),
    Metric("asyncrl_learner_ratio_mean", "gauge", "Mean policy/anchor ratio.", "ratio_mean"),
    Metric(
        "asyncrl_learner_dppo_masked_ratio", "gauge", "Fraction of tokens DPPO masked.", "dppo_masked_frac"
    ),
    Metric("asyncrl_learner_is_weight_mean", "gauge", "Mean importance weight.", "is_weight_mean"),
    Metric("asyncrl_learner_is_ess_ratio", "gauge", "Normalised effective sample size of IS weights.", "ess"),
    Metric(
        "asyncrl_learner_rollout_kl",
        "gauge",
        "KL(behaviour || policy) on trained tokens (k3, unbiased).",
        "rollout_kl",
    ),
    Metric(
        "asyncrl_learner_mismatch_kl",
        "gauge",
        "KL(behaviour || step-start policy) at staleness 0: engine vs learner numerics.",
        "mismatch_kl",
    ),
    Metric(
        "asyncrl_learner_kl",
        "gauge",
        "KL estimates between policy and behaviour on trained tokens, by direction and estimator.",
        "",
        label="estimator",
        series=OBJECTIVE_KL,
    ),
    Metric(
        "asyncrl_learner_drift_kl",
        "gauge",
        "KL(behaviour || step-start policy): engine mismatch (staleness 0) vs staleness (>= 1).",
        "",
        label="source",
        series=(("mismatch", "mismatch_kl"), ("staleness", "staleness_kl")),
    ),
    Metric(
        "asyncrl_learner_log_ppl_gap",
        "gauge",
        "Train minus rollout log-perplexity of trained tokens at step start.",
        "log_ppl_gap",
    ),
    Metric(
        "asyncrl_learner_held_tokens_ratio",
        "gauge",
        "Fraction of trained tokens each trust-region / IS mechanism held, by mechanism and side.",
        "",
        label="mechanism",
        series=OBJECTIVE_HELD,
    ),
    Metric(
        "asyncrl_learner_is_chi2",
        "gauge",
        "Chi-square divergence of the importance ratios (untruncated), by level.",
        "",
        label="level",
        series=(("token", "is_chi2"), ("sequence", "is_chi2_seq")),
    ),
    Metric("asyncrl_learner_entropy_nats", "gauge", "Mean token entropy.", "entropy"),
    Metric(
        "asyncrl_learner_staleness_steps",
        "histogram",
        "Per-token staleness V - v_t of trained tokens.",
        "staleness_hist",
        buckets=STALENESS_BUCKETS,
    ),  # fmt: skip
    Metric(
        "asyncrl_learner_staleness_max_steps",
        "gauge",
        "Max token staleness of the last step.",
        "staleness_max",
    ),
    Metric(
        "asyncrl_learner_dropped_stale_total",
        "counter",
        "Groups dropped as too stale.",
        "dropped_stale_total",
    ),
    Metric("asyncrl_learner_grad_norm", "gauge", "Gradient norm of the last step.", "grad_norm"),
    Metric(
        "asyncrl_learner_nonfinite_skips_total",
        "counter",
        "Steps skipped for a non-finite loss/grad.",
        "skipped_nonfinite",
    ),  # fmt: skip
    Metric("asyncrl_learner_policy_version", "gauge", "Latest published policy version.", "version"),
    Metric(
        "asyncrl_learner_max_staleness_steps", "gauge", "Configured staleness bound (eta).", "max_staleness"
    ),
    Metric(
        "asyncrl_learner_publish_seconds",
        "histogram",
        "Time to gather and publish weights.",
        "publish_s",
        buckets=SECONDS_BUCKETS,
    ),  # fmt: skip
    Metric(
        "asyncrl_learner_last_step_timestamp_seconds", "gauge", "Unix time of the last step.", "step_time"
    ),
    # Periodic eval (asyncrl.evaluate): the newest result the learner has seen (eval_version -1 = none).
    Metric(
        "asyncrl_learner_eval_policy_version", "gauge", "Policy version of the newest eval.", "eval_version"
    ),
    Metric("asyncrl_learner_eval_reward_mean", "gauge", "Mean reward on the eval split.", "eval_reward_mean"),
    Metric(
        "asyncrl_learner_eval_pass_at_k_ratio",
        "gauge",
        "Share of eval prompts passed within k samples.",
        "eval_pass_at_k",
    ),  # fmt: skip
    Metric(
        "asyncrl_learner_eval_length_mean_tokens", "gauge", "Mean eval completion length.", "eval_length_mean"
    ),
)

ALL_METRICS: tuple[Metric, ...] = ACTOR_METRICS + BUFFER_METRICS + LEARNER_METRICS


def metric_names() -> set[str]:
    """Names as exposed on /metrics (histograms add _bucket/_sum/_count)."""
    return {m.name for m in ALL_METRICS}


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
    """Exports ``metrics`` from ``snapshot()`` (a dict) at scrape time, with constant labels."""

    def __init__(
        self, metrics: Iterable[Metric], snapshot: Callable[[], dict], labels: dict[str, str] | None = None
    ):
        self.metrics = tuple(metrics)
        self.snapshot = snapshot
        self.labels = dict(labels or {})

    def collect(self):
        snap = self.snapshot() or {}
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


class LearnerExporter:
    """Mirrors the learner's step records (an ``on_step`` callback) into a scrape snapshot.

    Per-step fields are exported as last values; step and publish times and per-token staleness are
    accumulated into histograms here, because a record only describes one step.
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

    def __call__(self, record: Any) -> None:
        d = record.to_dict() if hasattr(record, "to_dict") else dict(record)
        with self.stats.lock:
            for k, v in d.items():
                if k not in ("step_s", "publish_s", "staleness_hist") and isinstance(v, int | float):
                    self.stats[k] = v
            self.stats["step_s"].observe(float(d.get("step_s", 0.0)))
            if d.get("published"):
                self.stats["publish_s"].observe(float(d.get("publish_s", 0.0)))
            for value, n in (d.get("staleness_hist") or {}).items():
                self.stats["staleness_hist"].observe(float(value), int(n))

    def snapshot(self) -> dict:
        with self.stats.lock:
            return dict(self.stats)


def learner_collectors(
    exporter: LearnerExporter, buffer_stats: Callable[[], dict]
) -> list[SnapshotCollector]:
    """The learner process serves its own metrics and the buffer's (read from Redis at scrape time)."""
    return [
        SnapshotCollector(LEARNER_METRICS, exporter.snapshot),
        SnapshotCollector(BUFFER_METRICS, buffer_stats),
    ]


def actor_collector(actor_id: str, stats: Callable[[], dict]) -> SnapshotCollector:
    return SnapshotCollector(ACTOR_METRICS, stats, labels={"actor": actor_id})
