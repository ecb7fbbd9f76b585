"""Off-policy policy objectives: pure tensor math, no I/O, no DeepSpeed, no distributed calls.

Vocabulary follows DESIGN.md. Per-token tensors are ``[B, T]``; ``mask`` is the bool loss mask.
Logprobs are fp32 natural logs of the *sampled* token: ``logp`` = log pi_theta (carries gradient),
``logp_behav`` = log mu (the sampler, stored with the rollout), ``logp_prox`` = log pi_prox (the
learner policy at the START of the step), ``token_versions`` = v_t, ``version`` = V, s_t = V - v_t.
The version convention, with a worked example for s = 0, 1, 2, is in
:mod:`asyncrl.learner.objectives.importance`.

The composition at the defaults (``ObjectiveConfig()`` == ``learner.loss`` defaults)
--------------------------------------------------------------------------------------
For a loss token t with advantage A::

    pg_t   = -w_t * r_t * A * keep_t            (A < 0 and w_t r_t > 3:  pg_t = 3|A|, no gradient)
    r_t    = pi_theta(y_t) / pi_prox(y_t)         carries the gradient: d pg_t = -w_t r_t A d log pi_theta
    w_t    = min(pi_prox(y_t) / mu(y_t), 2)       detached, token-level TIS: the staleness-aware weight
    keep_t = DPPO-TV mask taken against mu:       drop if A > 0 and pi_theta - mu > 0.2,
                                                  or   if A < 0 and mu - pi_theta > 0.2
    reg_t  = 1e-3 * (log pi_theta - log mu)^2 / 2 rollout-KL (k2), on every loss token

    loss   = sum_t pg_t / N  +  sum_t reg_t / N   (N = loss tokens of the whole optimizer step)

pi_prox is exact at the first update of every step (it IS the detached current logprob, free), exact
everywhere with ``learner.exact_prox``, and the A-3PO log-linear interpolation otherwise. Nothing is
counted twice: w_t r_t = pi_theta / mu (up to the truncation at 2), the single importance ratio from
the sampler to the current policy; w_t corrects mu -> pi_prox (staleness + engine mismatch), r_t
pi_prox -> pi_theta (this step's updates); the mask only selects tokens, it never rescales them.
At staleness 0 in fp32 (mu = pi_prox = pi_theta) every factor is 1, nothing is masked, the KL term
and its gradient are 0: the objective is the on-policy policy gradient -A log pi_theta exactly.

Modules: :mod:`.common` (NaN-safe helpers), :mod:`.kl` (KL estimators, entropy), :mod:`.importance`
(pi_prox, staleness, IS weights), :mod:`.trust_region` (DPPO, M2PO), :mod:`.policy` (the losses),
:mod:`.diagnostics` (metrics), :mod:`.options` (ObjectiveConfig). Loss reduction across micro-batches
/ ranks and the DeepSpeed scaling rule live in :mod:`asyncrl.learner.reduction` (re-exported here).
"""

from __future__ import annotations

from asyncrl.learner.objectives.common import LOG_RATIO_CLAMP
from asyncrl.learner.objectives.diagnostics import SIDE_METRICS, drift_sums, policy_metrics
from asyncrl.learner.objectives.importance import (
    IS_LEVELS,
    IS_MODES,
    importance_weights,
    loglinear_prox_logp,
    raw_is_ratios,
    staleness_mask,
)
from asyncrl.learner.objectives.kl import (
    KL_LOSS_KINDS,
    KL_METRICS,
    entropy_from_logits,
    entropy_from_logp,
    kl_penalty,
    rollout_kl_estimates,
)
from asyncrl.learner.objectives.options import MASK_LOSSES, RATIO_CLIP_LOSSES, ObjectiveConfig
from asyncrl.learner.objectives.policy import (
    ObjectiveTerms,
    group_advantages,
    objective_terms,
    policy_loss,
    rollout_kl_loss,
)
from asyncrl.learner.objectives.trust_region import dppo_drop_masks, dppo_keep_mask, m2po_keep_mask
from asyncrl.learner.reduction import (
    LOSS_REDUCTIONS,
    METRIC_AGGREGATION,
    LossDenominators,
    MetricAccumulator,
    aggregate_metrics,
    count_denominators,
    deepspeed_loss_scale,
    entropy_bonus,
    reduce_loss,
    token_mean,
)

__all__ = [
    "IS_LEVELS",
    "IS_MODES",
    "KL_LOSS_KINDS",
    "KL_METRICS",
    "LOG_RATIO_CLAMP",
    "LOSS_REDUCTIONS",
    "MASK_LOSSES",
    "METRIC_AGGREGATION",
    "RATIO_CLIP_LOSSES",
    "SIDE_METRICS",
    "LossDenominators",
    "MetricAccumulator",
    "ObjectiveConfig",
    "ObjectiveTerms",
    "aggregate_metrics",
    "count_denominators",
    "deepspeed_loss_scale",
    "dppo_drop_masks",
    "dppo_keep_mask",
    "drift_sums",
    "entropy_bonus",
    "entropy_from_logits",
    "entropy_from_logp",
    "group_advantages",
    "importance_weights",
    "kl_penalty",
    "loglinear_prox_logp",
    "m2po_keep_mask",
    "objective_terms",
    "policy_loss",
    "policy_metrics",
    "raw_is_ratios",
    "reduce_loss",
    "rollout_kl_estimates",
    "rollout_kl_loss",
    "staleness_mask",
    "token_mean",
]
