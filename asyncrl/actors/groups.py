"""Turning what the engine sampled into a wire :class:`~asyncrl.buffer.Group` (pure)."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence

import numpy as np

from asyncrl.buffer import Completion, Group
from asyncrl.tasks import Prompt

from .engine import SampledCompletion

__all__ = ["build_group"]


def version_span(seqs: Sequence[SampledCompletion], v_start: int, v_end: int) -> tuple[int, int]:
    """(first, last) policy version a group's tokens were sampled with: from the tokens' own versions,
    else (no tokens) the engine's versions read around the group, ``v_start`` and ``v_end``.

    Why not the engine's versions alone: ``v_start`` is read before the group reaches the engine, and
    a swap that lands in between (a between-groups drain, a swap the admission waited for) serves the
    whole group with the newer weights; the meta then named a version no token had."""
    sampled = [s.versions for s in seqs if s.versions]
    if not sampled:
        return v_start, v_end
    return min(min(v) for v in sampled), max(max(v) for v in sampled)


def swaps_seen(seqs: Sequence[SampledCompletion]) -> int:
    """How many weight swaps landed while a group's tokens were being sampled: its distinct token
    versions less one (0 without tokens). Counting the actor's swaps between the engine read before
    the request and the end also counted a swap that landed before the group reached the engine (its
    tokens then all carry the newer version) and one after its last token."""
    seen: set[int] = set()
    for s in seqs:
        seen.update(s.versions)
    return max(len(seen) - 1, 0)


def build_group(
    group_id: str,
    rewards: Sequence[float],
    prompt: Prompt,
    prompt_ids: Sequence[int],
    seqs: Sequence[SampledCompletion],
    actor_id: str,
    meta: Mapping[str, str | int | float | bool],
) -> Group:
    """A group of ``seqs`` with ``rewards[i]`` the score of ``seqs[i]`` (``Task.score`` of its text).

    The token arrays are copied as they came from the engine: ``logprobs`` are the behaviour
    logprobs mu_t (fp32) and ``versions`` the exact per-token policy versions.
    """
    completions = [
        Completion(
            token_ids=np.asarray(s.token_ids, dtype=np.uint32),
            logprobs=np.asarray(s.logprobs, dtype=np.float32),
            versions=np.asarray(s.versions, dtype=np.uint32),
            reward=float(r),
            finish_reason=s.finish_reason,
        )
        for s, r in zip(seqs, rewards, strict=True)
    ]
    return Group(
        group_id,
        prompt.prompt_id,
        np.asarray(list(prompt_ids), dtype=np.uint32),
        completions,
        actor_id=actor_id,
        created_at=time.time(),
        meta=dict(meta),
    )
