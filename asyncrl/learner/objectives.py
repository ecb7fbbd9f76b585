"""Off-policy policy objectives: pure tensor math, no I/O, no DeepSpeed, no distributed calls.

Vocabulary follows DESIGN.md. All per-token tensors are ``[B, T]`` (B sequences, T positions);
``mask`` is the bool loss mask (True = completion token that carries loss). Logprobs are fp32
natural logs of the *sampled* token:

- ``logp``        log pi_theta(y_t): current learner forward, carries gradient.
- ``logp_behav``  log mu(y_t): the engine's behaviour logprob stored with the rollout.
- ``logp_prox``   log pi_prox(y_t): learner policy at step start (exact recompute), or its A-3PO
                  log-linear approximation :func:`loglinear_prox_logp`.
- ``token_versions`` v_t, ``version`` V; staleness s_t = V - v_t.

The default objective (:func:`policy_loss` with a default :class:`ObjectiveConfig`) is the
decoupled off-policy objective of AReaL with a DPPO trust region:

    loss_t = -w_t * r_t * A * keep_t + beta * k2(logp, logp_behav)
    r_t    = pi_theta / pi_anchor          (anchor = proximal policy)
    w_t    = importance_weights(anchor, behaviour)   (truncated, detached: corrects mu -> anchor)
    keep_t = dppo_keep_mask(logp, anchor, A)          (DPPO, Qi et al. 2026)

NaN discipline (the invariant every function here keeps): inputs at masked positions may be
-inf / NaN (padding, prompt positions of a log_softmax, ...). We replace them with safe values
via ``torch.where`` *before* any arithmetic, never multiply a mask into something that can be
inf, and clamp every log-ratio before ``exp``. Hence values at masked positions are finite
(normally 0) and gradients flowing to masked positions are exactly 0, never NaN.

Loss reduction across micro-batches / data-parallel ranks and the DeepSpeed scaling rule live
in :mod:`asyncrl.learner.reduction` and are re-exported here; see its docstring.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

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
)

__all__ = [
    "LOG_RATIO_CLAMP",
    "LOSS_REDUCTIONS",
    "METRIC_AGGREGATION",
    "LossDenominators",
    "MetricAccumulator",
    "ObjectiveConfig",
    "aggregate_metrics",
    "count_denominators",
    "deepspeed_loss_scale",
    "dppo_drop_masks",
    "dppo_keep_mask",
    "entropy_bonus",
    "entropy_from_logits",
    "group_advantages",
    "importance_weights",
    "kl_penalty",
    "loglinear_prox_logp",
    "policy_loss",
    "reduce_loss",
    "staleness_mask",
]

# Every log-ratio is clamped to [-20, 20] before exp(): exp(20) ~ 4.9e8 is finite in fp32 and
# its square (k2 of a clamped d is at most 200) cannot overflow either.
LOG_RATIO_CLAMP = 20.0
# DPPO-KL clamps probabilities away from {0, 1} so both log terms of the binary KL are finite.
_PROB_EPS = 1e-6

KLKind = Literal["k1", "abs", "k2", "k3"]
Divergence = Literal["tv", "kl"]
ISMode = Literal["tis", "icepop", "none"]
ISLevel = Literal["token", "sequence"]


def _safe(x: Tensor, mask: Tensor | None, fill: float = 0.0) -> Tensor:
    """``x`` with masked-out positions replaced by ``fill`` (gradient there is exactly 0)."""
    if mask is None:
        return x
    return torch.where(mask.bool(), x, torch.full_like(x, fill))


def _per_token(x: Tensor, like: Tensor) -> Tensor:
    """Broadcast a per-sequence ``[B]`` tensor to ``[B, T]``; pass ``[B, T]`` through."""
    if x.dim() == like.dim() - 1:
        x = x.unsqueeze(-1)
    return x.expand_as(like)


def _log_ratio(a: Tensor, b: Tensor) -> Tensor:
    return (a - b).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


# --------------------------------------------------------------------------------------------
# KL estimators
# --------------------------------------------------------------------------------------------


def kl_penalty(logp: Tensor, logp_ref: Tensor, kind: KLKind = "k2", mask: Tensor | None = None) -> Tensor:
    """Per-token KL(pi || ref) estimate from sampled-token logprobs (Schulman's k1/k2/k3).

    With d = clamp(logp - logp_ref, -20, 20) and tokens sampled from pi:

    - ``k1``  = d                      unbiased, high variance, can be negative;
    - ``abs`` = |d|;
    - ``k2``  = d^2 / 2                biased, low variance; its gradient d * grad(logp) is the
                                       gradient of the true KL to first order (used as the
                                       rollout-KL penalty, see ``beta_rollout_kl``);
    - ``k3``  = exp(-d) + d - 1        unbiased, always >= 0 (GRPO's reference KL).

    ``mask`` (optional): positions outside it are replaced by 0 *before* the subtraction, so the
    result there is exactly 0 and gradients are exactly 0 even if logp is -inf there.
    """
    d = _log_ratio(_safe(logp, mask), _safe(logp_ref, mask))
    if kind == "k1":
        out = d
    elif kind == "abs":
        out = d.abs()
    elif kind == "k2":
        out = 0.5 * d * d
    elif kind == "k3":
        # expm1(-d) + d == exp(-d) - 1 + d without the cancellation near d = 0.
        out = torch.expm1(-d) + d
    else:
        raise ValueError(f"unknown KL kind {kind!r}; expected k1, abs, k2 or k3")
    return out


# --------------------------------------------------------------------------------------------
# DPPO trust region
# --------------------------------------------------------------------------------------------


@torch.no_grad()
def dppo_drop_masks(
    logp: Tensor,
    logp_anchor: Tensor,
    advantages: Tensor,
    divergence: Divergence = "tv",
    low: float = 0.2,
    high: float = 0.2,
) -> tuple[Tensor, Tensor]:
    """DPPO (Qi et al. 2026) drop decisions, split by side: ``(drop_low, drop_high)``, bool.

    DPPO replaces PPO's ratio clip by a trust region on a divergence between the policy
    probability p = pi_theta(y_t) and the anchor probability q = pi_anchor(y_t) of the sampled
    token; a token loses its gradient only when the update would move *further* out of the
    region in the direction the advantage pushes it:

    - TV:  drop_high = A > 0 and p - q > high;     drop_low = A < 0 and q - p > low.
    - KL:  D = q log(q/p) + (1-q) log((1-q)/(1-p)), p, q clamped to [1e-6, 1 - 1e-6]
           (binary KL of the Bernoulli "sampled token or not");
           drop_high = A > 0 and p > q and D > high;  drop_low = A < 0 and p < q and D > low.

    A = 0 is always kept. ``advantages`` is ``[B]`` (per sequence) or ``[B, T]``.
    "Low" is the side where the policy lowered the token's probability (A < 0), "high" the side
    where it raised it (A > 0); the two masks are disjoint.
    """
    adv = _per_token(advantages, logp)
    p = torch.exp(logp)
    q = torch.exp(logp_anchor)
    if divergence == "tv":
        up = p - q > high
        down = q - p > low
    elif divergence == "kl":
        pc = p.clamp(_PROB_EPS, 1.0 - _PROB_EPS)
        qc = q.clamp(_PROB_EPS, 1.0 - _PROB_EPS)
        d = qc * (torch.log(qc) - torch.log(pc)) + (1.0 - qc) * (torch.log1p(-qc) - torch.log1p(-pc))
        up = (pc > qc) & (d > high)
        down = (pc < qc) & (d > low)
    else:
        raise ValueError(f"unknown DPPO divergence {divergence!r}; expected 'tv' or 'kl'")
    return (adv < 0) & down, (adv > 0) & up


def dppo_keep_mask(
    logp: Tensor,
    logp_anchor: Tensor,
    advantages: Tensor,
    divergence: Divergence = "tv",
    low: float = 0.2,
    high: float = 0.2,
) -> Tensor:
    """Bool ``[B, T]``: True where the token keeps its policy gradient under DPPO.

    See :func:`dppo_drop_masks` for the rule and for the per-side masks used by metrics.
    """
    drop_low, drop_high = dppo_drop_masks(logp, logp_anchor, advantages, divergence, low, high)
    return ~(drop_low | drop_high)


# --------------------------------------------------------------------------------------------
# Proximal policy, staleness, importance weights
# --------------------------------------------------------------------------------------------


@torch.no_grad()
def loglinear_prox_logp(
    logp: Tensor,
    logp_behav: Tensor,
    token_versions: Tensor,
    version: int,
    mask: Tensor | None = None,
) -> Tensor:
    """A-3PO log-linear approximation of the proximal policy's logprob (detached).

    Instead of a second forward pass with the step-start weights, interpolate in log space
    between the behaviour policy and the current policy according to each token's staleness
    s = V - v_t:

        log pi_prox ~= log mu + alpha * (log pi_theta - log mu),  alpha = max(0, (s - 1) / s)

    (alpha = 0, i.e. prox = behaviour, when s <= 1; alpha -> 1 as the data gets staler).
    The result carries no gradient. Masked positions (optional ``mask``) return 0.
    """
    lp = _safe(logp.detach(), mask)
    lb = _safe(logp_behav, mask)
    s = (version - token_versions).to(lp.dtype)
    alpha = torch.where(s > 1, (s - 1) / s.clamp(min=1), torch.zeros_like(s))
    return lb + alpha * (lp - lb)


def staleness_mask(mask: Tensor, token_versions: Tensor, version: int, max_staleness: int | None) -> Tensor:
    """``mask`` minus tokens whose staleness V - v_t exceeds ``max_staleness`` (None: no drop).

    This is the loss mask :func:`policy_loss` returns; it depends only on data, not on the
    forward pass, so the learner can compute it (and the global loss denominators from it)
    before running any micro-batch.
    """
    if max_staleness is None:
        return mask
    return mask & ((version - token_versions) <= max_staleness)


@torch.no_grad()
def importance_weights(
    logp_prox: Tensor,
    logp_behav: Tensor,
    mask: Tensor,
    mode: ISMode = "tis",
    cap: float = 2.0,
    low: float = 0.5,
    level: ISLevel = "token",
) -> Tensor:
    """Detached behaviour -> proximal importance weights, ``[B, T]``.

    The ratio rho = pi_prox / mu corrects for the rollout engine's policy mu differing from the
    proximal policy (staleness and engine/learner numerics mismatch).

    - ``tis`` (truncated IS):  w = min(rho, cap).
    - ``icepop``:              w = rho if low <= rho <= cap else 0 (token dropped entirely).
    - ``none``:                w = 1.

    ``level="token"`` uses the per-token rho_t; ``level="sequence"`` uses the sequence ratio
    rho = exp(sum over the sequence's masked tokens of log rho_t) (GSPO/sequence-TIS style) and
    broadcasts it to every token of the sequence. Log-ratios (per token, and the sequence sum)
    are clamped to [-20, 20] before exp. Masked positions get the neutral weight 1.
    """
    if mode == "none":
        return torch.ones_like(logp_behav)
    log_rho = _log_ratio(_safe(logp_prox, mask), _safe(logp_behav, mask))
    if level == "sequence":
        # Masked positions are exactly 0 in log_rho, so a plain sum is the masked sum.
        log_rho = log_rho.sum(dim=-1, keepdim=True).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        log_rho = log_rho.expand_as(logp_behav)
    elif level != "token":
        raise ValueError(f"unknown IS level {level!r}; expected 'token' or 'sequence'")
    rho = torch.exp(log_rho)
    if mode == "tis":
        w = rho.clamp(max=cap)
    elif mode == "icepop":
        w = torch.where((rho >= low) & (rho <= cap), rho, torch.zeros_like(rho))
    else:
        raise ValueError(f"unknown IS mode {mode!r}; expected tis, icepop or none")
    return torch.where(mask.bool(), w, torch.ones_like(w))


# --------------------------------------------------------------------------------------------
# Advantages and entropy
# --------------------------------------------------------------------------------------------


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


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy of softmax(logits) over the last dim: logsumexp(l) - sum softmax(l) * l."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(dim=-1)


# --------------------------------------------------------------------------------------------
# The policy objective
# --------------------------------------------------------------------------------------------


@dataclass
class ObjectiveConfig:
    """Knobs of :func:`policy_loss`. Defaults: proximal anchor + DPPO-TV + token TIS + k2 rollout KL."""

    anchor: Literal["prox", "behaviour"] = "prox"
    """Trust-region anchor: "prox" (exact ``logp_prox`` if given, else A-3PO log-linear, with
    IS weights prox/behaviour) or "behaviour" (single forward, prime-rl style: anchor = mu,
    so the IS weight is 1 whatever is_mode says and the ratio itself carries the off-policy
    correction, guarded by the DPPO region / PPO clip around mu)."""
    policy_loss: Literal["dppo", "ppo_clip"] = "dppo"
    """"dppo": -w r A masked by the DPPO trust region; "ppo_clip": decoupled PPO clip."""
    divergence: Divergence = "tv"
    """DPPO divergence: "tv" (probability difference) or "kl" (binary KL)."""
    dppo_low: float = 0.2
    """DPPO threshold on the A < 0 side."""
    dppo_high: float = 0.2
    """DPPO threshold on the A > 0 side."""
    is_mode: ISMode = "tis"
    """Behaviour -> anchor importance weights: "tis", "icepop" or "none"."""
    is_level: ISLevel = "token"
    """"token" or "sequence" importance ratio."""
    is_cap: float = 2.0
    """Upper truncation (tis) / upper bound (icepop) of the IS ratio."""
    is_low: float = 0.5
    """Lower bound of the icepop window."""
    beta_rollout_kl: float = 1e-3
    """Coefficient of the per-token KL(pi_theta || mu) penalty; 0 disables it."""
    rollout_kl_kind: KLKind = "k2"
    """Estimator used for that penalty."""
    eps_low: float = 0.2
    """PPO clip: r >= 1 - eps_low."""
    eps_high: float = 0.2
    """PPO clip: r <= 1 + eps_high (DAPO "clip-higher" uses 0.28)."""
    dual_clip: float | None = None
    """PPO dual clip c > 1 (Ye et al. 2020; 3.0 is usual), None disables it."""
    max_staleness: int | None = None
    """Tokens with V - v_t > max_staleness leave the loss mask; None keeps all."""

    def __post_init__(self) -> None:
        choices = {
            "anchor": ("prox", "behaviour"),
            "policy_loss": ("dppo", "ppo_clip"),
            "divergence": ("tv", "kl"),
            "is_mode": ("tis", "icepop", "none"),
            "is_level": ("token", "sequence"),
            "rollout_kl_kind": ("k1", "abs", "k2", "k3"),
        }
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"ObjectiveConfig.{name}={getattr(self, name)!r}; expected one of {allowed}")
        if self.dual_clip is not None and self.dual_clip <= 1.0:
            raise ValueError(f"ObjectiveConfig.dual_clip must be > 1, got {self.dual_clip}")
        if self.max_staleness is not None and self.max_staleness < 0:
            raise ValueError(f"ObjectiveConfig.max_staleness must be >= 0, got {self.max_staleness}")
        if not (0 < self.is_low <= self.is_cap):
            raise ValueError("ObjectiveConfig needs 0 < is_low <= is_cap")


def _masked_stats(x: Tensor, mask: Tensor, n: Tensor) -> Tensor:
    """Mean of x over mask; 0 when the mask is empty (n is mask.sum() as a float tensor)."""
    return torch.where(mask, x, torch.zeros_like(x)).sum() / n.clamp(min=1)


def _masked_max(x: Tensor, mask: Tensor) -> Tensor:
    """Max of x over mask; 0 when the mask is empty."""
    if x.numel() == 0:
        return x.new_zeros(())
    m = torch.where(mask, x, torch.full_like(x, float("-inf"))).max()
    return torch.where(mask.any(), m, torch.zeros_like(m))


def policy_loss(
    logp: Tensor,
    logp_behav: Tensor,
    advantages: Tensor,
    mask: Tensor,
    token_versions: Tensor,
    version: int,
    cfg: ObjectiveConfig | None = None,
    logp_prox: Tensor | None = None,
) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
    """Per-token off-policy policy loss. Returns ``(per_token_loss, loss_mask, metrics)``.

    anchor = logp_prox (exact) | loglinear_prox_logp(...) (A-3PO) | logp_behav ("behaviour")
    r_t    = exp(clamp(logp - anchor, -20, 20))                  (gradient flows through logp)
    w_t    = importance_weights(anchor, logp_behav, ...)          (detached)

    - ``dppo``:     L_t = -w_t * r_t * A_t  where dppo_keep_mask(logp, anchor, A) else 0
                    (applied with torch.where; the dropped branch is finite).
    - ``ppo_clip``: decoupled PPO (AReaL): L_t = w_t * ppo_t with
                    ppo_t = -min(r A, clip(r, 1 - eps_low, 1 + eps_high) A), and with dual clip
                    c (Ye et al. 2020), for A < 0 only: ppo_t = min(ppo_t, -c A), i.e. the loss of
                    a negative-advantage token is capped at c|A| however large r gets.

    Both add ``beta_rollout_kl * kl_penalty(logp, logp_behav, rollout_kl_kind)`` on every
    loss-mask token (also DPPO-dropped ones: the penalty is what pulls them back).

    ``loss_mask`` = ``staleness_mask(mask, token_versions, version, cfg.max_staleness)``;
    ``per_token_loss`` is exactly 0 outside it. Reduce with
    :func:`~asyncrl.learner.reduction.reduce_loss` using denominators counted from loss masks.
    DPPO-dropped / PPO-clipped tokens stay in the denominators (they are in the loss mask).

    ``metrics``: detached 0-d tensors for this micro-batch, over loss-mask tokens (0 when there
    are none): ratio_mean, dppo_masked_frac(_low/_high), is_weight_mean, is_weight_max,
    is_weight_sq_mean, ess, rollout_kl_k2, rollout_kl_k3, staleness_mean / staleness_max /
    stale_dropped_frac (over the *input* mask), clip_frac and dual_clip_frac (ppo_clip only), and
    the counts num_tokens / num_tokens_in. Aggregate across micro-batches and ranks with
    :func:`~asyncrl.learner.reduction.aggregate_metrics` (never by averaging the dicts).
    """
    cfg = cfg or ObjectiveConfig()
    in_mask = mask.bool()
    loss_mask = staleness_mask(in_mask, token_versions, version, cfg.max_staleness)
    # Sanitise every input at non-loss positions first: everything below is then finite there.
    logp = _safe(logp, loss_mask)
    logp_behav = _safe(logp_behav, loss_mask)
    adv = _safe(_per_token(advantages, logp).to(logp.dtype), loss_mask)

    if cfg.anchor == "behaviour":
        anchor = logp_behav
    elif logp_prox is not None:
        anchor = _safe(logp_prox.detach(), loss_mask)
    else:
        anchor = loglinear_prox_logp(logp, logp_behav, token_versions, version, loss_mask)

    ratio = torch.exp(_log_ratio(logp, anchor))
    w = importance_weights(anchor, logp_behav, loss_mask, cfg.is_mode, cfg.is_cap, cfg.is_low, cfg.is_level)
    drop_low, drop_high = dppo_drop_masks(
        logp.detach(), anchor, adv, cfg.divergence, cfg.dppo_low, cfg.dppo_high
    )
    drop_low &= loss_mask
    drop_high &= loss_mask

    clip_masks: dict[str, Tensor] = {}  # ppo_clip only: where the (dual) clip is active
    if cfg.policy_loss == "dppo":
        keep = ~(drop_low | drop_high)
        pg = torch.where(keep, -w * ratio * adv, torch.zeros_like(ratio))
    else:
        unclipped = -adv * ratio
        clipped = -adv * ratio.clamp(1.0 - cfg.eps_low, 1.0 + cfg.eps_high)
        ppo = torch.maximum(unclipped, clipped)  # == -min(rA, clip(r)A)
        clip_active = (clipped > unclipped) & loss_mask
        if cfg.dual_clip is not None:
            cap = -cfg.dual_clip * adv
            dual_active = (adv < 0) & (ppo > cap) & loss_mask
            ppo = torch.where(adv < 0, torch.minimum(ppo, cap), ppo)
        else:
            dual_active = torch.zeros_like(loss_mask)
        pg = w * ppo
        clip_masks = {"clip_frac": clip_active, "dual_clip_frac": dual_active}

    loss = pg
    if cfg.beta_rollout_kl:
        loss = loss + cfg.beta_rollout_kl * kl_penalty(logp, logp_behav, cfg.rollout_kl_kind, loss_mask)
    loss = torch.where(loss_mask, loss, torch.zeros_like(loss))

    metrics = _policy_metrics(
        logp.detach(),
        logp_behav,
        ratio.detach(),
        w,
        drop_low,
        drop_high,
        clip_masks,
        loss_mask,
        in_mask,
        token_versions,
        version,
    )
    return loss, loss_mask, metrics


@torch.no_grad()
def _policy_metrics(
    logp: Tensor,
    logp_behav: Tensor,
    ratio: Tensor,
    w: Tensor,
    drop_low: Tensor,
    drop_high: Tensor,
    clip_masks: dict[str, Tensor],
    loss_mask: Tensor,
    in_mask: Tensor,
    token_versions: Tensor,
    version: int,
) -> dict[str, Tensor]:
    """Token-mean metrics over ``loss_mask`` (staleness ones over ``in_mask``); see policy_loss."""
    f = ratio.dtype
    n = loss_mask.sum().to(f)
    n_in = in_mask.sum().to(f)
    w_mean = _masked_stats(w, loss_mask, n)
    w_sq_mean = _masked_stats(w * w, loss_mask, n)
    stale = (version - token_versions).to(f)
    m = {
        "ratio_mean": _masked_stats(ratio, loss_mask, n),
        "dppo_masked_frac": (drop_low | drop_high).sum().to(f) / n.clamp(min=1),
        "dppo_masked_frac_low": drop_low.sum().to(f) / n.clamp(min=1),
        "dppo_masked_frac_high": drop_high.sum().to(f) / n.clamp(min=1),
        "is_weight_mean": w_mean,
        "is_weight_max": _masked_max(w, loss_mask),
        "is_weight_sq_mean": w_sq_mean,
        # Normalised ESS (sum w)^2 / (n sum w^2) == mean(w)^2 / mean(w^2); 1 = uniform weights.
        "ess": torch.where(
            w_sq_mean > 0, w_mean * w_mean / w_sq_mean.clamp(min=1e-30), torch.zeros_like(w_mean)
        ),
        "rollout_kl_k2": _masked_stats(kl_penalty(logp, logp_behav, "k2", loss_mask), loss_mask, n),
        "rollout_kl_k3": _masked_stats(kl_penalty(logp, logp_behav, "k3", loss_mask), loss_mask, n),
        "staleness_mean": _masked_stats(stale, in_mask, n_in),
        "staleness_max": _masked_max(stale, in_mask),
        "stale_dropped_frac": (in_mask & ~loss_mask).sum().to(f) / n_in.clamp(min=1),
        "num_tokens": n,
        "num_tokens_in": n_in,
    }
    for k, active in clip_masks.items():  # bool masks already restricted to loss_mask
        m[k] = active.sum().to(f) / n.clamp(min=1)
    return m
