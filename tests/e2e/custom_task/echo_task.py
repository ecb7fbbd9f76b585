"""A task defined outside the asyncrl package: "say back the word", with an async reward.

Used by tests/e2e/test_custom_task.py as `task.name=tests.e2e.custom_task.echo_task:make_task` and as
the worked example of docs/custom_tasks.md. Data: echo.jsonl next to this file (columns `prompt`,
`word`); the reward is a plain function of (prompt, completion, metadata).
"""

from __future__ import annotations

import asyncio
from difflib import SequenceMatcher

from asyncrl.tasks import dataset_task


async def reward(prompt: str, completion: str, metadata: dict) -> float:
    """Similarity of the completion to the row's word in [0, 1] (an async reward: e.g. a remote judge).

    ``metadata`` is the data row without its prompt column: here ``word`` and ``id``.
    """
    await asyncio.sleep(0)
    return SequenceMatcher(None, completion, metadata["word"]).ratio()


def make_task(task_cfg, seed: int):
    return dataset_task(task_cfg, seed, reward, name="echo")
