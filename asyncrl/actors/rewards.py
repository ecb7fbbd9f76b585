"""Scoring a group off the actor's event loop, with a time limit, and injected reward faults.

A reward function is user code: it may raise, return garbage, block on I/O or loop forever. None of
that may cost more than the group being scored (issue 12, "Failed tasks"):

* a group's ``task.reward`` calls run in one daemon thread (in order), so a slow or blocking reward
  never stalls the event loop that drives the engine, the heartbeats and the weight swaps; a reward
  that returns an awaitable (``async def``) is awaited on the loop, the group's concurrently. One
  thread per group, not per completion: a thread start and its loop callback are ~0.1 ms on a busy
  core, and the G of them sat between a synchronous step's last token and its buffer write. A call
  that takes longer than ``SERIAL_MAX_S`` (a sandbox, a remote verifier) sends the rest of the group
  to one thread each, so a slow synchronous reward costs about two calls' latency, not G;
* the whole group gets ``task.reward_timeout_s``; past it, or on any exception (a ``sys.exit`` in the
  reward included: :class:`asyncrl.tasks.base.RewardExit`) or a value that is not a finite number,
  :meth:`RewardRunner.score` raises :class:`RewardFailure` with a reason and the actor drops the group
  (dead letter, admission credit returned, counter, log line) and goes on.

Why daemon threads and not a pool: Python cannot kill a thread, and a hung reward in a
``ThreadPoolExecutor`` would both occupy a worker for good and block interpreter exit (the executor
joins its workers at exit). A daemon thread per call costs ~0.1 ms, never blocks exit, and a hung
one only costs its own stack; ``running`` counts them (the actor exports it).

``task.reward_fault`` (raise / hang every N-th call) injects these faults for tests and chaos runs.
"""

from __future__ import annotations

import asyncio
import inspect
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from asyncrl.tasks.base import RewardExit, check_reward

__all__ = ["RewardFailure", "RewardRunner", "InjectedRewardFault"]

#: A reward call slower than this (s) makes the rest of its group run in parallel threads.
SERIAL_MAX_S = 0.005


class RewardFailure(Exception):
    """A group's rewards could not be computed; ``str(exc)`` is the reason."""


class InjectedRewardFault(RuntimeError):
    """Raised by the ``task.reward_fault=raise`` injection."""


async def _no_exit(awaitable: Any) -> Any:
    """``await awaitable`` with a SystemExit (an async reward's ``sys.exit``) as :class:`RewardExit`: the
    task asyncio.gather wraps it in re-raises SystemExit out of the event loop, ending the actor."""
    try:
        return await awaitable
    except SystemExit as e:
        raise RewardExit(e) from None


class RewardRunner:
    """Runs one task's reward function for the actor (see the module doc). Used from one event loop."""

    def __init__(
        self,
        task: Any,
        timeout_s: float,
        fault: str = "none",
        fault_every: int = 10,
        fault_hang_s: float = 3600.0,
    ) -> None:
        if fault not in ("none", "raise", "hang"):
            raise ValueError(f"task.reward_fault={fault!r}; expected none, raise or hang")
        self.task = task
        self.timeout_s = float(timeout_s)
        self.fault, self.fault_every, self.fault_hang_s = fault, int(fault_every), float(fault_hang_s)
        self.calls = 0
        self.running = 0  # reward threads alive now (a hung reward stays counted until it returns)
        self._lock = threading.Lock()

    @classmethod
    def from_config(cls, task: Any, task_cfg: Any) -> RewardRunner:
        return cls(task, task_cfg.reward_timeout_s, task_cfg.reward_fault, task_cfg.reward_fault_every,
                   task_cfg.reward_fault_hang_s)  # fmt: skip

    def _target(self) -> Callable[[Any, str], Any]:
        self.calls += 1
        if self.fault == "none" or self.calls % self.fault_every:
            return self.task.reward
        if self.fault == "raise":

            def fail(_prompt: Any, _text: str) -> Any:
                raise InjectedRewardFault(f"injected reward fault (call {self.calls})")

            return fail

        def hang(_prompt: Any, _text: str) -> Any:
            time.sleep(self.fault_hang_s)
            return 0.0

        return hang

    async def score(self, prompt: Any, texts: Sequence[str]) -> list[float]:
        """The reward of each text for ``prompt``; :class:`RewardFailure` with the reason otherwise."""
        try:
            return await asyncio.wait_for(self._group(prompt, texts), self.timeout_s)
        except TimeoutError:
            raise RewardFailure(
                f"reward: timed out after {self.timeout_s:g} s (task.reward_timeout_s)"
            ) from None
        except Exception as e:
            raise RewardFailure(f"reward: {type(e).__name__}: {e}") from e

    async def _group(self, prompt: Any, texts: Sequence[str]) -> list[float]:
        fns = [self._target() for _ in texts]  # one call each (the fault injection counts calls)

        def run_all() -> list[Any]:
            out: list[Any] = []
            for i, (fn, t) in enumerate(zip(fns, texts, strict=True)):
                t0 = time.perf_counter()
                out.append(fn(prompt, t))
                if time.perf_counter() - t0 > SERIAL_MAX_S and i + 1 < len(fns):
                    # A slow synchronous reward (a sandbox, a remote verifier): the rest of the group
                    # in parallel, as before, not G times its latency in turn.
                    return out + self._concurrently(fns[i + 1 :], prompt, texts[i + 1 :])
            return out

        values = await self._in_thread(run_all)
        # Awaitables (async rewards) run concurrently on the loop.
        pending = [_no_exit(v) for v in values if inspect.isawaitable(v)]
        done = iter(await asyncio.gather(*pending)) if pending else iter(())
        values = [next(done) if inspect.isawaitable(v) else v for v in values]
        task, pid = getattr(self.task, "name", "task"), getattr(prompt, "prompt_id", "?")
        return [check_reward(v, task, pid) for v in values]

    def _concurrently(
        self, fns: Sequence[Callable[..., Any]], prompt: Any, texts: Sequence[str]
    ) -> list[Any]:
        """Run ``fns[i](prompt, texts[i])`` each in its own daemon thread and wait for all (from the
        group's thread; the group's timeout is enforced by the awaiting coroutine). The first exception,
        in order, is raised."""
        results: list[tuple[bool, Any]] = [(False, None)] * len(fns)

        def run(i: int) -> None:
            with self._lock:
                self.running += 1
            try:
                results[i] = (True, fns[i](prompt, texts[i]))
            except BaseException as e:
                results[i] = (False, e)
            finally:
                with self._lock:
                    self.running -= 1

        threads = [
            threading.Thread(target=run, args=(i,), name="asyncrl-reward", daemon=True)
            for i in range(len(fns))
        ]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        for ok, value in results:
            if not ok:
                raise value
        return [value for _, value in results]

    def _in_thread(self, fn: Callable[..., Any], *args: Any) -> asyncio.Future:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future = loop.create_future()

        def deliver(ok: bool, value: Any) -> None:
            if fut.done():  # cancelled: the group already timed out
                return
            if ok:
                fut.set_result(value)
            else:
                fut.set_exception(value)

        def run() -> None:
            with self._lock:
                self.running += 1
            try:
                result: tuple[bool, Any] = (True, fn(*args))
            except SystemExit as e:
                # A SystemExit set on the future would be re-raised out of the event loop (asyncio
                # propagates it), stopping the actor: it fails this group like any exception instead.
                result = (False, RewardExit(e))
            except BaseException as e:  # handed to the awaiting coroutine
                result = (False, e)
            finally:
                with self._lock:
                    self.running -= 1
            try:
                loop.call_soon_threadsafe(deliver, *result)
            except RuntimeError:
                pass  # the loop is gone (actor stopped while this reward hung)

        threading.Thread(target=run, name="asyncrl-reward", daemon=True).start()
        return fut
