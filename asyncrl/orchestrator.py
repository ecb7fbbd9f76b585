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
(asyncrl.actors.pool.call_bounded), summary.json written and redis.url removed before the learner's stop
(rewritten after it), the rest torn down as for any interrupted stop, and the process ends with os._exit,
also when an error escapes (Ray's own atexit shutdown would wait on the dead GCS until Ray's core worker
ends the process, exit code 1). That core worker waits ``gcs_rpc_server_reconnect_timeout_s`` for a lost
GCS: a local Ray started here gets ``learner.stop_grace_s`` + 120 s (Ray's default, 60 s, cut a long final
checkpoint short and the learner with it). A GCS or raylet that exits on its own fails the run at once.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
import urllib.parse
from collections import deque
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from asyncrl.config import Config, ConfigError, run_dir, to_yaml
from asyncrl.config.resume import check_resume
from asyncrl.config.resume import has_run_state as has_prior_run  # its name here before it moved
from asyncrl.console import make_console
from asyncrl.cpu_binding import resolve_plan
from asyncrl.launch import (
    EarlyRay,
    learner_gpu_split,
    learner_threads,
    redacted,
    start_learner_process,
    stop_process,
    visible_gpus,
    write_private,
)
from asyncrl.learner.records import JsonlTail, committed_step, iter_jsonl, last_record  # stdlib only
from asyncrl.lifetime import arm_reaper
from asyncrl.run_targets import clear_targets, write_targets


def write_summary(rdir: Path, records: Iterable[dict], start: float, end: float, extra: dict) -> dict:
    """``summary.json`` of the run dir from its metrics.jsonl records and this start's [start, end].

    After a resume metrics.jsonl holds the earlier starts' steps too: ``steps`` and ``trained_tokens``
    are the run's, but ``wall_s`` and the rate are this start's, so the rate counts only the tokens of
    steps that ended since ``start`` (before: every start's tokens over the last one's wall seconds).
    ``records`` is consumed once, in order (:func:`iter_jsonl`: a run of days is not held in memory)."""
    first: list[dict] = []
    last: deque[dict] = deque(maxlen=3)
    tokens = tokens_this_start = 0
    staleness_max = 0
    for r in records:
        if len(first) < 3:
            first.append(r)
        last.append(r)
        tokens += r.get("tokens", 0)
        if float(r.get("step_time", start)) >= start:
            tokens_this_start += r.get("tokens", 0)
        staleness_max = max(staleness_max, r["staleness_max"])
    summary = {
        "steps": last[-1]["step"] if last else 0,
        "final_version": last[-1]["version"] if last else 0,
        "start_reward": sum(r["reward_mean"] for r in first) / len(first) if first else None,
        "end_reward": sum(r["reward_mean"] for r in last) / len(last) if last else None,
        "wall_s": end - start,
        "trained_tokens": tokens,
        "trained_tokens_per_s": tokens_this_start / max(end - start, 1e-9),
        "staleness_max": staleness_max,
        **extra,
    }
    (rdir / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


class RunFailed(RuntimeError):
    """A supervised role failed more often than ``run.max_restarts`` allows."""


def read_summary(rdir: Path) -> dict:
    try:
        return json.loads((rdir / "summary.json").read_text())
    except (OSError, ValueError):
        return {}


class Supervisor:
    """Keeps the roles of one `asyncrl run` alive (see the module docstring); counts each restart."""

    def __init__(self, cfg: Config, rdir: Path, cfg_path: Path, start: float, note: Any) -> None:
        self.cfg, self.rdir, self.cfg_path, self.start, self.note = cfg, rdir, cfg_path, start, note
        self.restarts: dict[str, int] = {"redis": 0, "learner": 0}
        self.events: list[str] = []
        self.redis_srv: Any = None
        self.url = ""
        self.learner: subprocess.Popen | None = None
        self.actors: Any = None  # ActorSupervisor, once the pool is up
        self.cpu_plan = resolve_plan(cfg)  # disjoint cores for learner and engines, or None
        self.learner_gpu: str | None = None  # its own GPU beside GPU actors (launch.learner_gpu_split)

    def _restart(self, role: str, why: str) -> None:
        self.restarts[role] += 1
        n, limit = self.restarts[role], self.cfg.run.max_restarts
        if n > limit:
            raise RunFailed(f"{role} {why}; restarts exhausted ({limit}, run.max_restarts): stopping the run")
        msg = f"{role} {why}: restarting it ({n}/{limit})"
        self.events.append(msg)
        self.note(msg)

    def start_redis(self) -> str:
        from asyncrl.buffer.embedded import EmbeddedRedis

        if self.cfg.redis.url:
            self.url = self.cfg.redis.url
            return self.url
        # A random password unless one is configured: the server binds loopback, but other local users
        # could otherwise reach it.
        password = self.cfg.redis.password or secrets.token_urlsafe(24)
        self.redis_srv = EmbeddedRedis(self.rdir / "redis", password=password,
                                       appendfsync=self.cfg.redis.appendfsync).start()  # fmt: skip
        self.url = self.redis_srv.url
        write_private(self.rdir / "redis.url", self.url)
        return self.url

    def start_learner(self, resume: bool) -> None:
        # config.yaml has the password redacted (from the field and from the URL): hand it over apart.
        url_pw = urllib.parse.unquote(urllib.parse.urlsplit(self.url).password or "")
        self.learner = start_learner_process(
            self.cfg_path, self.url, self.start, resume=resume, log_path=self.rdir / "learner.log",
            threads=learner_threads(self.cfg, self.learner_cpus), redis_password=self.cfg.redis.password or url_pw,
            cpus=self.learner_cpus, gpu=self.learner_gpu,
        )  # fmt: skip

    @property
    def learner_cpus(self) -> tuple[int, ...] | None:
        return self.cpu_plan.learner if self.cpu_plan is not None else None

    def check(self) -> bool:
        """One supervision pass; True when the learner finished the run (exit 0 at ``max_steps``)."""
        srv = self.redis_srv
        if srv is not None and not srv.running:
            self._restart("redis", f"embedded redis-server (port {srv.port}) is gone")
            from asyncrl.buffer.embedded import EmbeddedRedisError

            try:
                srv.start()  # same data dir (AOF), port and password: every client reconnects
            except EmbeddedRedisError as e:
                self.note(f"redis restart failed: {e}")
        assert self.learner is not None
        rc = self.learner.poll()
        if rc is not None:
            last = last_record(self.rdir / "metrics.jsonl")  # its tail only; a torn last line is skipped
            # The newer of the last record and the committed checkpoint: a learner killed between its
            # final checkpoint and that step's record restarts at max_steps and exits 0 at once, and
            # judged by metrics.jsonl alone it was restarted until run.max_restarts failed the run
            # (and every re-run of the command did the same).
            step = max(last["step"] if last else 0, committed_step(self.rdir))
            if rc == 0 and self.cfg.run.max_steps and step >= self.cfg.run.max_steps:
                return True
            self._restart(
                "learner", f"exited with code {rc} at step {step} (see {self.rdir / 'learner.log'})"
            )
            time.sleep(min(2.0 * self.restarts["learner"], 10.0))  # let a cause outside it (Redis) pass
            self.start_learner(resume=True)
        if self.actors is not None:
            for msg in self.actors.poll():
                self.events.append(msg)
                self.note(msg)
        return False


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


def _exit_now(code: int, error: BaseException | None = None) -> None:
    """End the process now (os._exit, see :func:`run_all`), after reporting ``error`` the way
    ``asyncrl.cli.main`` would (its message and exit code: 2 for a user error, 1 for a role error,
    else the traceback and 1)."""
    try:
        if error is not None:
            from asyncrl.cli import ROLE_ERRORS, USER_ERRORS

            if isinstance(error, USER_ERRORS + ROLE_ERRORS):
                print(f"asyncrl: error: {error}", file=sys.stderr)
                code = 2 if isinstance(error, USER_ERRORS) else 1
            else:
                import traceback

                traceback.print_exception(error)
                code = 1
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)


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
        early_ray = EarlyRay(cfg)  # Ray starts while the model is built, Redis and the learner start
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
        owns_ray = early_ray.result()
        pool = ActorPool(cfg, rdir, redis_url=url, cpu_plan=sup.cpu_plan, owns_ray=owns_ray)
        if sup.cpu_plan is not None:
            _say(progress, f"cpu binding: learner on cores {list(sup.cpu_plan.learner)}, "
                           f"engines on {[list(b) for b in sup.cpu_plan.engines]} (run.cpu_binding=off to disable)")  # fmt: skip
        pool.start(check=lease.check)
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


def _shutdown_early_ray(early_ray: EarlyRay) -> bool:
    """Stop the Ray this run started when the run failed before an actor pool took it over, bounded like
    the pool's stop (:func:`asyncrl.actors.pool.call_bounded`); True when it was abandoned (its GCS or
    raylet gone: the process must end with os._exit)."""
    from asyncrl.actors.pool import RayLost, call_bounded, kill_local_ray, local_ray_lost

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


def _display_failed(sup: Supervisor, e: Exception) -> None:
    """The live display raised (a record it cannot format, a terminal gone): the run goes on without
    that refresh; logged to supervision.log and the console once per kind, counted in the events."""
    import traceback

    what = f"display update failed: {type(e).__name__}: {e}"
    if what not in sup.events:
        sup.events.append(what)
        detail = what + "\n" + "".join(traceback.format_exception(e)).rstrip()
        try:
            sup.note(detail)
        except Exception:  # the console itself is what fails: supervision.log has it, stderr too
            print(f"asyncrl run: {detail}", file=sys.stderr)


def _note(progress: Any, rdir: Path, msg: str) -> None:
    """A supervision event: appended to <run_dir>/supervision.log, and shown on the console (stderr when
    the console is off) so that no restart goes unseen."""
    with open(rdir / "supervision.log", "a") as f:
        f.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {msg}\n")
    _say(progress, msg)


def _say(progress: Any, msg: str) -> None:
    """Show ``msg`` on the console, or on stderr when the console is off."""
    if getattr(progress, "mode", "plain") in ("live", "plain"):
        progress.note(msg)
    else:
        print(msg, file=sys.stderr, flush=True)


def _teardown(pool: Any, sup: Supervisor, buf: Any, lease: Any = None, ray_gone: bool = False,
              on_ray_lost: Any = None) -> int:  # fmt: skip
    """Empty the Prometheus targets, then stop the pool (and free its number's lease), the learner and
    the embedded Redis, in that order; each step runs even if an earlier one raised. Returns the
    learner's exit code (0 when it was never started).

    When the local Ray is gone (``ray_gone``, or the pool's stop abandoned: ``pool.ray_lost``), Ray's
    core worker ends this process after ``gcs_rpc_server_reconnect_timeout_s`` (raised to cover the
    learner's grace, asyncrl.actors.pool.driver_gcs_timeout_s) whatever it is doing: before the learner's
    stop, ``on_ray_lost()`` runs (`asyncrl run` writes summary.json there) and redis.url is removed, so
    neither depends on the process outliving that stop."""

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
