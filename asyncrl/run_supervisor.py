"""What keeps the roles of one `asyncrl run` alive: :class:`Supervisor`, and how its events are shown.

Supervision (once a second, :meth:`Supervisor.check`): an embedded redis-server that died is started
again on its data dir and port (AOF: the buffer survives); a learner process that exited before the
run's end is restarted with ``--resume``; a dead, failed or silent actor is replaced
(asyncrl.actors.supervision). Each role instance gets ``run.max_restarts`` restarts, each one logged
(:func:`note`: <run_dir>/supervision.log and the console); one failure more raises :class:`RunFailed`,
which stops the run with a clear error and exit code 1. Moved out of asyncrl.orchestrator (still
importable there).
"""

from __future__ import annotations

import secrets
import subprocess
import sys
import time
import urllib.parse
from pathlib import Path
from typing import Any

from asyncrl.config import Config
from asyncrl.cpu_binding import resolve_plan
from asyncrl.launch import learner_threads, start_learner_process, write_private
from asyncrl.learner.records import committed_step, last_record  # stdlib only


class RunFailed(RuntimeError):
    """A supervised role failed more often than ``run.max_restarts`` allows."""


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


def display_failed(sup: Supervisor, e: Exception) -> None:
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


def note(progress: Any, rdir: Path, msg: str) -> None:
    """A supervision event: appended to <run_dir>/supervision.log, and shown on the console (stderr when
    the console is off) so that no restart goes unseen."""
    with open(rdir / "supervision.log", "a") as f:
        f.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {msg}\n")
    say(progress, msg)


def say(progress: Any, msg: str) -> None:
    """Show ``msg`` on the console, or on stderr when the console is off."""
    if getattr(progress, "mode", "plain") in ("live", "plain"):
        progress.note(msg)
    else:
        print(msg, file=sys.stderr, flush=True)
