"""vLLM's in-process executor for a one-device CPU engine: the worker runs inside the engine-core process.

Why: vLLM's CPU platform replaces the ``"uni"`` backend by its multiprocess executor (``OMP requires the
MP executor``, vllm/platforms/cpu.py), so a CPU engine starts *three* processes in turn (the actor's
front end, the engine core, the worker), each spawned and importing torch and vLLM; on the 2-core box
the worker alone took ~7 s of the engine's ~21 s start-up. Every step then crosses a shared-memory
queue whose readers busy-wait (asyncrl.actors.quiet_executor bounds that, it cannot remove it).

:class:`InProcessExecutor` is vLLM's own ``UniProcExecutor``, unchanged; naming it by qualified name
(``distributed_executor_backend``) instead of ``"uni"`` is what keeps the platform from swapping it
out. The worker (CPUWorker + asyncrl's extension) is created in the engine-core process, and
``collective_rpc`` (weight updates, asyncrl.actors.worker_ext) becomes a direct call.

What vLLM's reason was, and how it is kept: libgomp reads its binding (``OMP_NUM_THREADS``,
``OMP_PLACES``/``OMP_PROC_BIND``, or the KMP/GOMP equivalents) from the environment once, when the
process loads it, so the multiprocess executor sets them around the worker's spawn. Here the process
that runs the model is the engine core, so :func:`omp_env` applies vLLM's own ``OMPProcessManager``
settings (from ``VLLM_CPU_OMP_THREADS_BIND``) around the engine core's spawn instead
(asyncrl.actors.engine). Only for tensor- and pipeline-parallel size 1: more ranks need processes.

This module imports vLLM: it is loaded by vLLM (the front end resolves the name, the engine core
unpickles the class), never by the actor at import time.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from vllm.v1.executor.uniproc_executor import UniProcExecutor

from asyncrl.actors import atomic_commit

__all__ = ["InProcessExecutor", "QUALNAME", "omp_env"]

# The engine core that loads this executor gets the one-call staged commit (asyncrl.actors.atomic_commit).
atomic_commit.install()

QUALNAME = "asyncrl.actors.inproc_executor.InProcessExecutor"


class InProcessExecutor(UniProcExecutor):
    """``UniProcExecutor`` under a name vLLM's CPU platform does not rewrite to ``"mp"``."""


@contextlib.contextmanager
def omp_env(vllm_config: Any) -> Iterator[None]:
    """The OpenMP environment vLLM gives its rank-0 CPU worker, set while the block runs (the engine
    core is spawned inside it and inherits it). No-op off CPU or with ``VLLM_CPU_OMP_THREADS_BIND=nobind``."""
    from vllm.utils.ompmultiprocessing import OMPProcessManager

    with OMPProcessManager(vllm_config).configure_omp_envs(rank=0, local_rank=0):
        yield
