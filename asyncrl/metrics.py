"""Every Prometheus metric of asyncrl, in one place; the /metrics server is :mod:`asyncrl.metrics_export`.

Names follow ``asyncrl_<component>_<quantity>_<unit>``. Roles do not create Prometheus objects: they
keep plain counters in a stats dict (the actor's ``stats()``, the learner's step record, the buffer's
``stats()``), and a collector of :mod:`asyncrl.metrics_export` turns a snapshot of that dict into
metric families at scrape time. That keeps the roles free of metrics plumbing and makes a scrape
consistent (one snapshot).

Invariant: a declared series is always exported (0 when its source key is missing), so dashboard
queries and alerts never miss a series at start; labelled series (e.g. loss terms) are enumerated here.
One exception: the buffer's series are left out of a scrape while Redis is unreachable (a 0 would read
as an empty buffer, and a counter going 0 and back as a reset; asyncrl.metrics_export.BufferStats).
The learner's counters count what its current process did (from 0 at each start); run totals are in
metrics.jsonl.
"""

from __future__ import annotations

from dataclasses import dataclass, field


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
        "asyncrl_actor_group_workers",
        "gauge",
        "Group workers (actors.groups_in_flight): the admission wait counter sums their waits.",
        "group_workers",
    ),  # fmt: skip
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
        "asyncrl_actor_rejected_groups_total",
        "counter",
        "Groups whose request the engine refused (e.g. a prompt longer than model.max_model_len): "
        "dead-lettered with the engine's reason, never retried.",
        "groups_rejected",
    ),
    Metric(
        "asyncrl_actor_skipped_prompts_total",
        "counter",
        "Prompt positions passed over because the engine refused their prompt earlier in the run (recorded "
        "in Redis at its first refusal, dead-lettered then): no engine request, group slot or dead letter.",
        "prompts_skipped",
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
        "asyncrl_buffer_dead_letters_groups",
        "gauge",
        "Records in the dead-letter stream (trimmed at about 10000 records, so it stops growing: "
        "count dead letters with asyncrl_buffer_dead_letters_total).",
        "dead",
    ),
    Metric(
        "asyncrl_buffer_dead_letters_total",
        "counter",
        "Dead letters written since the run started (malformed, over-delivered or abandoned groups); "
        "kept in Redis, so it does not reset when the learner restarts.",
        "dead_total",
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
    Metric(
        "asyncrl_learner_steps_total",
        "counter",
        "Learner steps taken by this learner process (incl. skipped and redone).",
        "step",
    ),
    Metric(
        "asyncrl_learner_trained_tokens_total",
        "counter",
        "Completion tokens trained on by this learner process.",
        "tokens_total",
    ),
    Metric(
        "asyncrl_learner_trained_groups_total",
        "counter",
        "Groups trained on by this learner process.",
        "groups_total",
    ),
    Metric(
        "asyncrl_learner_step_seconds",
        "histogram",
        "Wall time of one learner step.",
        "step_s",
        buckets=SECONDS_BUCKETS,
    ),  # fmt: skip
    Metric(
        "asyncrl_learner_wait_seconds_total",
        "counter",
        "Time this learner process blocked waiting for data.",
        "wait_s_total",
    ),
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
        "Groups this learner process dropped as too stale.",
        "dropped_stale_total",
    ),
    Metric("asyncrl_learner_grad_norm", "gauge", "Gradient norm of the last step.", "grad_norm"),
    Metric(
        "asyncrl_learner_nonfinite_skips_total",
        "counter",
        "Steps this learner process skipped for a non-finite loss/grad.",
        "skipped_nonfinite",
    ),  # fmt: skip
    Metric(
        "asyncrl_learner_weights_delete_failures_total",
        "counter",
        "Failed attempts to remove stored weight versions (retried after each publish: storage that is not freed).",
        "weights_delete_failures_total",
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
    # Live, not per step: a learner blocked on data (AsyncrlLearnerStarved) vs one in a long step.
    Metric(
        "asyncrl_learner_waiting_since_timestamp_seconds",
        "gauge",
        "Unix time the learner began waiting for its current batch (0 while it trains).",
        "waiting_since",
    ),  # fmt: skip
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
