"""Weight swaps of the vLLM engine wrapper (:class:`asyncrl.actors.engine.Engine` mixes this in).

A swap runs, in the engine's input order, with no model step in between (vLLM's weight-transfer
API, engine ``asyncrl_file`` from :mod:`asyncrl.actors.worker_ext`), so every step's weight-version
label names exactly the weights that sampled its tokens. Before the pause, while generation goes on: the file's
header checks, and with ``actors.swap_staging`` the *stage* (:mod:`asyncrl.actors.staging`: the
worker loads the file into a second set of tensors and builds their oneDNN handles in a thread,
polled by RPC; an idle engine builds a small one inside the begin RPC: nothing to overlap). Then:

    engine_core.pause_scheduler_async("keep")   # freeze running requests; the engine goes idle
    staged:   collective_rpc("asyncrl_stage_commit", v)      # switch layers to the stage (pointers)
    in place: start_weight_update(); update_weights({"path": ..., "version": v}); finish_weight_update()
              # vLLM's layerwise reload: copy into the model and re-process (e.g. oneDNN repack)
    update_weight_version(str(v))               # the label of every later step
    reset_prefix_cache(reset_running_requests=True)   # (recompute_kv) drop KV of the old weights
    resume_generation()

A staged swap on an engine core that steps synchronously (the CPU engine's in-process executor) skips
that sequence: one engine-core utility call commits, labels and resets between two model steps
(:mod:`asyncrl.actors.atomic_commit`), so nothing can step in between without a pause
(``Engine.atomic_commit``: asked of the engine core once; False keeps the sequence above).

Why not ``AsyncLLM.pause_generation``: it ends with a fixed ``asyncio.sleep(0.02)`` (so that final
outputs of in-flight requests are delivered first; vLLM documents it as not needed for
correctness), which was 20 ms of every swap. The scheduler pause it wraps is awaited directly.

Off the pause: :meth:`Engine.swap_weights` verifies the manifest (sha256 or sizes, in a thread: the
actor passes it as ``verify``) while it checks the file's header (tensor names, version tag) and
builds the stage; the pause starts only after both succeeded. Staged, the pause holds only pointer
moves, the label and the KV reset (flat in model size; the stage costs a second copy of the weights while it is held); in place, the copy
into the model and its re-processing fall inside it too. A model the worker cannot stage exactly
is reloaded in place (logged once, ``Engine.staging_refused``); NCCL swaps are always in place.

Why the KV reset: a request frozen in flight holds keys/values computed by the old weights.
Without a reset the tokens sampled after the swap would come from a mixture (new weights over an
old-weight cache) that no learner can recompute. With ``recompute_kv`` the running requests are
preempted and re-prefilled (prompt + tokens so far) with the new weights, so every token's
behaviour logprob is log_softmax(logits / T) of exactly one published version; the cost is one
prefill per in-flight sequence per swap.

The header checks and the stage build, before the pause, are :mod:`asyncrl.actors.swap_prepare`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from asyncrl.actors.atomic_commit import ATOMIC_COMMIT, SUPPORTED
from asyncrl.actors.swap_prepare import EngineError, SwapPrepare, run_whole
from asyncrl.buffer.weights import WeightFileError

__all__ = ["EngineError", "SwapResult", "SWAP_MODES", "WeightSwaps"]

SWAP_MODES = ("in_flight", "between_groups")

log = logging.getLogger(__name__)


@dataclass
class SwapResult:
    version: int
    mode: str
    pause_s: float  # new tokens could not be sampled for this long (in_flight) / no new groups (between)
    drain_s: float  # between_groups: waiting for in-flight groups to finish (included in pause_s)
    reload_s: float  # the reload itself (in place) or the switch to the stage (staged), with the label
    staged: bool = False  # the weights were staged while generating and switched in the pause
    prepare_s: float = 0.0  # before the pause, generation going on: header checks (+ building the stage)


class WeightSwaps(SwapPrepare):
    """The swap half of :class:`asyncrl.actors.engine.Engine` (see the module docstring).

    Needs from the engine: ``llm`` (vLLM ``AsyncLLM``), ``model_path``, ``recompute_kv``, ``version``,
    the asyncio ``_swap_lock``, ``_admit`` and ``_idle`` events, ``_expected_specs``, the staging
    state (``staging``, ``staging_refused``, ``staged_swaps``, ``stage_replay``,
    ``stage_replay_refused``, ``atomic_commit``) and the swap's progress (``swapping_to``,
    ``swap_begun``, ``swap_settled``), all set by ``Engine.__init__``. The checks and the stage build
    before the pause are :class:`~asyncrl.actors.swap_prepare.SwapPrepare`'s.

    Invariant: ``swapping_to`` is set exactly while a swap holds the lock, and ``swap_settled`` is set
    whenever it is None; when a swap settles, ``version`` is ``swapping_to`` if it served, else it is
    unchanged (a refused or failed swap).
    """

    recompute_kv: bool
    version: int | None
    staged_swaps: int
    atomic_commit: bool | None
    _swap_lock: asyncio.Lock
    _admit: asyncio.Event
    _idle: asyncio.Event
    swapping_to: int | None
    swap_begun: asyncio.Event
    swap_settled: asyncio.Event

    async def load_weights(self, path: str | os.PathLike, version: int) -> float:
        """Load ``path`` as ``version`` (first load, or a swap with nothing in flight); returns seconds."""
        res = await self.swap_weights(path, version, "in_flight")
        return res.reload_s

    async def swap_weights(
        self,
        path: str | os.PathLike,
        version: int,
        mode: str,
        verify: Callable[[], Awaitable[Any]] | None = None,
    ) -> SwapResult:
        """Serve the weights in the safetensors file ``path`` as ``version`` from now on.

        ``in_flight``: freeze running requests, reload, resume them (see the module doc).
        ``between_groups``: hold back new groups, wait until the running ones finish, then reload.
        ``verify``: the manifest's integrity check (sha256 of the file), run concurrently with the
        header checks and the stage build, all before the pause. If it raises, a built stage is
        discarded and its error propagates (it wins over a build error: a damaged file often fails
        both); nothing paused and the old weights keep serving. Reading the file twice at once costs
        less than one read after the other: at 300M the hash (~1.0 s) and the stage (~1.2 s) used to
        add up on the way from publish to serving.
        """
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        request = WeightTransferUpdateRequest(update_info={"path": str(path), "version": int(version)})

        async def load() -> None:
            try:
                await self.llm.update_weights(request)
            except Exception as e:
                # Inside the pause the worker reopens the path (which may have been pruned or recycled
                # since the checks, e.g. during a between_groups drain); it refuses before touching the
                # model. If the file no longer passes the header checks, that was the failure: a refusal
                # (WeightFileError), not an engine error.
                try:
                    await asyncio.to_thread(self._check_file, Path(path), int(version))
                except WeightFileError as gone:
                    raise gone from e
                raise

        async def build() -> tuple[Callable[[], Awaitable[None]], bool]:
            # Off the pause: the header checks (names, shapes, dtypes, version tag), beside the stage
            # build when staging (whose worker checks names and tag too); a failure raises here,
            # before any pause, and drops a built stage.
            check = asyncio.to_thread(self._check_file, Path(path), int(version))
            if not self.staging:
                await check
                return self._in_place(load), False
            staged, checked = await asyncio.gather(
                self._stage(str(path), int(version)), check, return_exceptions=True
            )
            if isinstance(checked, BaseException):
                if staged is True:
                    await run_whole(self.llm.collective_rpc("asyncrl_stage_discard"))
                raise checked
            if isinstance(staged, BaseException):
                raise staged
            return (self._commit_stage(int(version)), True) if staged else (self._in_place(load), False)

        async def prepare() -> tuple[Callable[[], Awaitable[None]], bool]:
            if verify is None:
                return await build()
            built, checked = await asyncio.gather(build(), verify(), return_exceptions=True)
            if isinstance(checked, BaseException):
                if not isinstance(built, BaseException) and built[1]:
                    await run_whole(self.llm.collective_rpc("asyncrl_stage_discard"))
                raise checked
            if isinstance(built, BaseException):
                raise built
            return built

        return await self._swap(int(version), mode, prepare)

    def _commit_stage(self, version: int) -> Callable[[], Awaitable[None]]:
        async def commit() -> None:
            await self.llm.collective_rpc("asyncrl_stage_commit", args=(version,))

        return commit

    def _in_place(self, load: Callable[[], Awaitable[None]]) -> Callable[[], Awaitable[None]]:
        async def in_place() -> None:
            await self.llm.start_weight_update()
            await load()
            await self.llm.finish_weight_update()

        return in_place

    async def swap_with(
        self,
        version: int,
        mode: str,
        load: Callable[[], Awaitable[None]],
        check: Callable[[], Awaitable[None]] | None = None,
    ) -> SwapResult:
        """The swap sequence of the module doc around ``load`` (the ``update_weights`` call(s) of any
        weight-transfer engine; the NCCL receiver's waits for the learner's broadcast).

        ``check`` runs before the pause (a failure costs no pause and leaves the old weights serving).
        """

        async def prepare() -> tuple[Callable[[], Awaitable[None]], bool]:
            if check is not None:
                await check()
            return self._in_place(load), False

        return await self._swap(int(version), mode, prepare)

    async def _swap(
        self,
        version: int,
        mode: str,
        prepare: Callable[[], Awaitable[tuple[Callable[[], Awaitable[None]], bool]]],
    ) -> SwapResult:
        """``prepare`` runs before the pause (checks, staging; generation goes on) and returns what runs
        inside it (a staged commit or an in-place reload); then the label, the KV reset, the resume. A
        staged commit on an engine core that allows it is one utility call instead (no pause)."""
        if mode not in SWAP_MODES:
            raise ValueError(f"swap mode {mode!r}; expected one of {SWAP_MODES}")
        async with self._swap_lock:
            self.swapping_to = version
            self.swap_settled.clear()
            begun, self.swap_begun = self.swap_begun, asyncio.Event()
            begun.set()  # wakes workers refused for stale weights: admitted for `version` meanwhile
            try:
                return await self._swap_locked(version, mode, prepare)
            finally:
                self.swapping_to = None
                self.swap_settled.set()

    async def _swap_locked(
        self,
        version: int,
        mode: str,
        prepare: Callable[[], Awaitable[tuple[Callable[[], Awaitable[None]], bool]]],
    ) -> SwapResult:
        """:meth:`_swap` under the lock.

        Invariant, cancelled or not: from the pause to the resume runs as one task to its end
        (:func:`run_whole`), and ``version`` is set inside it once the engine serves and labels the new
        weights, so the label, ``version`` and the served weights agree and the engine is never left
        paused. A stage built but never committed (cancelled during the drain) is dropped."""
        tp = time.perf_counter()
        inner, staged = await prepare()
        t0 = time.perf_counter()
        drain_s = 0.0
        try:
            if mode == "between_groups":
                self._admit.clear()
                try:
                    await self._idle.wait()
                except asyncio.CancelledError:
                    if staged:
                        await run_whole(self.llm.collective_rpc("asyncrl_stage_discard"))
                    raise
                drain_s = time.perf_counter() - t0
            reload_s = await run_whole(self._commit(inner, staged, version))
        finally:
            self._admit.set()
        return SwapResult(int(version), mode, time.perf_counter() - t0, drain_s, reload_s, staged, t0 - tp)

    async def _commit(self, inner: Callable[[], Awaitable[None]], staged: bool, version: int) -> float:
        """The new weights served and labelled (atomic staged commit, or the paused sequence); sets
        ``version``. Returns the seconds from the pause's start (or the commit's) to the label."""
        if staged and await self._atomic_commit_ok():
            # Commit, label and KV reset in one utility call between two engine steps: no
            # pause (asyncrl.actors.atomic_commit).
            t1 = time.perf_counter()
            await self.llm.engine_core.call_utility_async(
                ATOMIC_COMMIT, int(version), bool(self.recompute_kv)
            )
            reload_s = time.perf_counter() - t1
        else:
            reload_s = await self._paused(inner, version)
        self.version = int(version)
        self.staged_swaps += int(staged)
        return reload_s

    async def _paused(self, inner: Callable[[], Awaitable[None]], version: int) -> float:
        """``inner`` inside the scheduler pause, then the label and the KV reset (the sequence of the
        module doc); returns the seconds from the pause's start to the label. Run whole (the caller's
        :func:`run_whole`): a cancellation halfway would skip the label or the resume."""
        try:
            # The scheduler pause without AsyncLLM.pause_generation's fixed 20 ms sleep. Inside the
            # try: a pause that failed on the way may still have paused the engine core.
            await self.llm.engine_core.pause_scheduler_async(mode="keep", clear_cache=False)
            t1 = time.perf_counter()
            await inner()
            # The label of every later step (finish_weight_update(weight_version=...) does exactly
            # this after its RPC; a staged commit has no update session to finish).
            await self.llm.update_weight_version(str(version))
            self.version = int(version)  # served and labelled from here on, whatever fails after
            reload_s = time.perf_counter() - t1
            if self.recompute_kv:
                # Preempt running requests: they re-prefill under the new weights.
                if not await self.llm.reset_prefix_cache(reset_running_requests=True):
                    raise EngineError("reset_prefix_cache failed after a weight reload")
        finally:
            # Resume even on failure: the old weights (or a failed reload's error) must not leave
            # requests frozen forever; the caller decides what to do with the error.
            await self.llm.resume_generation()
        return reload_s

    async def _atomic_commit_ok(self) -> bool:
        """Whether staged commits go through one engine-core utility call (``atomic_commit``; asked once)."""
        if self.atomic_commit is None:
            try:
                self.atomic_commit = bool(await self.llm.engine_core.call_utility_async(SUPPORTED))
            except Exception as e:  # an engine core without asyncrl's utility (another executor)
                log.info("staged commits keep the scheduler pause: %s", e)
                self.atomic_commit = False
        return self.atomic_commit
