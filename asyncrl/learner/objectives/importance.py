"""Proximal policy, staleness, and the detached behaviour -> proximal importance weights.

Version convention (V = the learner's version at the start of the step, i.e. the number of weight
publications so far; the step-start weights are exactly the weights published as V when
``publish_every`` = 1):

* ``v_t``     the version of the weights that sampled token t; its logprob there is mu_t (engine).
* ``s_t``     = V - v_t, the token's staleness (integer, in versions; the admission/drop bound).
* pi_prox     the learner policy at the START of the step (weights W_V): the policy the
              importance weight corrects mu toward and the ratio r = pi_theta / pi_prox starts from.
* pi_theta    the weights being updated: W_V at the first update of the step, then W_V plus the
              updates already applied in this step.

Worked example (publish_every = 1, one step = 2 optimizer updates: mini_batches = 2):

    s = 0: mu = W_V (engine numerics), pi_prox = W_V (learner numerics): w = pi_prox/mu corrects only
           the engine/learner mismatch; r = 1 at update 0.
    s = 1: mu = W_{V-1}, pi_prox = W_V: w corrects one version of drift.
    s = 2: mu = W_{V-2}, pi_prox = W_V: two versions.

At update 0 the step-start logprob IS the detached current logprob, so the exact pi_prox is free
there. At later updates it needs a no-grad recompute (``learner.exact_prox``) or the A-3PO
log-linear interpolation :func:`loglinear_prox_logp`, which places the three policies on a version
axis (mu at v_t, pi_prox at V + o, pi_theta at V + o + p, where o = steps since the last publication /
publish_every and p = the fraction of a version pi_theta has moved in this step) and interpolates:

    log pi_prox ~= log mu + alpha (log pi_theta - log mu),  alpha = (s + o) / (s + o + p)

In the example, update 1 has p = 1/2: alpha = 0 (s = 0), 2/3 (s = 1), 4/5 (s = 2); at update 0,
p = 0 and alpha = 1 for every s (pi_prox = pi_theta exactly).
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from asyncrl.learner.objectives.common import LOG_RATIO_CLAMP, log_ratio, safe, sequence_sum

__all__ = [
    "IS_LEVELS",
    "IS_MODES",
    "importance_weights",
    "loglinear_prox_logp",
    "raw_is_ratios",
    "level_log_rho",
    "raw_log_rho",
    "staleness_mask",
    "weights_from_log_rho",
]

ISMode = Literal["tis", "icepop", "none"]
ISLevel = Literal["token", "sequence", "geometric"]
IS_MODES: tuple[str, ...] = ("tis", "icepop", "none")
IS_LEVELS: tuple[str, ...] = ("token", "sequence", "geometric")


@torch.no_grad()
def loglinear_prox_logp(
    logp: Tensor,
    logp_behav: Tensor,
    token_versions: Tensor,
    version: int,
    mask: Tensor | None = None,
    prox_offset: float = 0.0,
    progress: float = 1.0,
) -> Tensor:
    """A-3PO log-linear approximation of the step-start logprob (detached); see the module docstring.

    ``alpha = (s + prox_offset) / (s + prox_offset + progress)`` per token, and alpha = 1 where that
    is 0 / 0 (s = 0 at the step start: pi_prox IS pi_theta). Masked positions return 0.
    """
    if prox_offset < 0 or progress < 0:
        raise ValueError("prox_offset and progress must be >= 0")
    lp = safe(logp.detach(), mask)
    lb = safe(logp_behav, mask)
    num = (version - token_versions).to(lp.dtype) + prox_offset
    den = num + progress
    alpha = torch.where(den > 0, num / den.clamp(min=1e-30), 1.0)
    return lb + alpha * (lp - lb)


def staleness_mask(mask: Tensor, token_versions: Tensor, version: int, max_staleness: int | None) -> Tensor:
    """``mask`` minus tokens whose staleness V - v_t exceeds ``max_staleness`` (None: no drop).

    It depends only on data, so the learner computes it (and the global loss denominators) before
    any forward pass.
    """
    if max_staleness is None:
        return mask
    return mask & ((version - token_versions) <= max_staleness)


def raw_log_rho(logp_prox: Tensor, logp_behav: Tensor, mask: Tensor, level: str) -> Tensor:
    """log of the untruncated ratio pi_prox / mu at ``level``, broadcast to ``[B, T]``."""
    log_rho = log_ratio(safe(logp_prox, mask), safe(logp_behav, mask))  # exactly 0 off the mask
    return level_log_rho(log_rho, mask, level)


def level_log_rho(log_rho: Tensor, mask: Tensor, level: str) -> Tensor:
    """The token log-ratios ``log_rho`` (exactly 0 off ``mask``) taken to ``level``, ``[B, T]``."""
    if level == "token":
        return log_rho
    total = sequence_sum(log_rho, mask)
    if level == "sequence":
        out = total
    elif level == "geometric":
        out = total / mask.sum(dim=-1, keepdim=True).clamp(min=1).to(total.dtype)
    else:
        raise ValueError(f"unknown IS level {level!r}; expected one of {IS_LEVELS}")
    return out.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).expand_as(log_rho)


@torch.no_grad()
def importance_weights(
    logp_prox: Tensor,
    logp_behav: Tensor,
    mask: Tensor,
    mode: ISMode = "tis",
    cap: float = 2.0,
    low: float = 0.5,
    level: ISLevel = "token",
    veto: float = 0.0,
) -> Tensor:
    """Detached behaviour -> proximal importance weights ``[B, T]`` (1 at masked positions).

    rho = pi_prox / mu corrects for the sampler mu differing from the step-start policy
    (staleness and engine/learner numerics), at ``level``:

    - ``token``:     rho_t;
    - ``sequence``:  exp(sum_t log rho_t) over the sequence's masked tokens (sequence IS);
    - ``geometric``: exp(mean_t log rho_t) (geometric-mean / length-normalised sequence ratio,
                     the "geo" MIS of verl's rollout correction), broadcast to the sequence.

    ``mode``: ``tis`` w = min(rho, cap); ``icepop`` (masked IS) w = rho if low <= rho <= cap else 0
    (low = 0: no lower bound); ``none`` w = 1. ``veto`` > 0: a sequence holding any token with
    rho_t < veto gets weight 0 on all its tokens (catastrophic tokens veto their sequence), in any
    mode. Every log-ratio (and the sequence sums) is clamped to [-20, 20] before exp.
    """
    mask = mask.bool()
    log_rho = log_ratio(safe(logp_prox, mask), safe(logp_behav, mask))  # exactly 0 off the mask
    return weights_from_log_rho(log_rho, mask, mode, cap, low, level, veto)[0]


@torch.no_grad()
def weights_from_log_rho(log_rho: Tensor, mask: Tensor, mode: ISMode, cap: float, low: float, level: ISLevel,
                         veto: float) -> tuple[Tensor, Tensor | None]:  # fmt: skip
    """:func:`importance_weights` from the token log-ratios ``log_rho`` = clamp(log pi_prox - log mu),
    exactly 0 off ``mask`` (bool); also returns the untruncated rho at ``level`` (None for mode none),
    so a caller that needs both (the policy loss: weights and is_trunc_frac) exponentiates once.
    """
    if mode not in IS_MODES:
        raise ValueError(f"unknown IS mode {mode!r}; expected one of {IS_MODES}")
    rho = None
    if mode == "none":
        w = torch.ones_like(log_rho)
    else:
        rho = torch.exp(level_log_rho(log_rho, mask, level))
        if mode == "tis":
            w = rho.clamp(max=cap)
        else:
            w = torch.where((rho >= low) & (rho <= cap), rho, 0.0)
    if veto > 0:
        tok = rho if rho is not None and level == "token" else torch.exp(log_rho)
        vetoed = ((tok < veto) & mask).any(dim=-1, keepdim=True).expand_as(w)
        w = torch.where(vetoed, 0.0, w)
    return torch.where(mask, w, 1.0), rho


@torch.no_grad()
def raw_is_ratios(logp_prox: Tensor, logp_behav: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """Untruncated ``(token rho [B, T], sequence rho [B])`` of pi_prox / mu, for diagnostics."""
    mask = mask.bool()
    tok = torch.exp(raw_log_rho(logp_prox, logp_behav, mask, "token"))
    seq = torch.exp(raw_log_rho(logp_prox, logp_behav, mask, "sequence"))[:, 0]
    return tok, seq
