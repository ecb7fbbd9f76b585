"""Per-micro-batch metrics of the policy loss and the step-start drift sums (no gradient).

Every value is a detached 0-d tensor; aggregate across micro-batches and ranks with
:class:`~asyncrl.learner.reduction.MetricAccumulator` (token means weighted by their token count,
sequence means by ``num_seqs``), never by averaging the dicts.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from asyncrl.learner.objectives.common import LOG_RATIO_CLAMP, log_ratio, masked_max, masked_mean, safe
from asyncrl.learner.objectives.kl import kl_estimates_from_log_ratio

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
    log_rho: Tensor | None = None,
    rho: Tensor | None = None,
    d: Tensor | None = None,
) -> dict[str, Tensor]:
    """Metric dict of one :func:`~asyncrl.learner.objectives.policy_loss` call (names in its doc).

    The token means over the loss mask are taken in one batched reduction (a ``[K, B, T]`` stack,
    one ``torch.where``, one sum): the same masked sums as K separate :func:`masked_mean` calls
    with a fraction of the small-op dispatches, which dominate a micro-batch this size.

    ``log_rho`` = clamp(log pi_prox - log mu), ``rho`` = exp(log_rho) and ``d`` = clamp(log pi - log mu),
    each exactly 0 (rho: 1) off ``loss_mask``, are the intermediates the loss already formed; given,
    they are reused (the same values the metrics would compute from the logprobs), else computed here.
    ``w`` must be >= 0 (every IS mode's weights are).
    """
    f = ratio.dtype
    if log_rho is None:
        log_rho = log_ratio(safe(logp_prox, loss_mask), safe(logp_behav, loss_mask))
    if rho is None:
        rho = torch.exp(log_rho)
    if d is None:
        d = log_ratio(safe(logp, loss_mask), safe(logp_behav, loss_mask))
    n = loss_mask.sum().to(f)
    n_in = in_mask.sum().to(f)
    seqs = loss_mask.any(dim=-1)
    n_seq = seqs.sum().to(f)
    # Sequence rho = exp(clamp(sum_t log rho_t)): log_rho is exactly 0 off the mask, so a plain row sum.
    rho_seq = torch.exp(log_rho.sum(dim=-1).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
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
        "is_chi2": rho * rho - 1.0,
        **kl_estimates_from_log_ratio(d),
        **{k: sides[k].to(f) for k in SIDE_METRICS if sides.get(k) is not None},
    }
    stack = torch.where(loss_mask, torch.stack(list(tok.values())), torch.zeros((), dtype=f, device=w.device))
    sums = stack.sum(dim=(-2, -1))
    m = dict(zip(tok, (sums / n.clamp(min=1)).unbind(), strict=True))
    w_mean, w_sq_mean = m["is_weight_mean"], m["is_weight_sq_mean"]
    zero = n * 0
    m.update({
        # w >= 0 and the masked stack holds 0 off the mask: its max is the max over the mask, 0 if empty.
        "is_weight_max": stack[list(tok).index("is_weight_mean")].max() if w.numel() else zero,
        # Normalised ESS (sum w)^2 / (n sum w^2) == mean(w)^2 / mean(w^2); 1 = uniform weights.
        "ess": torch.where(w_sq_mean > 0, w_mean * w_mean / w_sq_mean.clamp(min=1e-30), zero),
        "is_chi2_seq": torch.where(seqs, rho_seq * rho_seq - 1.0, 0.0).sum()
        / n_seq.clamp(min=1),
        "staleness_mean": masked_mean(stale, in_mask, n_in),
        "staleness_max": masked_max(stale, in_mask),
        # loss_mask is a subset of in_mask: the dropped count is n_in - n (exact integers in f).
        "stale_dropped_frac": (n_in - n) / n_in.clamp(min=1),
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
    logp_start: Tensor,
    logp_behav: Tensor,
    mask: Tensor,
    token_versions: Tensor,
    version: int,
    log_ratio_behav: Tensor | None = None,
    versions_present: Sequence[int] | None = None,
) -> dict[str, Tensor]:
    """Sums for the split of sampler drift at the step start, by token staleness s = V - v_t.

    With d = log pi_prox - log mu (pi_prox = the exact step-start policy) over ``mask``:
    ``drift_kl_sum/<s>`` = sum of the unbiased KL(mu || pi_prox) estimate e^d - 1 - d and
    ``drift_n/<s>`` its token count, per staleness value s present; ``log_ppl_gap_sum`` = sum of -d
    (mean = train minus rollout log-perplexity). s = 0 is the engine/learner mismatch alone (same
    weights); s >= 1 adds staleness. ``log_ratio_behav``: d already formed (clamped, exactly 0 off
    ``mask``), e.g. by the objective when ``logp_start`` is the current logprob; else computed here.
    ``versions_present``: every token version that can occur under ``mask``, known on the host (the
    collated batch's), so that no device-to-host sync picks the buckets; a bucket with no token
    under ``mask`` then sums to zero tokens, and the caller drops it (asyncrl.learner.step).
    """
    d = log_ratio_behav
    if d is None:
        d = log_ratio(safe(logp_start, mask), safe(logp_behav, mask))
    k3 = torch.expm1(d) - d  # as kl_mu_pi_k3 of rollout_kl_estimates; exactly 0 off the mask
    s = version - token_versions
    # d is exactly 0 off the mask: plain sums; -sum(d) == sum(-d) bit for bit (negation is exact).
    out: dict[str, Tensor] = {"log_ppl_gap_sum": -d.sum()}
    present = (
        torch.unique(s[mask]).tolist()  # a device sync
        if versions_present is None
        else sorted({version - int(tv) for tv in versions_present})
    )
    for v in present:
        m = mask & (s == v)
        out[f"drift_kl_sum/{v}"] = torch.where(m, k3, 0.0).sum()
        out[f"drift_n/{v}"] = m.sum().to(logp_start.dtype)
    return out
