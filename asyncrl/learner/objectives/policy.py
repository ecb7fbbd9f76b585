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
    importance_weights,
    loglinear_prox_logp,
    raw_log_rho,
    staleness_mask,
)
from asyncrl.learner.objectives.kl import kl_penalty
from asyncrl.learner.objectives.options import MASK_LOSSES, ObjectiveConfig
from asyncrl.learner.objectives.trust_region import dppo_drop_masks, m2po_keep_mask

__all__ = ["group_advantages", "policy_loss", "rollout_kl_loss"]


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
    cfg = cfg or ObjectiveConfig()
    in_mask = mask.bool()
    loss_mask = staleness_mask(in_mask, token_versions, version, cfg.max_staleness)
    # Sanitise every input at non-loss positions first: everything below is then finite there.
    logp = safe(logp, loss_mask)
    behav = safe(logp_behav, loss_mask)
    adv = safe(per_token(advantages, logp).to(logp.dtype), loss_mask)
    if logp_prox is not None:
        prox = safe(logp_prox.detach(), loss_mask)
    else:
        prox = loglinear_prox_logp(logp, behav, token_versions, version, loss_mask, prox_offset, progress)
    anchor = behav if cfg.anchor == "behaviour" else prox
    is_args = (cfg.is_mode, cfg.is_cap, cfg.is_low, cfg.is_level, cfg.is_veto)
    sides: dict[str, Tensor] = {}

    if cfg.policy_loss in MASK_LOSSES:
        w_num = prox
        w = importance_weights(prox, behav, loss_mask, *is_args)
        ratio = torch.exp(log_ratio(logp, prox))
        if cfg.policy_loss == "dppo":
            drop_low, drop_high = dppo_drop_masks(
                logp.detach(), anchor, adv, cfg.divergence, cfg.dppo_low, cfg.dppo_high
            )
            sides = {"dppo_masked_frac_low": drop_low, "dppo_masked_frac_high": drop_high}
            keep = ~(drop_low | drop_high)
        else:
            keep = m2po_keep_mask(logp, anchor, loss_mask, cfg.m2po_tau)
            sides = {"m2po_masked_frac": ~keep}
        pg = torch.where(keep, -w * ratio * adv, 0.0)
    else:
        # Ratio-clip losses: the clipped ratio is taken to the anchor; IS corrects mu -> anchor.
        w_num = anchor
        w = (
            importance_weights(anchor, behav, loss_mask, *is_args)
            if cfg.anchor == "prox"
            else torch.ones_like(logp)
        )
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
    pg = torch.where(loss_mask, pg, 0.0)

    w_raw = torch.exp(raw_log_rho(w_num, behav, loss_mask, cfg.is_level))  # for is_trunc_frac
    metrics = policy_metrics(
        logp=logp.detach(),
        logp_behav=behav,
        logp_prox=prox,
        ratio=ratio.detach(),
        w=w,
        w_raw=w_raw,
        sides=sides,
        loss_mask=loss_mask,
        in_mask=in_mask,
        token_versions=token_versions,
        version=version,
    )
    return pg, loss_mask, metrics


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
    """
    r = rewards.to(torch.promote_types(rewards.dtype, torch.float32))
    adv = r - r.mean(dim=-1, keepdim=True)
    if normalize_std:
        g = r.shape[-1]
        std = r.std(dim=-1, keepdim=True, unbiased=True) if g > 1 else torch.zeros_like(adv[..., :1])
        adv = adv / (std + eps)
    return adv
