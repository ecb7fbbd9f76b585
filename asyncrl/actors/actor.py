"""The rollout actor: prompts in, scored groups with per-token logprobs and versions out to Redis.

One :class:`RolloutActor` owns one vLLM engine and runs one asyncio loop with

* ``groups_in_flight`` group workers: admission (``try_admit``, waiting while the staleness bound
  is reached) -> next prompt -> ``G`` completions -> rewards -> ``ReplayBuffer.put``;
* a version watcher: on a newer manifest (pub/sub hint + poll of the registry), verify the sha256
  and swap per ``actors.swap_mode``; a manifest that fails verification is refused and logged and
  the actor keeps generating on the weights it has;
* a heartbeat writer (every ``actors.heartbeat_s``), kept alive across loop restarts.

Supervision (issue 12): Ray restarts a dead actor *process*, not a failed loop. :meth:`RolloutActor.run`
therefore restarts its own generation loop when it raises (a Redis outage past the retry budget, an
engine error): in-flight groups are cancelled and credited, the engine is rebuilt if it died, slots the
failed incarnation still held are reclaimed, and the loop starts again after an exponential backoff.
``actors.loop_restarts`` failures in a row without a group written in between give up (the error then
reaches the pool and ``asyncrl run``'s supervision); an ``ActorFatalError`` (a failure a restart would
repeat: a reward failing for ``task.reward_failure_limit`` groups in a row, or a config error found while
the actor was built, see ``RolloutActor.__init__``) gives up at once. Rewards run off the event loop with a time limit
(:mod:`asyncrl.actors.rewards`): a reward that raises or hangs costs its group (dead letter with the
reason, credit returned, ``groups_reward_failed``), never the actor.

Invariants:
* no token is generated before a published version is loaded (a (re)started actor waits for v0);
* a group that was admitted but not written (aborted at stop, or finished by an engine abort)
  returns its admission credit, so admission cannot leak;
* the actor never imports the learner; it meets it only through ``asyncrl.buffer``.

:class:`RolloutActor` works without Ray (tests, scripts); ``ray_actor.RayRolloutActor`` is the
thin wrapper the pool turns into a Ray actor. This module holds its lifecycle (run, restarts, stop,
heartbeats); the group workers are in :mod:`asyncrl.actors.group_worker`, the weight-version side in
:mod:`asyncrl.actors.version_watch`.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections import deque
from pathlib import Path
from typing import Any

from asyncrl.buffer import ReplayBuffer
from asyncrl.buffer.broadcast import BroadcastSession
from asyncrl.buffer.paths import weight_roots
from asyncrl.config import ConfigError
from asyncrl.evaluate import PeriodicEval
from asyncrl.metrics_export import histogram_for
from asyncrl.tasks import PromptSource, make_task

from .admission_wake import AdmissionWaker
from .engine import SWAP_MODES, Engine
from .group_worker import GroupProduction
from .nccl_receiver import NcclReceiver
from .nccl_receiver import expected_names as nccl_expected_names
from .rewards import RewardRunner
from .supervision import ActorFatalError, slot_actor_id
from .timeline import Timeline
from .version_watch import MANIFEST_POLL_S, VersionWatching

__all__ = ["RolloutActor", "initial_counters"]

log = logging.getLogger(__name__)


def initial_counters(actor_id: str) -> dict[str, Any]:
    """A new actor's counters (the event loop's; ``RolloutActor.stats`` snapshots them)."""
    return {
        "actor_id": actor_id,
        "pid": os.getpid(),
        "state": "created",
        "version": None,
        "groups_written": 0,
        "groups_aborted": 0,
        "generated_tokens": 0,
        "in_flight": 0,
        "admission_wait_s": 0.0,
        "admission_blocked": 0,
        "swaps": 0,
        "swap_pause_s": deque(maxlen=256),  # most recent swap windows, seconds
        # Every swap window since the process started (the /metrics histogram: never shrinks).
        "swap_pause_hist": histogram_for("swap_pause_hist"),
        "weight_rejects": 0,
        "engine_errors": 0,
        "reconstructed": False,
        "groups_reward_failed": 0,
        # Prompts the engine refused or the chat template could not render (group_worker: dead-lettered,
        # slot credited).
        "groups_rejected": 0,
        # Prompt positions passed over because the engine refused that prompt earlier in the run
        # (group_worker._claim_prompt: asyncrl:{R}:poison_prompts).
        "prompts_skipped": 0,
        # Slots taken for the version a swap was preparing (group_worker._await_swap), and those
        # given back because that swap did not serve it.
        "preadmissions": 0,
        "preadmissions_returned": 0,
        "loop_restarts": 0,
    }


class RolloutActor(GroupProduction, VersionWatching):
    """One actor: engine + group workers + version watcher + heartbeat. See the module doc."""

    def __init__(
        self,
        cfg: Any,
        run_dir: str | os.PathLike,
        actor_index: int = 0,
        *,
        redis_url: str,
        redis_password: str | None = None,
        actor_id: str | None = None,
        model_path: str | os.PathLike | None = None,
    ) -> None:
        from asyncrl.cpu_binding import bind_from_env
        from asyncrl.tinymodel import resolve_model_path

        from . import engine_start

        # First, before this process binds itself or imports vLLM: a spawned engine-core process whose
        # imports start now, on every core this process may use, in parallel with ours (engine_standby).
        self.standby = engine_start.start_standby_for(cfg)
        # Before the engine exists: its engine-core and worker processes inherit this process's cores.
        self.cpus = bind_from_env()
        self.cfg = cfg
        self.run_dir = Path(run_dir)
        self.index = actor_index
        pool = cfg.actors.pool_index  # leased per serve-actors process: pools never share ids
        self.actor_id = actor_id or slot_actor_id(pool, actor_index)
        self.model_path = Path(model_path) if model_path else resolve_model_path(cfg, self.run_dir)
        # AUTH, ACL user, TLS client certificate, timeouts and the outage retry budget from the config.
        self.buffer = ReplayBuffer.from_config(cfg, redis_url, password=redis_password)
        self.task = make_task(cfg.task, cfg.run.seed)
        self.rewards = RewardRunner.from_config(self.task, cfg.task)
        # Weights are loaded only from this run's weight directories (manifest paths come from Redis).
        self.weight_roots = weight_roots(self.run_dir, cfg.run.name)
        # A config error here (eval.every > 0 for a task without eval prompts: every CLI path refuses it
        # at start, a pool built from Python does not) fails every incarnation the same way. Raised from
        # the constructor, it failed the Ray actor's creation task, which Ray reports without the
        # exception (an ActorDiedError carrying only text), so the supervisor could not tell it from a
        # crash and replaced the actor run.max_restarts times. Kept and raised by run() as an
        # ActorFatalError instead: the loop does not restart on it and the supervisor fails the run at
        # once with its line (the key and the way out: asyncrl.tasks.registry.require_eval_prompts).
        self._fatal: ActorFatalError | None = None
        try:
            self.evaluator = PeriodicEval.for_actor(cfg, self.task, actor_index)
        except ConfigError as e:
            self.evaluator = None
            self._fatal = ActorFatalError(f"{self.actor_id}: {e}")
        self.source: PromptSource | None = None  # set by run(): the run's prompt order (positions from Redis)
        self.engine: Engine | None = None
        # learner.weight_transport=nccl: the engine's membership in the learner's broadcast group.
        self.receiver: NcclReceiver | None = None
        self.swap_mode: str = cfg.actors.swap_mode  # may be changed at run time (set_swap_mode)
        self._tokenizer: Any = None
        self._prompt_ids: dict[str, list[int]] = {}
        self._stop_requested = False
        self._abort = True
        self._done: asyncio.Event | None = None
        self._wake: asyncio.Event | None = None
        self._started = 0  # groups admitted by this process
        self._max_groups: int | None = None
        self._rejected: set[tuple[int, str]] = set()
        self._writes: set[asyncio.Future] = set()  # buffer writes in flight (see _write)
        self._waker: AdmissionWaker | None = None  # admission hints (actors.admission_events)
        self._swap_hint: asyncio.Event | None = None  # a worker started waiting (actors.swap_min_lag > 1)
        # Per-group and per-swap timestamps for `asyncrl plan`'s calibration (asyncrl.actors.timeline).
        self.timeline = Timeline(self.run_dir, self.actor_id)
        # /metrics of this actor ("host:port"), advertised in heartbeats for Prometheus file_sd.
        self.metrics_addr: str | None = None
        # Snapshot for the scrape thread, refreshed on the loop thread with every heartbeat: the
        # counters (and the swap-pause deque) are only ever touched by the event loop.
        self.last_stats: dict[str, Any] = {}
        self.counters: dict[str, Any] = initial_counters(self.actor_id)

    # ------------------------------------------------------------------ public

    def stats(self) -> dict[str, Any]:
        """A snapshot of the counters (plain types: the recent swap pauses as a list, the cumulative
        swap-pause histogram as a dict)."""
        out = dict(self.counters)
        out["swap_pause_s"] = list(self.counters["swap_pause_s"])
        out["swap_pause_hist"] = self.counters["swap_pause_hist"].to_dict()
        out["in_flight"] = self.engine.in_flight if self.engine else 0
        out["group_workers"] = self.cfg.actors.groups_in_flight  # admission_wait_s sums over them
        # Tokens received so far by the groups in flight (progress inside long generations); 0 until a
        # group ends unless actors.stream_tokens (vLLM then hands the tokens over as they are sampled).
        out["in_flight_tokens"] = sum(self.engine.progress.values()) if self.engine else 0
        out["swap_mode"] = self.swap_mode
        out["reward_threads"] = self.rewards.running
        return out

    def set_swap_mode(self, mode: str) -> None:
        """Switch between ``in_flight`` and ``between_groups`` for the following swaps."""
        if mode not in SWAP_MODES:
            raise ValueError(f"swap mode {mode!r}; expected one of {SWAP_MODES}")
        self.swap_mode = mode

    def request_stop(self, abort: bool = True) -> None:
        """Stop admitting groups; ``abort`` cancels in-flight groups, else they finish and are written."""
        self._stop_requested = True
        self._abort = abort
        if self._wake is not None:
            self._wake.set()

    async def stop(self, abort: bool = True) -> None:
        """:meth:`request_stop` and wait until :meth:`run` has shut the engine down."""
        self.request_stop(abort)
        if self._done is not None:
            await self._done.wait()

    async def run(self, max_groups: int | None = None) -> dict[str, Any]:
        """Generate until stopped (or ``max_groups`` groups were admitted); returns :meth:`stats`.

        Restarts a failed generation loop (see the module doc); raises once ``actors.loop_restarts``
        failures in a row (no group written in between) are exceeded.
        """
        self._done, self._wake = asyncio.Event(), asyncio.Event()
        self._max_groups = max_groups
        heartbeat: asyncio.Task | None = None
        failures = 0
        try:
            if self._fatal is not None:  # a config error found while building the actor (see __init__)
                log.error("%s", self._fatal)
                raise self._fatal
            # The run's one prompt order; each group claims its position in Redis (group_worker).
            self.source = self.task.source(self.cfg.run.seed, 0, 1)
            heartbeat = asyncio.create_task(self._heartbeat_loop(), name="heartbeat")
            while True:
                written = self.counters["groups_written"]
                try:
                    await self._run_once()
                    break
                except ActorFatalError as e:  # a restart would fail the same way (a reward never working)
                    log.error("%s: %s", self.actor_id, e)
                    raise
                except Exception as e:
                    if self._stop_requested:
                        raise
                    failures = 1 if self.counters["groups_written"] > written else failures + 1
                    limit = self.cfg.actors.loop_restarts
                    if failures > limit:
                        log.error("%s: generation loop failed %d times in a row (actors.loop_restarts=%d): "
                                  "giving up", self.actor_id, failures, limit)  # fmt: skip
                        raise
                    self.counters["loop_restarts"] += 1
                    delay = min(2.0 ** (failures - 1), 30.0)
                    log.exception("%s: generation loop failed (%s: %s); restart %d/%d in %.0f s",
                                  self.actor_id, type(e).__name__, e, failures, limit, delay)  # fmt: skip
                    await self._sleep(delay)
                    if self._stop_requested:
                        break
        finally:
            if heartbeat is not None:
                heartbeat.cancel()
                await asyncio.gather(heartbeat, return_exceptions=True)
            if self.engine is not None:
                self.engine.shutdown()
            if self.standby is not None:  # ended before an engine adopted or discarded it (a fatal error)
                from . import engine_standby

                await asyncio.to_thread(engine_standby.discard)
                self.standby = None
            self._set_state("stopped")
            try:
                self._heartbeat_now()
            except Exception as e:  # Redis gone for longer than the retry budget: nothing to record it in
                log.warning("%s: final heartbeat not written: %s", self.actor_id, e)
            await self._writes_done()
            self.buffer.close()
            self.timeline.close()
            self._done.set()
        return self.stats()  # after the finally: the final state is "stopped"

    async def _run_once(self) -> None:
        """One incarnation of the generation loop; the engine survives it unless it died."""
        tasks: list[asyncio.Task] = []
        try:
            self._set_state("starting")
            # Slots a crashed previous incarnation of this actor was admitted for will never be
            # written: turn them into credits before admitting anything (admission cannot leak).
            # Writes of the failed incarnation still retrying must land (or give up) first: a put or
            # credit that ran after the reclaim would count its slot twice.
            await self._writes_done()
            reclaimed = await asyncio.to_thread(self.buffer.reclaim_inflight, self.actor_id)
            if reclaimed:
                log.warning(
                    "%s: reclaimed %d admission slots of a previous incarnation", self.actor_id, reclaimed
                )
            self.counters["reclaimed_slots"] = reclaimed
            if self.engine is not None and (self.engine.llm is None or self.engine.llm.errored):
                self.engine.shutdown()
                self.engine = None
            if self.engine is None:
                await self._start_engine()
            # Also when an engine survived a failed first load (or Redis dropped during it): it serves
            # no version yet and every group worker would fail at once.
            if self.engine.version is None:
                await self._load_first_version()
            if not self._stop_requested:
                await self._generate(tasks)
        finally:
            self._set_state("stopping")
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _generate(self, tasks: list[asyncio.Task]) -> None:
        self._set_state("running")
        if self.cfg.actors.admission_events:
            waker = AdmissionWaker(self.buffer, asyncio.get_running_loop(), self.actor_id)
            self._waker = await asyncio.to_thread(waker.start)
        try:
            tasks.append(asyncio.create_task(self._watch_versions(), name="versions"))
            workers = [
                asyncio.create_task(self._group_worker(), name=f"group-{i}")
                for i in range(self.cfg.actors.groups_in_flight)
            ]
            await self._supervise(workers, tasks)
        finally:
            if self._waker is not None:
                waker, self._waker = self._waker, None
                await asyncio.to_thread(waker.stop)

    # ------------------------------------------------------------------ lifecycle helpers

    def _set_state(self, state: str) -> None:
        self.counters["state"] = state
        log.info("%s: %s", self.actor_id, state)

    async def _start_engine(self) -> None:
        from transformers import AutoTokenizer

        try:
            import ray

            # Only inside a Ray actor: a driver with Ray up (tests) has no actor id, and asking asserts.
            ctx = ray.get_runtime_context() if ray.is_initialized() else None
            self.counters["reconstructed"] = bool(
                ctx is not None and ctx.get_actor_id() is not None and ctx.was_current_actor_reconstructed
            )
        except ImportError:
            pass
        self._tokenizer = AutoTokenizer.from_pretrained(str(self.model_path))
        # The start-up takes ~25 s on CPU: build in a thread so that stats/stop stay responsive.
        # AsyncLLM binds its output handler to the loop lazily, on first use from this loop.
        from asyncrl.cpu_binding import ENV_FRONTEND_CPUS, bind_from_env

        self.cpus = bind_from_env()  # a restarted engine inherits the engine's cores, not the front end's
        self.engine = await asyncio.to_thread(Engine.from_config, self.cfg, self.model_path)
        if self.standby is not None:  # adopted as the engine core, or not needed any more
            from . import engine_standby

            await asyncio.to_thread(engine_standby.discard)  # an unadopted one may still be importing
            self.standby = None
        # Its processes are up on the engine's cores: this process (the front end) may move now.
        self.cpus = bind_from_env(ENV_FRONTEND_CPUS) or self.cpus
        if self.cfg.learner.weight_transport == "nccl":  # a new engine joins the learner's next group
            a = self.cfg.actors
            self.receiver = NcclReceiver(
                self.engine, BroadcastSession(self.buffer.client, self.cfg.run.name), self.actor_id,
                await asyncio.to_thread(nccl_expected_names, self.model_path),
                a.tensor_parallel_size * a.pipeline_parallel_size, timeout_s=self.cfg.learner.nccl_timeout_s,
            )  # fmt: skip

    async def _load_first_version(self) -> None:
        """Wait for a published, verifiable manifest and load it before any generation."""
        self._set_state("waiting_for_weights")
        while not self._stop_requested:
            if await self._maybe_swap(first=True):
                return
            await self._sleep(MANIFEST_POLL_S)

    async def _sleep(self, seconds: float, *hints: asyncio.Event | None) -> None:
        """Sleep, waking early on a stop request (or when one of ``hints`` is set)."""
        assert self._wake is not None
        waits = [asyncio.ensure_future(self._wake.wait())]
        waits += [asyncio.ensure_future(h.wait()) for h in hints if h is not None]
        try:
            await asyncio.wait(waits, timeout=seconds, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()

    async def _supervise(self, workers: list[asyncio.Task], helpers: list[asyncio.Task]) -> None:
        """Wait for the workers to finish; a failing task (worker or helper) stops all and raises."""
        assert self._wake is not None
        pending: set[asyncio.Future] = set(workers) | set(helpers)
        aborting = False
        # A stop request sets _wake (never cleared): waiting on it as well makes an abort cancel the
        # workers at once. On the 0.2 s timeout alone it landed up to 200 ms late, by when a short
        # group had often finished and been written although the stop came while it generated.
        wake = asyncio.ensure_future(self._wake.wait())
        pending.add(wake)
        try:
            while any(not w.done() for w in workers):
                done, pending = await asyncio.wait(pending, timeout=0.2, return_when=asyncio.FIRST_COMPLETED)
                for t in done:
                    if t is not wake and not t.cancelled() and t.exception() is not None:
                        for w in workers:
                            w.cancel()
                        await asyncio.gather(*workers, return_exceptions=True)
                        self.counters["engine_errors"] += 1
                        raise t.exception()  # type: ignore[misc]
                if self._stop_requested and self._abort and not aborting:
                    aborting = True
                    for w in workers:
                        w.cancel()
            await asyncio.gather(*workers, return_exceptions=True)
        finally:
            wake.cancel()

    # ------------------------------------------------------------------ heartbeat

    def _heartbeat_info(self) -> dict[str, Any]:
        s = self.stats()
        self.last_stats = s
        return {
            "metrics_addr": self.metrics_addr or "",
            "actor_id": self.actor_id,
            "index": self.index,
            "pid": s["pid"],
            "state": s["state"],
            "version": -1 if s["version"] is None else s["version"],
            "groups_written": s["groups_written"],
            "generated_tokens": s["generated_tokens"],
            "in_flight": s["in_flight"],
            "swaps": s["swaps"],
            "weight_rejects": s["weight_rejects"],
            "admission_wait_s": round(s["admission_wait_s"], 3),
            "reconstructed": s["reconstructed"],
            **({"eval": self.evaluator.last.to_dict()} if self.evaluator and self.evaluator.last else {}),
        }

    def _heartbeat_now(self) -> None:
        self.buffer.heartbeat(self.actor_id, self._heartbeat_info())

    async def _heartbeat_async(self) -> None:
        # The snapshot is taken on the loop thread (the counters are not thread-safe); only the
        # Redis round trip runs in a worker thread.
        info = self._heartbeat_info()
        await asyncio.to_thread(self.buffer.heartbeat, self.actor_id, info)

    async def _heartbeat_loop(self) -> None:
        # Best effort: a missing heartbeat is how a supervisor sees trouble, so one that cannot be
        # written (Redis gone past the retry budget) is logged and the next one tried.
        while True:
            try:
                await self._heartbeat_async()
            except Exception as e:
                log.warning("%s: heartbeat not written: %s: %s", self.actor_id, type(e).__name__, e)
            await asyncio.sleep(self.cfg.actors.heartbeat_s)
