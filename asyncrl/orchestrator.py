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
before anything starts; the learner is bound when it is (re)started, each actor slot through its Ray
runtime_env.

Secrets: the Redis password never goes on a command line or into ``config.yaml`` (it is redacted
there). The embedded Redis binds 127.0.0.1 and gets a random password unless ``redis.password`` is
set; the learner gets the URL through its environment (``ASYNCRL_REDIS_URL``/``ASYNCRL_REDIS_PASSWORD``,
readable only by the user), ``asyncrl status``/``serve-actors``/``learn`` find it in ``redis.url``
(mode 0600) in the run dir.

Invariant: whatever happens, the finally-block stops the pool (engines + Ray), the learner process
and the embedded Redis in that order, so no redis-server, Ray or vLLM process outlives the command.
"""

from __future__ import annotations

import dataclasses
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
from pathlib import Path
from typing import Any

from asyncrl.config import Config, ConfigError, run_dir, to_yaml
from asyncrl.console import make_console
from asyncrl.cpu_binding import resolve_plan
from asyncrl.learner.records import read_jsonl  # stdlib only: a torn last line is skipped
from asyncrl.lifetime import arm_reaper, die_with_parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


#: Environment variables that carry Redis secrets to child roles (never argv, never config.yaml).
ENV_REDIS_URL = "ASYNCRL_REDIS_URL"
ENV_REDIS_PASSWORD = "ASYNCRL_REDIS_PASSWORD"


def redact_url(url: str) -> str:
    """``url`` without the password of its userinfo (``redis://user:pw@h`` -> ``redis://user@h``)."""
    parts = urllib.parse.urlsplit(url)
    if parts.password is None:
        return url
    host = parts.netloc.rsplit("@", 1)[1]
    user = f"{parts.username}@" if parts.username else ""
    return urllib.parse.urlunsplit(parts._replace(netloc=user + host))


def redacted(cfg: Config) -> Config:
    """A copy of ``cfg`` fit for a world-readable file: no Redis password, in the field or the URL."""
    redis_cfg = dataclasses.replace(cfg.redis, password="", url=redact_url(cfg.redis.url))
    return dataclasses.replace(cfg, redis=redis_cfg)


def write_private(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` with mode 0600 (atomically: never readable by others, not even briefly)."""
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(tmp, 0o600)
    os.replace(tmp, path)


def start_learner_process(cfg_path: Path, redis_url: str, start_time: float, resume: bool = False,
                          log_path: Path | None = None, threads: int = 0,
                          redis_password: str = "", cpus: tuple[int, ...] | None = None,
                          ) -> subprocess.Popen:  # fmt: skip
    """The learner as its own process group (so Ctrl-C reaches it only through us, in order).

    The Redis URL (it may hold the password) and the password travel in the environment. ``cpus``: the
    cores it is bound to (asyncrl.cpu_binding), set on the child as soon as it exists: it is then still
    a single-threaded interpreter starting up, so every thread it creates later (torch's OpenMP pool,
    gloo) inherits the affinity."""
    # A kill -9 of `asyncrl run` runs no cleanup: the learner dies with it (die_with_parent), and so does
    # every process started from here on, the learner's, Ray's and the vLLM engines' (asyncrl.lifetime).
    arm_reaper()
    env = dict(os.environ)
    env.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(_free_port()), ASYNCRL_START_TIME=repr(start_time))  # fmt: skip
    env[ENV_REDIS_URL] = redis_url
    if redis_password:
        env[ENV_REDIS_PASSWORD] = redis_password
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    cmd = [sys.executable, "-m", "asyncrl.cli", "learn", "--config", str(cfg_path)]
    if resume:
        cmd.insert(4, "--resume")
    cmd = die_with_parent(cmd)  # see arm_reaper() above
    out = open(log_path, "ab") if log_path else None  # noqa: SIM115 - handed to the child
    proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT if out else None,
                            start_new_session=True)  # fmt: skip
    if cpus:
        os.sched_setaffinity(proc.pid, cpus)
    return proc


def learner_threads(cfg: Config, cpus: tuple[int, ...] | None = None) -> int:
    """Threads for a learner co-located with the actors: on a CPU-only machine the vLLM engines already
    use the cores, and a multi-threaded learner fighting them ran 10x slower than a single thread.
    Bound to its own ``cpus`` (asyncrl.cpu_binding), it uses one thread per core it owns."""
    if cfg.learner.torch_threads:
        return cfg.learner.torch_threads
    if cpus:
        return len(cpus)
    if "OMP_NUM_THREADS" in os.environ or shutil.which("nvidia-smi"):
        return 0  # the user's choice, or a GPU learner: leave torch's default
    return 1


def stop_process(proc: subprocess.Popen, grace_s: float = 60.0) -> int:
    """SIGTERM (the learner finishes its step and checkpoints), then SIGKILL after ``grace_s``."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    return proc.returncode


def write_targets(rdir: Path, run: str, learner_status: dict, actors: dict) -> list[dict]:
    """Prometheus ``file_sd_configs`` targets of the endpoints this run started (atomic rewrite)."""
    groups = []
    if learner_status.get("metrics_addr"):
        groups.append(
            {"targets": [learner_status["metrics_addr"]], "labels": {"run": run, "role": "learner"}}
        )
    addrs = sorted(a["metrics_addr"] for a in actors.values() if a.get("metrics_addr"))
    if addrs:
        groups.append({"targets": addrs, "labels": {"run": run, "role": "actor"}})
    tmp = rdir / "prometheus_targets.json.tmp"
    tmp.write_text(json.dumps(groups, indent=2))
    os.replace(tmp, rdir / "prometheus_targets.json")
    return groups


def write_summary(rdir: Path, records: list[dict], start: float, end: float, extra: dict) -> dict:
    k = min(3, len(records))
    summary = {
        "steps": records[-1]["step"] if records else 0,
        "final_version": records[-1]["version"] if records else 0,
        "start_reward": sum(r["reward_mean"] for r in records[:k]) / k if k else None,
        "end_reward": sum(r["reward_mean"] for r in records[-k:]) / k if k else None,
        "wall_s": end - start,
        "trained_tokens": sum(r.get("tokens", 0) for r in records),
        "trained_tokens_per_s": sum(r.get("tokens", 0) for r in records) / max(end - start, 1e-9),
        "staleness_max": max((r["staleness_max"] for r in records), default=0),
        **extra,
    }
    (rdir / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


class EarlyRay:
    """``ray.init`` in a background thread from the run's first second (asyncrl.actors.pool.init_ray).

    Start-up is the actor's chain (Ray, actor process, vLLM engine) and it used to begin only after the
    model build, Redis and the learner's launch (~4 s in on the 2-core box); Ray's start (~3 s, mostly
    waiting on its own processes) now overlaps them. Ray may install a native SIGTERM handler while it
    starts: :meth:`result` (main thread) puts the run's handlers back.

    Invariant: the thread lives until :meth:`release`, i.e. until Ray is shut down. Ray starts its GCS
    and raylet with ``PR_SET_PDEATHSIG``, which follows the *thread* that spawned them: a thread that
    ended after ``ray.init`` took the GCS down with it."""

    def __init__(self, cfg: Config) -> None:
        self._handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
        self._done, self._release = threading.Event(), threading.Event()
        self._owned = False
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(cfg,), name="ray-init", daemon=True)
        self._thread.start()

    def _run(self, cfg: Config) -> None:
        try:
            from asyncrl.actors.pool import init_ray

            self._owned = init_ray(cfg)
        except BaseException as e:  # handed to result() in the main thread
            self._error = e
        finally:
            self._done.set()
        self._release.wait()

    def result(self) -> bool:
        """Wait for Ray; True when this run started it (re-raises ray.init's error)."""
        self._done.wait()
        for s, h in self._handlers.items():
            if h is not None:
                signal.signal(s, h)
        if self._error is not None:
            raise self._error
        return self._owned

    def shutdown(self) -> None:
        """Stop the Ray this run started, when the run failed before an actor pool took it over."""
        self._done.wait()
        if self._owned:
            import ray

            ray.shutdown()

    def release(self) -> None:
        """Ray is down (or was never started here): let the thread end."""
        self._release.set()


class RunFailed(RuntimeError):
    """A supervised role failed more often than ``run.max_restarts`` allows."""


def read_summary(rdir: Path) -> dict:
    try:
        return json.loads((rdir / "summary.json").read_text())
    except (OSError, ValueError):
        return {}


def has_prior_run(rdir: Path) -> bool:
    """The run dir holds state of an earlier start of this run: checkpoints, weights or a buffer."""
    return any((rdir / d).is_dir() and any((rdir / d).iterdir()) for d in ("checkpoints", "weights", "redis"))


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
            cpus=self.learner_cpus,
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
            recs = read_jsonl(self.rdir / "metrics.jsonl")
            step = recs[-1]["step"] if recs else 0
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


def run_all(cfg: Config, config_path: str | None = None) -> int:
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
    early_ray = None
    extra: dict = {}
    status, error = "interrupted", ""
    if resume:
        _say(progress, f"resuming run {cfg.run.name!r} in {rdir} from its last checkpoint")
    try:
        # Before Ray: its processes (and the agents its raylet starts) must carry the reaper's token, so a
        # kill -9 of this command takes them down too (asyncrl.lifetime).
        arm_reaper()
        early_ray = EarlyRay(cfg)  # Ray starts while the model is built, Redis and the learner start
        resolve_model_path(cfg, rdir)  # build once here, before two roles race to build it
        url = sup.start_redis()
        cfg.redis.url = url
        sup.start_learner(resume)
        from asyncrl.actors.pool import ActorPool
        from asyncrl.actors.supervision import ActorSupervisionError, ActorSupervisor

        owns_ray = early_ray.result()
        pool = ActorPool(cfg, rdir, redis_url=url, cpu_plan=sup.cpu_plan, owns_ray=owns_ray)
        if sup.cpu_plan is not None:
            _say(progress, f"cpu binding: learner on cores {list(sup.cpu_plan.learner)}, "
                           f"engines on {[list(b) for b in sup.cpu_plan.engines]} (run.cpu_binding=off to disable)")  # fmt: skip
        pool.start()
        # A short socket timeout: a frozen Redis must not freeze the supervision loop with it.
        buf = ReplayBuffer.from_config(cfg, url, socket_timeout=5.0)
        sup.actors = ActorSupervisor(pool, buf, cfg.actors.heartbeat_timeout_s, cfg.run.max_restarts)
        metrics_path = rdir / "metrics.jsonl"
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
            progress.update(read_jsonl(metrics_path), time.time() - start)
            try:
                write_targets(rdir, cfg.run.name, buf.learner_status(), buf.actors())
            except Exception as e:  # Redis away (being restarted): the next pass catches up
                log_once = f"metrics targets not updated: {type(e).__name__}"
                if log_once not in sup.events:
                    sup.events.append(log_once)
            stop.wait(1.0)
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
        progress.close()
        if pool is None and early_ray is not None:
            early_ray.shutdown()  # failed before the pool took Ray over
        rc = _teardown(pool, sup, buf)
        if early_ray is not None:
            early_ray.release()
        for s, h in prev_handlers.items():
            signal.signal(s, h)
        end = time.time()
        records = read_jsonl(rdir / "metrics.jsonl")
        finished = status == "finished" and rc == 0
        if status == "finished" and rc != 0:
            status, error = "failed", f"learner exited with code {rc} after the last step"
        extra.update(finished=finished, status=status, error=error, learner_exit_code=rc,
                     restarts={**sup.restarts, "actors": sup.actors.restarts if sup.actors else []},
                     supervision_events=sup.events)  # fmt: skip
        summary = write_summary(rdir, records, start, end, extra)
    print(f"run dir: {rdir}\nsteps {summary['steps']}  reward {summary['start_reward']} -> {summary['end_reward']}  "
          f"wall {summary['wall_s']:.0f}s  status {status}")  # fmt: skip
    if status == "failed":
        print(f"asyncrl run: error: {error}", file=sys.stderr)
        return 1
    if not finished:
        print(f"the run is not finished ({status}): run the same command again to resume it", flush=True)
    return 0


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


def _teardown(pool: Any, sup: Supervisor, buf: Any) -> int:
    """Stop the pool, the learner and the embedded Redis, in that order; each step runs even if an
    earlier one raised. Returns the learner's exit code (0 when it was never started)."""
    if pool is not None:
        try:
            pool.stop()
        except Exception as e:  # an actor's error: reported, the rest of the tear-down still runs
            print(f"actor pool stop: {type(e).__name__}: {e}", file=sys.stderr)
    rc = stop_process(sup.learner) if sup.learner is not None else 0
    if buf is not None:
        buf.close()
    if sup.redis_srv is not None:
        sup.redis_srv.stop()
        (sup.rdir / "redis.url").unlink(missing_ok=True)
    return rc
