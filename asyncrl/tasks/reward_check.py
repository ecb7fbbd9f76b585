"""The task's reward function, checked at start against how the actors call it.

Why: a reward function with the wrong parameters (two instead of three, a required keyword, verl's
``compute_score(data_source, solution_str, ground_truth, extra_info)``) raised TypeError in every actor's
every group; each group was dead-lettered and the run stopped only after ``task.reward_failure_limit``
(64) failed groups of an actor, once Redis, Ray, vLLM and the learner had started. :func:`check_reward_signature`
(called by :func:`asyncrl.tasks.registry.check_task` before any role starts) binds the call the actors
make to the function's signature and fails with a :class:`ConfigError` that shows the expected one.

verl's ``compute_score`` takes three positional parameters and an optional fourth, so it binds to
``(prompt, completion, metadata)`` and would be called with the prompt as ``data_source`` and the
metadata as ``ground_truth``: a first parameter named ``data_source`` is refused too, with the wrapper to
write. Only that name: the others are fair names for a reward's own parameters.

Imports neither torch, vllm nor ray.
"""

from __future__ import annotations

import inspect
from typing import Any

from .base import FunctionTask, Task

__all__ = ["check_reward_signature", "DATA_REWARD_SIGNATURE", "TASK_REWARD_SIGNATURE"]

#: How a data task's reward function is called (asyncrl.tasks.base.FunctionTask.reward).
DATA_REWARD_SIGNATURE = "reward(prompt: str, completion: str, metadata: dict) -> float"
#: How a Task subclass's reward method is called (asyncrl.tasks.base.Task.score).
TASK_REWARD_SIGNATURE = "reward(self, prompt: asyncrl.tasks.Prompt, completion_text: str) -> float"
#: The first parameter of verl's custom reward function (verl.utils.reward_score.default_compute_score):
#: never a name for the prompt text.
VERL_FIRST = "data_source"
VERL_WRAPPER = ("def reward(prompt, completion, metadata): return compute_score(metadata.get('data_source'), "
                "completion, metadata['target'], metadata.get('extra_info'))")  # fmt: skip


def _described(fn: Any) -> str:
    name = getattr(fn, "__qualname__", None) or type(fn).__name__
    code = getattr(getattr(fn, "__func__", fn), "__code__", None)
    return f"{name} ({code.co_filename}:{code.co_firstlineno})" if code is not None else name


def check_reward_signature(task: Task, key: str = "task.name") -> None:
    """A :class:`ConfigError` naming ``key`` (``task.name=...``) when ``task``'s reward cannot be called as
    the actors call it: a :class:`FunctionTask`'s ``reward_fn(prompt, completion, metadata)``, else the
    task's ``reward(prompt, completion_text)`` (which a Task subclass must define). A callable without a
    readable signature (a builtin) is left to run time."""
    from asyncrl.config import ConfigError  # here, not at the top: asyncrl.config imports asyncrl.tasks

    if isinstance(task, FunctionTask):
        fn, expected, args = task.reward_fn, DATA_REWARD_SIGNATURE, ("prompt", "completion", {})
    else:
        if type(task).reward is Task.reward:
            raise ConfigError(
                f"{key}: task {task.name!r} ({type(task).__qualname__}) defines no reward method; a Task subclass "
                f"defines {TASK_REWARD_SIGNATURE} (or use asyncrl.tasks.dataset_task with {DATA_REWARD_SIGNATURE})"
            )
        fn, expected, args = task.reward, TASK_REWARD_SIGNATURE, (task.prompts[0], "completion")
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # no signature to read: it is called and seen at run time
        return
    try:
        sig.bind(*args)
    except TypeError as e:
        raise ConfigError(
            f"{key}: the reward function {_described(fn)} has the signature {sig} and cannot be called as "
            f"{expected} ({e}); the actors call it so, positionally, for each completion"
        ) from None
    names = list(sig.parameters)
    if isinstance(task, FunctionTask) and len(names) >= 2 and names[0] == VERL_FIRST:
        raise ConfigError(
            f"{key}: the reward function {_described(fn)} has verl's signature {sig}, but is called as {expected} "
            f"(the prompt would be its {names[0]!r}, the completion its {names[1]!r}); wrap it: {VERL_WRAPPER}"
        )
