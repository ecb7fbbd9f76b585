"""The Ray-facing wrapper of :class:`asyncrl.actors.actor.RolloutActor` (the pool applies
``ray.remote`` to it with the restart options). Every method is async so that ``stats``/``stop``
run concurrently with the long ``run`` call on the actor's event loop."""

from __future__ import annotations

import logging
import os
from typing import Any

from .actor import RolloutActor

__all__ = ["RayRolloutActor"]


class RayRolloutActor:
    """One rollout actor in its own Ray worker process."""

    def __init__(
        self,
        cfg: Any,
        run_dir: str,
        actor_index: int,
        redis_url: str,
        redis_password: str | None,
        model_path: str | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        # First: the pool's environment for this actor (asyncrl.actors.pool.actor_env), before anything
        # reads it (vLLM, the CPU binding, the engine standby's start-up environment, torch's libgomp).
        # It comes here rather than in a Ray runtime_env so that the actor can take one of Ray's idle
        # workers, which were started with none.
        os.environ.update(env or {})
        if cfg.console.log_dir:  # asyncrl run: this actor's and its vLLM engine's output to a file
            from asyncrl.console import redirect_output

            redirect_output(os.path.join(cfg.console.log_dir, f"actor-{actor_index}.log"))
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
        self.actor = RolloutActor(
            cfg,
            run_dir,
            actor_index,
            redis_url=redis_url,
            redis_password=redis_password,
            model_path=model_path,
        )
        self._stop_metrics = None
        if cfg.metrics.enabled:
            import ray

            from asyncrl.metrics_export import actor_collector, metrics_endpoint, serve

            # Advertise the node's address, as Ray knows it, for a wildcard or `node` bind: that is
            # what a Prometheus on another machine can reach (never the literal 0.0.0.0).
            bind, advertised = metrics_endpoint(cfg.metrics.host, ray.util.get_node_ip_address())
            port, self._stop_metrics = serve(
                [actor_collector(self.actor.actor_id, lambda: self.actor.last_stats)], bind, 0
            )
            self.actor.metrics_addr = f"{advertised}:{port}"

    async def run(self, max_groups: int | None = None) -> dict[str, Any]:
        return await self.actor.run(max_groups)

    async def stop(self, abort: bool = True) -> None:
        await self.actor.stop(abort)

    async def stats(self) -> dict[str, Any]:
        return self.actor.stats()

    async def set_swap_mode(self, mode: str) -> None:
        self.actor.set_swap_mode(mode)

    async def pid(self) -> int:
        return os.getpid()

    async def crash(self) -> None:
        """Die at once, as a segfault or OOM kill would (tests)."""
        os._exit(1)
