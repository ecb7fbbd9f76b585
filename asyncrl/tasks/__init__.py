"""Prompt sources and reward functions: built-in tasks and the plug-in protocol.

    task = make_task(cfg.task, seed)          # built-in name, entry point, or "pkg.mod:make_task"
    source = task.source(seed, 0, 1)          # the run's one prompt order
    prompt = source.at(position)              # position: claimed in the run's Redis by each actor
    r = await task.score(prompt, completion_text)   # reward, sync or async, finite float
    task.eval_prompts                         # the held-out split

A plug-in (see docs/custom_tasks.md) is a factory ``make_task(task_cfg, seed) -> Task``; the
shortest one is ``dataset_task(task_cfg, seed, reward_fn)`` with ``reward_fn(prompt, completion,
metadata) -> float``.

Invariant: imports neither torch, vllm nor ray (nor ``datasets``, until a data file is read).
"""

from __future__ import annotations

from .base import (
    FunctionTask,
    Prompt,
    PromptSource,
    RewardExit,
    RewardFn,
    Task,
    TaskDataError,
    check_reward,
    holdout_split,
)
from .chat import Conversation, prompt_token_ids, uses_chat_template
from .data import dataset_task, load_prompt_splits, load_rows, rows_to_prompts
from .math import Gsm8kTask, extract_answer, load_gsm8k, parse_number
from .registry import (
    BUILTIN_TASKS,
    DATA_KEYS,
    ENTRY_POINT_GROUP,
    TINY_TASKS,
    TaskNotFound,
    check_task,
    check_task_config,
    make_task,
    resolve_factory,
)
from .tiny import AdditionTask, CopyTask, CountTask, ReverseTask, TinyTask, char_reward

__all__ = [
    "Prompt",
    "PromptSource",
    "Task",
    "FunctionTask",
    "RewardFn",
    "RewardExit",
    "TaskDataError",
    "TaskNotFound",
    "TinyTask",
    "CopyTask",
    "ReverseTask",
    "CountTask",
    "AdditionTask",
    "Gsm8kTask",
    "TINY_TASKS",
    "BUILTIN_TASKS",
    "ENTRY_POINT_GROUP",
    "DATA_KEYS",
    "check_task",
    "check_task_config",
    "char_reward",
    "check_reward",
    "extract_answer",
    "parse_number",
    "load_gsm8k",
    "load_rows",
    "rows_to_prompts",
    "load_prompt_splits",
    "dataset_task",
    "holdout_split",
    "make_task",
    "resolve_factory",
    "prompt_token_ids",
    "uses_chat_template",
    "Conversation",
]
