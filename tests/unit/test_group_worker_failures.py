"""A group worker on a real Redis buffer with a stand-in engine (no vLLM engine started): a prompt the
chat template cannot render and a reward that never works (findings of the "bring your own task /
model" review).

* A chat template refusing a prompt (jinja's TemplateError) dead-letters that group with the reason and
  the worker goes on; it used to fail the generation loop (crash-loop: restarts, replacements).
* A reward failing for task.reward_failure_limit groups in a row stops the actor with ActorFatalError,
  naming the reward and the last reason, whether it never worked or broke for good after working; it
  used to dead-letter every group for ever. A reward whose failures come fewer than the limit in a row
  keeps dropping only its failing groups.
"""

from __future__ import annotations

import asyncio
import logging
import time
from types import SimpleNamespace
from typing import Any

import pytest

from asyncrl.actors.engine import SampledCompletion
from asyncrl.actors.group_worker import GroupProduction
from asyncrl.actors.rewards import RewardRunner
from asyncrl.actors.supervision import ActorFatalError
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


def _verl_reward(prompt, text, meta):
    return {"score": 1.0, "acc": True}  # a verl-style dict: not a number


def test_a_reward_that_never_works_stops_the_actor_at_the_limit(buf) -> None:
    w = _Worker(buf, _verl_reward, ["task.reward_failure_limit=6"])
    with pytest.raises(ActorFatalError) as e:
        w.produce(100)
    msg = str(e.value)
    assert w.counters["groups_reward_failed"] == 6 and w.counters["groups_written"] == 0
    assert "the reward of task 'mine' (_verl_reward at " in msg and "test_group_worker_failures.py:" in msg
    assert "failed for 6 groups in a row and never once succeeded (task.reward_failure_limit=6)" in msg
    assert "last failure: reward: ValueError: " in msg and "'score': 1.0" in msg
    assert len(buf.dead_letters(count=100)) == 6 and _balanced(buf)["depth"] == 0


def test_a_reward_that_worked_and_then_broke_for_good_stops_the_actor_at_the_limit(buf) -> None:
    """Its verifier went away after the first group: before, having succeeded once, it dead-lettered
    every group for as long as the run was let run (the actor generating all the while)."""
    calls = {"n": 0}

    def verified(prompt, text, meta):  # the first group's rewards work, then the verifier is gone
        calls["n"] += 1
        if calls["n"] > 2:
            raise ConnectionError("verifier at 10.0.0.7:8080 refused the connection")
        return 1.0

    w = _Worker(buf, verified, ["task.reward_failure_limit=6", "task.reward_failure_window_s=0"])
    with pytest.raises(ActorFatalError) as e:
        w.produce(100)
    assert w.counters["groups_written"] == 1 and w.counters["groups_reward_failed"] == 6
    msg = str(e.value)
    assert msg.startswith("actor-0: the reward of task 'mine' (") and ".verified at " in msg, msg
    assert (
        "failed for 6 groups in a row over 0 s since its last success (1 group scored before) "
        "(task.reward_failure_limit=6, task.reward_failure_window_s=0); last failure: reward: ConnectionError: "
        "verifier at 10.0.0.7:8080 refused the connection" in msg
    )
    s = _balanced(buf)
    assert s["depth"] == 1 and s["dead"] == 6


def test_a_reward_that_worked_stops_only_once_its_failures_span_the_window(buf) -> None:
    """A verifier outage shorter than task.reward_failure_window_s only drops groups, however many in a row
    (at ~100 groups/s the limit of 64 is under a second); past the window the actor stops."""
    calls = {"n": 0}

    def verified(prompt, text, meta):
        calls["n"] += 1
        if calls["n"] > 2:
            time.sleep(0.005)  # a refused connection still takes a moment: ~10 ms a group
            raise ConnectionError("verifier restarting")
        return 1.0

    w = _Worker(buf, verified, ["task.reward_failure_limit=6", "task.reward_failure_window_s=1.0"])
    t0 = time.monotonic()
    with pytest.raises(ActorFatalError) as e:
        w.produce(1000)
    assert time.monotonic() - t0 >= 1.0
    failed = w.counters["groups_reward_failed"]
    assert failed > 6 and w.counters["groups_written"] == 1, failed  # the limit alone did not stop it
    assert f"failed for {failed} groups in a row over 1 s since its last success" in str(e.value), str(
        e.value
    )
    assert "task.reward_failure_window_s=1" in str(e.value)


def test_intermittent_reward_failures_below_the_limit_in_a_row_only_drop_their_groups(buf) -> None:
    """5 failed groups, 1 scored, over and over (limit 6): each success restarts the count, the worker
    runs on, and exactly the failed groups are dead-lettered, with their reason."""
    calls = {"n": 0}

    def flaky(prompt, text, meta):  # two calls per group (a dict is refused after both ran)
        calls["n"] += 1
        group = (calls["n"] - 1) // 2
        return 1.0 if group % 6 == 5 else {"score": 0.0}

    w = _Worker(buf, flaky, ["task.reward_failure_limit=6"])
    w.produce(36)  # returns: 30 failed groups, never 6 in a row
    assert w.counters["groups_written"] == 6 and w.counters["groups_reward_failed"] == 30
    reasons = [d["reason"] for d in buf.dead_letters(count=100)]
    assert len(reasons) == 30 and all(r.startswith("reward: ValueError: ") for r in reasons), reasons
    s = _balanced(buf)
    assert s["depth"] == 6 and s["dead"] == 30


def test_reward_failure_limit_zero_never_stops_and_the_warnings_are_throttled(buf, caplog) -> None:
    from asyncrl.log_throttle import RepeatThrottle

    for name in ("asyncrl.actors.group_worker", "asyncrl.buffer.producer"):  # no earlier test's window
        for f in logging.getLogger(name).filters:
            if isinstance(f, RepeatThrottle):
                f.reset()
    w = _Worker(buf, _verl_reward, ["task.reward_failure_limit=0"])
    with caplog.at_level(logging.WARNING):
        w.produce(40)
    assert w.counters["groups_reward_failed"] == 40 and len(buf.dead_letters(count=100)) == 40
    # 2 warnings per dropped group before (80 lines): now the first 5 of each logger in the window.
    dropped = [r for r in caplog.records if "dropped" in r.getMessage()]
    assert len(dropped) == 10, [r.getMessage() for r in dropped]
