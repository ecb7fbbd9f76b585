"""KL estimators from sampled-token logprobs, named by direction and estimator, and entropy.

Two different jobs, two different families (never mix them up):

* **Penalties** (gradient flows, tokens come from mu, NOT from pi): :func:`kl_penalty` with
  ``k2`` (0.5 d^2: its gradient d * grad(log pi) pulls pi_theta(y) toward mu(y) on every sampled
  token), ``k3`` or ``abs``. ``k1`` = d is refused as a loss (see :data:`KL_LOSS_KINDS`): with
  tokens sampled from mu, E_mu[log pi - log mu] = -KL(mu || pi), so minimising k1 MAXIMISES the
  divergence: its gradient lowers log pi on exactly the tokens mu samples, pushing pi away from the
  anchor instead of toward it.
* **Metrics** (no gradient): :func:`rollout_kl_estimates`, over tokens sampled from mu, with
  d = log pi - log mu (clamped to [-20, 20]) and r = e^d:

  ================  =======================  ========================================
  name              per-token value          estimates (E over y ~ mu)
  ================  =======================  ========================================
  kl_mu_pi_k1       -d                       KL(mu || pi), unbiased, high variance
  kl_mu_pi_k3       r - 1 - d                KL(mu || pi), unbiased, >= 0 (Schulman k3)
  kl_mu_pi_k2       d^2 / 2                  KL(mu || pi) to 2nd order only (biased)
  kl_pi_mu_is       r d - (r - 1)            KL(pi || mu), unbiased (importance-weighted), >= 0
  ================  =======================  ========================================

  (Unbiasedness uses E_mu[r] = 1: E_mu[r - 1 - d] = 0 + KL(mu||pi); E_mu[r d] = KL(pi||mu).)
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from asyncrl.learner.objectives.common import LOG_RATIO_CLAMP, log_ratio, safe

#: k2 / abs penalties hold a finite log-ratio beyond this (see :func:`penalty_log_ratio`).
PENALTY_DIFF_MAX = 1e6

__all__ = [
    "KL_LOSS_KINDS",
    "KL_METRICS",
    "entropy_from_logits",
    "entropy_from_logp",
    "kl_estimates_from_log_ratio",
    "kl_from_log_ratio",
    "kl_penalty",
    "penalty_log_ratio",
    "rollout_kl_estimates",
]

KLKind = Literal["k1", "abs", "k2", "k3"]
#: Estimators allowed as a loss term (rollout KL, reference KL). k1 is metric-only (module docstring).
KL_LOSS_KINDS: tuple[str, ...] = ("abs", "k2", "k3")
#: Metric names of :func:`rollout_kl_estimates`.
KL_METRICS: tuple[str, ...] = ("kl_mu_pi_k1", "kl_mu_pi_k2", "kl_mu_pi_k3", "kl_pi_mu_is")


def penalty_log_ratio(a: Tensor, b: Tensor, kind: str) -> Tensor:
    """The log-ratio ``a - b`` a KL penalty of ``kind`` is computed from.

    k3 (and k1) take ``clamp(a - b, -20, 20)``: k3 has exp(-d), which must stay finite. k2 and abs
    have no exp and take the plain difference: a clamp there made the penalty flat (zero gradient)
    past |d| = 20, on exactly the tokens that moved furthest, which the rollout-KL term exists to pull
    back (and the reference KL stopped acting on tokens furthest from the base model). A non-finite
    difference (an infinite logprob at a loss position) is clamped to +-20 in every kind; for k2 and
    abs a finite one beyond +-PENALTY_DIFF_MAX (1e6) is held there. A clamped value's gradient is 0,
    never NaN (torch.where routes it)."""
    if kind in ("k2", "abs"):
        diff = a - b
        # |d| past PENALTY_DIFF_MAX only from a sentinel logprob (the record contract refuses behaviour
        # logprobs below -1e4): held there, k2 = d^2 / 2 <= 5e11 stays finite in fp32 (it overflows
        # at |d| ~ 1.8e19), where d^2 summed over a batch would be inf and void the whole step.
        finite = diff.clamp(-PENALTY_DIFF_MAX, PENALTY_DIFF_MAX)
        return torch.where(torch.isfinite(diff), finite, diff.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    return log_ratio(a, b)


def kl_penalty(logp: Tensor, logp_ref: Tensor, kind: KLKind = "k2", mask: Tensor | None = None) -> Tensor:
    """Per-token KL penalty between pi_theta and a reference from sampled-token logprobs.

    With d = logp - logp_ref (:func:`penalty_log_ratio`: clamped to [-20, 20] for k1 and k3 only):

    - ``k1``  = d                   (metric only: refused as a loss, see the module docstring);
    - ``abs`` = |d|;
    - ``k2``  = d^2 / 2             gradient d * grad(logp): pulls logp toward logp_ref;
    - ``k3``  = exp(-d) + d - 1     >= 0; unbiased for KL(pi || ref) when tokens come from pi.

    ``mask`` (optional): positions outside it are replaced by 0 *before* the subtraction, so the
    result there is exactly 0 and gradients are exactly 0 even if logp is -inf there.
    """
    return kl_from_log_ratio(penalty_log_ratio(safe(logp, mask), safe(logp_ref, mask), kind), kind)


def kl_from_log_ratio(d: Tensor, kind: KLKind = "k2") -> Tensor:
    """:func:`kl_penalty` from the log-ratio ``d`` of :func:`penalty_log_ratio` (0 where d is 0, e.g.
    off a mask)."""
    if kind == "k1":
        return d
    if kind == "abs":
        return d.abs()
    if kind == "k2":
        return 0.5 * d * d
    if kind == "k3":
        # expm1(-d) + d == exp(-d) - 1 + d without the cancellation near d = 0.
        return torch.expm1(-d) + d
    raise ValueError(f"unknown KL kind {kind!r}; expected k1, abs, k2 or k3")


@torch.no_grad()
def rollout_kl_estimates(logp: Tensor, logp_behav: Tensor, mask: Tensor) -> dict[str, Tensor]:
    """Per-token KL estimates between pi (``logp``) and mu (``logp_behav``) for tokens y ~ mu.

    Returns ``{name: [B, T] tensor}`` for the names in :data:`KL_METRICS` (table in the module
    docstring); exactly 0 outside ``mask``. Token-mean them over the mask to get the estimates.
    """
    return kl_estimates_from_log_ratio(log_ratio(safe(logp.detach(), mask), safe(logp_behav, mask)))


@torch.no_grad()
def kl_estimates_from_log_ratio(d: Tensor) -> dict[str, Tensor]:
    """:func:`rollout_kl_estimates` from the clamped log-ratio ``d`` (exactly 0 off the mask)."""
    em1 = torch.expm1(d)  # r - 1, exact near d = 0
    return {
        "kl_mu_pi_k1": -d,
        "kl_mu_pi_k2": 0.5 * d * d,
        "kl_mu_pi_k3": em1 - d,
        "kl_pi_mu_is": d * torch.exp(d) - em1,
    }


def entropy_from_logp(logp_all: Tensor) -> Tensor:
    """Entropy ``-sum_v p_v log p_v`` over the last dim from full log-probabilities (fp32).

    Value and gradient stay finite when a probability underflows to 0 (a logit gap > ~104 in fp32):
    ``xlogy(p, p)`` would back-propagate 0 * log(0) = NaN there. Here the product is p * log p with
    log p finite (log_softmax of finite logits), so its gradient p * (1 + log p) is exactly 0 for
    p = 0; log p = -inf (a -inf logit) is clamped to the most negative float first for the same reason.
    """
    logp_all = logp_all.clamp(min=torch.finfo(logp_all.dtype).min)
    return -(logp_all.exp() * logp_all).sum(dim=-1)


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy of softmax(logits) over the last dim, in fp32 (see :func:`entropy_from_logp`)."""
    return entropy_from_logp(torch.log_softmax(logits.float(), dim=-1))
