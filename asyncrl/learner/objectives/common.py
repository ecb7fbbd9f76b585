"""Shared numerics of the objectives: NaN-safe masking, clamped log-ratios, masked statistics.

NaN discipline (the invariant every objective function keeps): inputs at masked positions may be
-inf / NaN (padding, prompt positions of a log_softmax, ...). They are replaced with safe values via
``torch.where`` *before* any arithmetic, a mask is never multiplied into something that can be
inf, and every log-ratio is clamped before ``exp``. Values at masked positions are therefore finite
(normally 0) and the gradient reaching a masked position is exactly 0, never NaN.
"""

from __future__ import annotations

import torch
from torch import Tensor

# Every log-ratio is clamped to [-20, 20] before exp(): exp(20) ~ 4.9e8 is finite in fp32, and so are
# its square (chi-square metrics) and d * exp(d) (the IS estimate of KL(pi || mu)).
LOG_RATIO_CLAMP = 20.0


def safe(x: Tensor, mask: Tensor | None, fill: float = 0.0) -> Tensor:
    """``x`` with masked-out positions replaced by ``fill`` (gradient there is exactly 0)."""
    if mask is None:
        return x
    return torch.where(mask.bool(), x, fill)


def per_token(x: Tensor, like: Tensor) -> Tensor:
    """Broadcast a per-sequence ``[B]`` tensor to ``[B, T]``; pass ``[B, T]`` through."""
    if x.dim() == like.dim() - 1:
        x = x.unsqueeze(-1)
    return x.expand_as(like)


def log_ratio(a: Tensor, b: Tensor) -> Tensor:
    """``clamp(a - b, -20, 20)``: the only way a log-ratio is formed before an exp."""
    return (a - b).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


def unit_ratio(logp: Tensor) -> Tensor:
    """``exp(logp - sg(logp))``: value exactly 1, gradient ``grad(logp)``.

    Lets a detached weight c enter a loss as ``-c * A * unit_ratio(logp)``: the gradient is the
    REINFORCE term ``-c A grad(log pi)`` while the value stays ``-c A`` (comparable across losses).
    """
    return torch.exp(logp - logp.detach())


def masked_mean(x: Tensor, mask: Tensor, n: Tensor | None = None) -> Tensor:
    """Mean of x over mask; 0 when the mask is empty (``n`` = mask.sum() if already known)."""
    if n is None:
        n = mask.sum().to(x.dtype)
    return torch.where(mask, x, 0.0).sum() / n.clamp(min=1)


def masked_max(x: Tensor, mask: Tensor) -> Tensor:
    """Max of x over mask; 0 when the mask is empty."""
    if x.numel() == 0:
        return x.new_zeros(())
    m = torch.where(mask, x, float("-inf")).max()
    return torch.where(mask.any(), m, 0.0)


def sequence_sum(x: Tensor, mask: Tensor) -> Tensor:
    """Per-sequence masked sum ``[B, 1]`` (positions outside ``mask`` add exactly 0)."""
    return torch.where(mask, x, 0.0).sum(dim=-1, keepdim=True)
