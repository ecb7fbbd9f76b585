"""The end of `asyncrl run`: the ordered teardown of its roles, and the local Ray's loss.

Invariant: whatever happens, :func:`teardown` stops the pool (engines + Ray), the learner process and
the embedded Redis in that order, each step even if an earlier one raised, so no redis-server, Ray or
vLLM process outlives the command. A SIGTERM to the whole process group also kills Ray's GCS and
raylet: the pool's stop (or, before the pool, Ray's shutdown: :func:`shutdown_early_ray`) is then
abandoned (asyncrl.actors.ray_loss.call_bounded), summary.json written and redis.url removed before the
learner's stop, and the process ends with os._exit (:func:`exit_now`, asyncrl.actors.ray_loss's), also
when an error escapes: Ray's own atexit shutdown would wait on the dead GCS until Ray's core worker ends
the process (exit code 1).
Moved out of asyncrl.orchestrator (still importable there, under their old names with a leading ``_``).
"""

from __future__ import annotations

import sys
from typing import Any

from asyncrl.actors.ray_loss import exit_now  # noqa: F401  (its home since serve-actors uses it too)
from asyncrl.launch import EarlyRay, stop_process
from asyncrl.run_supervisor import Supervisor
from asyncrl.run_targets import clear_targets


def teardown(pool: Any, sup: Supervisor, buf: Any, lease: Any = None, ray_gone: bool = False,
             on_ray_lost: Any = None) -> int:  # fmt: skip
    """Empty the Prometheus targets, then stop the pool (and free its number's lease), the learner and
    the embedded Redis, in that order; each step runs even if an earlier one raised. Returns the
    learner's exit code (0 when it was never started).

    When the local Ray is gone (``ray_gone``, or the pool's stop abandoned: ``pool.ray_lost``), Ray's
    core worker ends this process after ``gcs_rpc_server_reconnect_timeout_s`` (raised to cover the
    learner's grace, asyncrl.actors.ray_setup.driver_gcs_timeout_s) whatever it is doing: before the
    learner's stop, ``on_ray_lost()`` runs (`asyncrl run` writes summary.json there) and redis.url is
    removed, so neither depends on the process outliving that stop."""

    def step(what: str, fn: Any) -> Any:
        try:
            return fn()
        except Exception as e:  # reported; the rest of the tear-down (and the summary after it) still runs
            print(f"{what}: {type(e).__name__}: {e}", file=sys.stderr)
            return None

    step("metrics targets clear", lambda: clear_targets(sup.rdir))
    if pool is not None:  # bounded: a signal to the process group may have taken Ray's GCS down with it
        step("actor pool stop", pool.stop_bounded)
    if lease is not None:  # after the pool: no actor of ours runs once another pool may take the number
        step("actor pool lease release", lease.release)
    if ray_gone or (pool is not None and pool.ray_lost):
        if sup.redis_srv is not None:  # its server stops with this process, whenever that ends
            step("redis.url removal", lambda: (sup.rdir / "redis.url").unlink(missing_ok=True))
        if on_ray_lost is not None:
            step("summary before the learner stop", on_ray_lost)
    learner, grace_s = sup.learner, sup.cfg.learner.stop_grace_s
    rc = step("learner stop", lambda: stop_process(learner, grace_s)) if learner is not None else 0
    if buf is not None:
        step("buffer close", buf.close)
    if sup.redis_srv is not None:
        step("redis stop", sup.redis_srv.stop)
        (sup.rdir / "redis.url").unlink(missing_ok=True)
    return -1 if rc is None else rc


def shutdown_early_ray(early_ray: EarlyRay) -> bool:
    """Stop the Ray this run started when the run failed before an actor pool took it over, bounded like
    the pool's stop (:func:`asyncrl.actors.ray_loss.call_bounded`); True when it was abandoned (its GCS or
    raylet gone: the process must end with os._exit)."""
    from asyncrl.actors.ray_loss import RayLost, call_bounded, kill_local_ray, local_ray_lost

    if local_ray_lost():  # ray.shutdown would wait on the dead GCS
        kill_local_ray()
        return True
    try:
        call_bounded(early_ray.shutdown)
    except RayLost:
        return True
    except Exception as e:  # reported; the rest of the tear-down still runs
        print(f"ray shutdown: {type(e).__name__}: {e}", file=sys.stderr)
    return False
