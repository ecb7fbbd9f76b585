"""The `echo` tiny task (the staleness sweep's task): prompts, targets and rewards by hand."""

from __future__ import annotations

import itertools

import pytest

from asyncrl.config import TaskConfig
from asyncrl.tasks import TINY_TASKS, make_task
from asyncrl.tasks.tiny import EchoTask


def _sweep_task(seed: int = 0, num_prompts: int = 200) -> EchoTask:
    # The sweep's settings (configs/sweep_staleness.yaml): one letter over abcd.
    cfg = TaskConfig(name="echo", alphabet="abcd", min_len=1, max_len=1, num_prompts=num_prompts)
    task = make_task(cfg, seed)
    assert isinstance(task, EchoTask)
    return task


def test_echo_is_a_builtin_with_bare_prompts():
    assert TINY_TASKS["echo"] is EchoTask
    task = _sweep_task()
    for p in task.prompts:
        # No "echo:...=" framing: the prompt is the input itself, the target is it three times.
        assert len(p.text) == 1 and p.text in "abcd" and p.target == p.text * 3
    assert {p.text for p in task.prompts} == set("abcd")  # 200 draws cover the alphabet
    multi = make_task(TaskConfig(name="echo", alphabet="xy", min_len=2, max_len=3, num_prompts=30), 1)
    for p in multi.prompts:
        assert 2 <= len(p.text) <= 3 and p.target == p.text * 3


def test_echo_prompts_are_deterministic_per_seed_and_eval_is_separate():
    a, b, c = _sweep_task(0, 50), _sweep_task(0, 50), _sweep_task(1, 50)
    assert [p.text for p in a.prompts] == [p.text for p in b.prompts]
    assert [p.text for p in a.prompts] != [p.text for p in c.prompts]
    cfg = TaskConfig(name="echo", alphabet="abcd", min_len=1, max_len=1, num_prompts=5, eval_size=7)
    t = make_task(cfg, 0)
    assert len(t.eval_prompts) == 7 and all(p.prompt_id.startswith("echo-eval-") for p in t.eval_prompts)


@pytest.mark.parametrize(
    ("prompt", "completion", "want"),
    [
        ("a", "aaa", 1.0),
        ("a", "aba", (1 + 0.25 + 1) / 3),  # one wrong but valid letter: 0.25 credit
        ("a", "bbb", 0.25),  # a constant wrong letter: only the valid-symbol credit
        ("a", "xyz", 0.0),  # not task letters at all
        ("a", "aa", (2 / 3) * (1 / (1 + 1 / 3))),  # stopped early: 0.5
        ("a", "aaaa", 1 / (1 + 1 / 3)),  # rambling one past: 0.75
        ("a", "", 0.0),
        ("c", "cxc", 2 / 3),
    ],
)
def test_echo_reward_by_hand(prompt, completion, want):
    task = _sweep_task()
    p = next(p for p in task.prompts if p.text == prompt)
    assert task.reward(p, completion) == pytest.approx(want, abs=1e-12)


def test_echo_constant_answers_score_low():
    # Why this task: every prompt-independent answer of three task letters averages at most
    # (1 + 3 x 0.25) / 4 = 0.4375 over the four prompts, far below the maximum 1.
    task = _sweep_task()
    prompts = {p.text: p for p in task.prompts}
    best = max(
        sum(task.reward(prompts[c], "".join(ans)) for c in "abcd") / 4
        for ans in itertools.product("abcd", repeat=3)
    )
    assert best == pytest.approx(0.4375)
    assert sum(task.reward(prompts[c], c * 3) for c in "abcd") / 4 == 1.0
