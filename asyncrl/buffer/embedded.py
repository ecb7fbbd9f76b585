"""A local redis-server owned by this process: the default for ``asyncrl run``.

The server binds 127.0.0.1 on a free port, keeps its data in ``data_dir`` with AOF on (so
the buffer, version and manifests survive a Redis restart), and is stopped with SHUTDOWN
(which flushes the AOF) when the owner stops it, exits, or is interrupted.

It runs in its own session (``start_new_session=True``): a Ctrl-C in the terminal goes to
our process group only, so the server is not killed mid-write before we shut it down
cleanly from ``finally``/``atexit``. If this process is SIGKILLed the server is killed with it
(``asyncrl.lifetime.die_with_parent``; the AOF keeps what ``appendfsync`` had written); the
pidfile in ``data_dir`` still lets a start detect a live server instead of starting a second one
on the same AOF.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import socket
import subprocess
import time
import urllib.parse
from pathlib import Path

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from asyncrl.lifetime import die_with_parent

__all__ = ["EmbeddedRedis", "EmbeddedRedisError", "find_redis_server"]

_PIDFILE = "redis.pid"
_LOGFILE = "redis.log"
_CONF = "redis.conf"


class EmbeddedRedisError(RuntimeError):
    """redis-server is missing, did not start, or its data dir is in use."""


def find_redis_server() -> str:
    """Path of the redis-server binary ($ASYNCRL_REDIS_SERVER, then PATH, then /usr/bin)."""
    candidates = [
        os.environ.get("ASYNCRL_REDIS_SERVER"),
        shutil.which("redis-server"),
        "/usr/bin/redis-server",
    ]
    for c in candidates:
        if c and os.path.isfile(c) and os.access(c, os.X_OK):
            return c
    raise EmbeddedRedisError(
        "redis-server not found. Install it (Debian/Ubuntu: `sudo apt-get install redis-server`, "
        "macOS: `brew install redis`, conda: `conda install -c conda-forge redis-server`), "
        "set ASYNCRL_REDIS_SERVER=/path/to/redis-server, or point asyncrl at an existing Redis."
    )


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pid_alive_redis(pid: int) -> bool:
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        try:  # no procfs (macOS): fall back to "is the pid alive"
            os.kill(pid, 0)
        except OSError:
            return False
        return True
    return b"redis" in cmdline


class EmbeddedRedis:
    """Start/stop a private redis-server. Use as a context manager or call start()/stop()."""

    def __init__(
        self,
        data_dir: str | os.PathLike[str],
        port: int | None = None,
        password: str | None = None,
        *,
        appendfsync: str = "everysec",
        startup_timeout: float = 15.0,
    ) -> None:
        if appendfsync not in ("always", "everysec", "no"):
            raise ValueError(f"appendfsync must be always/everysec/no, got {appendfsync!r}")
        self.data_dir = Path(data_dir).resolve()
        self.host = "127.0.0.1"
        self.port = port
        self.password = password
        self.appendfsync = appendfsync
        self.startup_timeout = startup_timeout
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """``redis://[:password@]127.0.0.1:port/0`` (the password URL-encoded)."""
        if self.port is None:
            raise EmbeddedRedisError("embedded redis has not been started")
        auth = f":{urllib.parse.quote(self.password, safe='')}@" if self.password else ""
        return f"redis://{auth}{self.host}:{self.port}/0"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    @property
    def log_path(self) -> Path:
        return self.data_dir / _LOGFILE

    def client(self, **kwargs: object) -> redis.Redis:
        """A new redis-py client (bytes responses) for this server."""
        return redis.Redis(host=self.host, port=self.port, password=self.password, **kwargs)

    def _control_client(self, timeout: float) -> redis.Redis:
        # No retries: redis-py would otherwise back off and reconnect after SHUTDOWN closes
        # the connection, or while the server is still starting, costing seconds.
        return self.client(socket_timeout=timeout, socket_connect_timeout=1.0, retry=Retry(NoBackoff(), 0))

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def _check_data_dir_free(self) -> None:
        pidfile = self.data_dir / _PIDFILE
        try:
            pid = int(pidfile.read_text().strip())
        except (OSError, ValueError):
            return
        if pid != os.getpid() and _pid_alive_redis(pid):
            raise EmbeddedRedisError(
                f"another redis-server (pid {pid}) is using {self.data_dir}; stop it first "
                "(two servers on one AOF would corrupt it)"
            )
        pidfile.unlink(missing_ok=True)

    def _write_config(self, port: int) -> Path:
        # A config file (mode 0600) instead of argv keeps the password out of `ps`.
        lines = [
            f"port {port}",
            f"bind {self.host}",
            "protected-mode yes",
            "daemonize no",
            f'dir "{self.data_dir}"',
            f'pidfile "{self.data_dir / _PIDFILE}"',
            f'logfile "{self.log_path}"',
            "appendonly yes",
            f"appendfsync {self.appendfsync}",
            'save ""',  # AOF is the durability mechanism; no RDB snapshots needed
        ]
        if self.password:
            lines.append(f'requirepass "{self.password}"')
        conf = self.data_dir / _CONF
        fd = os.open(conf, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write("\n".join(lines) + "\n")
        return conf

    def start(self) -> EmbeddedRedis:
        """Start the server and wait until it answers PING (AOF loaded)."""
        if self._proc is not None and self._proc.poll() is None:
            return self
        binary = find_redis_server()
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self._check_data_dir_free()
        fixed_port = self.port
        # A free port found by bind(0) can be taken before redis binds it: retry on that race.
        for attempt in range(3):
            port = fixed_port if fixed_port is not None else _free_port()
            conf = self._write_config(port)
            self._proc = subprocess.Popen(
                # Dies with this process even on kill -9 (start it from the main thread; asyncrl.lifetime).
                die_with_parent([binary, str(conf)]),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
            )
            self.port = port
            atexit.register(self.stop)
            try:
                self._wait_ready()
                return self
            except EmbeddedRedisError:
                in_use = "Address already in use" in self.log_tail()
                self.stop()
                if not in_use or fixed_port is not None or attempt == 2:
                    self.port = fixed_port
                    raise
        raise AssertionError("unreachable")

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.startup_timeout
        client = self._control_client(1.0)
        try:
            while True:
                assert self._proc is not None
                if self._proc.poll() is not None:
                    raise EmbeddedRedisError(
                        f"redis-server exited with code {self._proc.returncode} during startup; "
                        f"log {self.log_path}:\n{self.log_tail()}"
                    )
                try:
                    # Check the pid: with a fixed port, a PING could be answered by another
                    # server that holds the port while ours failed to bind it.
                    if client.info("server")["process_id"] == self._proc.pid:
                        return
                except redis.RedisError:
                    pass  # not listening yet, still loading the AOF, or not our server
                if time.monotonic() > deadline:
                    raise EmbeddedRedisError(
                        f"redis-server on port {self.port} did not answer PING within "
                        f"{self.startup_timeout}s; log {self.log_path}:\n{self.log_tail()}"
                    )
                time.sleep(0.02)
        finally:
            client.close()

    def stop(self, timeout: float = 10.0) -> None:
        """SHUTDOWN (flushes the AOF), then terminate/kill if needed. Idempotent."""
        atexit.unregister(self.stop)
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.poll() is None:
            client = self._control_client(timeout)
            with contextlib.suppress(redis.RedisError, OSError):
                client.shutdown()  # the server closes the connection: an error is expected
            client.close()
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                proc.terminate()
                try:
                    proc.wait(timeout=5.0)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()

    def kill(self) -> None:
        """SIGKILL the server (simulates a crash; tests). The AOF is left as the kill found it."""
        atexit.unregister(self.stop)
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def __enter__(self) -> EmbeddedRedis:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
