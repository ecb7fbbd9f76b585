"""Prompts, the task interface, and the deterministic sharded prompt source.

A task is a fixed, seed-determined list of :class:`Prompt` plus a pure reward function. The
:class:`PromptSource` decides which actor sees which prompt and in which order:

* epoch ``e`` visits every prompt exactly once, in a permutation drawn from ``(seed, e)``;
* actor ``i`` of ``n`` takes positions ``i, i + n, i + 2n, ...`` of that permutation, so the
  shards of one epoch are disjoint and together cover the prompt set;
* the position is a cursor ``(epoch, index)`` (``index`` counts within the actor's shard), so a
  restarted actor continues where it stopped instead of replaying the start of the data.

Invariant: this package imports neither torch, vllm nor ray.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field

__all__ = ["Prompt", "Task", "PromptSource", "TaskDataError"]


class TaskDataError(ValueError):
    """A task's data file is unusable; the message names the file and the line."""


@dataclass(frozen=True)
class Prompt:
    """One prompt of a task.

    ``target`` is what a perfect completion says (the reward compares against it); ``meta`` is
    a small str -> scalar map that travels with the group (e.g. the task name).
    """

    prompt_id: str
    text: str
    target: str
    meta: dict[str, str | int | float | bool] = field(default_factory=dict)


class Task:
    """A named prompt set with a pure reward ``reward(prompt, completion_text) -> [0, 1]``."""

    name: str = "task"

    def __init__(self, prompts: Sequence[Prompt]) -> None:
        if not prompts:
            raise ValueError(f"task {self.name!r} has no prompts")
        self.prompts: list[Prompt] = list(prompts)

    def reward(self, prompt: Prompt, completion_text: str) -> float:
        """Score ``completion_text`` (decoded, without the end-of-sequence token) for ``prompt``."""
        raise NotImplementedError

    def source(self, seed: int, shard: int = 0, num_shards: int = 1, cursor=(0, 0)) -> PromptSource:
        """A :class:`PromptSource` over this task's prompts for actor ``shard`` of ``num_shards``."""
        return PromptSource(self.prompts, seed, shard=shard, num_shards=num_shards, cursor=cursor)


class PromptSource:
    """Serves ``prompts`` to one actor of ``num_shards``, epoch by epoch, resumably.

    Determinism: the sequence of prompts depends only on (prompts, seed, shard, num_shards) and the
    starting cursor. Shards never overlap within an epoch: a prompt index appears in exactly one
    shard's slice of each epoch's permutation.
    """

    def __init__(
        self,
        prompts: Sequence[Prompt],
        seed: int,
        *,
        shard: int = 0,
        num_shards: int = 1,
        cursor: tuple[int, int] | Sequence[int] = (0, 0),
    ) -> None:
        if num_shards < 1 or not 0 <= shard < num_shards:
            raise ValueError(f"shard {shard} of {num_shards}: need 0 <= shard < num_shards")
        if len(prompts) < num_shards:
            raise ValueError(f"{len(prompts)} prompts cannot be sharded over {num_shards} actors")
        self._prompts = list(prompts)
        self._seed = int(seed)
        self._shard = shard
        self._num_shards = num_shards
        epoch, index = (int(x) for x in cursor)
        if epoch < 0 or index < 0:
            raise ValueError(f"cursor {tuple(cursor)} must be non-negative")
        self._epoch = -1
        self._order: list[int] = []
        self._load_epoch(epoch)
        # An index past the end of the shard (e.g. a cursor saved with another shard count) rolls
        # over into the next epoch rather than failing.
        while index >= len(self._order):
            index -= len(self._order)
            self._load_epoch(self._epoch + 1)
        self._index = index

    def epoch_order(self, epoch: int) -> list[int]:
        """Prompt indices of this shard for ``epoch``, in serving order."""
        perm = list(range(len(self._prompts)))
        # An int seed makes random.Random reproducible across processes and platforms.
        random.Random(self._seed * 1_000_003 + epoch).shuffle(perm)
        return perm[self._shard :: self._num_shards]

    def _load_epoch(self, epoch: int) -> None:
        self._epoch = epoch
        self._order = self.epoch_order(epoch)

    @property
    def cursor(self) -> tuple[int, int]:
        """Position of the next prompt: ``(epoch, index within this shard's epoch order)``."""
        return (self._epoch, self._index)

    def next(self) -> Prompt:
        """The next prompt; advances the cursor, rolling over into a freshly shuffled epoch."""
        prompt = self._prompts[self._order[self._index]]
        self._index += 1
        if self._index == len(self._order):
            self._load_epoch(self._epoch + 1)
            self._index = 0
        return prompt

    def take(self, n: int) -> list[Prompt]:
        return [self.next() for _ in range(n)]

    def __len__(self) -> int:
        """Prompts per epoch in this shard."""
        return len(self._order)
