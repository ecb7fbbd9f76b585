"""Prompts the engine refuses (the request itself is bad: longer than model.max_model_len) are refused
once per run: dead-lettered the first time, recorded in Redis, and passed over after, without an engine
request, a group slot or a dead letter, by later epochs, other actors and pools and a resumed run.

Before, every epoch asked the engine again and dead-lettered the same prompts again (the dead-letter
stream grew by the same records each epoch). A group worker on a real Redis buffer with a stand-in
engine that raises vLLM's own client-error class, as vLLM does for a too-long prompt (the real engine's
refusal: tests/integration/test_actor_faults.py).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from types import SimpleNamespace
from typing import Any

import pytest
from vllm.exceptions import VLLMValidationError

from asyncrl.actors.engine import SampledCompletion
from asyncrl.actors.group_worker import GroupProduction
from asyncrl.actors.rewards import RewardRunner
from asyncrl.actors.supervision import ActorFatalError
from asyncrl.buffer import ReplayBuffer
from asyncrl.config import load_config
from asyncrl.metrics_export import actor_collector
from asyncrl.tasks import FunctionTask, Prompt

#: 8 prompts, 2 of them too long for any engine here.
PROMPTS = [Prompt(f"p-{i}", f"long {i}" if i in (2, 5) else f"say {i}") for i in range(8)]
LONG = {"p-2", "p-5"}


class _Engine:
    """Refuses a prompt of ``limit`` tokens or more as vLLM does (VLLMValidationError, a VLLMClientError);
    records every prompt it was asked for."""

    version = 0
    swap_begun = None
    swapping_to = None

    def __init__(self, limit: int) -> None:
        self.limit, self.asked = limit, []

    async def generate_group(self, prompt_ids, n, temperature, top_p, max_tokens, group_id, seed=None):
        await asyncio.sleep(0)
        self.asked.append(len(prompt_ids))
        if len(prompt_ids) >= self.limit:
            raise VLLMValidationError(
                f"The decoder prompt (length {len(prompt_ids)}) is longer than the maximum model length of "
                f"{self.limit}.", parameter="input_tokens", value=len(prompt_ids)
            )  # fmt: skip
        return [SampledCompletion([5, 6], [-0.5, -0.5], [0, 0], "ab", "stop") for _ in range(n)]


class _Tokenizer:
    """A chat tokenizer: 3 tokens a prompt, 1000 for a ``long`` one."""

    chat_template = "{{ messages }}"

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=True):
        return [1] * (1000 if messages[-1]["content"].startswith("long") else 3)


class _Worker(GroupProduction):
    """One actor's group worker (a new one: a new actor process, or the same actor resumed)."""

    def __init__(self, buffer: ReplayBuffer, prompts=PROMPTS, max_model_len: int = 256,
                 engine_limit: int | None = None, actor_id: str = "actor-0") -> None:  # fmt: skip
        self.cfg = load_config(overrides=["actors.refuse_stale_weights=false", "actors.group_size=2",
                                          "actors.admission_events=false",
                                          f"model.max_model_len={max_model_len}",
                                          f"model.tiny.max_position_embeddings={max(max_model_len, 256)}"])  # fmt: skip
        self.actor_id, self.index, self.swap_mode = actor_id, 0, "in_flight"
        self.buffer, self.engine = buffer, _Engine(engine_limit or max_model_len)
        self.task = FunctionTask("mine", prompts, lambda p, t, m: 1.0)
        self.rewards = RewardRunner(self.task, 5.0)
        self.source = self.task.source(0, 0, 1)
        self.counters = {k: 0 for k in ("groups_written", "groups_aborted", "generated_tokens", "admission_wait_s",
                                        "admission_blocked", "groups_reward_failed", "groups_rejected", "prompts_skipped")}  # fmt: skip
        self.timeline = SimpleNamespace(record=lambda *a, **k: None)
        self._tokenizer, self._prompt_ids = _Tokenizer(), {}
        self._stop_requested, self._max_groups, self._started = False, None, 0
        self._waker, self._swap_hint, self._writes = None, None, set()

    async def _sleep(self, s: float, *events: Any) -> None:
        await asyncio.sleep(min(s, 0.01))

    def produce(self, groups: int, workers: int = 1) -> None:
        """Run ``workers`` group workers until ``groups`` groups were admitted (or one raises)."""
        self._max_groups = groups

        async def main() -> None:
            tasks = [asyncio.ensure_future(self._group_worker()) for _ in range(workers)]
            try:
                await asyncio.gather(*tasks)
            finally:  # one raised: the others stop (their slots go back), as the actor's supervision does
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                await self._writes_done()

        asyncio.run(main())

    @property
    def long_asked(self) -> int:
        return sum(n >= 1000 for n in self.engine.asked)


@pytest.fixture
def buf(redis_client, run_name: str):
    b = ReplayBuffer(redis_client, run_name, max_staleness=1000, groups_per_step=100)
    yield b
    b.delete_run()


@pytest.fixture(autouse=True)
def _no_throttle_window() -> None:
    from asyncrl.log_throttle import RepeatThrottle

    for f in logging.getLogger("asyncrl.actors.group_worker").filters:
        if isinstance(f, RepeatThrottle):
            f.reset()


def _balanced(buf: ReplayBuffer) -> dict[str, int]:
    s = buf.stats()
    inflight = sum(int(v) for v in buf.client.hvals(buf.keys.inflight))
    assert inflight == 0 and s["admitted"] == s["depth"] + s["credits"], s  # every slot written or back
    return s


def _dead_prompts(buf: ReplayBuffer) -> list[str]:
    return sorted(d["reason"].split("'")[1] for d in buf.dead_letters(count=1000))


def test_a_refused_prompt_is_dead_lettered_once_and_skipped_in_later_epochs(buf, caplog) -> None:
    w = _Worker(buf)
    with caplog.at_level(logging.WARNING, logger="asyncrl.actors.group_worker"):
        w.produce(20)  # epoch 0: 8 slots (2 refused); epochs 1 and 2: 6 slots each, the long ones skipped
    c = w.counters
    assert w.long_asked == 2 and c["groups_rejected"] == 2 and c["groups_written"] == 18, c
    assert _dead_prompts(buf) == ["p-2", "p-5"]  # old code: 6 (the same two, every epoch)
    assert c["prompts_skipped"] == buf.prompts_claimed() - 20 >= 2, (c, buf.prompts_claimed())
    assert _balanced(buf)["dead"] == 2
    skips = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
    assert len(skips) == 2, skips  # once per prompt, not per skip
    assert all("refused by the engine" in m and "longer than the maximum model length" in m for m in skips)
    assert set(buf.poison_prompts(256)) == LONG
    samples = {
        s.name: s.value for f in actor_collector("actor-0", lambda: dict(c)).collect() for s in f.samples
    }
    assert samples["asyncrl_actor_skipped_prompts_total"] == c["prompts_skipped"]  # the /metrics counter


def test_other_actors_and_a_resumed_run_skip_without_asking_the_engine(buf) -> None:
    first = _Worker(buf)
    first.produce(8)  # epoch 0: both long prompts refused
    assert first.long_asked == 2 and _dead_prompts(buf) == ["p-2", "p-5"]
    for n, actor_id in ((1, "actor-1"), (2, "actor-0")):  # another actor (pool), then the first one resumed
        w = _Worker(buf, actor_id=actor_id)
        w.produce(12, workers=3)
        assert w.long_asked == 0 and w.counters["groups_rejected"] == 0, (n, w.counters)
        # (>= 12: three workers may pass the max_groups check together; no cap applies in a run)
        assert w.counters["groups_written"] >= 12 and w.counters["prompts_skipped"] >= 2, w.counters
    assert _dead_prompts(buf) == ["p-2", "p-5"] and _balanced(buf)["dead"] == 2


def test_a_refusal_is_recorded_per_length_limit_and_a_raised_limit_asks_again(buf) -> None:
    assert buf.mark_poison_prompt("p-2", 256, "too long") is True
    assert buf.mark_poison_prompt("p-2", 256, "too long again") is False  # the first record stays
    assert buf.poison_prompts(256) == {"p-2": "too long"} == buf.poison_prompts(128)
    assert buf.poison_prompts(512) == {}  # a resume with model.max_model_len raised: asked again
    w = _Worker(buf, max_model_len=2048, engine_limit=2048)  # the long prompts fit now
    w.produce(8)
    assert w.long_asked == 2 and w.counters["groups_written"] == 8 and w.counters["prompts_skipped"] == 0
    assert buf.keys.poison_prompts in buf.keys.all_keys()


def test_a_prompt_refused_again_by_a_racing_actor_is_not_dead_lettered_twice(buf) -> None:
    """Recorded by another actor after this one read the record (its refusal still in flight then):
    asked once more, it is credited back, not dead-lettered again."""
    w = _Worker(buf)
    w._poison_known = _stale_reads(w._poison_known)  # never sees the other actor's records
    for pid in LONG:
        buf.mark_poison_prompt(pid, 256, f"prompt {pid!r} refused by another actor")
    w.produce(8)
    assert w.long_asked == 2 and w.counters["groups_rejected"] == 0 and w.counters["prompts_skipped"] == 2
    assert buf.dead_letters(count=10) == [] and _balanced(buf)["depth"] == 6


def _stale_reads(read):
    async def known(seq: int) -> dict[str, str]:
        return {}

    return known


def test_a_run_whose_prompts_are_all_refused_ends_instead_of_spinning(buf) -> None:
    """Every prompt longer than the limit (the start-time check, which refuses such a data set, skipped:
    a pool built from Python): each is dead-lettered once, then the actor stops with the reason. Before,
    it dead-lettered every group for as long as it was let run."""
    w = _Worker(buf, prompts=[Prompt(f"p-{i}", f"long {i}") for i in range(4)])
    with pytest.raises(ActorFatalError) as e:
        w.produce(200, workers=2)
    msg = str(e.value)
    assert msg.startswith("actor-0: every prompt of task 'mine' (4) was refused by the engine "
                          "(model.max_model_len=256): nothing to generate; e.g. prompt 'p-"), msg  # fmt: skip
    assert "longer than the maximum model length of 256" in msg
    assert w.long_asked == 4 and w.counters["groups_rejected"] == 4 and w.counters["groups_written"] == 0
    assert _dead_prompts(buf) == ["p-0", "p-1", "p-2", "p-3"] and _balanced(buf)["depth"] == 0


def test_a_stop_while_the_refusal_is_recorded_still_returns_the_slot(buf) -> None:
    """A stop with abort (the worker cancelled) while the refusal's record is written: the record, the
    dead letter and the slot's return still land (admission cannot leak)."""
    w = _Worker(buf, prompts=[Prompt(f"p-{i}", f"long {i}") for i in range(2)])
    record, started = buf.mark_poison_prompt, threading.Event()

    def slow_record(*args):
        started.set()
        time.sleep(0.3)
        return record(*args)

    buf.mark_poison_prompt = slow_record
    w._max_groups = 10

    async def main() -> None:
        worker = asyncio.ensure_future(w._group_worker())
        assert await asyncio.to_thread(started.wait, 10)
        worker.cancel()
        await asyncio.gather(worker, return_exceptions=True)
        await w._writes_done()

    asyncio.run(main())
    assert len(buf.poison_prompts(256)) == 1 and w.counters["groups_rejected"] == 1
    assert _balanced(buf)["dead"] == 1  # before: the slot stayed in the actor's in-flight tally


def test_a_record_for_a_prompt_that_fits_now_is_not_followed(buf) -> None:
    """Prompt ids are row positions: a record made before a resume that changed the data file, the system
    prompt or the chat template can name a prompt that fits now. It is asked for, not skipped (and a
    data set whose every id was recorded does not end the run as 'every prompt refused')."""
    for i in range(8):  # every id recorded, as by a run on an older data file
        buf.mark_poison_prompt(f"p-{i}", 256, f"prompt 'p-{i}' refused earlier")
    w = _Worker(buf)
    w.produce(12)
    # The six that fit are asked for and written; the two still too long stay passed over, unasked.
    assert w.counters["groups_written"] == 12 and w.long_asked == 0, w.counters
    assert w.counters["prompts_skipped"] == buf.prompts_claimed() - 12 >= 2, w.counters
    assert buf.dead_letters(count=10) == []


def test_a_refusal_for_another_reason_than_the_length_is_not_recorded(buf) -> None:
    """The engine refusing a prompt that fits model.max_model_len (its sampling settings, the engine
    itself): not a property of the prompt, so it is dead-lettered each time and not recorded (a record
    would outlive the fix, and here it ended the run as 'every prompt refused' after one epoch)."""
    w = _Worker(buf, engine_limit=2)  # refuses the 3-token prompts too
    w.produce(16)  # two epochs and more
    assert w.counters["groups_rejected"] == 16 and w.counters["groups_written"] == 0, w.counters
    assert set(buf.poison_prompts(256)) == LONG  # only the prompts longer than model.max_model_len
    dead = _dead_prompts(buf)
    assert dead.count("p-0") >= 2 and dead.count("p-2") == 1, dead  # asked again / recorded, passed over
