"""The learner's /metrics as Prometheus reads it: counters of this process, eval gauges only once an eval
exists, and its own series served while the buffer's Redis is away."""

from __future__ import annotations

import dataclasses

from asyncrl.learner.records import StepRecord
from asyncrl.metrics import LEARNER_METRICS
from asyncrl.metrics_export import LearnerExporter, learner_collectors


def _values(exporter: LearnerExporter) -> dict[str, float]:
    """Name -> value of every unlabelled learner series in one scrape of the exporter."""
    (col, _buf) = learner_collectors(exporter, dict)
    return {s.name: s.value for fam in col.collect() for s in fam.samples if not s.labels}


#: Exposed name -> snapshot key of every learner counter (each declared name ends in _total).
COUNTERS = {m.name: m.key for m in LEARNER_METRICS if m.kind == "counter"}


def test_every_learner_counter_has_a_per_step_source_in_the_step_record() -> None:
    from asyncrl.metrics_export import PROCESS_COUNTERS

    fields = {f.name for f in dataclasses.fields(StepRecord)}
    assert set(COUNTERS.values()) == set(PROCESS_COUNTERS)
    assert {f for f in PROCESS_COUNTERS.values() if f is not None} <= fields


def test_a_resumed_learner_exports_counts_of_its_own_process_from_zero() -> None:
    """A learner restored at step 40 with run-wide totals (3183 tokens, 12.5 s waited, 3 stale drops,
    1 non-finite skip) exports 0 for every counter until it steps, then only what it did: restored
    totals exported as counters made Prometheus count the whole run again as new increase."""
    restored = {"step": 40, "tokens_total": 3183, "groups_total": 80, "wait_s_total": 12.5,
                "dropped_stale_total": 3, "skipped_nonfinite": 1, "weights_delete_failures_total": 5}  # fmt: skip
    exporter = LearnerExporter(max_staleness=1)
    first = _values(exporter)
    assert {name: first[name] for name in COUNTERS} == dict.fromkeys(COUNTERS, 0.0)

    totals = dict(restored)
    steps = [  # (tokens, groups, wait_s, dropped_stale, skipped, failed removals of stored weights)
        (120, 2, 0.25, 0, 0, 0),
        (96, 2, 1.5, 2, 1, 1),
        (130, 2, 0.0, 1, 0, 1),
    ]
    for tokens, groups, wait_s, dropped, skipped, undeleted in steps:
        totals["step"] += 1
        totals["tokens_total"] += tokens
        totals["groups_total"] += groups
        totals["wait_s_total"] += wait_s
        totals["dropped_stale_total"] += dropped
        totals["skipped_nonfinite"] += skipped
        totals["weights_delete_failures_total"] += undeleted
        exporter(StepRecord(step=totals["step"], tokens=tokens, groups=groups, wait_s=wait_s,
                            dropped_stale=dropped, skipped=skipped, tokens_total=totals["tokens_total"],
                            groups_total=totals["groups_total"], wait_s_total=totals["wait_s_total"],
                            dropped_stale_total=totals["dropped_stale_total"],
                            skipped_nonfinite=totals["skipped_nonfinite"], weights_delete_failures=undeleted,
                            weights_delete_failures_total=totals["weights_delete_failures_total"]))  # fmt: skip
    got = _values(exporter)
    assert got["asyncrl_learner_steps_total"] == 3
    assert got["asyncrl_learner_trained_tokens_total"] == 346
    assert got["asyncrl_learner_trained_groups_total"] == 6
    assert got["asyncrl_learner_wait_seconds_total"] == 1.75
    assert got["asyncrl_learner_dropped_stale_total"] == 3
    assert got["asyncrl_learner_nonfinite_skips_total"] == 1
    assert got["asyncrl_learner_weights_delete_failures_total"] == 2
    # Exactly the run-wide totals' increase since the restore, for every counter.
    for name, key in COUNTERS.items():
        assert got[name] == totals[key] - restored[key], name
    # The run-wide totals stay what the gauges and metrics.jsonl say: the record is not changed.
    assert exporter.stats["tokens_total"] == totals["tokens_total"] == 3529


def test_eval_gauges_are_nan_until_a_first_eval_exists() -> None:
    """Before any eval the record's eval results are 0.0 (eval_version -1): exported as they were, a run
    without evals showed an eval reward and pass@k of 0 (a dashboard's worst possible eval)."""
    import math

    eval_values = ("asyncrl_learner_eval_reward_mean", "asyncrl_learner_eval_pass_at_k_ratio",
                   "asyncrl_learner_eval_length_mean_tokens")  # fmt: skip
    exporter = LearnerExporter()
    for record in (None, StepRecord(step=1, version=1), StepRecord(step=2, version=2)):
        if record is not None:
            exporter(record)
        got = _values(exporter)
        assert got["asyncrl_learner_eval_policy_version"] == -1
        assert all(math.isnan(got[name]) for name in eval_values), got
    exporter(StepRecord(step=3, version=3, eval_version=2, eval_reward_mean=0.0, eval_pass_at_k=0.25,
                        eval_length_mean=17.5))  # fmt: skip
    got = _values(exporter)
    assert got["asyncrl_learner_eval_policy_version"] == 2
    assert [got[name] for name in eval_values] == [0.0, 0.25, 17.5]  # a measured 0 is exported as 0
