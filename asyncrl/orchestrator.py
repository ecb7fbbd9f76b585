"""`asyncrl run`: the embedded default, all roles on one machine, supervised.

Starts an embedded redis-server inside the run dir (unless redis.url is set), builds or resolves the
model, starts the learner as its own OS process (`asyncrl learn`), runs the actor pool on a local Ray
in this process, shows a live progress line, and tears everything down on completion, on the wall
budget, or on Ctrl-C/SIGTERM.

Supervision (once a second): an embedded redis-server that died is started again on its data dir and
port (AOF: the buffer survives); a learner process that exited before the run's end is restarted with
``--resume``; a dead, failed or silent actor is replaced (asyncrl.actors.supervision). Each role
instance gets ``run.max_restarts`` restarts, each one logged; one failure more stops the run with a
clear error and exit code 1.

Resume: re-running the same command on a run dir that holds an unfinished run (interrupted by Ctrl-C
or SIGTERM, crashed, or stopped by ``max_wall_s``) continues it: same run name, same embedded Redis
data (the buffer), the learner restored from its last checkpoint. ``summary.json`` is written at every
end; ``"finished": true`` (the learner reached ``run.max_steps``) marks a finished run, which a
re-run refuses to overwrite.

Cores: on a CPU-only machine the learner and the engines get disjoint cores (``run.cpu_binding``,
asyncrl.cpu_binding): the plan is made (and a ``run.learner_cpus`` this machine cannot honour refused)
before anything starts; the learner is bound when it is (re)started, each actor slot through the
environment the pool hands its constructor (asyncrl.actors.pool.actor_env).

Secrets: the Redis password never goes on a command line or into ``config.yaml`` (it is redacted
there). The embedded Redis binds 127.0.0.1 and gets a random password unless ``redis.password`` is
set; the learner gets the URL through its environment (``ASYNCRL_REDIS_URL``/``ASYNCRL_REDIS_PASSWORD``,
readable only by the user), ``asyncrl status``/``serve-actors``/``learn`` find it in ``redis.url``
(mode 0600) in the run dir.

Invariant: whatever happens, the finally-block stops the pool (engines + Ray), the learner process
and the embedded Redis in that order, so no redis-server, Ray or vLLM process outlives the command.
A SIGTERM to the whole process group (``timeout``, ``kill -- -PGID``, systemd, scancel) also kills Ray's
GCS and raylet: the pool's stop (or, before the pool, Ray's shutdown) is then abandoned
(asyncrl.actors.ray_loss.call_bounded), summary.json written and redis.url removed before the learner's stop
(rewritten after it), the rest torn down as for any interrupted stop, and the process ends with os._exit,
also when an error escapes (Ray's own atexit shutdown would wait on the dead GCS until Ray's core worker
ends the process, exit code 1). That core worker waits ``gcs_rpc_server_reconnect_timeout_s`` for a lost
GCS: a local Ray started here gets ``learner.stop_grace_s`` + 120 s (Ray's default, 60 s, cut a long final
checkpoint short and the learner with it). A GCS or raylet that exits on its own fails the run at once.

Modules: this one holds the driver (:func:`run_all`); the supervision of the roles is
asyncrl.run_supervisor, the teardown and the Ray-loss exit asyncrl.run_teardown, summary.json
asyncrl.run_summary.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

from asyncrl.actors.ray_setup import StartStopped, stop_check  # stdlib only (asyncrl.actors is lazy)
from asyncrl.config import Config, ConfigError, run_dir, to_yaml
from asyncrl.config.resume import check_resume
from asyncrl.config.resume import has_run_state as has_prior_run  # its name here before it moved
from asyncrl.console import make_console
from asyncrl.cpu_binding import resolve_plan
from asyncrl.launch import EarlyRay, learner_gpu_split, redacted, visible_gpus
from asyncrl.learner.records import JsonlTail, iter_jsonl  # stdlib only
from asyncrl.lifetime import arm_reaper
from asyncrl.run_summary import read_summary, write_summary
from asyncrl.run_supervisor import RunFailed, Supervisor
from asyncrl.run_supervisor import display_failed as _display_failed
from asyncrl.run_supervisor import note as _note
from asyncrl.run_supervisor import say as _say
from asyncrl.run_targets import write_targets
from asyncrl.run_teardown import exit_now as _exit_now
from asyncrl.run_teardown import shutdown_early_ray as _shutdown_early_ray
from asyncrl.run_teardown import teardown as _teardown

# Other code and tests import write_summary, read_summary, RunFailed, Supervisor, has_prior_run and the
# _-named helpers from here (where they were defined before they moved): keep these names importable.


def run_all(cfg: Config, config_path: str | None = None, allow_changes: tuple[str, ...] = ()) -> int:
    """`asyncrl run` (see the module docstring); ``allow_changes``: the keys of --allow-config-change.

    Once the local Ray's teardown was abandoned (its GCS or raylet gone, :class:`RayLost`) the process
    ends here with os._exit, whether the run returns or raises: Ray's atexit shutdown would wait on the
    dead GCS until Ray's core worker ends the process (exit code 1). A raised error is reported as the
    CLI reports it, with its exit code (:func:`_exit_now`)."""
    ray_gone = threading.Event()
    try:
        code = _run_all(cfg, config_path, allow_changes, ray_gone)
    except BaseException as e:
        if not ray_gone.is_set():
            raise
        _exit_now(1, e)
    if ray_gone.is_set():
        _exit_now(code)
    return code


def _run_all(
    cfg: Config, config_path: str | None, allow_changes: tuple[str, ...], ray_gone: threading.Event
) -> int:
    """:func:`run_all`'s body; sets ``ray_gone`` once the local Ray's teardown was abandoned."""
    from asyncrl.buffer import ReplayBuffer
    from asyncrl.tinymodel import resolve_model_path

    start = time.time()
    rdir = run_dir(cfg).resolve()
    if read_summary(rdir).get("finished"):
        raise ConfigError(
            f"run dir {rdir} holds a finished run (summary.json); choose another run.name=... or remove the dir "
            "(an unfinished run is resumed from its last checkpoint instead)"
        )
    resolve_plan(cfg)  # a run.learner_cpus this machine cannot honour fails here, before anything starts
    # A resume under a changed config: refused (keys that define the run) before config.yaml is rewritten
    # and model/ resolved, or accepted and logged below (asyncrl.config.resume).
    changes = check_resume(cfg, rdir, allow_changes)
    resume = has_prior_run(rdir)
    rdir.mkdir(parents=True, exist_ok=True)
    cfg_path = rdir / "config.yaml"
    cfg_path.write_text(to_yaml(redacted(cfg)))  # world-readable: no secrets in it
    stop = threading.Event()
    prev_handlers = {s: signal.signal(s, lambda *_: stop.set()) for s in (signal.SIGINT, signal.SIGTERM)}
    progress = make_console(cfg, rdir)  # before Ray and the pool: it points the actors' output at <rdir>/logs
    sup = Supervisor(cfg, rdir, cfg_path, start, lambda msg: _note(progress, rdir, msg))
    pool = None
    buf = None
    lease = None
    early_ray = None
    extra: dict = {}
    status, error = "interrupted", ""
    if resume:
        _say(progress, f"resuming run {cfg.run.name!r} in {rdir} from its last checkpoint")
    for line in changes:  # also in supervision.log: the run dir keeps when its config changed
        _note(progress, rdir, line)
    try:
        # Before Ray: its processes (and the agents its raylet starts) must carry the reaper's token, so a
        # kill -9 of this command takes them down too (asyncrl.lifetime).
        arm_reaper()
        split = learner_gpu_split(cfg, visible_gpus()) if cfg.actors.num_gpus_per_actor > 0 else None
        if split is not None:
            # Before Ray starts: its raylet schedules only the GPUs in this process's environment.
            sup.learner_gpu, os.environ["CUDA_VISIBLE_DEVICES"] = split[0], ",".join(split[1])
            _note(progress, rdir, f"GPU {split[0]} for the learner, {','.join(split[1])} for the actors")
        from asyncrl.actors.ray_setup import driver_gcs_timeout_s

        # Ray starts while the model is built, Redis and the learner start; a local head it starts waits
        # for a lost GCS long enough for the learner's stop (serve-actors keeps Ray's default).
        early_ray = EarlyRay(cfg, driver_gcs_timeout_s(cfg))
        resolve_model_path(cfg, rdir)  # build once here, before two roles race to build it
        url = sup.start_redis()
        cfg.redis.url = url
        sup.start_learner(resume)
        from asyncrl.actors.pool import ActorPool, local_ray_lost
        from asyncrl.actors.serve import PoolLease
        from asyncrl.actors.supervision import ActorSupervisionError, ActorSupervisor, LapsedPoolReclaimer

        # This run's own pool holds its number (0 unless a serve-actors of an external Redis took it) the
        # way `asyncrl serve-actors` does: a serve-actors joining the run then leases another number instead
        # of running actor-0.. beside ours, and a dead joined pool's slots are reclaimed here too.
        lease = PoolLease(cfg, url, None, on_lost=stop.set)
        # Bounded (ray.start_timeout_s: an unreachable ray.address was retried for good) and given up at
        # the run's stop, as the pool's start below: a signal while either waited was seen only after it.
        owns_ray = early_ray.result(stop_check(stop))
        pool = ActorPool(cfg, rdir, redis_url=url, cpu_plan=sup.cpu_plan, owns_ray=owns_ray,
                         gcs_reconnect_timeout_s=driver_gcs_timeout_s(cfg))  # fmt: skip
        if sup.cpu_plan is not None:
            _say(progress, f"cpu binding: learner on cores {list(sup.cpu_plan.learner)}, "
                           f"engines on {[list(b) for b in sup.cpu_plan.engines]} (run.cpu_binding=off to disable)")  # fmt: skip
        pool.start(check=stop_check(stop, lease.check))
        # A short socket timeout and retry budget: a frozen or dead Redis must not freeze the loop that
        # restarts it (the pass fails, the next one restarts redis-server). With redis.retry_budget_s
        # (120 s) a Redis that died mid-pass held the loop while the roles' own budgets ran out.
        buf = ReplayBuffer.from_config(cfg, url, socket_timeout=5.0, retry_budget_s=2.0)
        sup.actors = ActorSupervisor(pool, buf, cfg.actors.heartbeat_timeout_s, cfg.run.max_restarts)
        lapsed, next_lapsed_check = LapsedPoolReclaimer(buf, lease.n, lease.token, lease.TTL_S), 0.0
        metrics = JsonlTail(rdir / "metrics.jsonl")  # the display's window, read as it is appended
        while not stop.is_set():
            try:
                if sup.check():
                    status = "finished"
                    break
            except (RunFailed, ActorSupervisionError) as e:
                status, error = "failed", str(e)
                break
            if cfg.run.max_wall_s and time.time() - start > cfg.run.max_wall_s:
                status = "wall_budget"
                break
            if owns_ray and local_ray_lost():  # no actor can run or be replaced without them
                if not stop.wait(2.0):  # a SIGTERM to the process group (it killed them) sets it first
                    status, error = "failed", "the local Ray's GCS or raylet exited (see <run_dir>/logs)"
                break
            if time.monotonic() >= next_lapsed_check:  # every TTL/3, as serve-actors does
                for msg in lapsed.poll():
                    sup.events.append(msg)
                    sup.note(msg)
                next_lapsed_check = time.monotonic() + lease.TTL_S / 3
            metrics.poll()
            try:
                progress.update(list(metrics.recent), time.time() - start)
            except Exception as e:  # supervision boundary: a display bug must not fail the run
                _display_failed(sup, e)
            try:
                write_targets(rdir, cfg.run.name, buf.learner_status(), buf.actors(), cfg.actors.num_actors,
                              cfg.actors.pool_index)  # fmt: skip
            except Exception as e:  # Redis away (being restarted): the next pass catches up
                log_once = f"metrics targets not updated: {type(e).__name__}"
                if log_once not in sup.events:
                    sup.events.append(log_once)
            stop.wait(1.0)
        if lease.lost:  # it set the stop event: another process runs this pool's actor ids
            status, error = "failed", lease.lost
        try:
            extra["actors"] = {k: {kk: vv for kk, vv in v.items() if isinstance(vv, int | float | str)}
                               for k, v in buf.actors().items()}  # fmt: skip
            extra["buffer"] = buf.stats()
        except Exception as e:  # the summary must still be written
            extra["buffer_error"] = f"{type(e).__name__}: {e}"
    except StartStopped:  # the stop came while Ray or the pool started: an interrupted run, as any stop
        if lease is not None and lease.lost:  # it set the stop event
            status, error = "failed", lease.lost
    except Exception as e:
        status, error = "failed", f"{type(e).__name__}: {e}"
        raise
    finally:
        try:
            progress.close()
        except Exception as e:  # the teardown below must run
            print(f"console close: {type(e).__name__}: {e}", file=sys.stderr)
        if pool is None and early_ray is not None:  # failed before the pool took Ray over
            if _shutdown_early_ray(early_ray):
                ray_gone.set()

        def summarize(rc: int | None) -> dict:
            """summary.json as things stand; ``rc``: the learner's exit code (None: still stopping)."""
            st, err = status, error
            if st == "finished" and rc not in (0, None):
                st, err = "failed", f"learner exited with code {rc} after the last step"
            extra.update(finished=st == "finished" and rc == 0, status=st, error=err, learner_exit_code=rc,
                         restarts={**sup.restarts, "actors": sup.actors.restarts if sup.actors else []},
                         supervision_events=sup.events)  # fmt: skip
            return write_summary(rdir, iter_jsonl(rdir / "metrics.jsonl"), start, time.time(), extra)

        def before_learner_stop() -> None:
            # Ray's core worker ends this process some time after its GCS died, whatever it is doing:
            # summary.json must not wait on the learner's stop (rewritten once that is done).
            ray_gone.set()
            summarize(sup.learner.poll() if sup.learner is not None else 0)

        rc = _teardown(pool, sup, buf, lease, ray_gone=ray_gone.is_set(), on_ray_lost=before_learner_stop)
        if pool is not None and pool.ray_lost:
            ray_gone.set()
        if early_ray is not None:
            early_ray.release()
        for s, h in prev_handlers.items():
            signal.signal(s, h)
        summary = summarize(rc)
        status, error, finished = summary["status"], summary["error"], summary["finished"]
    print(f"run dir: {rdir}\nsteps {summary['steps']}  reward {summary['start_reward']} -> {summary['end_reward']}  "
          f"wall {summary['wall_s']:.0f}s  status {status}")  # fmt: skip
    code = 0
    if status == "failed":
        print(f"asyncrl run: error: {error}", file=sys.stderr)
        code = 1
    elif not finished:
        print(f"the run is not finished ({status}): run the same command again to resume it", flush=True)
    return code
