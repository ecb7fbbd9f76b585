"""Validating a group against the run before the learner trains on it (pure, no torch).

The wire codec (asyncrl.buffer.records) already guarantees a record is well formed: aligned
arrays, finite rewards, finite logprobs <= 0, non-decreasing versions, bounded sizes. What it cannot
know is the run: a record can decode and still break a step (an embedding lookup past the vocabulary,
a sequence longer than the model's positions, a group of the wrong size for GRPO advantages, a zero
temperature dividing the logits) or be impossible (a token sampled by a version the learner has not
published yet). :func:`check_group` names such a record's first problem; the learner dead-letters
it with that reason and credits its admission slot back (asyncrl.learner.feed), so a bad producer
costs one group, never the learner.

The checks that repeat the codec's (lengths, finiteness) are cheap and kept on purpose: records
can also reach the learner from a buffer written by an older or foreign producer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from asyncrl.buffer.records import LOGPROB_MIN, REWARD_ABS_MAX

__all__ = ["RunSpec", "check_group"]


@dataclass(frozen=True)
class RunSpec:
    """What a trainable group must fit: the model's vocabulary and context, the run's group size."""

    vocab_size: int
    max_model_len: int
    group_size: int

    @classmethod
    def from_config(cls, cfg: Any, vocab_size: int) -> RunSpec:
        return cls(int(vocab_size), int(cfg.model.max_model_len), int(cfg.actors.group_size))


def _out_of_vocab(ids: np.ndarray, vocab_size: int) -> str | None:
    if ids.size and int(ids.max()) >= vocab_size:
        i = int(np.flatnonzero(ids >= vocab_size)[0])
        return f"token id {int(ids[i])} at {i} is outside the vocabulary (vocab_size={vocab_size})"
    return None


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


#: vLLM's own greedy threshold (vllm.sampling_params._SAMPLING_EPS): a lower temperature samples greedily.
MIN_TEMPERATURE = 1e-5

#: meta keys the learner orders a batch by; absent is fine (sorted first, as -1).
ORDER_KEYS = ("actor_index", "prompt_seq")


def _check_meta(meta: dict[str, Any]) -> str | None:
    if "temperature" in meta:
        t = _number(meta["temperature"])
        if t is None or not math.isfinite(t) or t < MIN_TEMPERATURE:
            # Below vLLM's 1e-5 the engine samples greedily, so mu is not the tempered distribution, and
            # fp32 logits divided by a subnormal temperature overflow to inf (NaN log-softmax).
            return (
                f"meta['temperature']: {meta['temperature']!r} (the learner divides logits by it: must be "
                f">= {MIN_TEMPERATURE:g})"
            )
    if "top_p" in meta:
        p = _number(meta["top_p"])
        if p is None or not 0 < p <= 1:
            return f"meta['top_p']: {meta['top_p']!r} (must be in (0, 1])"
    # The batch is sorted by these (asyncrl.learner.feed.batch_order_key, which relies on this check):
    # anything but an integer would raise there, after delivery and before the acknowledgement, and
    # crash-loop the learner until max_deliveries quarantined the whole batch without the reason.
    for key in ORDER_KEYS:
        if key in meta:
            v = meta[key]
            if isinstance(v, bool) or not isinstance(v, int):
                return f"meta[{key!r}]: {v!r} (orders the step's batch: must be an integer)"
    return None


def check_group(group: Any, spec: RunSpec, version: int) -> str | None:
    """None if ``group`` can be trained at learner version ``version``, else the reason (it starts
    with the offending field, like the codec's errors)."""
    n = len(group.completions)
    if n != spec.group_size:
        return f"completions: {n} completions, the run's group size (actors.group_size) is {spec.group_size}"
    prompt = group.prompt_token_ids
    if prompt.size == 0:
        return "prompt_token_ids: empty prompt"
    bad = _out_of_vocab(prompt, spec.vocab_size)
    if bad:
        return f"prompt_token_ids: {bad}"
    for i, c in enumerate(group.completions):
        name = f"completions[{i}]"
        t = c.num_tokens
        if c.logprobs.shape[0] != t or c.versions.shape[0] != t:
            return f"{name}: {t} tokens but {c.logprobs.shape[0]} logprobs and {c.versions.shape[0]} versions"
        total = prompt.size + t
        if total > spec.max_model_len:
            return f"{name}: prompt + completion = {total} tokens > model.max_model_len={spec.max_model_len}"
        bad = _out_of_vocab(c.token_ids, spec.vocab_size)
        if bad:
            return f"{name}.token_ids: {bad}"
        if t and not np.isfinite(c.logprobs).all():
            return f"{name}.logprobs: non-finite value"
        if t and float(c.logprobs.min()) < LOGPROB_MIN:
            return f"{name}.logprobs: {float(c.logprobs.min()):g} is below {LOGPROB_MIN:g} (a sentinel, not a logprob)"
        r = _number(c.reward)
        if r is None or not math.isfinite(r):
            return f"{name}.reward: {c.reward!r} is not a finite number"
        if abs(r) > REWARD_ABS_MAX:
            return f"{name}.reward: {r:g} is beyond +-{REWARD_ABS_MAX:g} (overflows the fp32 step)"
        if t and int(c.versions.max()) > version:
            return (
                f"{name}.versions: token sampled by v{int(c.versions.max())}, newer than the learner's "
                f"current version v{version}"
            )
    return _check_meta(group.meta)
