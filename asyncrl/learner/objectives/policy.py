"""The policy-gradient losses (dppo, m2po, ppo_clip, gspo, cispo), the rollout-KL term, advantages.

Per loss token t (A = advantage, mu = sampler, pi_prox = step-start policy, anchor per ``cfg.anchor``):

    dppo      -w r A        if DPPO keeps the token (pi_theta vs anchor), else 0
    m2po      -w r A        if the M2PO second-moment mask keeps it (log pi_theta - log anchor)
              with r = pi_theta / pi_prox (gradient) and w = IS(pi_prox / mu) (detached)
    ppo_clip  w_a max(-r_a A, -clip(r_a, 1-eps_low, 1+eps_high) A)           r_a = pi_theta / anchor
    gspo      w_a max(-s A, -clip(s, 1-gspo_eps_low, 1+gspo_eps_high) A)
              s = sg(exp(mean_t log r_a)) * pi_theta(y_t) / sg(pi_theta(y_t))    (GSPO-token form)
    cispo     -w_a sg(clip(r_a, 1-eps_low, 1+eps_high)) A * grad-carrier of log pi_theta(y_t)
              with w_a = IS(anchor / mu) (= 1 for anchor = behaviour)

then, for every loss, the ratio cap: a token with A < 0 whose loss exceeds c |A| (c = dual_clip) is
replaced by the constant c |A| (dual clip: no gradient), and everything outside the loss mask is 0.
The rollout-KL penalty is a separate per-token term (:func:`rollout_kl_loss`), reduced as a token
mean over the whole optimizer step by the caller, whatever the policy reduction.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from asyncrl.learner.objectives.common import (
    LOG_RATIO_CLAMP,
    log_ratio,
    per_token,
    safe,
    sequence_sum,
    unit_ratio,
)
from asyncrl.learner.objectives.diagnostics import policy_metrics
from asyncrl.learner.objectives.importance import (
    loglinear_prox_logp,
    staleness_mask,
    weights_from_log_rho,
)
from asyncrl.learner.objectives.kl import kl_from_log_ratio, kl_penalty, penalty_log_ratio
from asyncrl.learner.objectives.options import MASK_LOSSES, ObjectiveConfig
from asyncrl.learner.objectives.trust_region import dppo_drop_masks, m2po_keep_mask

__all__ = ["ObjectiveTerms", "group_advantages", "objective_terms", "policy_loss", "rollout_kl_loss"]


class ObjectiveTerms(NamedTuple):
    """What :func:`objective_terms` returns (per-token tensors ``[B, T]``)."""

    policy: Tensor  # per-token policy loss, exactly 0 (+-0) outside loss_mask
    rollout_kl: Tensor  # per-token beta_rollout_kl * kl_penalty(logp, mu), 0 outside loss_mask
    loss_mask: Tensor
    metrics: dict[str, Tensor]
    log_ratio_behav: Tensor  # detached clamp(log pi_theta - log mu), exactly 0 outside loss_mask


def policy_loss(
    logp: Tensor,
    logp_behav: Tensor,
    advantages: Tensor,
    mask: Tensor,
    token_versions: Tensor,
    version: int,
    cfg: ObjectiveConfig | None = None,
    logp_prox: Tensor | None = None,
    prox_offset: float = 0.0,
    progress: float = 1.0,
) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
    """Per-token policy loss. Returns ``(per_token_loss, loss_mask, metrics)``.

    ``logp_prox``: the exact step-start logprob (the caller passes ``logp.detach()`` at the first
    update of a step, or a no-grad recompute); None = A-3PO with ``prox_offset`` / ``progress`` (see
    :mod:`~asyncrl.learner.objectives.importance`). ``loss_mask`` = ``staleness_mask(mask, ...)``;
    the loss is exactly 0 outside it and masked/clipped tokens stay in the denominators.

    ``metrics`` (detached 0-d tensors over loss tokens): ratio_mean (the gradient-carrying ratio),
    dppo_masked_frac(_low/_high), m2po_masked_frac, clip_frac(_low/_high), dual_clip_frac,
    is_weight_mean/max/sq_mean, ess, is_trunc_frac, is_masked_frac, is_chi2 (token), is_chi2_seq,
    kl_mu_pi_k1/k2/k3, kl_pi_mu_is (pi_theta vs mu), staleness_mean/max and stale_dropped_frac (over
    the input mask), num_tokens, num_tokens_in, num_seqs.
    """
    t = objective_terms(logp, logp_behav, advantages, mask, token_versions, version, cfg, logp_prox,
                        prox_offset, progress, rollout_kl=False)  # fmt: skip
    return t.policy, t.loss_mask, t.metrics


def objective_terms(logp: Tensor, logp_behav: Tensor, advantages: Tensor, mask: Tensor, token_versions: Tensor,
                    version: int, cfg: ObjectiveConfig | None = None, logp_prox: Tensor | None = None,
                    prox_offset: float = 0.0, progress: float = 1.0, rollout_kl: bool = True) -> ObjectiveTerms:  # fmt: skip
    """:func:`policy_loss` and :func:`rollout_kl_loss` in one pass (the learner's per-micro-batch call).

    The values (and gradients) are those of the two functions called separately; every intermediate
    they share (the sanitised inputs, the log-ratios to mu and pi_prox, their exps) is formed once:
    at a micro-batch of a few hundred tokens the objective's cost is the number of small tensor ops.
    """
    cfg = cfg or ObjectiveConfig()
    in_mask = mask.bool()
    loss_mask = staleness_mask(in_mask, token_versions, version, cfg.max_staleness)
    # Sanitise every input at non-loss positions first: everything below is then finite there, and
    # every log-ratio of two sanitised inputs is exactly 0 there.
    logp = safe(logp, loss_mask)
    behav = safe(logp_behav, loss_mask)
    adv = safe(per_token(advantages, logp).to(logp.dtype), loss_mask)
    if logp_prox is not None:
        prox = safe(logp_prox.detach(), loss_mask)
    else:
        prox = loglinear_prox_logp(logp, behav, token_versions, version, loss_mask, prox_offset, progress)
    anchor = behav if cfg.anchor == "behaviour" else prox
    # log pi_theta - log mu: the rollout-KL term's (with gradient; unclamped for k2/abs, see
    # penalty_log_ratio) and, clamped, the KL metrics' d (their k3 has an exp).
    d_grad = (
        penalty_log_ratio(logp, behav, cfg.rollout_kl_kind) if rollout_kl and cfg.beta_rollout_kl else None
    )
    with torch.no_grad():
        d = (
            d_grad.detach().clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
            if d_grad is not None
            else log_ratio(logp.detach(), behav)
        )
        log_rho = log_ratio(prox, behav)  # token log(pi_prox / mu)
    is_args = (cfg.is_mode, cfg.is_cap, cfg.is_low, cfg.is_level, cfg.is_veto)
    sides: dict[str, Tensor] = {}
    rho_tok: Tensor | None = None  # exp(log_rho), when formed on the way

    if cfg.policy_loss in MASK_LOSSES:
        w, w_raw = weights_from_log_rho(log_rho, loss_mask, *is_args)
        if w_raw is not None and cfg.is_level == "token":
            rho_tok = w_raw
        ratio = torch.exp(log_ratio(logp, prox))
        if cfg.policy_loss == "dppo":
            drop_low, drop_high = dppo_drop_masks(
                logp.detach(), anchor, adv, cfg.divergence, cfg.dppo_low, cfg.dppo_high
            )
            sides = {"dppo_masked_frac_low": drop_low, "dppo_masked_frac_high": drop_high}
            pg = torch.where(drop_low | drop_high, 0.0, -w * ratio * adv)
        else:
            keep = m2po_keep_mask(logp, anchor, loss_mask, cfg.m2po_tau)
            sides = {"m2po_masked_frac": ~keep}
            pg = torch.where(keep, -w * ratio * adv, 0.0)
    else:
        # Ratio-clip losses: the clipped ratio is taken to the anchor; IS corrects mu -> anchor.
        w_raw = None
        if cfg.anchor == "prox":
            w, w_raw = weights_from_log_rho(log_rho, loss_mask, *is_args)
            if w_raw is not None and cfg.is_level == "token":
                rho_tok = w_raw
        else:
            w = torch.ones_like(logp)
        log_r = log_ratio(logp, anchor)
        if cfg.policy_loss == "cispo":
            r = torch.exp(log_r).detach()
            lo, hi = 1.0 - cfg.eps_low, 1.0 + cfg.eps_high
            sides = {"clip_frac_low": r < lo, "clip_frac_high": r > hi}
            ratio = r
            pg = -w * r.clamp(lo, hi) * adv * unit_ratio(logp)
        else:
            if cfg.policy_loss == "gspo":
                n_seq = loss_mask.sum(dim=-1, keepdim=True).clamp(min=1).to(logp.dtype)
                seq_log = (sequence_sum(log_r, loss_mask) / n_seq).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
                ratio = torch.exp(seq_log).detach() * unit_ratio(logp)
                lo, hi = 1.0 - cfg.gspo_eps_low, 1.0 + cfg.gspo_eps_high
            else:
                ratio = torch.exp(log_r)
                lo, hi = 1.0 - cfg.eps_low, 1.0 + cfg.eps_high
            unclipped = -adv * ratio
            clipped = -adv * ratio.clamp(lo, hi)
            active = clipped.detach() > unclipped.detach()  # the clip decides the value
            sides = {"clip_frac_low": active & (adv < 0), "clip_frac_high": active & (adv > 0)}
            pg = w * torch.maximum(unclipped, clipped)

    if cfg.dual_clip > 0:
        cap = -cfg.dual_clip * adv  # c|A| where A < 0; a constant (no gradient)
        capped = (adv < 0) & (pg.detach() > cap)
        sides["dual_clip_frac"] = capped
        pg = torch.where(capped, cap, pg)
    # No final torch.where(loss_mask, pg, 0): off the loss mask adv is 0 and every other factor finite
    # (w = 1, ratios of sanitised inputs = 1, caps 0), so pg is already +-0 there, and its gradient 0.

    with torch.no_grad():
        # is_trunc_frac compares w with the untruncated ratio at its level; only tis truncates, so with
        # is_mode none (w = 1, or 0 where vetoed) and without IS (ratio-clip losses anchored at mu)
        # w is its own untruncated value and nothing counts as truncated.
        if w_raw is None:
            w_raw = w
        metrics = policy_metrics(
            logp=logp.detach(), logp_behav=behav, logp_prox=prox, ratio=ratio.detach(), w=w, w_raw=w_raw,
            sides=sides, loss_mask=loss_mask, in_mask=in_mask, token_versions=token_versions,
            version=version, log_rho=log_rho, rho=rho_tok, d=d,
        )  # fmt: skip
    if d_grad is None:
        kl = torch.zeros_like(logp)
    else:  # 0 off the loss mask: d is exactly 0 there, and so is every KL estimator of it
        kl = cfg.beta_rollout_kl * kl_from_log_ratio(d_grad, cfg.rollout_kl_kind)
    return ObjectiveTerms(pg, kl, loss_mask, metrics, d)


def rollout_kl_loss(logp: Tensor, logp_behav: Tensor, loss_mask: Tensor, cfg: ObjectiveConfig) -> Tensor:
    """Per-token ``beta_rollout_kl * kl_penalty(logp, mu, rollout_kl_kind)``; 0 outside ``loss_mask``.

    Reduce it as a token mean over ALL loss tokens of the optimizer step (its own global denominator),
    whatever the policy reduction. DPPO-dropped / clipped tokens keep it: it is what pulls them back.
    """
    if not cfg.beta_rollout_kl:
        return torch.zeros_like(logp)
    kl = kl_penalty(logp, logp_behav, cfg.rollout_kl_kind, loss_mask)
    return torch.where(loss_mask, cfg.beta_rollout_kl * kl, 0.0)


def group_advantages(rewards: Tensor, normalize_std: bool = True, eps: float = 1e-6) -> Tensor:
    """GRPO group-relative advantages for ``rewards [n_groups, G]``.

    A = r - mean_group(r), divided by (unbiased group std + eps) when ``normalize_std``
    (GRPO); ``normalize_std=False`` is Dr.GRPO, which drops the std division because it
    up-weights groups whose rewards barely differ. G = 1 has std 0 (not NaN), so A = 0.

    A group whose rewards are all equal gets exactly A = 0 (no learning signal): its mean can be an
    ulp off the rewards (fp32 0.6 x 8 sums inexactly), and with the std division that ulp over an
    ulp-sized std was an O(1) advantage of one sign for every completion (0.056 at reward 0.6). The
    arithmetic runs in float64; the result has the rewards' dtype promoted to at least float32.
    """
    out_dtype = torch.promote_types(rewards.dtype, torch.float32)
    r = rewards.to(torch.float64)
    adv = r - r.mean(dim=-1, keepdim=True)
    if normalize_std:
        g = r.shape[-1]
        std = r.std(dim=-1, keepdim=True, unbiased=True) if g > 1 else torch.zeros_like(adv[..., :1])
        adv = adv / (std + eps)
    if r.shape[-1] > 0:
        adv = torch.where(r.amax(dim=-1, keepdim=True) == r.amin(dim=-1, keepdim=True), 0.0, adv)
    return adv.to(out_dtype)
