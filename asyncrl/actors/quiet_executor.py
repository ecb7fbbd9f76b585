"""vLLM's multiprocess executor with a bounded busy-wait on its shared-memory queues.

vLLM's engine processes talk over shared-memory ring buffers (``shm_broadcast.MessageQueue``). A reader
that has just read a message keeps polling the buffer with ``sched_yield`` for ``busy_loop_s`` (a hard
1 s in vLLM 0.32, no setting) before it sleeps on a zmq notification socket. Two readers do that: the
worker (waiting for the next step from the engine core) and the engine core (waiting for the worker's
result). On a GPU box that spin burns an otherwise idle host core; on a CPU-only box it takes a core
from generation or from a co-located learner (measured: ~0.9 core held by an engine that generates
~20% of the time, and a learner step 3.4x slower inside the pipeline than alone).

:class:`QuietMultiprocExecutor` is vLLM's own ``MultiprocExecutor`` (vLLM resolves it by qualified name
from ``distributed_executor_backend``, inside the engine-core process), with ``busy_loop_s`` set from
``additional_config[CONFIG_KEY]`` on every reader it owns: the engine core's response queues here, and
the workers' broadcast queue through a ``collective_rpc``. A reader past its window takes vLLM's own
idle path (poll on the writer's notification socket; the writer notifies after every message), so
correctness is vLLM's; only the wake-up latency of an idle reader changes (tens of microseconds).

This module imports vLLM: it is loaded only by vLLM's engine core (never by the actor at import time).
"""

from __future__ import annotations

import gc
from typing import Any

from vllm.distributed.device_communicators.shm_broadcast import SpinCondition
from vllm.v1.executor.multiproc_executor import MultiprocExecutor

from asyncrl.actors import atomic_commit
from asyncrl.actors.engine_logs import quiet_routine_lines

__all__ = ["QuietMultiprocExecutor", "QUALNAME", "CONFIG_KEY", "set_reader_busy_loop"]

# The engine core that loads this executor gets the one-call staged commit (asyncrl.actors.atomic_commit).
atomic_commit.install()
# ... and logs no "Successfully reset prefix cache" line per swap (asyncrl.actors.engine_logs).
quiet_routine_lines()

QUALNAME = "asyncrl.actors.quiet_executor.QuietMultiprocExecutor"
CONFIG_KEY = "asyncrl_busy_loop_s"


def set_reader_busy_loop(_worker: Any, seconds: float) -> int:
    """Set ``busy_loop_s`` of every shared-memory queue reader of this process; returns how many.

    Runs inside each vLLM worker (``collective_rpc`` passes the worker as the first argument). The
    worker's broadcast queue belongs to vLLM's ``WorkerProc``, which the worker object does not
    reference, so the readers are found among the live objects; a process has a handful of them."""
    readers = [o for o in gc.get_objects() if isinstance(o, SpinCondition) and o.is_reader]
    for r in readers:
        r.busy_loop_s = seconds
    return len(readers)


class QuietMultiprocExecutor(MultiprocExecutor):
    """``MultiprocExecutor`` whose queue readers busy-wait at most ``additional_config[CONFIG_KEY]`` s."""

    def _init_executor(self) -> None:
        super()._init_executor()
        extra = self.vllm_config.additional_config or {}
        if CONFIG_KEY not in extra:
            return  # vLLM's default spin
        seconds = float(extra[CONFIG_KEY])
        self.busy_loop_s = seconds
        for mq in self.response_mqs:
            cond = getattr(mq, "_spin_condition", None)
            if cond is not None and cond.is_reader:
                cond.busy_loop_s = seconds
        # One reader per worker (its broadcast queue); fewer would mean vLLM changed its queues.
        counts = self.collective_rpc(set_reader_busy_loop, args=(seconds,))
        self.worker_readers = list(counts)
