"""Prompt sources and reward functions.

    task = make_task(cfg.task, seed)
    source = task.source(seed, shard=actor_index, num_shards=num_actors, cursor=(0, 0))
    prompt = source.next()
    r = task.reward(prompt, completion_text)      # pure, in [0, 1]

Invariant: imports neither torch, vllm nor ray.
"""

from __future__ import annotations

from typing import Any

from .base import Prompt, PromptSource, Task, TaskDataError
from .math import Gsm8kTask, extract_answer, load_gsm8k, parse_number
from .tiny import AdditionTask, CopyTask, CountTask, ReverseTask, TinyTask, char_reward

__all__ = [
    "Prompt",
    "PromptSource",
    "Task",
    "TaskDataError",
    "TinyTask",
    "CopyTask",
    "ReverseTask",
    "CountTask",
    "AdditionTask",
    "Gsm8kTask",
    "TINY_TASKS",
    "char_reward",
    "extract_answer",
    "parse_number",
    "load_gsm8k",
    "make_task",
]

TINY_TASKS: dict[str, type[TinyTask]] = {
    "copy": CopyTask,
    "reverse": ReverseTask,
    "count": CountTask,
    "addition": AdditionTask,
}


def make_task(task_cfg: Any, seed: int) -> Task:
    """The task named by ``task_cfg.name`` (a :class:`asyncrl.config.TaskConfig`)."""
    if task_cfg.name == "gsm8k":
        return Gsm8kTask(task_cfg.data_path or None)
    cls = TINY_TASKS.get(task_cfg.name)
    if cls is None:
        raise ValueError(f"task.name={task_cfg.name!r}: unknown; choose one of {[*TINY_TASKS, 'gsm8k']}")
    return cls(task_cfg.num_prompts, seed, task_cfg.alphabet, task_cfg.min_len, task_cfg.max_len)
