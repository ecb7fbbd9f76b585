"""The actor pool: N rollout actors as Ray actors, supervised, with a clean stop.

    pool = ActorPool(cfg, run_dir, redis_url=url)
    pool.start()                 # Ray up (or attach), model built once, N actors running
    pool.wait_written(8)         # e.g. in tests
    pool.stop()                  # in-flight groups aborted (not written), engines shut down

``asyncrl.actors.serve.serve_actors(cfg, run_dir, stop_event)`` runs a pool under a leased pool number
until Ctrl-C / SIGTERM / ``stop_event``.

Fault tolerance is Ray's: every actor is created with ``max_restarts`` and ``max_task_retries``,
so a crashed actor process is restarted and its long-running ``run`` call retried on the new
instance, which loads the latest published weights before generating and claims its next prompt
position from the run's Redis (one prompt order per run, whatever the pools and actors). The pool only reports an actor that Ray gave up on (or whose loop
raised) by raising from :meth:`ActorPool.check`.

How Ray is started and what environment reaches an actor: asyncrl.actors.ray_setup; how a lost local
Ray (its GCS or raylet killed) is seen and its teardown bounded: asyncrl.actors.ray_loss. Their names
stay importable from here.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .ray_actor import RayRolloutActor

# Defined there; callers and tests import them from here too (where they were before they moved).
from .ray_loss import RayLost, call_bounded, kill_local_ray, local_ray_lost
from .ray_setup import (
    GCS_LOSS_MARGIN_S,
    GCS_RECONNECT_KEY,
    StartStopped,
    actor_env,
    actor_runtime_env,
    driver_gcs_timeout_s,
    init_ray,
    local_head_system_config,
    ray_connect_message,
)

__all__ = [
    "ActorPool", "RayLost", "actor_env", "actor_runtime_env", "call_bounded", "init_ray",
    # moved (asyncrl.actors.ray_setup, asyncrl.actors.ray_loss), kept importable from here
    "GCS_LOSS_MARGIN_S", "GCS_RECONNECT_KEY", "driver_gcs_timeout_s", "kill_local_ray",
    "local_head_system_config", "local_ray_lost", "ray_connect_message",
]  # fmt: skip

log = logging.getLogger(__name__)


class ActorPool:
    """``cfg.actors.num_actors`` Ray rollout actors writing to the buffer at ``redis_url``."""

    def __init__(
        self,
        cfg: Any,
        run_dir: str | os.PathLike,
        *,
        redis_url: str | None = None,
        redis_password: str | None = None,
        cpu_plan: Any = None,
        owns_ray: bool = False,
        gcs_reconnect_timeout_s: int | None = None,
    ) -> None:
        self.cfg = cfg
        # A local Ray this pool starts: its GCS reconnect timeout (asyncrl.actors.ray_setup.init_ray;
        # `asyncrl run` starts Ray before the pool, with its own); None: Ray's default (serve-actors).
        self.gcs_reconnect_timeout_s = gcs_reconnect_timeout_s
        # asyncrl.cpu_binding.CpuPlan from `asyncrl run` on a CPU box: each slot's cores (None = unbound).
        self.cpu_plan = cpu_plan
        self.run_dir = Path(run_dir)
        self.redis_url = redis_url or cfg.redis.url
        if not self.redis_url:
            raise ValueError("the actor pool needs a Redis URL (redis.url, or the one `asyncrl run` started)")
        self.redis_password = redis_password or cfg.redis.password or None
        self.actors: list[Any] = []
        self.run_refs: list[Any] = []
        self.generations: list[int] = []  # replacements of each slot (asyncrl run's supervision)
        self._model_path: Any = None
        self._started_ray = owns_ray  # the caller started Ray for this pool (init_ray): stop() shuts it down
        self._stopped = False
        self._pg: Any = None  # the actors' placement group: bundle i is actor slot i's reservation
        #: stop_bounded() found the local Ray this pool started without its GCS or raylet and abandoned
        #: the Ray calls (or start() gave up on an unfinished ray.init): the caller must end its process
        #: with os._exit (Ray's atexit shutdown would wait on the dead GCS until Ray's core worker aborts
        #: the process, exit code 1).
        self.ray_lost = False

    # ------------------------------------------------------------------ lifecycle

    def start(
        self, max_groups_per_actor: int | None = None, check: Callable[[], None] | None = None
    ) -> ActorPool:
        """Start (or attach to) Ray and launch every actor's loop; returns without waiting for them.

        ``check()`` runs between the (slow) start-up steps, while Ray starts and the placement group
        waits, and right before any actor is spawned, and raises to abort the start: the command's stop
        (asyncrl.actors.ray_setup.StartStopped), or serve-actors' lost lease (its actor ids may be another
        pool's; an actor spawned now would reclaim that pool's in-flight admission slots)."""

        import ray

        from asyncrl.launch import EarlyRay
        from asyncrl.tinymodel import resolve_model_path

        check = check or (lambda: None)
        # Ray starts in a thread (serve-actors; `asyncrl run` started it already), overlapping the model
        # build, so that its wait is bounded (ray.start_timeout_s) and ends at check()'s stop: on the
        # main thread an unreachable ray.address held the command for good, deaf to its signals.
        ray_start = None if ray.is_initialized() else EarlyRay(self.cfg, self.gcs_reconnect_timeout_s)
        try:
            # Build the tiny model once here: N actors building it concurrently would race on the dir.
            model_path = resolve_model_path(self.cfg, self.run_dir)
            check()
            if ray_start is not None and ray_start.result(check):
                self._started_ray = True
        except BaseException as e:
            if ray_start is not None:  # at the stop, an unfinished ray.init is not waited for
                self._abandon_ray_start(ray_start, wait=not isinstance(e, StartStopped))
            raise
        check()
        self._pg = self._placement_group(check=check)
        self._model_path = model_path
        check()
        self.actors = [self._spawn(i, 0) for i in range(self.cfg.actors.num_actors)]
        self.run_refs = [h.run.remote(max_groups_per_actor) for h in self.actors]
        self.generations = [0] * len(self.actors)
        return self

    def _abandon_ray_start(self, ray_start: Any, wait: bool) -> None:
        """The start failed or was stopped while Ray started: stop that Ray. A ``ray.init`` given up on
        (still running) has what it started killed and :attr:`ray_lost` set: the caller must end its
        process with os._exit (Ray's atexit shutdown would meet the unfinished ray.init). Nothing of the
        pool runs and Ray is down: :meth:`stop` has nothing left to do, and its first Ray call
        (``ray.get([])``) would start a new local Ray (Ray's auto-init), so it is marked done."""
        self._stopped = True
        try:
            ray_start.shutdown(wait)
        except RayLost:
            self.ray_lost = True
        else:
            ray_start.release()

    def _spawn(self, i: int, generation: int) -> Any:
        """Create the Ray actor of slot ``i`` (a replacement gets a fresh name: a killed actor's name
        is released asynchronously)."""
        import ray

        a = self.cfg.actors
        suffix = f"-r{generation}" if generation else ""
        return (
            ray.remote(RayRolloutActor)
            .options(
                name=f"asyncrl-{self.cfg.run.name}-actor-{i}{suffix}",
                **self._placement(i),
                max_restarts=a.max_restarts,
                max_task_retries=a.max_restarts,
                max_concurrency=64,
            )
            .remote(
                self.cfg,
                str(self.run_dir),
                i,
                self.redis_url,
                self.redis_password,
                str(self._model_path),
                env=self._actor_env(i),
            )
        )

    def _actor_env(self, i: int) -> dict[str, str]:
        """Slot ``i``'s environment (set by the actor as it starts): the common one, plus its cores when
        the pool is CPU-bound (the actor binds itself to them at start; its engine's OpenMP threads get
        them from vLLM)."""
        env = actor_env()
        if self.cpu_plan is not None:
            from asyncrl.cpu_binding import engine_env, frontend_cpus, frontend_placement

            a = self.cfg.actors
            front = frontend_cpus(self.cpu_plan, i, frontend_placement(self.cfg))
            env.update(
                engine_env(self.cpu_plan.engine(i), a.tensor_parallel_size * a.pipeline_parallel_size, front)
            )
        return env

    def replace_actor(self, i: int, before_spawn: Any = None, timeout: float = 30.0) -> bool:
        """Kill slot ``i``'s actor for good and, once its death is confirmed (its run call failed
        within ``timeout`` seconds), start a new one in its place (``asyncrl run``'s supervision);
        returns whether it did. ``before_spawn()`` runs between the two, before the new one can admit
        anything (the supervisor reclaims the dead incarnation's admission slots there).

        Invariant: no replacement runs beside a possibly live predecessor. They share the slot's actor
        id, and a new incarnation reclaims that id's in-flight slots as it starts, so a predecessor
        that could still write (its node unreachable, say) would have a slot credited twice and
        admission widened for good. Unconfirmed, the slot stays killed and unreplaced (its slots
        taken); the supervisor tries again at its next check."""
        import ray

        ray.kill(self.actors[i], no_restart=True)
        # Its run() call fails once the process is gone: proof that it can no longer write or admit.
        dead, _ = ray.wait([self.run_refs[i]], timeout=timeout)
        if not dead:
            return False
        if before_spawn is not None:
            before_spawn()
        self.generations[i] += 1
        self.actors[i] = self._spawn(i, self.generations[i])
        self.run_refs[i] = self.actors[i].run.remote(None)
        return True

    def bundle(self) -> dict[str, float]:
        """One actor's reservation: its CPUs, GPUs for every tensor/pipeline-parallel worker of its engine,
        and the custom resources that pin it to chosen nodes."""
        a = self.cfg.actors
        gpus = a.num_gpus_per_actor * a.tensor_parallel_size * a.pipeline_parallel_size
        b = {"CPU": float(a.num_cpus_per_actor), **{k: float(v) for k, v in a.resources.items()}}
        if gpus:
            b["GPU"] = float(gpus)
        return b

    def _placement_group(self, timeout: float = 120.0, check: Callable[[], None] = lambda: None) -> Any:
        """Reserve every actor's bundle at once (Ray schedules the group atomically, so a pool that does
        not fit fails here, naming what it asked for, instead of leaving actors pending forever).
        ``check()`` runs once a second while it waits (see :meth:`start`)."""
        import ray
        from ray.util.placement_group import placement_group

        a = self.cfg.actors
        pg = placement_group([self.bundle()] * a.num_actors, strategy=a.placement_strategy)
        deadline = time.monotonic() + timeout
        ready: list[Any] = []
        while not ready and time.monotonic() < deadline:
            try:
                check()
            except BaseException:
                ray.util.remove_placement_group(pg)
                raise
            ready, _ = ray.wait([pg.ready()], timeout=min(1.0, max(deadline - time.monotonic(), 0.0)))
        if not ready:
            ray.util.remove_placement_group(pg)
            raise RuntimeError(
                f"the Ray cluster cannot place {a.num_actors} actor(s) x {self.bundle()} "
                f"({a.placement_strategy}) within {timeout:.0f}s; cluster resources: {ray.cluster_resources()}"
            )
        return pg

    def _placement(self, i: int) -> dict[str, Any]:
        """Ray options that run actor slot ``i`` inside bundle ``i`` of the pool's placement group."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        b = self.bundle()
        return {
            "num_cpus": b["CPU"],
            "num_gpus": b.get("GPU", 0.0),
            "resources": {k: v for k, v in b.items() if k not in ("CPU", "GPU")},
            "scheduling_strategy": PlacementGroupSchedulingStrategy(
                placement_group=self._pg, placement_group_bundle_index=i
            ),
        }

    def check(self) -> None:
        """Raise if an actor's loop failed for good (an error, or Ray ran out of restarts)."""
        import ray

        done, _ = ray.wait(self.run_refs, num_returns=len(self.run_refs), timeout=0)
        for ref in done:
            ray.get(ref)  # raises the actor's exception, if any

    def stats(self, timeout: float = 30.0) -> list[dict[str, Any]]:
        """Each actor's counters (an actor being restarted answers once it is back)."""
        import ray

        return ray.get([h.stats.remote() for h in self.actors], timeout=timeout)

    def written(self) -> int:
        """Groups written by the current incarnation of every actor."""
        return sum(s["groups_written"] for s in self.stats())

    def wait_written(self, n: int, timeout: float = 300.0, poll_s: float = 0.5) -> int:
        """Block until the actors have written ``n`` groups in total; returns the count."""
        deadline = time.monotonic() + timeout
        while True:
            self.check()
            got = self.written()
            if got >= n:
                return got
            if time.monotonic() > deadline:
                raise TimeoutError(f"actors wrote {got} of {n} groups within {timeout}s")
            time.sleep(poll_s)

    def kill_actor(self, i: int, restart: bool = True) -> None:
        """Kill actor ``i`` abruptly; with ``restart`` Ray brings it back (its restart budget permitting)."""
        import ray

        ray.kill(self.actors[i], no_restart=not restart)

    def crash_actor(self, i: int) -> None:
        """Make actor ``i`` exit its process from inside (``os._exit``), like a crash."""
        self.actors[i].crash.remote()

    @property
    def owns_local_ray(self) -> bool:
        """This pool started the local Ray it runs on (its GCS and raylet live and die with this process)."""
        return self._started_ray

    def stop_bounded(self, poll_s: float = 0.5) -> list[dict[str, Any]]:
        """:meth:`stop`, abandoned as soon as the local Ray this pool started has lost its GCS or raylet.

        A SIGTERM to the whole process group of `asyncrl run` (``timeout``, ``kill -- -PGID``, systemd,
        scancel) reaches Ray's GCS and raylet, which are in that group too: every Ray call of the stop
        would then wait on the dead GCS until Ray's core worker aborts this process (after
        :func:`driver_gcs_timeout_s`, exit code 1, no summary). Here the stop runs in a daemon thread
        that is left behind once that is seen (:func:`call_bounded`); the rest of Ray's processes are
        killed, :class:`RayLost` raised, and :attr:`ray_lost` tells the caller to end with os._exit."""
        try:
            return call_bounded(self.stop, lambda: self._started_ray, poll_s)
        except RayLost:
            self.ray_lost = True
            raise

    def stop(self, abort: bool = True, timeout: float = 120.0) -> list[dict[str, Any]]:
        """Stop every actor: ``abort`` cancels in-flight groups (not written, admission credited),
        else they finish first. Engines shut down inside the actors; then the actors are killed and
        Ray shut down if this pool started it. Returns the actors' final counters."""
        import ray

        if self._stopped:
            return []
        self._stopped = True
        results: list[dict[str, Any]] = []
        errors: list[BaseException] = []
        try:
            ray.get([h.stop.remote(abort) for h in self.actors], timeout=timeout)
            for ref in self.run_refs:
                try:
                    results.append(ray.get(ref, timeout=timeout))
                except Exception as e:  # collected, re-raised after cleanup
                    errors.append(e)
        finally:
            for h in self.actors:
                ray.kill(h, no_restart=True)
            if self._pg is not None:
                ray.util.remove_placement_group(self._pg)
                self._pg = None
            if self._started_ray:
                if local_ray_lost():  # ray.shutdown would wait on the dead GCS (see stop_bounded)
                    self.ray_lost = True
                    kill_local_ray()
                    raise RayLost()
                ray.shutdown()
        if errors:
            raise errors[0]
        return results
