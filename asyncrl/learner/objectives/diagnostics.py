"""Per-micro-batch metrics of the policy loss and the step-start drift sums (no gradient).

Every value is a detached 0-d tensor; aggregate across micro-batches and ranks with
:class:`~asyncrl.learner.reduction.MetricAccumulator` (token means weighted by their token count,
sequence means by ``num_seqs``), never by averaging the dicts.
"""

from __future__ import annotations

import torch
from torch import Tensor

from asyncrl.learner.objectives.common import masked_max, masked_mean
from asyncrl.learner.objectives.importance import raw_is_ratios
from asyncrl.learner.objectives.kl import rollout_kl_estimates

__all__ = ["SIDE_METRICS", "drift_sums", "policy_metrics"]

#: Fractions of loss tokens by mechanism and side; 0 when the mechanism is not in use.
SIDE_METRICS = (
    "dppo_masked_frac_low",
    "dppo_masked_frac_high",
    "m2po_masked_frac",
    "clip_frac_low",
    "clip_frac_high",
    "dual_clip_frac",
)


@torch.no_grad()
def policy_metrics(
    *,
    logp: Tensor,
    logp_behav: Tensor,
    logp_prox: Tensor,
    ratio: Tensor,
    w: Tensor,
    w_raw: Tensor,
    sides: dict[str, Tensor],
    loss_mask: Tensor,
    in_mask: Tensor,
    token_versions: Tensor,
    version: int,
) -> dict[str, Tensor]:
    """Metric dict of one :func:`~asyncrl.learner.objectives.policy_loss` call (names in its doc).

    The token means over the loss mask are taken in one batched reduction (a ``[K, B, T]`` stack,
    one ``torch.where``, one sum): the same masked sums as K separate :func:`masked_mean` calls
    with a fraction of the small-op dispatches, which dominate a micro-batch this size.
    """
    f = ratio.dtype
    n = loss_mask.sum().to(f)
    n_in = in_mask.sum().to(f)
    seqs = loss_mask.any(dim=-1)
    n_seq = seqs.sum().to(f)
    rho_tok, rho_seq = raw_is_ratios(logp_prox, logp_behav, loss_mask)
    stale = (version - token_versions).to(f)
    # Per-token values whose mean over the loss mask is the metric (off-mask values may be anything:
    # torch.where below drops them before the sum, never a multiplied mask).
    tok: dict[str, Tensor] = {
        "ratio_mean": ratio,
        "is_weight_mean": w,
        "is_weight_sq_mean": w * w,
        "is_trunc_frac": ((w > 0) & (w < w_raw)).to(f),
        "is_masked_frac": (w == 0).to(f),
        # chi^2(pi_prox || mu) = E_mu[rho^2] - 1, per token and per sequence (untruncated ratios).
        "is_chi2": rho_tok * rho_tok - 1.0,
        **rollout_kl_estimates(logp, logp_behav, loss_mask),
        **{k: sides[k].to(f) for k in SIDE_METRICS if sides.get(k) is not None},
    }
    stack = torch.stack(list(tok.values()))
    sums = torch.where(loss_mask, stack, torch.zeros((), dtype=f, device=stack.device)).sum(dim=(-2, -1))
    m = dict(zip(tok, (sums / n.clamp(min=1)).unbind(), strict=True))
    w_mean, w_sq_mean = m["is_weight_mean"], m["is_weight_sq_mean"]
    zero = n * 0
    m.update({
        "is_weight_max": masked_max(w, loss_mask),
        # Normalised ESS (sum w)^2 / (n sum w^2) == mean(w)^2 / mean(w^2); 1 = uniform weights.
        "ess": torch.where(w_sq_mean > 0, w_mean * w_mean / w_sq_mean.clamp(min=1e-30), zero),
        "is_chi2_seq": torch.where(seqs, rho_seq * rho_seq - 1.0, 0.0).sum()
        / n_seq.clamp(min=1),
        "staleness_mean": masked_mean(stale, in_mask, n_in),
        "staleness_max": masked_max(stale, in_mask),
        "stale_dropped_frac": (in_mask & ~loss_mask).sum().to(f) / n_in.clamp(min=1),
        "num_tokens": n,
        "num_tokens_in": n_in,
        "num_seqs": n_seq,
    })  # fmt: skip
    for k in SIDE_METRICS:  # 0 when the mechanism is not in use
        m.setdefault(k, zero)
    m["dppo_masked_frac"] = m["dppo_masked_frac_low"] + m["dppo_masked_frac_high"]
    m["clip_frac"] = m["clip_frac_low"] + m["clip_frac_high"]
    return m


@torch.no_grad()
def drift_sums(
    logp_start: Tensor, logp_behav: Tensor, mask: Tensor, token_versions: Tensor, version: int
) -> dict[str, Tensor]:
    """Sums for the split of sampler drift at the step start, by token staleness s = V - v_t.

    With d = log pi_prox - log mu (pi_prox = the exact step-start policy) over ``mask``:
    ``drift_kl_sum/<s>`` = sum of the unbiased KL(mu || pi_prox) estimate e^d - 1 - d and
    ``drift_n/<s>`` its token count, per staleness value s present; ``log_ppl_gap_sum`` = sum of -d
    (mean = train minus rollout log-perplexity). s = 0 is the engine/learner mismatch alone (same
    weights); s >= 1 adds staleness.
    """
    est = rollout_kl_estimates(logp_start, logp_behav, mask)
    s = version - token_versions
    out: dict[str, Tensor] = {"log_ppl_gap_sum": torch.where(mask, est["kl_mu_pi_k1"], 0.0).sum()}
    for v in torch.unique(s[mask]).tolist():
        m = mask & (s == v)
        out[f"drift_kl_sum/{v}"] = torch.where(m, est["kl_mu_pi_k3"], 0.0).sum()
        out[f"drift_n/{v}"] = m.sum().to(logp_start.dtype)
    return out
