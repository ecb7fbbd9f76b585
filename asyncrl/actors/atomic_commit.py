"""A staged weight swap committed by one utility call of the vLLM engine core, with no scheduler pause.

Why: a staged swap's commit is pointer moves (asyncrl.actors.staging), but around it
:mod:`asyncrl.actors.weight_swaps` sends five utility calls in turn (pause, commit, version label, KV
reset, resume): ~2.3 ms of paused generation per swap on the 2-core box, and five round trips of the
actor's front end. The pause is there so that no model step runs between the commit, the label and
the KV reset. The engine core runs a utility call between two steps of its busy loop, so when the three
run inside *one* call nothing can step between them: the same guarantee, without a pause.

Invariant (checked by :func:`atomic_commit_supported`, which the front end asks once): only an engine
core whose steps are synchronous, i.e. without vLLM's batch queue (``max_concurrent_batches`` > 1:
async scheduling or pipeline parallelism keep a step in flight while inputs are processed). The
others, and engine cores this module is not installed in, keep the paused sequence.

Why it holds for any executor: the engine core's thread runs the utility call, and with it the
``collective_rpc`` to the worker(s), to its end before it schedules the next step.

Installed into vLLM's ``EngineCore`` by :func:`install`, which asyncrl's executors
(:mod:`asyncrl.actors.inproc_executor`, the CPU default, and :mod:`asyncrl.actors.quiet_executor`) run
when the engine core loads them; engines on vLLM's own executors keep the paused sequence. This module
imports vLLM only in :func:`install`.
"""

from __future__ import annotations

from typing import Any

__all__ = ["ATOMIC_COMMIT", "SUPPORTED", "install"]

#: The engine-core utility methods this module adds (called with ``engine_core.call_utility_async``).
ATOMIC_COMMIT = "asyncrl_atomic_commit"
SUPPORTED = "asyncrl_atomic_commit_supported"


def atomic_commit_supported(self: Any) -> bool:
    """Whether this engine core steps synchronously (no batch queue): see the module doc."""
    return getattr(self, "batch_queue", None) is None


def atomic_commit(self: Any, version: int, reset_running: bool) -> None:
    """Switch the worker(s) to the built stage of ``version``, label every later step with it and, with
    ``reset_running``, preempt the running requests so that they re-prefill under the new weights."""
    if not atomic_commit_supported(self):  # never reached through the front end, which asks first
        raise RuntimeError("asyncrl_atomic_commit needs an engine core without a batch queue")
    self.collective_rpc("asyncrl_stage_commit", args=(int(version),))
    self.set_weight_version(str(int(version)))
    if reset_running and not self.reset_prefix_cache(reset_running_requests=True):
        raise RuntimeError("reset_prefix_cache failed after a staged commit")


def install() -> None:
    """Add the two utility methods to vLLM's ``EngineCore`` (idempotent)."""
    from vllm.v1.engine.core import EngineCore

    setattr(EngineCore, ATOMIC_COMMIT, atomic_commit)
    setattr(EngineCore, SUPPORTED, atomic_commit_supported)
