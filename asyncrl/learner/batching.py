"""Turning groups into padded micro-batches: flatten, split, shard over ranks, pack, collate, pad.

Pure data layout (numpy + torch, no model, no DeepSpeed, no distributed calls), so every rank can
compute the *same* plan from the same groups without talking to the others.

Layout of a micro-batch (``dict[str, Tensor]``, one row per completion, right-padded):

    input_ids       [B, L] int64   prompt + completion tokens (pad id after the end)
    attention_mask  [B, L] int64   1 on real tokens
    loss_mask       [B, L] bool    True on completion tokens that carry loss (position of the token)
    logp_behav      [B, L] fp32    behaviour logprob mu_t at the token's position (0 elsewhere)
    token_versions  [B, L] int64   policy version v_t of the token (0 elsewhere)
    advantages      [B]    fp32    the completion's group advantage
    temperature     [B]    fp32    sampling temperature the actor used for the completion

Every per-token field is aligned with the *token's own position* j; its logprob comes from the
logits at j - 1 (see :mod:`asyncrl.learner.logprobs`). Position 0 is a prompt token, never in the loss.

Data parallelism: ranks must run the same number of micro-batches (collectives in backward and
ZeRO-3 forward). :func:`plan_mini_batch` returns per-rank micro-batch lists padded with ``[]``
entries; such an entry is run as :func:`padding_like` of a real micro-batch: a copy of EVERY key of
a real, fully prepared micro-batch (so no loss input is missing or invalid, e.g. no zero
temperature) with the loss mask all False. Its loss and gradient are then exactly zero.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

__all__ = [
    "LOSS_MASK",
    "Sample",
    "build_samples",
    "split_mini_batches",
    "assign_ranks",
    "pack_micro_batches",
    "plan_mini_batch",
    "collate",
    "padding_like",
    "micro_batch_tokens",
]

#: The key of the loss mask; the only key :func:`padding_like` changes.
LOSS_MASK = "loss_mask"


@dataclass
class Sample:
    """One completion as a training sequence (prompt + completion)."""

    group_index: int
    completion_index: int
    input_ids: np.ndarray  # int64 [prompt_len + n]
    prompt_len: int
    logp_behav: np.ndarray  # float32 [n]
    versions: np.ndarray  # int64 [n]
    loss_mask: np.ndarray  # bool [n]
    advantage: float
    temperature: float

    @property
    def length(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def loss_tokens(self) -> int:
        return int(self.loss_mask.sum())


def build_samples(
    groups: Sequence, advantages: Sequence[Sequence[float]], overlong_mask: bool, default_temperature: float
) -> tuple[list[Sample], int]:
    """Flatten groups into samples. Returns ``(samples, n_overlong_masked)``.

    ``advantages[g][i]`` is completion i of group g's advantage. Completions without tokens are
    skipped (they carry no loss; their reward still entered the group advantages). With
    ``overlong_mask`` a completion that ended by length keeps its tokens but loses its loss mask.
    """
    samples: list[Sample] = []
    overlong = 0
    for gi, g in enumerate(groups):
        temp = float(g.meta.get("temperature", default_temperature))
        if not temp > 0:
            raise ValueError(f"group {g.group_id}: meta temperature must be > 0, got {temp}")
        prompt = np.asarray(g.prompt_token_ids, dtype=np.int64)
        for ci, c in enumerate(g.completions):
            n = c.num_tokens
            if n == 0:
                continue
            mask = np.ones(n, dtype=bool)
            if overlong_mask and c.finish_reason == "length":
                mask[:] = False
                overlong += 1
            samples.append(
                Sample(
                    group_index=gi,
                    completion_index=ci,
                    input_ids=np.concatenate([prompt, np.asarray(c.token_ids, dtype=np.int64)]),
                    prompt_len=int(prompt.shape[0]),
                    logp_behav=np.asarray(c.logprobs, dtype=np.float32),
                    versions=np.asarray(c.versions, dtype=np.int64),
                    loss_mask=mask,
                    advantage=float(advantages[gi][ci]),
                    temperature=temp,
                )
            )
    return samples, overlong


def split_mini_batches(n: int, mini_batches: int) -> list[list[int]]:
    """Split sample indices ``0..n-1`` into ``mini_batches`` contiguous, near-equal, non-empty chunks.

    Fewer chunks are returned when there are fewer samples than requested mini-batches.
    """
    k = max(1, min(mini_batches, n))
    return [list(map(int, c)) for c in np.array_split(np.arange(n), k) if len(c)] if n else []


def assign_ranks(lengths: Sequence[int], indices: Sequence[int], world_size: int) -> list[list[int]]:
    """Longest-processing-time assignment of samples to ranks by token count (deterministic).

    Longest first, each to the currently least-loaded rank (lowest rank on ties).
    """
    order = sorted(indices, key=lambda i: (-lengths[i], i))
    loads = [0] * world_size
    out: list[list[int]] = [[] for _ in range(world_size)]
    for i in order:
        r = min(range(world_size), key=lambda k: (loads[k], k))
        out[r].append(i)
        loads[r] += lengths[i]
    return out


def pack_micro_batches(lengths: Sequence[int], indices: Sequence[int], budget: int) -> list[list[int]]:
    """First-fit-decreasing packing under a padded token budget: rows * longest row <= budget.

    Longest first, so a micro-batch's padded length is its first sample's length. A sample longer
    than the budget gets a micro-batch of its own (the budget is a target, not a hard limit).
    """
    order = sorted(indices, key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    for i in order:
        for b in bins:
            if (len(b) + 1) * lengths[b[0]] <= budget:
                b.append(i)
                break
        else:
            bins.append([i])
    return bins


def plan_mini_batch(
    lengths: Sequence[int], indices: Sequence[int], world_size: int, budget: int
) -> list[list[list[int]]]:
    """Per-rank micro-batches of one optimizer step, every rank padded to the same count.

    Returns ``plan[rank][k]`` = sample indices of rank's k-th micro-batch; ``[]`` marks a padding
    micro-batch. Every rank that computes this from the same inputs gets the same plan.
    """
    per_rank = [pack_micro_batches(lengths, ix, budget) for ix in assign_ranks(lengths, indices, world_size)]
    n = max((len(p) for p in per_rank), default=0)
    return [p + [[] for _ in range(n - len(p))] for p in per_rank]


def collate(samples: Sequence[Sample], indices: Sequence[int], pad_id: int) -> dict[str, Tensor]:
    """Right-padded tensors of the samples ``indices`` (layout in the module docstring)."""
    if not indices:
        raise ValueError("collate needs at least one sample (padding micro-batches use padding_like)")
    rows = [samples[i] for i in indices]
    b, length = len(rows), max(s.length for s in rows)
    # Filled in numpy and wrapped once per field (torch.from_numpy shares the buffer): a numpy slice
    # assignment costs ~1 us where a torch one costs ~10 (5 per row), and this runs every step.
    input_ids = np.full((b, length), pad_id, dtype=np.int64)
    attention = np.zeros((b, length), dtype=np.int64)
    loss_mask = np.zeros((b, length), dtype=bool)
    logp_behav = np.zeros((b, length), dtype=np.float32)
    versions = np.zeros((b, length), dtype=np.int64)
    for r, s in enumerate(rows):
        n, p = s.length, s.prompt_len
        input_ids[r, :n] = s.input_ids
        attention[r, :n] = 1
        loss_mask[r, p:n] = s.loss_mask
        logp_behav[r, p:n] = s.logp_behav
        versions[r, p:n] = s.versions
    if loss_mask[:, 0].any():
        raise ValueError("a completion token at position 0 has no logits to predict it (empty prompt?)")
    return {
        "input_ids": torch.from_numpy(input_ids),
        "attention_mask": torch.from_numpy(attention),
        LOSS_MASK: torch.from_numpy(loss_mask),
        "logp_behav": torch.from_numpy(logp_behav),
        "token_versions": torch.from_numpy(versions),
        "advantages": torch.tensor([s.advantage for s in rows], dtype=torch.float32),
        "temperature": torch.tensor([s.temperature for s in rows], dtype=torch.float32),
    }


def padding_like(mb: dict[str, Tensor]) -> dict[str, Tensor]:
    """A padding micro-batch: a copy of every key of the real micro-batch ``mb``, loss mask all False.

    Built from ``mb``'s own keys (never a hand-written list), after every per-token field the loss
    reads (prox/ref logprobs, ...) has been attached to ``mb``, so nothing the loss needs is absent;
    the copied values are real data, so the forward stays finite and the masked loss and its
    gradient are exactly 0.
    """
    out = {k: v.clone() for k, v in mb.items()}
    out[LOSS_MASK] = torch.zeros_like(mb[LOSS_MASK])
    return out


def micro_batch_tokens(indices: Sequence[int], lengths: Sequence[int]) -> int:
    """Padded token cost of a micro-batch (rows * longest row)."""
    return len(indices) * max((lengths[i] for i in indices), default=0)
