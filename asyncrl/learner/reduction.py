"""Loss reduction with global denominators, the DeepSpeed scaling rule, metric aggregation.

Pure tensor math (no torch.distributed, no DeepSpeed); re-exported by
:mod:`asyncrl.learner.objectives`.

Why global denominators
-----------------------
One optimizer step sees N loss tokens in S sequences, split over R data-parallel ranks and
GAS micro-batches per rank. A micro-batch-local mean (divide by the micro-batch's own token
count) weights tokens differently depending on how the step happens to be split, and any term
reduced that way and then summed over micro-batches is GAS times too large (the regulariser bug
found in review of SkyRL PR 1296). Here every term of every micro-batch is divided by a
*step-global* denominator, so the micro-batch losses **sum** to the full-batch loss and the summed
gradient is identical for any split. The policy term uses the configured reduction:

    token_mean               sum_{tokens} loss_t / N
    sequence_mean            sum_{seqs} (sum_t loss_t / n_seq) / S
    seq_mean_token_sum_norm  sum_{seqs} (sum_t loss_t / max_tokens) / S_all      (Dr.GRPO)

The regularisers (rollout KL, reference KL, entropy) are ALWAYS token means, sum_t term_t / N
(:func:`token_mean`, :func:`entropy_bonus`), whatever the policy reduction: their strength must
not depend on how the policy loss happens to be normalised.

N and S count loss-mask tokens and sequences with at least one loss token, from the *final*
loss masks (after ``staleness_mask``; DPPO-dropped or PPO-clipped tokens still count). S_all is
the number of sampled sequences of the step, masked or not: Dr.GRPO's normaliser is a constant
and must not move when, e.g., overlong completions lose their loss mask.

    dens = count_denominators(all_loss_masks_of_this_rank)        # before any forward
    all_reduce(SUM) torch.tensor([dens.tokens, dens.seqs]) over the DP group  -> N, S

DeepSpeed scaling rule
----------------------
``engine.backward(loss)`` divides the loss by ``gradient_accumulation_steps`` (GAS, the
configured value, with the default ``scale_wrt_gas=True``) and the gradient all-reduce
*averages* over the R data-parallel ranks. To obtain the gradient of the global sum we undo
both, per micro-batch:

    loss_mb = reduce_loss(per_token_pg, mask, mode, N, S or S_all, max_tokens)
            + token_mean(per_token_kl, mask, N) + entropy_bonus(entropy, mask, coef, N)
    engine.backward(loss_mb * deepspeed_loss_scale(GAS, R))          # scale = GAS * R

so that grad = (1/R) sum_ranks (1/GAS) sum_mb grad(GAS * R * loss_mb) = grad(full-batch loss).
Use the configured GAS even if a rank runs fewer micro-batches (DeepSpeed divides by the
configured value). For logging, the step loss is sum over micro-batches and ranks of loss_mb
(unscaled), not their mean.

Metric aggregation
------------------
:func:`asyncrl.learner.objectives.policy_loss` returns per-micro-batch values. Do not average
them across micro-batches: feed every micro-batch's dict to a :class:`MetricAccumulator`
(token means are weighted by their token count, maxima take the max, counts add, ``ess`` is
recomputed from the aggregated mean(w) and mean(w^2)). Across ranks, gather each rank's
``MetricAccumulator.state()`` (e.g. ``all_gather_object``) and :meth:`MetricAccumulator.merge`
them, or call :func:`aggregate_metrics` on the concatenated list of per-micro-batch dicts.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Literal, NamedTuple

import torch
from torch import Tensor

LossReduction = Literal["token_mean", "sequence_mean", "seq_mean_token_sum_norm"]
LOSS_REDUCTIONS: tuple[str, ...] = ("token_mean", "sequence_mean", "seq_mean_token_sum_norm")

# How each policy_loss metric aggregates. ("mean", k): token mean weighted by metric k;
# "max": maximum; "sum": counts that add; "ess": derived from the aggregated IS moments.
METRIC_AGGREGATION: dict[str, tuple[str, str] | str] = {
    **{
        k: ("mean", "num_tokens")
        for k in (
            "ratio_mean",
            "dppo_masked_frac",
            "dppo_masked_frac_low",
            "dppo_masked_frac_high",
            "m2po_masked_frac",
            "clip_frac",
            "clip_frac_low",
            "clip_frac_high",
            "dual_clip_frac",
            "is_weight_mean",
            "is_weight_sq_mean",
            "is_trunc_frac",
            "is_masked_frac",
            "is_chi2",
            "kl_mu_pi_k1",
            "kl_mu_pi_k2",
            "kl_mu_pi_k3",
            "kl_pi_mu_is",
        )
    },
    "is_chi2_seq": ("mean", "num_seqs"),
    "is_weight_max": "max",
    "ess": "ess",
    "staleness_mean": ("mean", "num_tokens_in"),
    "staleness_max": "max",
    "stale_dropped_frac": ("mean", "num_tokens_in"),
    "num_tokens": "sum",
    "num_tokens_in": "sum",
    "num_seqs": "sum",
}


class LossDenominators(NamedTuple):
    """Loss tokens and sequences (with >= 1 loss token) of a whole optimizer step."""

    tokens: int
    seqs: int


def count_denominators(masks: Iterable[Tensor]) -> LossDenominators:
    """Count loss tokens and non-empty sequences over a rank's loss masks ``[B, T]``.

    Pass the final loss masks (after ``staleness_mask``) of every micro-batch of the step on this
    rank, then SUM-all-reduce both numbers over the data-parallel group (see module docstring).
    """
    tokens = 0
    seqs = 0
    for m in masks:
        m = m.bool()
        tokens += int(m.sum().item())
        seqs += int(m.any(dim=-1).sum().item())
    return LossDenominators(tokens, seqs)


def reduce_loss(
    per_token_loss: Tensor,
    mask: Tensor,
    mode: LossReduction,
    global_tokens: int | Tensor,
    global_seqs: int | Tensor,
    max_tokens: int | None = None,
) -> Tensor:
    """Reduce a micro-batch's ``[B, T]`` loss to a scalar with step-global denominators.

    Summing the result over all micro-batches and ranks of a step gives the full-batch loss
    (see the module docstring for the formulas and the DeepSpeed scaling). Masked positions are
    removed with torch.where, so an inf/NaN there cannot leak into the value or the gradient.
    Zero denominators (a step without loss tokens) give 0, not NaN.
    """
    mask = mask.bool()
    loss = torch.where(mask, per_token_loss, 0.0)
    if mode == "token_mean":
        return loss.sum() / _denominator(global_tokens)
    if mode == "sequence_mean":
        # Per-sequence token mean; an empty sequence contributes 0 (and is not in global_seqs).
        n_seq = mask.sum(dim=-1).clamp(min=1).to(loss.dtype)
        return (loss.sum(dim=-1) / n_seq).sum() / _denominator(global_seqs)
    if mode == "seq_mean_token_sum_norm":
        # global_seqs here is S_all, ALL sampled sequences of the step (see the module docstring).
        if max_tokens is None or max_tokens <= 0:
            raise ValueError("seq_mean_token_sum_norm needs max_tokens > 0 (e.g. max generation length)")
        # Dr.GRPO: a constant normaliser, so long and short sequences weigh tokens equally.
        return loss.sum() / (_denominator(global_seqs) * max_tokens)
    raise ValueError(f"unknown loss reduction {mode!r}; expected one of {LOSS_REDUCTIONS}")


def _denominator(x: int | Tensor) -> Tensor | float:
    """max(x, 1): a step without loss tokens reduces to 0, not NaN. Tensors stay on device."""
    return x.clamp(min=1) if isinstance(x, Tensor) else float(max(x, 1))


def token_mean(per_token: Tensor, mask: Tensor, global_tokens: int | Tensor) -> Tensor:
    """A regulariser's share of the step's token mean: sum over ``mask`` / the step-global N."""
    return reduce_loss(per_token, mask, "token_mean", global_tokens, 0)


def entropy_bonus(entropy: Tensor, mask: Tensor, coef: float, global_tokens: int | Tensor) -> Tensor:
    """Scalar loss term ``-coef * token_mean(entropy)`` to *add* to the reduced policy loss.

    A token mean over the step's N loss tokens whatever the policy reduction, so it sums correctly
    over micro-batches and ranks and its strength does not depend on the policy normaliser.
    """
    return -coef * token_mean(entropy, mask, global_tokens)


def deepspeed_loss_scale(gradient_accumulation_steps: int, world_size: int) -> float:
    """Factor to multiply a globally-reduced micro-batch loss by before ``engine.backward``.

    DeepSpeed divides by GAS in backward and averages gradients over the ``world_size``
    data-parallel ranks; multiplying by GAS * world_size makes the step gradient the gradient of
    the sum of micro-batch losses, i.e. of the full-batch loss.
    """
    if gradient_accumulation_steps < 1 or world_size < 1:
        raise ValueError("gradient_accumulation_steps and world_size must be >= 1")
    return float(gradient_accumulation_steps * world_size)


class MetricAccumulator:
    """Aggregates policy_loss metric dicts over micro-batches (and, via merge, over ranks).

    Keys not in :data:`METRIC_AGGREGATION` (e.g. a learner's own ``loss``) are averaged
    uniformly over the dicts that contain them. Values may be floats or 0-d tensors; tensors are
    summed on device and only converted to floats in :meth:`compute` (one sync per step).
    """

    def __init__(self) -> None:
        self._sum: dict[str, Tensor | float] = {}  # mean keys: sum of value*weight; sums
        self._weight: dict[str, Tensor | float] = {}  # mean keys: total weight
        self._max: dict[str, Tensor | float] = {}

    def update(self, metrics: Mapping[str, Tensor | float]) -> None:
        for key, value in metrics.items():
            value = value.detach() if isinstance(value, Tensor) else float(value)
            rule = METRIC_AGGREGATION.get(key)
            if rule == "ess":
                continue  # recomputed from is_weight_mean / is_weight_sq_mean
            if rule == "max":
                old = self._max.get(key)
                self._max[key] = value if old is None else _maximum(old, value)
            elif rule == "sum":
                self._sum[key] = self._sum.get(key, 0.0) + value
            else:
                weight = metrics.get(rule[1], 1.0) if isinstance(rule, tuple) else 1.0
                weight = weight.detach() if isinstance(weight, Tensor) else float(weight)
                self._sum[key] = self._sum.get(key, 0.0) + value * weight
                self._weight[key] = self._weight.get(key, 0.0) + weight

    def state(self) -> dict[str, dict[str, float]]:
        """Plain-float sufficient statistics, picklable, for gathering across ranks."""
        return {
            name: {k: float(v) for k, v in d.items()}
            for name, d in (("sum", self._sum), ("weight", self._weight), ("max", self._max))
        }

    def merge(self, state: Mapping[str, Mapping[str, float]]) -> None:
        """Fold another accumulator's :meth:`state` (e.g. another rank's) into this one."""
        for k, v in state["sum"].items():
            self._sum[k] = self._sum.get(k, 0.0) + v
        for k, v in state["weight"].items():
            self._weight[k] = self._weight.get(k, 0.0) + v
        for k, v in state["max"].items():
            self._max[k] = v if k not in self._max else _maximum(self._max[k], v)

    def compute(self) -> dict[str, float]:
        st = self.state()
        out: dict[str, float] = dict(st["max"])
        for k, s in st["sum"].items():
            if k in st["weight"]:
                w = st["weight"][k]
                out[k] = s / w if w > 0 else 0.0
            else:
                out[k] = s
        if "is_weight_mean" in out and "is_weight_sq_mean" in out:
            m, m2 = out["is_weight_mean"], out["is_weight_sq_mean"]
            # 0 when every loss token's weight is 0 (icepop masked them all: nothing effective);
            # NaN without loss tokens (not measured: an adaptive bound must not read it as 0).
            out["ess"] = m * m / m2 if m2 > 0 else (0.0 if out.get("num_tokens", 0.0) > 0 else math.nan)
        return out


def _maximum(a: Tensor | float, b: Tensor | float) -> Tensor | float:
    if isinstance(a, Tensor) and isinstance(b, Tensor):
        return torch.maximum(a, b.to(a.device))
    if isinstance(a, Tensor) or isinstance(b, Tensor):
        return max(float(a), float(b))
    return max(a, b)


def aggregate_metrics(metric_dicts: Iterable[Mapping[str, Tensor | float]]) -> dict[str, float]:
    """Aggregate per-micro-batch metric dicts (from any number of micro-batches and ranks)."""
    acc = MetricAccumulator()
    for m in metric_dicts:
        acc.update(m)
    return acc.compute()
