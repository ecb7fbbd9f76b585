"""vLLM's per-weight-swap INFO line, kept out of the actor's log.

Why: ``<log_dir>/actor-<i>.log`` takes everything the actor and its engine processes write (their fds 1
and 2 are redirected there, asyncrl.console.redirect_output) and nothing rotates it. In a steady run the
only lines that came at the rate of steps were two per weight swap, i.e. per published version: asyncrl's
``serving vN`` (INFO only for the first version an engine serves, asyncrl.actors.version_watch) and the
engine core's ``Successfully reset prefix cache`` (vLLM's ``vllm.v1.core.block_pool`` logger at INFO,
once per swap's KV reset). Measured on the demo: 217 bytes per step, the file's only growth with steps
(~2 MB per 10k steps, per actor); what is left is per event (start-up, restarts, evals, throttled
warnings: asyncrl.log_throttle).

:func:`quiet_routine_lines` adds a filter to that one logger in the calling process: below WARNING its
records pass only while vLLM logs at DEBUG (``VLLM_LOGGING_LEVEL=DEBUG``); its "Failed to reset prefix
cache" warning always passes, and no other vLLM logger changes. A filter, not a level: vLLM configures
its logging (``logging.config.dictConfig``) when the engine core starts, which resets the level of every
``vllm.*`` logger but keeps their filters, and the engine core's modules may be imported before that (the
actor's standby preloads them, asyncrl.actors.engine_start.PRELOAD). It runs where asyncrl code runs
inside the engine-core process: the worker extension's import (asyncrl.actors.worker_ext; the CPU
in-process engine and a one-GPU engine run their worker in the engine core) and asyncrl's multiprocess
executor (asyncrl.actors.quiet_executor: multi-device and multi-process CPU engines). An engine on
vLLM's stock ``mp`` executor (``actors.engine_busy_loop_ms`` = vLLM's 1000 with several devices) keeps
the line. Stdlib only: importing this module imports nothing of vLLM.
"""

from __future__ import annotations

import logging

__all__ = ["ROUTINE_LOGGERS", "RoutineFilter", "quiet_routine_lines"]

#: vLLM loggers whose INFO lines repeat at every weight swap.
ROUTINE_LOGGERS = ("vllm.v1.core.block_pool",)


class RoutineFilter(logging.Filter):
    """Drops records below WARNING unless vLLM's own logger is at DEBUG."""

    def filter(self, record: logging.LogRecord) -> bool:
        return (
            record.levelno >= logging.WARNING
            or logging.getLogger("vllm").getEffectiveLevel() <= logging.DEBUG
        )


def quiet_routine_lines() -> None:
    """Add a :class:`RoutineFilter` to each of :data:`ROUTINE_LOGGERS` in this process (idempotent)."""
    for name in ROUTINE_LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, RoutineFilter) for f in logger.filters):
            logger.addFilter(RoutineFilter())
