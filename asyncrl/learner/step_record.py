"""The learner's step record of one step, built from the trainer's result and the batch it trained.

Kept apart from the loop (asyncrl.learner.loop) that calls it once per step on rank 0; the record's
fields and conventions are :class:`asyncrl.learner.records.StepRecord`'s.
"""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING, Any

import numpy as np

from asyncrl.learner.records import OBJECTIVE_FIELDS, StepRecord

if TYPE_CHECKING:
    from asyncrl.learner.checkpoint import LearnerState
    from asyncrl.learner.feed import Batch
    from asyncrl.learner.step import StepResult

__all__ = ["step_record"]


def step_record(
    cfg: Any, state: LearnerState, res: StepResult, groups: list[Any], batch: Batch, counters: dict[str, float],
    start_time: float, t_step: float, train_s: float, publish_s: float, published: bool, checkpointed: bool,
    lr: float, delete_failures: int,
) -> StepRecord:  # fmt: skip
    """The record of the step just taken (rank 0): the trainer's result, the batch it trained and the run's
    cumulative ``counters`` (asyncrl.learner.loop.COUNTERS, already including this step);
    ``delete_failures``: the weight transport's failed removals of stored weights during this step."""
    m = res.metrics
    rewards = [float(c.reward) for g in groups for c in g.completions]
    hist = {int(k): v for k, v in res.staleness_hist.items()}
    n_hist = sum(hist.values())
    finite = [x for x in res.grad_norms if math.isfinite(x)]
    grad_norm = float(np.mean(finite)) if finite else (res.grad_norms[-1] if res.grad_norms else 0.0)
    now = time.time()
    return StepRecord(
        step=state.step, version=state.version, time=now - start_time, step_time=now,
        step_s=time.monotonic() - t_step, wait_s=batch.wait_s, train_s=train_s, publish_s=publish_s,
        groups=len(groups), sequences=res.sequences, tokens=res.tokens,
        reward_mean=float(np.mean(rewards)) if rewards else 0.0,
        reward_std=float(np.std(rewards)) if rewards else 0.0,
        dropped_stale=batch.dropped_stale, dropped_filtered=batch.dropped_filtered,
        overlong_masked=res.overlong_masked,
        staleness_mean=sum(k * v for k, v in hist.items()) / n_hist if n_hist else 0.0,
        staleness_max=float(max(hist)) if hist else 0.0, staleness_hist=res.staleness_hist,
        loss=m.get("loss", 0.0), loss_policy=m.get("loss_policy", 0.0),
        loss_rollout_kl=m.get("loss_rollout_kl", 0.0), loss_entropy=m.get("loss_entropy", 0.0),
        loss_ref_kl=m.get("loss_ref_kl", 0.0), ratio_mean=m.get("ratio_mean", 0.0),
        mismatch_kl=m.get("mismatch_kl", 0.0), mismatch_tokens=int(m.get("mismatch_tokens", 0)),
        rollout_kl=m.get("kl_mu_pi_k3", 0.0), drift_kl=res.drift_kl, drift_tokens=int(m.get("drift_tokens", 0)),
        empty_mini_batches=int(m.get("empty_mini_batches", 0)), **{k: m.get(k, 0.0) for k in OBJECTIVE_FIELDS},
        ref_kl=m.get("ref_kl", 0.0), dppo_masked_frac=m.get("dppo_masked_frac", 0.0),
        is_weight_mean=m.get("is_weight_mean", 0.0), is_weight_max=m.get("is_weight_max", 0.0),
        ess=m.get("ess", math.nan), entropy=m.get("entropy", 0.0), grad_norm=grad_norm, lr=lr,
        optimizer_steps=res.optimizer_steps, micro_batches=res.micro_batches,
        padding_micro_batches=res.padding_micro_batches, skipped=res.skipped,
        skipped_nonfinite=int(counters["skipped_nonfinite"]), published=published, checkpointed=checkpointed,
        trained_group_ids=len(groups), max_staleness=cfg.buffer.max_staleness,
        groups_total=int(counters["groups_total"]), tokens_total=int(counters["tokens_total"]),
        wait_s_total=counters["wait_s_total"], dropped_stale_total=int(counters["dropped_stale_total"]),
        dropped_filtered_total=int(counters["dropped_filtered_total"]),
        weights_delete_failures=delete_failures,
        weights_delete_failures_total=int(counters["weights_delete_failures_total"]),
    )  # fmt: skip
