"""Generate dashboards/asyncrl.json (Grafana) from the panel list below.

The JSON is committed; re-run this after changing a panel: `.venv/bin/python scripts/make_dashboard.py`.
Every query uses only names declared in asyncrl/metrics.py (tests/unit/test_dashboards.py checks it).

One Prometheus may scrape several runs (each series carries its target's `run` label): the dashboard
has a `run` variable (multi-select, "All" by default), :func:`for_run` adds `run=~"$run"` to every
metric selector below, and every aggregation keeps `run` (`sum by (run)`, `sum by (run, le)`), so two
runs are never summed into one line; legends start with the run.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

DS = {"type": "prometheus", "uid": "asyncrl-prometheus"}
RUN_SELECTOR = 'run=~"$run"'
# Every run's learner exports this from its start (asyncrl.metrics: every declared series, 0 until set).
RUN_VARIABLE_QUERY = "label_values(asyncrl_learner_steps_total, run)"
_METRIC = re.compile(r"\b(asyncrl_[a-z0-9_]+)\b(\{)?")

ROWS: list[tuple[str, list[tuple[str, str, list[tuple[str, str]]]]]] = [
    ("Throughput", [
        ("Tokens / s", "short", [
            ("generated", "sum by (run) (rate(asyncrl_actor_generated_tokens_total[1m]))"),
            ("trained", "sum by (run) (rate(asyncrl_learner_trained_tokens_total[1m]))"),
        ]),
        ("Groups / s", "short", [
            ("written {{actor}}", "rate(asyncrl_actor_groups_written_total[1m])"),
            ("trained", "sum by (run) (rate(asyncrl_learner_trained_groups_total[1m]))"),
        ]),
        ("Learner step time", "s", [
            ("p50", "histogram_quantile(0.5, sum by (run, le) (rate(asyncrl_learner_step_seconds_bucket[5m])))"),
            ("p90", "histogram_quantile(0.9, sum by (run, le) (rate(asyncrl_learner_step_seconds_bucket[5m])))"),
            ("steps/min", "sum by (run) (rate(asyncrl_learner_steps_total[5m])) * 60"),
        ]),
        ("Learner wait fraction", "percentunit", [
            ("waiting for data", "sum by (run) (rate(asyncrl_learner_wait_seconds_total[1m]))"),
        ]),
        ("Reward", "short", [
            ("mean reward (train)", "asyncrl_learner_reward_mean"),
            ("mean reward (eval)", "asyncrl_learner_eval_reward_mean"),
            ("pass@k (eval)", "asyncrl_learner_eval_pass_at_k_ratio"),
        ]),
        ("Eval", "short", [
            ("evaluated version", "asyncrl_learner_eval_policy_version"),
            ("mean length (tokens)", "asyncrl_learner_eval_length_mean_tokens"),
        ]),
        ("Actors", "short", [
            ("in flight {{actor}}", "asyncrl_actor_inflight_requests"),
            ("engine errors/s {{actor}}", "rate(asyncrl_actor_engine_errors_total[5m])"),
            ("reward failures/s {{actor}}", "rate(asyncrl_actor_reward_failures_total[5m])"),
            ("rejected by the engine/s {{actor}}", "rate(asyncrl_actor_rejected_groups_total[5m])"),
            ("refused prompts skipped/s {{actor}}", "rate(asyncrl_actor_skipped_prompts_total[5m])"),
            ("loop restarts {{actor}}", "increase(asyncrl_actor_loop_restarts_total[15m])"),
        ]),
    ]),
    ("Staleness", [
        ("Token staleness V - v_t", "short", [
            ("p50", "histogram_quantile(0.5, sum by (run, le) (rate(asyncrl_learner_staleness_steps_bucket[5m])))"),
            ("p99", "histogram_quantile(0.99, sum by (run, le) (rate(asyncrl_learner_staleness_steps_bucket[5m])))"),
            ("max", "asyncrl_learner_staleness_max_steps"),
            ("bound", "asyncrl_learner_max_staleness_steps"),
            ("admission bound (adaptive)", "asyncrl_buffer_staleness_bound_steps"),
        ]),
        ("Dropped stale groups / min", "short", [
            ("dropped", "sum by (run) (rate(asyncrl_learner_dropped_stale_total[5m])) * 60"),
        ]),
        # The counter sums the waits of the actor's group workers: a share of their time, not of the clock's.
        ("Admission wait fraction", "percentunit", [
            ("{{actor}}", "rate(asyncrl_actor_admission_wait_seconds_total[1m]) / asyncrl_actor_group_workers"),
        ]),
    ]),
    ("Off-policy health", [
        ("Ratio and IS weights", "short", [
            ("ratio mean", "asyncrl_learner_ratio_mean"),
            ("IS weight mean", "asyncrl_learner_is_weight_mean"),
            ("ESS", "asyncrl_learner_is_ess_ratio"),
        ]),
        ("DPPO masked fraction", "percentunit", [("masked", "asyncrl_learner_dppo_masked_ratio")]),
        ("KL", "short", [
            ("rollout KL(mu||pi) k3", "asyncrl_learner_rollout_kl"),
            ("mismatch KL", "asyncrl_learner_mismatch_kl"),
            ("KL {{estimator}}", "asyncrl_learner_kl"),
        ]),
        ("Drift at step start", "short", [
            ("KL(mu||pi_prox) {{source}}", "asyncrl_learner_drift_kl"),
            ("log-ppl gap (train - rollout)", "asyncrl_learner_log_ppl_gap"),
            ("chi2 {{level}}", "asyncrl_learner_is_chi2"),
        ]),
        ("Held tokens by mechanism", "percentunit", [("{{mechanism}}", "asyncrl_learner_held_tokens_ratio")]),
        ("Loss terms", "short", [("{{term}}", "asyncrl_learner_loss")]),
        ("Entropy and grad norm", "short", [
            ("entropy", "asyncrl_learner_entropy_nats"),
            ("grad norm", "asyncrl_learner_grad_norm"),
        ]),
        # a counter restarts at 0 with its process: panels show rate() or increase(), never the raw value
        ("Non-finite skips, weights not freed", "short", [
            ("skips in the last hour", "sum by (run) (increase(asyncrl_learner_nonfinite_skips_total[1h]))"),
            ("failed weight removals in the last hour",
             "sum by (run) (increase(asyncrl_learner_weights_delete_failures_total[1h]))"),
        ]),
    ]),
    ("Buffer", [
        ("Depth and pending", "short", [
            ("depth", "asyncrl_buffer_depth_groups"),
            ("pending", "asyncrl_buffer_pending_groups"),
        ]),
        ("Admission", "short", [
            ("admitted", "asyncrl_buffer_admitted_groups"),
            ("bound", "asyncrl_buffer_admission_bound_groups"),
            ("credits", "asyncrl_buffer_credits_groups"),
            ("version skew (learner forks)", "asyncrl_buffer_version_skew_versions"),
        ]),
        ("Dead letters", "short", [
            # the stream is trimmed at about 10000 records: its length stops growing, the counter does not
            ("new in 10 min", "max by (run) (increase(asyncrl_buffer_dead_letters_total[10m]))"),
            ("in the stream", "asyncrl_buffer_dead_letters_groups"),
        ]),
    ]),
    ("Weight sync", [
        ("Policy version", "short", [
            ("learner", "asyncrl_learner_policy_version"),
            ("actor {{actor}}", "asyncrl_actor_policy_version"),
        ]),
        ("Publish time", "s", [
            ("p90", "histogram_quantile(0.9, sum by (run, le) (rate(asyncrl_learner_publish_seconds_bucket[5m])))"),
        ]),
        ("Swap pause", "s", [
            ("p90", "histogram_quantile(0.9, sum by (run, le) (rate(asyncrl_actor_swap_pause_seconds_bucket[5m])))"),
            ("swaps/min {{actor}}", "rate(asyncrl_actor_weight_swaps_total[5m]) * 60"),
        ]),
        ("Since last learner step; waiting for data", "s", [
            ("since the last step", "time() - asyncrl_learner_last_step_timestamp_seconds"),
            # 0 while it trains (a long step is no starvation); never empty, so the panel always has data.
            ("waiting for data", "(time() - asyncrl_learner_waiting_since_timestamp_seconds)"
             " * (asyncrl_learner_waiting_since_timestamp_seconds > bool 0)"),
        ]),
    ]),
]  # fmt: skip


def for_run(expr: str) -> str:
    """``expr`` with ``run=~"$run"`` in every metric selector (the ROWS queries are written without it)."""
    return _METRIC.sub(lambda m: f"{m[1]}{{{RUN_SELECTOR}{',' if m[2] else '}'}", expr)


RUN_VARIABLE = {
    "name": "run", "label": "run", "type": "query", "datasource": DS,
    "query": {"query": RUN_VARIABLE_QUERY, "refId": "run"}, "definition": RUN_VARIABLE_QUERY,
    "refresh": 2, "sort": 1, "multi": True, "includeAll": True, "allValue": ".*",
    "current": {"selected": True, "text": ["All"], "value": ["$__all"]}, "options": [], "hide": 0,
}  # fmt: skip


def build() -> dict:
    panels, pid, y = [], 1, 0
    for row_title, row_panels in ROWS:
        panels.append({"type": "row", "title": row_title, "id": pid, "collapsed": False,
                       "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}})  # fmt: skip
        pid += 1
        y += 1
        for i, (title, unit, targets) in enumerate(row_panels):
            panels.append({
                "type": "timeseries", "title": title, "id": pid, "datasource": DS,
                "gridPos": {"h": 8, "w": 8, "x": 8 * (i % 3), "y": y + 8 * (i // 3)},
                "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
                "targets": [{"refId": chr(65 + k), "expr": for_run(expr), "legendFormat": f"{{{{run}}}} {legend}",
                             "datasource": DS}
                            for k, (legend, expr) in enumerate(targets)],
            })  # fmt: skip
            pid += 1
        y += 8 * ((len(row_panels) + 2) // 3)
    return {
        "uid": "asyncrl-overview", "title": "asyncrl", "schemaVersion": 39, "version": 1,
        "tags": ["asyncrl", "rl"], "timezone": "browser", "refresh": "10s",
        "time": {"from": "now-1h", "to": "now"}, "panels": panels,
        "templating": {"list": [RUN_VARIABLE]}, "annotations": {"list": []},
    }  # fmt: skip


if __name__ == "__main__":
    out = Path(__file__).resolve().parent.parent / "dashboards" / "asyncrl.json"
    out.write_text(json.dumps(build(), indent=2) + "\n")
    print(out)
