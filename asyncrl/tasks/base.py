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

import inspect
import math
import numbers
import random
import reprlib
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

from asyncrl.buffer.records import REWARD_ABS_MAX

__all__ = [
    "Prompt",
    "Task",
    "FunctionTask",
    "PromptSource",
    "RewardFn",
    "RewardExit",
    "TaskDataError",
    "check_reward",
    "holdout_split",
]

#: A user reward: ``(prompt text, completion text, metadata) -> float``, sync or ``async def``.
RewardFn = Callable[[str, str, Mapping[str, Any]], "float | Awaitable[float]"]


class TaskDataError(ValueError):
    """A task's data file is unusable; the message names the file and the line."""


class RewardExit(RuntimeError):
    """A reward function called ``sys.exit`` (or raised SystemExit).

    User reward code is scored inside the actor and ``asyncrl eval``: a stray ``sys.exit`` (a script
    turned into a reward, a verifier's CLI entry point) must cost the group being scored, like any
    other exception, not stop the process. KeyboardInterrupt is left alone: it is the operator's.
    """

    def __init__(self, exc: SystemExit) -> None:
        super().__init__(f"the reward function called sys.exit({exc.code!r})")


@dataclass(frozen=True)
class Prompt:
    """One prompt of a task.

    ``text`` is the user turn as plain text (a chat template, when the model has one, is applied by
    the actor: :func:`asyncrl.tasks.chat.prompt_token_ids`), or a :class:`~asyncrl.tasks.chat.Conversation`
    (a message-list row: a ``str``, its last user turn, carrying the messages); ``target`` is what a perfect completion
    says (empty when the task has none); ``meta`` is the rest of the data row, handed to the reward
    function (it stays in the actor: it is not sent over Redis).
    """

    prompt_id: str
    text: str
    target: str = ""
    meta: dict[str, Any] = field(default_factory=dict)


class Task:
    """The task protocol: a named prompt set, a held-out eval split, and a reward.

    * ``source(seed, shard, num_shards, cursor)`` -> an object with ``next() -> Prompt`` and a
      ``cursor`` property (a tuple of non-negative ints) from which a restarted actor resumes; the
      default is :class:`PromptSource` over ``self.prompts``.
    * ``reward(prompt, completion_text)`` -> float, or an awaitable of one (``async def``). The
      completion is the decoded text without the end-of-sequence token. Any finite float is allowed
      (the built-ins stay in [0, 1]); :meth:`score` is what the actors and ``asyncrl eval`` call.
    * ``eval_prompts``: the held-out prompts periodic and ``asyncrl eval`` evaluation score (may be
      empty: evaluation then says so instead of scoring training prompts).
    """

    name: str = "task"

    def __init__(self, prompts: Sequence[Prompt], eval_prompts: Sequence[Prompt] = ()) -> None:
        if not prompts:
            raise ValueError(f"task {self.name!r} has no prompts")
        self.prompts: list[Prompt] = list(prompts)
        self.eval_prompts: list[Prompt] = list(eval_prompts)

    def reward(self, prompt: Prompt, completion_text: str) -> float | Awaitable[float]:
        """Score ``completion_text`` (decoded, without the end-of-sequence token) for ``prompt``."""
        raise NotImplementedError

    async def score(self, prompt: Prompt, completion_text: str) -> float:
        """:meth:`reward`, awaited when it is async, checked to be a finite number. A ``sys.exit`` in the
        reward is a :class:`RewardExit` (an ordinary exception), not the end of the scoring process."""
        try:
            value = self.reward(prompt, completion_text)
            if inspect.isawaitable(value):
                value = await value
        except SystemExit as e:
            raise RewardExit(e) from None
        return check_reward(value, self.name, prompt.prompt_id)

    def source(self, seed: int, shard: int = 0, num_shards: int = 1, cursor=(0, 0)) -> PromptSource:
        """A :class:`PromptSource` over this task's prompts for actor ``shard`` of ``num_shards``."""
        return PromptSource(self.prompts, seed, shard=shard, num_shards=num_shards, cursor=cursor)


def check_reward(value: Any, task: str, prompt_id: str) -> float:
    """``value`` as a float; ValueError when it is not a finite number or beyond +-REWARD_ABS_MAX.

    Any :class:`numbers.Real` (``int``, ``float``, ``Fraction``, numpy's ``float32`` / ``int64``: what a
    reward computed with numpy returns) or :class:`~decimal.Decimal` counts. A bool (Python's or numpy's)
    does not: a reward returning ``answer == target`` is refused so the user writes the number they mean.
    """
    number = isinstance(value, numbers.Real | Decimal) and not isinstance(value, bool)
    try:
        # float() of an int past 1e308 raises OverflowError, of a signalling Decimal NaN ValueError.
        as_float = float(value) if number else math.nan
    except (OverflowError, ValueError):
        as_float = math.nan
    if math.isfinite(as_float) and abs(as_float) > REWARD_ABS_MAX:
        # Finite, and still past what an fp32 step can train (the record contract refuses it too).
        raise ValueError(
            f"task {task!r}: reward for {prompt_id} is {as_float:g}, beyond +-{REWARD_ABS_MAX:g} (rescale it)"
        )
    if not math.isfinite(as_float):
        hint = " (a bool is refused: return float(...))" if "bool" in type(value).__name__ else ""
        # reprlib: a 400-digit int or a long string would otherwise fill the dead-letter log line.
        raise ValueError(
            f"task {task!r}: reward for {prompt_id} is {reprlib.repr(value)}, not a finite number{hint}"
        )
    return as_float


class FunctionTask(Task):
    """A task from prompts and a plain reward function ``fn(prompt_text, completion, metadata)``.

    ``metadata`` is ``prompt.meta`` plus ``target`` (the target column's value; without a target column
    a data column named ``target`` reaches the reward as it is, and ``target`` is "" when neither exists).
    """

    def __init__(self, name: str, prompts: Sequence[Prompt], reward_fn: RewardFn,
                 eval_prompts: Sequence[Prompt] = ()) -> None:  # fmt: skip
        if not callable(reward_fn):
            raise TypeError(f"task {name!r}: reward_fn {reward_fn!r} is not callable")
        self.name = name
        self.reward_fn = reward_fn
        super().__init__(prompts, eval_prompts)

    def reward(self, prompt: Prompt, completion_text: str) -> float | Awaitable[float]:
        meta = prompt.meta
        if (
            prompt.target or "target" not in meta
        ):  # else: the row's own 'target' column (no target column set)
            meta = {**meta, "target": prompt.target}
        return self.reward_fn(prompt.text, completion_text, meta)


def holdout_split(prompts: Sequence[Prompt], fraction: float, seed: int) -> tuple[list[Prompt], list[Prompt]]:
    """(train, eval): a seed-determined ``fraction`` of ``prompts`` held out for evaluation.

    At least one prompt stays in each part when ``fraction`` > 0 and there are two or more prompts.
    """
    if fraction <= 0 or len(prompts) < 2:
        return list(prompts), []
    order = list(range(len(prompts)))
    random.Random(seed * 1_000_003 + 17).shuffle(order)
    n_eval = min(len(prompts) - 1, max(1, round(fraction * len(prompts))))
    held = set(order[:n_eval])
    return [p for i, p in enumerate(prompts) if i not in held], [prompts[i] for i in sorted(held)]


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
        self._orders: dict[int, list[int]] = {}  # epoch -> shuffle, for at()
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

    def at(self, seq: int) -> Prompt:
        """The prompt at position ``seq`` of the whole order (shard 0 of 1): epoch ``seq // len``, then
        that epoch's shuffle. What the actors serve: each claims its next position from the run's
        Redis (``claim_prompt_seq``), so the order is the run's, not an actor's. A shard's own cursor
        is not moved."""
        if self._num_shards != 1:
            raise ValueError("PromptSource.at() is the order of one shard of one (the run's order)")
        if seq < 0:
            raise ValueError(f"prompt position {seq} must be >= 0")
        epoch, index = divmod(int(seq), len(self._prompts))
        order = self._orders.get(epoch)
        if order is None:
            # Workers claim positions close to each other: a few epochs' shuffles are all it needs.
            if len(self._orders) >= 4:
                del self._orders[min(self._orders)]
            order = self._orders[epoch] = self.epoch_order(epoch)
        return self._prompts[order[index]]

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
