"""A group worker on a real Redis buffer with a stand-in engine (no vLLM engine started): a prompt the
chat template cannot render (a finding of the "bring your own task / model" review).

* A chat template refusing a prompt (jinja's TemplateError) dead-letters that group with the reason and
  the worker goes on; it used to fail the generation loop (crash-loop: restarts, replacements).
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

from asyncrl.actors.engine import SampledCompletion
from asyncrl.actors.group_worker import GroupProduction
from asyncrl.actors.rewards import RewardRunner
from asyncrl.buffer import ReplayBuffer
from asyncrl.config import load_config
from asyncrl.tasks import FunctionTask, Prompt

PROMPTS = [Prompt(f"p-{i}", f"say {i}") for i in range(8)]


class _Engine:
    """What the group worker asks of the engine: a served version and G completions of a prompt."""

    version = 0
    swap_begun = None
    swapping_to = None

    async def generate_group(self, prompt_ids, n, temperature, top_p, max_tokens, group_id, seed=None):
        await asyncio.sleep(0)
        return [SampledCompletion([5, 6], [-0.5, -0.5], [0, 0], "ab", "stop") for _ in range(n)]


class _Tokenizer:
    """A chat tokenizer whose template refuses the prompts listed in ``refuse`` (as jinja does)."""

    chat_template = "{{ messages }}"

    def __init__(self, refuse: set[str]) -> None:
        self.refuse = refuse

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=True):
        import jinja2

        if messages[-1]["content"] in self.refuse:
            raise jinja2.exceptions.TemplateError("Conversation roles must alternate user/assistant")
        return [1, 2, 3]


class _Worker(GroupProduction):
    def __init__(self, buffer: ReplayBuffer, reward, overrides: list[str], refuse: set[str] = frozenset()):
        self.cfg = load_config(overrides=["actors.refuse_stale_weights=false", "actors.group_size=2",
                                          "actors.admission_events=false", *overrides])  # fmt: skip
        self.actor_id, self.index, self.swap_mode = "actor-0", 0, "in_flight"
        self.buffer, self.engine = buffer, _Engine()
        self.task = FunctionTask("mine", PROMPTS, reward)
        self.rewards = RewardRunner(self.task, 5.0)
        self.source = self.task.source(0, 0, 1)
        self.counters = {k: 0 for k in ("groups_written", "groups_aborted", "generated_tokens", "admission_wait_s",
                                        "admission_blocked", "groups_reward_failed", "groups_rejected")}  # fmt: skip
        self.timeline = SimpleNamespace(record=lambda *a, **k: None)
        self._tokenizer, self._prompt_ids = _Tokenizer(set(refuse)), {}
        self._stop_requested, self._max_groups, self._started = False, None, 0
        self._waker, self._swap_hint, self._writes = None, None, set()

    async def _sleep(self, s: float, *events: Any) -> None:
        await asyncio.sleep(min(s, 0.01))

    def produce(self, groups: int) -> None:
        """Run one group worker until ``groups`` groups were admitted (or it raises)."""
        self._max_groups = groups

        async def main() -> None:
            try:
                await self._group_worker()
            finally:
                await self._writes_done()

        asyncio.run(main())


@pytest.fixture
def buf(redis_client, run_name: str):
    b = ReplayBuffer(redis_client, run_name, max_staleness=100, groups_per_step=100)
    yield b
    for key in redis_client.scan_iter(f"*{run_name}*"):
        redis_client.delete(key)


def _balanced(buf: ReplayBuffer) -> dict[str, int]:
    s = buf.stats()
    inflight = sum(int(v) for v in buf.client.hvals(buf.keys.inflight))
    assert inflight == 0 and s["admitted"] == s["depth"] + s["credits"], s  # every slot written or back
    return s


def test_a_prompt_the_chat_template_refuses_is_dead_lettered_and_the_worker_goes_on(buf) -> None:
    w = _Worker(buf, lambda p, t, m: 1.0, [], refuse={"say 1", "say 4"})
    w.produce(16)  # two epochs of 8 prompts: each refused prompt is drawn twice
    c = w.counters
    assert c["groups_rejected"] == 4 and c["groups_written"] == 12
    reasons = [d["reason"] for d in buf.dead_letters(count=100)]
    assert len(reasons) == 4 and _balanced(buf)["dead"] == 4
    assert all(r.startswith("prompt 'p-1'") or r.startswith("prompt 'p-4'") for r in reasons), reasons
    assert all("could not be rendered (model.chat_template='auto')" in r and
               "TemplateError: Conversation roles must alternate" in r for r in reasons)  # fmt: skip
