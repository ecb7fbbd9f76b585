"""One learner step on a list of groups: advantages, plan, proximal/reference logprobs, updates.

Every rank calls :meth:`Trainer.train` with the SAME groups (the loop broadcasts them) and derives
the same plan locally; ranks only talk inside DeepSpeed (gradient reduction), in the non-finite
veto all-reduce and in one all-gather of the step metrics.

Order inside a step (V = the version at step start):

1. GRPO advantages per group; flatten to samples (overlong completions lose their loss mask).
2. Split into ``mini_batches`` chunks; per chunk, the global loss denominators (tokens / sequences
   in the loss over ALL ranks, known locally because every rank has all samples) and the per-rank
   micro-batch plan (token budget; ranks padded to the same micro-batch count).
3. Before any update: collate this rank's micro-batches and attach the step-start no-grad
   logprobs (``logp_prox`` when ``exact_prox``, ``logp_ref`` with a reference model).
4. ``epochs`` x ``mini_batches`` optimizer steps; each accumulates over its micro-batches with the
   global-denominator reduction and ends in :meth:`LearnerEngine.optimizer_step`. A mini-batch
   without loss tokens runs no forward and no optimizer step (weights and Adam moments unchanged).

The proximal policy pi_prox (the step-start policy, see asyncrl.learner.objectives.importance) of
a mini-batch after u optimizer updates of this step were applied (an empty mini-batch or a vetoed
update moves nothing and is not counted): u = 0 uses the detached current logprob (it IS the
step-start logprob, exact and free); ``exact_prox`` uses the no-grad recompute of step 3 for every
u; otherwise u > 0 uses A-3PO with prox_offset = since_publish / publish_every and progress =
u / (mini_batches * epochs * publish_every) (versions are publications; with publish_every > 1 the
step-start weights are since_publish steps past the weights published as V). The drift split
(engine mismatch at s = 0, staleness at s >= 1) is measured on step-start logprobs only: the
mini-batches before the first applied update, or every mini-batch with exact_prox, in the first
epoch; the s = 0 bucket counts as engine mismatch only when since_publish = 0 (otherwise the
learner's weights are not those V names).

Entropy: a full-vocabulary pass per token (one more [B, L, vocab] tensor). It is computed only when a
term uses it (``learner.loss.entropy_coef > 0``) or ``learner.entropy_metric`` asks for the metric;
otherwise the step's ``entropy`` metric is NaN (not measured; never 0, which would read as a collapse).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor

from asyncrl.learner.batching import (
    LOSS_MASK,
    Sample,
    build_samples,
    collate,
    micro_batch_tokens,
    padding_like,
    plan_mini_batch,
    split_mini_batches,
)
from asyncrl.learner.engine import LearnerEngine
from asyncrl.learner.logprobs import ReferenceModel, token_logprobs
from asyncrl.learner.objectives import (
    MetricAccumulator,
    ObjectiveConfig,
    deepspeed_loss_scale,
    drift_sums,
    entropy_bonus,
    group_advantages,
    kl_penalty,
    objective_terms,
    reduce_loss,
    token_mean,
)

__all__ = ["Trainer", "StepResult", "objective_config", "MicroBatchResult", "advantage_lists", "loss_tokens"]


#: Micro-batch key of the token versions under the loss mask, a CPU tensor kept on the host (see
#: Trainer.prepare): padding micro-batches copy it like every key; their buckets then count no token.
VERSIONS_PRESENT = "token_versions_present"


def objective_config(cfg: Any) -> ObjectiveConfig:
    """The objectives' config from ``learner.loss`` (+ the staleness bound from ``buffer``)."""
    return ObjectiveConfig.from_loss_config(cfg.learner.loss, cfg.buffer.max_staleness)


def advantage_lists(rewards: list[list[float]], normalize_std: bool) -> list[list[float]]:
    """GRPO advantages of each group's rewards (float64, :func:`group_advantages` per group).

    Equal group sizes (the usual case) take one ``[n_groups, G]`` call, row for row the same math
    as one call per group; ragged groups fall back to one call each.
    """
    # float64: rewards are float64 numbers (bounded by the record contract, +-1e9); in fp32 the
    # group's mean and std lose the small differences between large rewards.
    if rewards and len({len(r) for r in rewards}) == 1:
        return group_advantages(torch.tensor(rewards, dtype=torch.float64), normalize_std).tolist()
    return [group_advantages(torch.tensor(r, dtype=torch.float64), normalize_std).tolist() for r in rewards]


def loss_tokens(
    samples: Sequence[Sample], version: int, max_staleness: int
) -> tuple[list[int], dict[str, int]]:
    """Loss tokens per sample and the step's staleness histogram ``{str(s): count}`` (sorted s).

    The loss mask is the final one (overlong + staleness), as the objectives will apply it; one pass
    over the step's concatenated tokens (every sample has >= 1 token: build_samples skips empty
    completions) instead of a few numpy calls per sample.
    """
    if not samples:
        return [], {}
    stale = version - np.concatenate([s.versions for s in samples])
    mask = np.concatenate([s.loss_mask for s in samples]) & (stale <= max_staleness)
    starts = np.cumsum([0] + [s.versions.shape[0] for s in samples[:-1]])
    per_sample = np.add.reduceat(mask, starts, dtype=np.int64).tolist()
    vals, counts = np.unique(stale[mask], return_counts=True)
    return per_sample, {str(v): c for v, c in zip(vals.tolist(), counts.tolist(), strict=True)}


@dataclass
class Denominators:
    """Step-global denominators of one optimizer step (identical on every rank)."""

    tokens: int  # N: loss tokens (policy token_mean, and every regulariser)
    seqs: int  # S: sequences with >= 1 loss token (sequence_mean)
    samples: int  # S_all: sampled sequences, masked or not (Dr.GRPO's constant normaliser)


@dataclass
class ProxPlan:
    """Where pi_prox comes from for one optimizer update (see the module docstring)."""

    source: str  # "current" (detached logp, update 0) | "exact" (recomputed) | "loglinear" (A-3PO)
    prox_offset: float = 0.0
    progress: float = 1.0
    measure: bool = False  # step-start logprobs available and not yet measured: drift metrics


def prox_plan(applied: int, epoch: int, mini_batches: int, epochs: int, exact: bool, since_publish: int,
              publish_every: int) -> ProxPlan:  # fmt: skip
    """pi_prox source of a mini-batch in epoch ``epoch`` after ``applied`` optimizer updates of this
    step took effect (pure; tested in unit tests). Counted by updates applied, not by position: a
    mini-batch without loss tokens and a vetoed (non-finite) update move nothing, so the mini-batch
    after them still sees the step-start weights and its exact pi_prox is free."""
    # Step-start logprobs exist while nothing moved (or always, recomputed, with exact_prox); each
    # mini-batch's samples are measured once, in the first epoch.
    measure = epoch == 0 and (applied == 0 or exact)
    if exact:
        return ProxPlan("exact", measure=measure)
    if applied == 0:
        return ProxPlan("current", measure=measure)
    return ProxPlan(
        "loglinear",
        prox_offset=since_publish / publish_every,
        progress=applied / (mini_batches * epochs * publish_every),
        measure=measure,
    )


@dataclass
class MicroBatchResult:
    """What one micro-batch forward/backward produced (all detached)."""

    loss: Tensor  # the reduced loss as back-propagated, before the DeepSpeed scale
    terms: dict[str, Tensor]  # loss_policy, loss_rollout_kl, loss_entropy, loss_ref_kl
    metrics: dict[str, Tensor]  # policy_loss metrics
    sums: dict[str, Tensor]  # entropy_sum, ref_kl_sum, drift_kl_sum/<s>, drift_n/<s>, log_ppl_gap_sum

    def to_host(self) -> tuple[float, dict[str, float], dict[str, float], dict[str, float]]:
        """``(loss, metrics, terms, sums)`` as Python floats, in ONE device-to-host transfer.

        Every value is a 0-d tensor; stacking them (dtype promotion is exact: fp32 -> fp64) and one
        ``tolist`` replaces ~40 ``.item()`` syncs (and the accumulator's per-key tensor arithmetic)
        per micro-batch; the floats are exactly what ``float(v)`` of each tensor gives.
        """
        parts = (self.metrics, self.terms, self.sums)
        vals = torch.stack([self.loss.reshape(()), *(v.reshape(()) for d in parts for v in d.values())])
        flat = vals.tolist()
        out, i = [], 1
        for d in parts:
            out.append(dict(zip(d, flat[i : i + len(d)], strict=True)))
            i += len(d)
        return flat[0], out[0], out[1], out[2]


@dataclass
class StepResult:
    """Aggregated over every micro-batch, optimizer step and rank of one learner step."""

    metrics: dict[str, float] = field(default_factory=dict)
    optimizer_steps: int = 0
    skipped: int = 0
    empty_skipped: int = 0  # mini-batches without loss tokens: no forward, no optimizer call
    micro_batches: int = 0
    padding_micro_batches: int = 0  # summed over ranks and epochs
    sequences: int = 0
    tokens: int = 0
    overlong_masked: int = 0
    staleness_hist: dict[str, int] = field(default_factory=dict)
    drift_kl: dict[str, float] = field(default_factory=dict)  # staleness -> KL(mu || pi_prox), k3
    grad_norms: list[float] = field(default_factory=list)


class Trainer:
    """Runs learner steps on a :class:`LearnerEngine` (see the module docstring)."""

    def __init__(self, cfg: Any, le: LearnerEngine, ref: ReferenceModel | None, pad_id: int) -> None:
        self.cfg = cfg
        self.le = le
        self.ref = ref
        self.pad_id = pad_id
        self.ocfg = objective_config(cfg)
        # Micro-batches are built on the CPU and moved to the engine's device (a no-op on CPU).
        self.device = torch.device(getattr(le.engine, "device", "cpu"))
        self.applied_steps = 0  # optimizer updates applied so far (drives the LR warm-up)
        lc = cfg.learner.loss
        if lc.ref_kl_coef > 0 and ref is None:
            raise ValueError("learner.loss.ref_kl_coef > 0 needs a ReferenceModel")
        if ref is not None and ref.dtype != le.dtype:
            raise ValueError(f"reference dtype {ref.dtype} != policy dtype {le.dtype} (precision path)")

    # ------------------------------------------------------------------ data

    def samples(self, groups: Sequence) -> tuple[list[Sample], int]:
        """Advantages (per group, GRPO / Dr.GRPO) and the flattened samples."""
        rewards = [[float(c.reward) for c in g.completions] for g in groups]
        advs = advantage_lists(rewards, self.cfg.learner.loss.normalize_adv_std)
        return build_samples(groups, advs, self.cfg.learner.overlong_mask, self.cfg.actors.temperature)

    # ------------------------------------------------------------------ micro-batches

    @torch.no_grad()
    def prepare(self, mb: dict[str, Tensor]) -> dict[str, Tensor]:
        """Move ``mb`` to the device and attach the step-start no-grad logprobs the loss reads.

        Call before any update of the step (the logprobs must come from the step-start weights).
        """
        # The token versions under the loss mask, read here on the host: the drift sums need them and
        # would otherwise sync with the device to find them (a CPU tensor, never moved).
        present = torch.unique(mb["token_versions"][mb[LOSS_MASK]]) if VERSIONS_PRESENT not in mb else None
        mb = {k: v if k == VERSIONS_PRESENT else v.to(self.device) for k, v in mb.items()}
        if present is not None:
            mb[VERSIONS_PRESENT] = present
        if self.cfg.learner.exact_prox:
            mb["logp_prox"], _ = token_logprobs(self.le.engine, mb, entropy=False)
        if self.ref is not None:
            mb["logp_ref"] = self.ref.logprobs(mb)
        return mb

    def micro_batch(
        self, mb: dict[str, Tensor], version: int, dens: Denominators, plan: ProxPlan
    ) -> MicroBatchResult:
        """Forward + backward of one micro-batch with step-global denominators."""
        lc = self.cfg.learner.loss
        mode, max_tokens = lc.reduction, self.cfg.actors.max_tokens
        want_entropy = lc.entropy_coef > 0 or self.cfg.learner.entropy_metric
        logp, ent = token_logprobs(self.le.engine, mb, entropy=want_entropy, entropy_grad=lc.entropy_coef > 0)
        start = {"current": logp.detach(), "exact": mb.get("logp_prox")}.get(plan.source)
        # policy_loss + rollout_kl_loss in one pass (shared intermediates; the same values).
        obj = objective_terms(
            logp, mb["logp_behav"], mb["advantages"], mb[LOSS_MASK], mb["token_versions"], version,
            self.ocfg, logp_prox=start, prox_offset=plan.prox_offset, progress=plan.progress,
        )  # fmt: skip
        loss_mask, metrics = obj.loss_mask, obj.metrics
        seqs = {"sequence_mean": dens.seqs, "seq_mean_token_sum_norm": dens.samples}.get(mode, dens.seqs)
        policy = reduce_loss(obj.policy, loss_mask, mode, dens.tokens, seqs, max_tokens)
        # Regularisers: token means over ALL loss tokens of the optimizer step, whatever `mode`.
        kl_term = token_mean(obj.rollout_kl, loss_mask, dens.tokens)
        terms = {"loss_policy": policy.detach(), "loss_rollout_kl": kl_term.detach()}
        loss = policy + kl_term
        sums: dict[str, Tensor] = {}
        if self.ref is not None:
            ref_kl = kl_penalty(logp, mb["logp_ref"], lc.ref_kl_kind, loss_mask)
            ref_term = lc.ref_kl_coef * token_mean(ref_kl, loss_mask, dens.tokens)
            terms["loss_ref_kl"] = ref_term.detach()
            sums["ref_kl_sum"] = torch.where(loss_mask, ref_kl.detach(), 0.0).sum()
            loss = loss + ref_term
        if lc.entropy_coef > 0:
            assert ent is not None
            ent_term = entropy_bonus(ent, loss_mask, lc.entropy_coef, dens.tokens)
            terms["loss_entropy"] = ent_term.detach()
            loss = loss + ent_term
        self.le.engine.backward(loss * deepspeed_loss_scale(1, self.le.world_size), scale_wrt_gas=False)
        with torch.no_grad():
            if ent is not None:
                sums["entropy_sum"] = torch.where(loss_mask, ent.detach(), 0.0).sum()
            if plan.measure and start is not None:
                # At update 0 the step-start logprob IS logp: the objective's log-ratio to mu is d.
                d = obj.log_ratio_behav if plan.source == "current" else None
                present = mb[VERSIONS_PRESENT].tolist() if VERSIONS_PRESENT in mb else None
                sums.update(drift_sums(start, mb["logp_behav"], loss_mask, mb["token_versions"], version, d,
                                       versions_present=present))  # fmt: skip
        return MicroBatchResult(loss.detach(), terms, metrics, sums)

    # ------------------------------------------------------------------ the step

    def lr_now(self) -> float:
        lc = self.cfg.learner
        if lc.warmup_steps <= 0:
            return lc.lr
        return lc.lr * min(1.0, (self.applied_steps + 1) / lc.warmup_steps)

    def train(self, groups: Sequence, version: int, since_publish: int = 0) -> StepResult:
        """One learner step on ``groups`` at version ``version`` (identical call on every rank).

        ``since_publish``: learner steps taken since the weights were last published (0 when every
        step publishes); it places the step-start weights on the version axis (module docstring).
        """
        le, lc = self.le, self.cfg.learner
        samples, overlong = self.samples(groups)
        res = StepResult(overlong_masked=overlong, sequences=len(samples))
        lengths = [s.length for s in samples]
        n_loss, res.staleness_hist = loss_tokens(samples, version, self.cfg.buffer.max_staleness)
        res.tokens = sum(n_loss)

        # Plans, denominators and step-start logprobs for every mini-batch, before any update.
        minis = []
        for idx in split_mini_batches(len(samples), lc.mini_batches):
            plan = plan_mini_batch(lengths, idx, le.world_size, lc.micro_batch_tokens)
            n_tok = sum(n_loss[i] for i in idx)
            n_seq = sum(1 for i in idx if n_loss[i])
            mbs: list[dict[str, Tensor] | None] = [
                self.prepare(collate(samples, ix, self.pad_id)) if ix else None for ix in plan[le.rank]
            ]
            if any(m is None for m in mbs):
                # Template = the cheapest real micro-batch of the step (any rank's: all have the data).
                real = [ix for rank_plan in plan for ix in rank_plan if ix]
                tmpl = min(real, key=lambda ix: (micro_batch_tokens(ix, lengths), ix))
                # One prepare() per padding slot, like a real micro-batch: under ZeRO-3 the exact-prox
                # forward is a collective, so every rank must run the same number of them.
                mbs = [m if m is not None else padding_like(self.prepare(collate(samples, tmpl, self.pad_id)))
                       for m in mbs]  # fmt: skip
                res.padding_micro_batches += sum(1 for ix in plan[le.rank] if not ix)
            minis.append((mbs, Denominators(n_tok, n_seq, len(idx))))

        acc = MetricAccumulator()
        terms: dict[str, float] = {}
        sums: dict[str, float] = {}
        for epoch in range(lc.epochs):
            for mbs, dens in minis:
                if dens.tokens == 0 or not mbs:
                    # Nothing carries loss (e.g. all overlong-masked): an optimizer call would still move
                    # the weights (momentum, weight decay) and the Adam moments. Every rank agrees (global N).
                    res.empty_skipped += 1
                    continue
                plan = prox_plan(
                    res.optimizer_steps, epoch, len(minis), lc.epochs, lc.exact_prox, since_publish,
                    lc.publish_every,
                )  # fmt: skip
                nonfinite = False
                # The results stay on the device until the mini-batch's last backward: no host sync
                # inside the loop, so a GPU learner's host queues micro-batch k+1 while the device
                # runs k. The values, and the order they are accumulated in, are unchanged.
                pending = []
                for k, mb in enumerate(mbs):
                    le.engine.set_gradient_accumulation_boundary(k == len(mbs) - 1)
                    pending.append(self.micro_batch(mb, version, dens, plan))
                for r in pending:
                    loss, metrics, mb_terms, mb_sums = r.to_host()
                    nonfinite |= not math.isfinite(loss)
                    acc.update(metrics)
                    for key, v in mb_terms.items():
                        terms[key] = terms.get(key, 0.0) + v
                    for key, v in mb_sums.items():
                        sums[key] = sums.get(key, 0.0) + v
                res.micro_batches += len(mbs)
                le.set_lr(self.lr_now())
                outcome = le.optimizer_step(nonfinite)
                res.grad_norms.append(outcome.grad_norm)
                if outcome.applied:
                    res.optimizer_steps += 1
                    self.applied_steps += 1
                else:
                    res.skipped += 1
        # Padding micro-batches are reported summed over ranks (rank 0 alone often has none).
        sums["padding_micro_batches"] = float(res.padding_micro_batches * lc.epochs)
        res.metrics = self._aggregate(acc, terms, sums, max(1, lc.epochs * len(minis) - res.empty_skipped))
        res.padding_micro_batches = int(res.metrics["padding_micro_batches"])
        res.drift_kl = _drift_split(res.metrics, since_publish)
        res.metrics["empty_mini_batches"] = float(res.empty_skipped)
        return res

    def _aggregate(
        self, acc: MetricAccumulator, terms: dict[str, float], sums: dict[str, float], n_opt: int
    ) -> dict[str, float]:
        """Merge this rank's statistics with every other rank's (one all_gather_object)."""
        mine = {"acc": acc.state(), "terms": terms, "sums": sums}
        if self.le.world_size > 1:
            parts: list[Any] = [None] * self.le.world_size
            dist.all_gather_object(parts, mine)
        else:
            parts = [mine]
        total = MetricAccumulator()
        t_all: dict[str, float] = {}
        s_all: dict[str, float] = {}
        for p in parts:
            total.merge(p["acc"])
            for k, v in p["terms"].items():
                t_all[k] = t_all.get(k, 0.0) + v
            for k, v in p["sums"].items():
                s_all[k] = s_all.get(k, 0.0) + v
        out = total.compute()
        # Terms summed over micro-batches and ranks are full-batch values per optimizer step.
        for k in ("loss_policy", "loss_rollout_kl", "loss_entropy", "loss_ref_kl"):
            out[k] = t_all.get(k, 0.0) / n_opt
        out["loss"] = sum(out[k] for k in ("loss_policy", "loss_rollout_kl", "loss_entropy", "loss_ref_kl"))
        n = max(out.get("num_tokens", 0.0), 1.0)
        # Not computed (no term uses it and learner.entropy_metric is off): NaN = not measured.
        out["entropy"] = s_all["entropy_sum"] / n if "entropy_sum" in s_all else float("nan")
        out["ref_kl"] = s_all.get("ref_kl_sum", 0.0) / n
        out["padding_micro_batches"] = s_all.get("padding_micro_batches", 0.0)
        for k, v in s_all.items():  # drift sums: finished by _drift_split
            if k.startswith(("drift_", "log_ppl_gap")):
                out[k] = v
        return out


def _drift_split(m: dict[str, float], since_publish: int) -> dict[str, float]:
    """Turn the drift sums in ``m`` into metrics (in place); returns {staleness: KL(mu || pi_prox)}.

    mismatch_kl = the s = 0 bucket (engine vs learner at equal weights; only when since_publish = 0),
    staleness_kl = the s >= 1 buckets pooled, log_ppl_gap = train minus rollout log-perplexity over
    every measured token. All are the unbiased k3 estimate e^d - 1 - d of KL(mu || pi_prox).
    """
    by_s: dict[str, float] = {}
    counts: dict[str, float] = {}
    stale_sum = stale_n = 0.0
    for key in [k for k in m if k.startswith("drift_n/")]:
        s = key.split("/", 1)[1]
        n, total = m.pop(key), m.pop(f"drift_kl_sum/{s}", 0.0)
        if n == 0:  # a bucket of a version present in the batch but with no token under the loss mask
            continue
        counts[s] = n
        by_s[s] = total / max(n, 1.0)
        if int(s) > 0:
            stale_sum, stale_n = stale_sum + total, stale_n + n
    n_all = sum(counts.values())
    m["log_ppl_gap"] = m.pop("log_ppl_gap_sum", 0.0) / max(n_all, 1.0)
    m["drift_tokens"] = n_all
    m["staleness_kl"] = stale_sum / max(stale_n, 1.0)
    zero = since_publish == 0 and "0" in by_s
    m["mismatch_kl"] = by_s["0"] if zero else 0.0
    m["mismatch_tokens"] = counts["0"] if zero else 0.0
    return dict(sorted(by_s.items(), key=lambda kv: int(kv[0])))
