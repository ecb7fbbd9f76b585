"""What a weight swap does before its pause, generation going on (:class:`SwapPrepare`, mixed into
:class:`asyncrl.actors.weight_swaps.WeightSwaps`): the file's header checks, and with
``actors.swap_staging`` the stage build in the worker(s) (begin, poll and discard RPCs of
:mod:`asyncrl.actors.worker_ext`; the worker side is :mod:`asyncrl.actors.staging`). A failure here
raises before any pause and leaves the old weights serving; the swap sequence itself, and why it is
what it is, are in :mod:`asyncrl.actors.weight_swaps`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Awaitable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from asyncrl.buffer.weights import WeightFileError, WeightFileGone

STAGE_POLL_MIN_S, STAGE_POLL_MAX_S = 0.001, 0.02  # poll interval bounds while a stage builds
#: An idle engine builds a stage of at most this many file bytes inside the begin RPC (no thread, no
#: polls); ~10 ms at the tiny demo size, and a group submitted meanwhile waits at most about that long.
SYNC_STAGE_MAX_BYTES = 16 << 20

#: Errors of a stage build (reported by the worker as "TypeName: message") that are about the file:
#: its header checks (ValueError), a file that vanished or cannot be read. Anything else is the engine's.
_FILE_ERRORS = ("ValueError", "FileNotFoundError", "SafetensorError", "OSError", "IsADirectoryError")

log = logging.getLogger(__name__)


async def run_whole(aw: Awaitable[Any]) -> Any:
    """Await ``aw`` in its own task, which runs to its end even if the caller is cancelled meanwhile.

    Why: a vLLM utility call (pause, commit, update_weights, label, resume) still runs in the engine
    core after its caller is cancelled, so a swap abandoned halfway leaves the engine paused or serving
    new weights under the old label. Cancelled, this waits for the task (further cancellations too) and
    then re-raises the cancellation; the task's own error, if any, is logged (the caller is going away).
    """
    task = asyncio.ensure_future(aw)
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        while not task.done():
            try:
                await asyncio.wait((task,))  # never cancels the task it waits for
            except asyncio.CancelledError:
                pass
        if not task.cancelled() and task.exception() is not None:
            log.error("a weight swap step failed while its caller was cancelled: %r", task.exception())
        raise


def safetensors_bytes(path: str | os.PathLike) -> int:
    """Bytes of a safetensors file, or of every ``*.safetensors`` file of a directory (a checkpoint)."""
    p = Path(path)
    return sum(f.stat().st_size for f in p.glob("*.safetensors")) if p.is_dir() else p.stat().st_size


class EngineError(RuntimeError):
    """The engine returned something the actor cannot turn into a valid record."""


class SwapPrepare:
    """The checks and the stage build of a swap, before its pause (see the module docstring).

    Needs from the engine: ``llm`` (vLLM ``AsyncLLM``), ``model_path``, ``_expected_specs``, ``_active``
    (groups generating now) and the staging state (``staging``, ``staging_refused``, ``stage_replay``,
    ``stage_replay_refused``), all set by ``Engine.__init__``.
    """

    llm: Any
    model_path: Path
    staging: bool
    staging_refused: str | None
    stage_replay: bool
    stage_replay_refused: str | None
    _expected_specs: dict[str, tuple[tuple[int, ...], str]] | None  # name -> (shape, dtype) served

    async def _stage(self, path: str, version: int) -> bool:
        """Build the stage of ``version`` in the worker(s) while generation goes on; False = this model
        cannot be staged (logged once; in-place reloads from now on). Raises on a bad file (no pause)."""
        # Nothing generating (the synchronous case: every worker waits for these weights): build the
        # stage inside the begin RPC. Nothing is there to overlap with, and the thread's start and the
        # polls (~5 ms of a ~17 ms tiny swap) are saved. Only for small files: a group submitted
        # meanwhile waits for the build, which must stay short.
        try:
            wait = self._active == 0 and safetensors_bytes(path) <= SYNC_STAGE_MAX_BYTES
        except FileNotFoundError as e:
            raise WeightFileGone(f"{path}: the file of v{version} is gone ({e})") from e
        try:
            return await self._stage_built(path, version, wait)
        except asyncio.CancelledError:
            # The begin RPC runs in the engine core whether or not its caller still waits, and its
            # thread builds on. The discard, sent after it (the engine core runs utility calls in
            # order), joins that build and drops it: the next begin finds no stage in progress.
            await run_whole(self.llm.collective_rpc("asyncrl_stage_discard"))
            raise

    async def _stage_built(self, path: str, version: int, wait: bool) -> bool:
        """:meth:`_stage` from the begin RPC on."""
        begun = await self.llm.collective_rpc(
            "asyncrl_stage_begin", args=(path, version, wait, self.stage_replay)
        )
        reasons = [r["unsupported"] for r in begun if "unsupported" in r]
        if reasons:
            self.staging = False
            self.staging_refused = reasons[0]
            log.warning("staged weight swaps refused (%s): reloading in place", reasons[0])
            return False
        states = begun
        t0 = time.perf_counter()
        while not wait:
            # Each poll is one RPC between two model steps (~0.1 ms): the interval grows with the stage
            # so that polling costs little while a large stage builds and adds <= 25% latency.
            await asyncio.sleep(
                min(max(0.25 * (time.perf_counter() - t0), STAGE_POLL_MIN_S), STAGE_POLL_MAX_S)
            )
            states = await self.llm.collective_rpc("asyncrl_stage_poll")
            if any(s["error"] for s in states) or all(s["done"] for s in states):
                break
        errors = [s["error"] for s in states if s["error"]]
        if errors:
            await run_whole(self.llm.collective_rpc("asyncrl_stage_discard"))
            msg = f"staging v{version} from {path} failed: {errors[0]}"
            kind = str(errors[0]).split(":", 1)[0]
            if kind == "FileNotFoundError":
                raise WeightFileGone(msg)
            if kind in _FILE_ERRORS:
                raise WeightFileError(msg)  # the file's content: a refusal of this manifest
            raise EngineError(msg)
        if not all(s["done"] for s in states):
            raise EngineError(f"staging v{version}: the worker reports no stage after building ({states})")
        refused = next((s["plan_refused"] for s in states if s.get("plan_refused")), None)
        if refused and not self.stage_replay_refused:  # once: every stage runs the loaders from now on
            self.stage_replay_refused = refused
            log.warning("stage replay refused (%s): every stage runs the model's weight loaders", refused)
        return True

    def _check_file(self, path: Path, version: int) -> None:
        """Raise :class:`WeightFileError` unless ``path`` holds exactly the served tensors (names, shapes,
        dtypes), tagged ``version``; :class:`WeightFileGone` if it is not there (any more).

        Headers only (cheap). The worker checks names and tag again, but a failure there costs a pause;
        here it costs nothing. A wrong shape passes the worker's checks and fails the in-place reload
        halfway, leaving a half-reloaded model: it is refused here, before the pause.
        """
        try:
            self._check_headers(path, version)
        except WeightFileError:
            raise
        except FileNotFoundError as e:
            raise WeightFileGone(f"{path}: the file of v{version} is gone ({e})") from e
        except Exception as e:  # the file cannot be read as safetensors (truncated, recycled, ...)
            if not path.exists():
                raise WeightFileGone(f"{path}: the file of v{version} is gone ({e})") from e
            raise WeightFileError(f"{path}: unreadable as safetensors ({type(e).__name__}: {e})") from e

    def _check_headers(self, path: Path, version: int) -> None:
        """The worker's own header checks (asyncrl.actors.tensor_specs: tag, duplicate names, names,
        shapes, dtypes), run here on the front end before any pause; their ValueError is a refusal."""
        from asyncrl.actors.tensor_specs import checkpoint_specs, open_checked

        if self._expected_specs is None:
            self._expected_specs = checkpoint_specs(self.model_path)
        if path.is_dir() and not any(path.glob("*.safetensors")):
            raise WeightFileGone(f"{path}: no safetensors files")
        with ExitStack() as stack:
            try:
                open_checked(path, version, stack, self._expected_specs)
            except ValueError as e:
                raise WeightFileError(str(e)) from e
