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
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from .ray_actor import RayRolloutActor
from .supervision import RayConnectError

__all__ = ["ActorPool", "RayLost", "actor_env", "actor_runtime_env", "call_bounded", "init_ray"]

log = logging.getLogger(__name__)

# Environment the actor processes need: vLLM/HF settings of the launching shell travel with them
# (a remote Ray cluster does not inherit the driver's environment).
_ENV_PREFIXES = ("VLLM_", "HF_", "TRANSFORMERS_", "OMP_", "KMP_", "LD_PRELOAD")
#: What the dynamic loader reads as a process starts: only Ray's runtime_env can put these in a worker's
#: environment in time. Everything else an actor needs is read later (vLLM's and asyncrl's variables when
#: the engine is built, libgomp's when torch is first imported, after the actor's constructor began).
_LOAD_TIME = ("LD_PRELOAD",)


def actor_env() -> dict[str, str]:
    """The environment every actor process gets (on top of its worker's), set by the actor itself as its
    constructor starts (:class:`asyncrl.actors.ray_actor.RayRolloutActor`)."""
    env = {k: v for k, v in os.environ.items() if k.startswith(_ENV_PREFIXES)}
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    # vLLM's engine runs in child processes; inside a Ray actor it must spawn, never fork.
    env.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    return env


def actor_runtime_env() -> dict[str, Any]:
    """The Ray job's ``runtime_env``: the load-time variables only (``LD_PRELOAD``), empty when there are
    none. Why not every variable: Ray starts a few idle workers as its raylet comes up, with no
    runtime_env, and only an actor whose runtime_env is empty can take one; any other waits for a worker
    started for it (a bare actor's constructor ran 1.2-1.6 s after its creation instead of 0.3-0.6 s on
    the 2-core box, on the path to the first step). The rest of the environment travels in the actor's
    constructor arguments (:func:`actor_env`), as its Redis URL and password already did."""
    env = {k: v for k, v in os.environ.items() if k.startswith(_LOAD_TIME)}
    return {"env_vars": env} if env else {}


@contextlib.contextmanager
def _keep_signal_handlers() -> Iterator[None]:
    """Restore the Python SIGINT/SIGTERM handlers after the block (main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in saved.items():
            if handler is not None:
                signal.signal(sig, handler)


def init_ray(cfg: Any) -> bool:
    """Start a local Ray for the actors (or attach to ``ray.address``); True when this call started it,
    False when Ray was already up in this process. Callable from any thread (`asyncrl run` starts Ray
    in the background while it builds the model): off the main thread the caller must re-install its
    SIGINT/SIGTERM handlers afterwards, on the main thread they are kept here."""
    import ray

    if ray.is_initialized():
        return False
    # ray.init installs a native SIGTERM handler that dumps a stack and aborts the driver;
    # keep the caller's Python handlers (e.g. "set the stop event") in charge instead.
    with _keep_signal_handlers():
        try:
            ray.init(
                address=cfg.ray.address or None,
                num_cpus=(cfg.ray.num_cpus or None) if not cfg.ray.address else None,
                include_dashboard=False,
                runtime_env=actor_runtime_env() or None,
                logging_level=logging.WARNING,
                # asyncrl run: the actors write to <run_dir>/logs (asyncrl.console); -v forwards.
                log_to_driver=not cfg.console.log_dir,
                _system_config=local_head_system_config(cfg),
            )
        except (ray.exceptions.AuthenticationError, ConnectionError) as e:
            raise RayConnectError(ray_connect_message(cfg.ray.address, e)) from e
    return True


#: Ray's setting: how long (s) its core worker waits for a lost GCS before it ends the process
#: (std::_Exit(1)); 60 by default.
GCS_RECONNECT_KEY = "gcs_rpc_server_reconnect_timeout_s"
#: What the teardown after a lost GCS needs beside the learner's grace (its SIGKILL wait, the pool
#: stop's abandonment, Redis's stop, the summary, and the supervision pass that was running).
GCS_LOSS_MARGIN_S = 120


def driver_gcs_timeout_s(cfg: Any) -> int:
    """Ray's ``gcs_rpc_server_reconnect_timeout_s`` for a local head this process starts: long enough for
    `asyncrl run`'s teardown after a SIGTERM to its process group (which kills the GCS) to stop the
    learner with its full ``learner.stop_grace_s``; at Ray's default (60 s) the core worker ended the
    driver in the middle of a long final checkpoint, without summary.json, the learner SIGKILLed with
    it (it dies with its parent, asyncrl.lifetime). Never below Ray's default."""
    return max(60, math.ceil(cfg.learner.stop_grace_s) + GCS_LOSS_MARGIN_S)


def local_head_system_config(cfg: Any) -> dict[str, Any] | None:
    """Ray's ``_system_config`` for :func:`init_ray`: the GCS reconnect timeout of
    :func:`driver_gcs_timeout_s` when this call starts a new local Ray (the config is the cluster's, set
    when its head starts); None when it attaches to a running cluster (``ray.address``, ``RAY_ADDRESS``
    or a ``ray start --head`` on this machine), where Ray refuses one."""
    if cfg.ray.address:
        return None
    try:
        from ray._private.services import canonicalize_bootstrap_address

        if canonicalize_bootstrap_address(None) is not None:
            return None
    except Exception:  # a Ray without this helper: leave its config alone
        return None
    return {GCS_RECONNECT_KEY: driver_gcs_timeout_s(cfg)}


class RayLost(RuntimeError):
    """The local Ray this process started lost its GCS or raylet: its Ray calls were abandoned and its
    processes killed; the process must end with os._exit (Ray's atexit shutdown waits on the dead GCS)."""

    def __init__(self) -> None:
        super().__init__("the local Ray lost its GCS or raylet (a signal to the process group?): "
                         "its processes were killed without an orderly stop")  # fmt: skip


def call_bounded(fn: Callable[[], Any], watch: Callable[[], bool] = lambda: True, poll_s: float = 0.5) -> Any:
    """``fn()`` (a call of Ray's teardown), abandoned as soon as the local Ray this process started has
    lost its GCS or raylet while ``watch()`` is true: every Ray call would then wait on the dead GCS until
    Ray's core worker ends the process. ``fn`` runs in a daemon thread that is left behind; what is left
    of Ray's processes is killed and :class:`RayLost` raised. ``fn``'s own result or error otherwise."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["result"] = fn()
        except BaseException as e:  # re-raised in the caller's thread
            box["error"] = e

    t = threading.Thread(target=run, name="ray-teardown", daemon=True)
    t.start()
    while t.is_alive():
        if watch() and local_ray_lost():
            kill_local_ray()
            raise RayLost()
        t.join(poll_s)
    if "error" in box:
        raise box["error"]
    return box.get("result")


def local_ray_lost() -> bool:
    """True when this process started a local Ray whose GCS or raylet has exited. Not while Ray's own
    teardown kills them (ray.shutdown, :func:`kill_local_ray`: they hold the node's removal lock while a
    killed process is still listed), so a call of ray.shutdown can be watched too. After a SIGTERM to the
    process group (Ray 2.60) the GCS stops serving at once but its process may linger; the raylet exits
    within ~10 s: that is what shows the loss."""
    try:
        from ray._private import worker

        node = worker._global_node
        if node is None or not node.head:
            return False
        lock = getattr(node, "removal_lock", None)
        if lock is not None and not lock.acquire(blocking=False):
            return False  # Ray is killing its processes itself
        try:
            return any(kind in ("gcs_server", "raylet") for kind, _ in node.dead_processes())
        finally:
            if lock is not None:
                lock.release()
    except Exception:  # a Ray without these internals: assume alive (the plain stop path)
        return False


def kill_local_ray() -> None:
    """SIGKILL what is left of the local Ray this process started (and reap it), without a Ray call."""
    try:
        from ray._private import worker

        node = worker._global_node
        if node is not None:
            node.kill_all_processes(check_alive=False, allow_graceful=False, wait=True)
    except Exception:  # best effort: the run's reaper (asyncrl.lifetime) takes the rest on exit
        pass


def ray_connect_message(address: str | None, e: BaseException) -> str:
    """One line for a Ray that refused or could not be reached, with the usual cause: a cluster started
    by ``ray start --head`` with ``~/.ray/auth_token`` present uses token authentication, and every
    driver and node must then run with RAY_AUTH_MODE=token and that token (Ray's own error names
    neither in its first line)."""
    first = next((line.strip() for line in str(e).splitlines() if line.strip()), type(e).__name__)
    return (
        f"cannot connect to Ray at {address or 'a new local cluster'}: {type(e).__name__}: {first[:200]} "
        f"(a cluster started by `ray start --head` with ~/.ray/auth_token present needs "
        f"`export RAY_AUTH_MODE=token` in every shell that runs `ray start` or asyncrl, and that token "
        f"file copied to every node)"
    )


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
    ) -> None:
        self.cfg = cfg
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
        #: the Ray calls: the caller must end its process with os._exit (Ray's atexit shutdown would wait
        #: on the dead GCS until Ray's core worker aborts the process, exit code 1).
        self.ray_lost = False

    # ------------------------------------------------------------------ lifecycle

    def start(
        self, max_groups_per_actor: int | None = None, check: Callable[[], None] | None = None
    ) -> ActorPool:
        """Start (or attach to) Ray and launch every actor's loop; returns without waiting for them.

        ``check()`` runs between the (slow) start-up steps and right before any actor is spawned, and
        raises to abort the start (serve-actors: the pool lost its number's lease, so its actor ids may
        be another pool's; an actor spawned now would reclaim that pool's in-flight admission slots)."""

        from asyncrl.tinymodel import resolve_model_path

        check = check or (lambda: None)
        # Build the tiny model once here: N actors building it concurrently would race on the dir.
        model_path = resolve_model_path(self.cfg, self.run_dir)
        check()
        if init_ray(self.cfg):
            self._started_ray = True
        check()
        self._pg = self._placement_group(check=check)
        self._model_path = model_path
        check()
        self.actors = [self._spawn(i, 0) for i in range(self.cfg.actors.num_actors)]
        self.run_refs = [h.run.remote(max_groups_per_actor) for h in self.actors]
        self.generations = [0] * len(self.actors)
        return self

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
