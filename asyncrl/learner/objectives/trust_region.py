"""Trust-region masks: DPPO (divergence of the sampled token's probability) and M2PO (second moment).

Both decide, without gradient, which tokens keep their policy gradient; they never rescale it.
The anchor they compare pi_theta with is the configured ``anchor`` (default: the behaviour policy
mu, which is what staleness and engine mismatch move).
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from asyncrl.learner.objectives.common import log_ratio, per_token

__all__ = ["dppo_drop_masks", "dppo_keep_mask", "m2po_keep_mask"]

Divergence = Literal["tv", "kl"]
# DPPO-KL clamps probabilities away from {0, 1} so both log terms of the binary KL are finite.
_PROB_EPS = 1e-6


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

    A = 0 is always kept. ``advantages`` is ``[B]`` (per sequence) or ``[B, T]``. "Low" is the side
    where the policy lowered the token's probability (A < 0), "high" where it raised it (A > 0).
    """
    adv = per_token(advantages, logp)
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
    """Bool ``[B, T]``: True where the token keeps its policy gradient under DPPO."""
    drop_low, drop_high = dppo_drop_masks(logp, logp_anchor, advantages, divergence, low, high)
    return ~(drop_low | drop_high)


@torch.no_grad()
def m2po_keep_mask(logp: Tensor, logp_anchor: Tensor, mask: Tensor, tau: float) -> Tensor:
    """M2PO (Zheng et al. 2025) second-moment mask: bool ``[B, T]``, True = token keeps its gradient.

    With d_t = clamp(log pi_theta - log pi_anchor, -20, 20) over the tokens in ``mask``, drop the
    tokens with the largest d_t^2, one at a time, until the second moment of the rest,
    M2 = mean(d^2), is <= ``tau`` (ties: the lower flat index goes first). Everything stays if M2 is
    already <= tau. The mask is taken over the tensors given (one micro-batch); False off ``mask``.
    """
    mask = mask.bool()
    d2 = torch.where(mask, log_ratio(logp.detach(), logp_anchor), 0.0) ** 2
    flat = d2.reshape(-1)
    idx = mask.reshape(-1).nonzero().squeeze(-1)
    n = int(idx.numel())
    keep = mask.clone()
    if n == 0:
        return keep
    vals = flat[idx].to(torch.float64)
    order = torch.sort(vals, descending=True, stable=True).indices
    sorted_vals = vals[order]
    # rest[k] = sum of the values left after dropping the k largest, k = 0..n-1.
    total = sorted_vals.sum()
    dropped = torch.cat([sorted_vals.new_zeros(1), torch.cumsum(sorted_vals, 0)[:-1]])
    rest_mean = (total - dropped) / torch.arange(n, 0, -1, dtype=torch.float64, device=vals.device)
    ok = (rest_mean <= tau).nonzero()
    k = int(ok[0]) if ok.numel() else n
    if k:
        drop = idx[order[:k]]
        keep.reshape(-1)[drop] = False
    return keep
