"""vLLM rollout actors: engine wrapper (``engine``), worker extension for in-place weight reload
(``worker_ext``), the actor loop (``actor``) and the Ray pool (``pool``).

    from asyncrl.actors import ActorPool, serve_actors

Importing this package is cheap: vllm, torch and ray load only when a submodule that needs them is
used. The actors never import ``asyncrl.learner``; they meet it only through ``asyncrl.buffer``.
"""

from __future__ import annotations

from typing import Any

__all__ = ["ActorPool", "serve_actors", "RolloutActor", "Engine"]

_WHERE = {
    "ActorPool": "asyncrl.actors.pool",
    "serve_actors": "asyncrl.actors.serve",
    "RolloutActor": "asyncrl.actors.actor",
    "Engine": "asyncrl.actors.engine",
}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        import importlib

        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module 'asyncrl.actors' has no attribute {name!r}")
