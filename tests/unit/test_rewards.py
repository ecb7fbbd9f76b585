"""asyncrl.actors.rewards: a reward that raises, hangs or returns garbage costs its group, never the
event loop or the process; injected faults follow task.reward_fault."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
import time
from decimal import Decimal
from fractions import Fraction

import numpy as np
import pytest

from asyncrl.actors.rewards import InjectedRewardFault, RewardFailure, RewardRunner
from asyncrl.tasks import Prompt, Task

PROMPT = Prompt("p0", "abc", "abc")


class LengthTask(Task):
    """A real reward: len(text); 'boom' raises, 'hang' blocks, 'nan' is not finite, 'async' awaits."""

    name = "length"

    def __init__(self) -> None:
        super().__init__([PROMPT])

    def reward(self, prompt: Prompt, text: str):
        if text == "boom":
            raise KeyError("no such answer")
        if text == "hang":
            time.sleep(30)
        if text == "nan":
            return float("nan")
        if text == "async":
            return self._later(len(text))
        return float(len(text))

    async def _later(self, value: int) -> float:
        await asyncio.sleep(0.01)
        return float(value)


def score(runner: RewardRunner, texts: list[str]) -> list[float]:
    return asyncio.run(runner.score(PROMPT, texts))


def test_rewards_of_a_group_in_order_sync_and_async() -> None:
    assert score(RewardRunner(LengthTask(), 5.0), ["a", "bb", "async", ""]) == [1.0, 2.0, 5.0, 0.0]


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("boom", "reward: KeyError: 'no such answer'"),
        ("nan", "reward: ValueError: task 'length': reward for p0 is nan"),
    ],
)
def test_a_failing_reward_fails_the_group_with_its_reason(text: str, reason: str) -> None:
    with pytest.raises(RewardFailure) as e:
        score(RewardRunner(LengthTask(), 5.0), ["ok", text])
    assert str(e.value).startswith(reason)


def test_a_hanging_reward_times_out_and_never_blocks_the_loop() -> None:
    runner = RewardRunner(LengthTask(), 0.5)

    async def main() -> tuple[float, int]:
        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        t = asyncio.create_task(ticker())
        t0 = time.monotonic()
        with pytest.raises(RewardFailure, match=r"timed out after 0.5 s \(task.reward_timeout_s\)"):
            await runner.score(PROMPT, ["a", "hang"])
        elapsed = time.monotonic() - t0
        t.cancel()
        return elapsed, ticks

    elapsed, ticks = asyncio.run(main())
    assert 0.45 <= elapsed < 2.0
    assert ticks >= 20  # the loop kept running while the reward thread was blocked
    assert runner.running == 1  # the hung reward is still counted; the next group is unaffected
    assert score(runner, ["xyz"]) == [3.0]


def test_a_hung_reward_does_not_block_process_exit() -> None:
    code = textwrap.dedent(
        """
        import asyncio, time
        from asyncrl.actors.rewards import RewardFailure, RewardRunner
        from asyncrl.tasks import Prompt, Task
        class Hang(Task):
            name = "hang"
            def reward(self, prompt, text):
                time.sleep(3600)
        p = Prompt("p", "x", "x")
        try:
            asyncio.run(RewardRunner(Hang([p]), 0.2).score(p, ["a"]))
        except RewardFailure as e:
            print("dropped:", e)
        """
    )
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "dropped: reward: timed out" in out.stdout
    assert time.monotonic() - t0 < 30


def test_injected_faults_every_nth_call() -> None:
    runner = RewardRunner(LengthTask(), 5.0, fault="raise", fault_every=3)
    outcomes = []
    for _ in range(4):  # groups of 2 completions: calls 1-2, 3-4, 5-6, 7-8
        try:
            score(runner, ["a", "b"])
            outcomes.append("ok")
        except RewardFailure as e:
            assert isinstance(e.__cause__, InjectedRewardFault)
            outcomes.append("fail")
    assert outcomes == ["ok", "fail", "fail", "ok"] and runner.calls == 8
    hang = RewardRunner(LengthTask(), 0.3, fault="hang", fault_every=2, fault_hang_s=5.0)
    with pytest.raises(RewardFailure, match="timed out"):
        score(hang, ["a", "b"])
    with pytest.raises(ValueError, match="task.reward_fault"):
        RewardRunner(LengthTask(), 1.0, fault="crash")


def test_a_group_is_scored_in_one_thread_off_the_loop_and_async_rewards_overlap() -> None:
    """One reward thread per group (not per completion: G thread starts sat on the synchronous
    critical path), never the loop's thread; a group's async rewards still run concurrently."""
    import threading

    seen: list[int] = []

    class Recording(LengthTask):
        def reward(self, prompt: Prompt, text: str):
            seen.append(threading.get_ident())
            return super().reward(prompt, text)

        async def _later(self, value: int) -> float:
            await asyncio.sleep(0.1)
            return float(value)

    async def main() -> tuple[list[float], float]:
        runner = RewardRunner(Recording(), 5.0)
        t0 = time.perf_counter()
        out = await runner.score(PROMPT, ["a", "bb", "async", "ccc", "async", "async"])
        return out, time.perf_counter() - t0

    loop_thread = threading.get_ident()
    out, took = asyncio.run(main())
    assert out == [1.0, 2.0, 5.0, 3.0, 5.0, 5.0]
    assert len(seen) == 6 and len(set(seen)) == 1 and seen[0] != loop_thread
    assert took < 0.25  # three 100 ms async rewards overlapped (in turn they would take >= 0.3 s)


def test_a_slow_synchronous_reward_runs_the_rest_of_its_group_in_parallel() -> None:
    """A reward call slower than SERIAL_MAX_S (a sandbox, a remote verifier) does not make the group
    take G times its latency: the remaining calls run one thread each; an exception among them still
    fails the group with its reason."""
    import threading

    from asyncrl.actors.rewards import SERIAL_MAX_S

    seen: set[int] = set()
    lock = threading.Lock()

    class Slow(LengthTask):
        def reward(self, prompt: Prompt, text: str):
            with lock:
                seen.add(threading.get_ident())
            time.sleep(0.1)
            if text == "boom":
                raise RuntimeError("sandbox died")
            return super().reward(prompt, text)

    assert SERIAL_MAX_S < 0.1
    t0 = time.perf_counter()
    assert score(RewardRunner(Slow(), 5.0), ["a", "bb", "ccc", "dddd", "eeeee", "ffffff"]) == [
        1.0,
        2.0,
        3.0,
        4.0,
        5.0,
        6.0,
    ]
    took = time.perf_counter() - t0
    assert 0.19 <= took < 0.45, took  # the first call, then the other five together (in turn: >= 0.6 s)
    assert len(seen) == 6  # the group's thread and one per remaining call
    with pytest.raises(RewardFailure, match="RuntimeError: sandbox died"):
        score(RewardRunner(Slow(), 5.0), ["a", "boom", "ccc"])


class NumberTask(Task):
    """Returns the value the completion names: what rewards computed with numpy or decimal return."""

    name = "numbers"
    VALUES = {
        "f32": np.float32(0.5),
        "i64": np.int64(2),
        "dec": Decimal("0.25"),
        "frac": Fraction(3, 4),
        "int": 3,
        "np_bool": np.bool_(True),
        "bool": True,
        "dec_nan": Decimal("NaN"),
        "dec_snan": Decimal("sNaN"),
        "f32_inf": np.float32("inf"),
        "huge": 10**400,
        "str": "1.0",
    }

    def __init__(self) -> None:
        super().__init__([PROMPT])

    def reward(self, prompt: Prompt, text: str):
        return self.VALUES[text]


def test_any_finite_real_number_is_a_reward_as_a_float() -> None:
    """numpy scalars (np.float32, np.int64) and Decimal were refused: every group of a numpy reward was
    dead-lettered."""
    out = score(RewardRunner(NumberTask(), 5.0), ["f32", "i64", "dec", "frac", "int"])
    assert out == [0.5, 2.0, 0.25, 0.75, 3.0] and all(type(v) is float for v in out)


@pytest.mark.parametrize("text", ["np_bool", "bool", "dec_nan", "dec_snan", "f32_inf", "huge", "str"])
def test_bools_and_non_finite_numbers_are_refused(text: str) -> None:
    with pytest.raises(
        RewardFailure, match=r"reward: ValueError: task 'numbers': reward for p0 is .*not a finite"
    ):
        score(RewardRunner(NumberTask(), 5.0), ["int", text])


class ExitingTask(LengthTask):
    """'exit' calls sys.exit in the group's thread, 'slow' makes the rest of the group run one thread each,
    'aexit' is an async reward that calls sys.exit on the event loop."""

    def reward(self, prompt: Prompt, text: str):
        if text == "exit":
            sys.exit(3)
        if text == "slow":
            time.sleep(0.02)
        if text == "aexit":
            return self._exit()
        return super().reward(prompt, text)

    async def _exit(self) -> float:
        await asyncio.sleep(0)
        sys.exit("verifier done")


@pytest.mark.parametrize(
    ("texts", "code"),
    [(["a", "exit"], "3"), (["slow", "b", "exit"], "3"), (["a", "aexit"], "'verifier done'")],
    ids=["group-thread", "parallel-thread", "async"],
)
def test_a_reward_calling_sys_exit_fails_its_group_not_the_actor(texts: list[str], code: str) -> None:
    """SystemExit escaped RewardRunner.score (it caught Exception only) and stopped the actor's loop."""
    runner = RewardRunner(ExitingTask(), 5.0)

    async def main() -> list[float]:
        with pytest.raises(
            RewardFailure, match=rf"^reward: RewardExit: the reward function called sys.exit\({code}\)"
        ):
            await runner.score(PROMPT, texts)
        return await runner.score(PROMPT, ["next", "group"])  # the same loop and runner go on

    assert asyncio.run(main()) == [4.0, 5.0]
