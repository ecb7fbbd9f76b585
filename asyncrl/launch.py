"""How `asyncrl run` starts and stops its child processes, and keeps Redis secrets out of sight.

* The learner runs as its own OS process (``asyncrl learn``) in its own process group, bound to its
  cores (asyncrl.cpu_binding) and set to die with its parent (asyncrl.lifetime).
* Ray starts in a background thread from the run's first second (:class:`EarlyRay`), overlapping the
  model build, Redis and the learner's launch.
* The Redis URL and password travel in the environment (``ASYNCRL_REDIS_URL`` /
  ``ASYNCRL_REDIS_PASSWORD``), never on a command line or in a world-readable file.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
from collections.abc import Callable
from pathlib import Path

from asyncrl.config import Config
from asyncrl.lifetime import arm_reaper, die_with_parent

__all__ = [
    "ENV_REDIS_PASSWORD", "ENV_REDIS_URL", "EarlyRay", "learner_threads", "redact_url", "redacted",
    "start_learner_process", "stop_process", "write_private", "visible_gpus", "learner_gpu_split",
]  # fmt: skip


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
    """A copy of ``cfg`` fit for a world-readable file: no Redis password, in the field or the URL. Its
    relative paths (model.path, task.data_path, a task file, ...: asyncrl.config.paths.PATH_KEYS) are
    made absolute against this command's working directory: the run dir's config.yaml is read by
    `asyncrl export`, `asyncrl eval` and resumes from any directory."""
    from asyncrl.config.paths import absolute_paths

    redis_cfg = dataclasses.replace(cfg.redis, password="", url=redact_url(cfg.redis.url))
    return absolute_paths(dataclasses.replace(cfg, redis=redis_cfg))


def write_private(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` with mode 0600 (atomically: never readable by others, not even briefly)."""
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(tmp, 0o600)
    os.replace(tmp, path)


def visible_gpus() -> list[str]:
    """The GPU ids this process may use, without importing torch (the run process stays torch-free):
    ``CUDA_VISIBLE_DEVICES`` if set, else one per ``nvidia-smi -L`` line; [] without either."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        return [d.strip() for d in env.split(",") if d.strip() and d.strip() != "-1"]
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return []
    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=20, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [str(i) for i, line in enumerate(ln for ln in out.splitlines() if ln.startswith("GPU "))]


def learner_gpu_split(cfg: Config, gpus: list[str]) -> tuple[str, list[str]] | None:
    """``(learner's GPU, the local Ray's GPUs)`` for ``asyncrl run`` with GPU actors, or None (nothing
    to split). The learner took cuda:0 of every GPU while the local Ray handed the same GPU to actor 0's
    bundle: vLLM refused to start there (free memory below gpu_memory_utilization) or the learner ran
    out of memory, and NCCL refuses two ranks of one communicator on one device. The learner gets the
    last GPU when the actors fit on the others; otherwise (one GPU, as in the gpu smoke test) they share
    it, as configured (None)."""
    a = cfg.actors
    if cfg.ray.address or a.num_gpus_per_actor <= 0 or len(gpus) < 2:
        return None
    need = a.num_actors * a.num_gpus_per_actor * a.tensor_parallel_size * a.pipeline_parallel_size
    if need > len(gpus) - 1:
        return None
    return gpus[-1], gpus[:-1]


def start_learner_process(cfg_path: Path, redis_url: str, start_time: float, resume: bool = False,
                          log_path: Path | None = None, threads: int = 0,
                          redis_password: str = "", cpus: tuple[int, ...] | None = None,
                          gpu: str | None = None) -> subprocess.Popen:  # fmt: skip
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
    if gpu is not None:  # its own GPU (learner_gpu_split): the local Ray does not see it
        env["CUDA_VISIBLE_DEVICES"] = gpu
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


def stop_process(proc: subprocess.Popen, grace_s: float) -> int:
    """SIGTERM (the learner finishes its step and checkpoints), then SIGKILL its process group after
    ``grace_s`` (the learner's: ``learner.stop_grace_s``)."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    return proc.returncode


class EarlyRay:
    """``ray.init`` in a background thread from the run's first second (asyncrl.actors.pool.init_ray).

    Start-up is the actor's chain (Ray, actor process, vLLM engine) and it used to begin only after the
    model build, Redis and the learner's launch (~4 s in on the 2-core box); Ray's start (~3 s, mostly
    waiting on its own processes) now overlaps them. Ray may install a native SIGTERM handler while it
    starts: :meth:`result` (main thread) puts the run's handlers back. `asyncrl serve-actors`' pool
    starts Ray the same way (asyncrl.actors.pool.ActorPool.start), so that both commands' wait for Ray
    is bounded and ends at their stop.

    Invariant: the thread lives until :meth:`release`, i.e. until Ray is shut down. Ray starts its GCS
    and raylet with ``PR_SET_PDEATHSIG``, which follows the *thread* that spawned them: a thread that
    ended after ``ray.init`` took the GCS down with it. A wait that :meth:`result` gave up on (the stop,
    or ``ray.start_timeout_s``) leaves ``ray.init`` running in its daemon thread: nothing can interrupt
    it (an unreachable address is retried for good); :meth:`shutdown` then kills what it started."""

    def __init__(self, cfg: Config, gcs_reconnect_timeout_s: int | None = None) -> None:
        self._gcs_reconnect_timeout_s = gcs_reconnect_timeout_s  # for init_ray (asyncrl run passes one)
        self._address, self._timeout_s = cfg.ray.address, cfg.ray.start_timeout_s
        self._handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
        self._done, self._release = threading.Event(), threading.Event()
        self._owned = False
        self._gave_up = False  # result() stopped waiting for ray.init (see shutdown)
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(cfg,), name="ray-init", daemon=True)
        self._thread.start()

    def _run(self, cfg: Config) -> None:
        try:
            from asyncrl.actors.pool import init_ray

            self._owned = init_ray(cfg, self._gcs_reconnect_timeout_s)
        except BaseException as e:  # handed to result() in the main thread
            self._error = e
        finally:
            self._done.set()
        self._release.wait()

    def result(self, check: Callable[[], None] = lambda: None, poll_s: float = 0.2) -> bool:
        """Wait for Ray; True when this run started it (re-raises ray.init's error). ``check()`` runs
        every ``poll_s`` while Ray starts and raises to give the wait up (the command's stop:
        asyncrl.actors.ray_setup.StartStopped); past ``ray.start_timeout_s``, :class:`RayConnectError`
        names ``ray.address`` and what to check. Before, an address that refused connections held the
        command for good (ray.init retries it) and a signal meanwhile did nothing."""
        from asyncrl.actors.ray_setup import RayConnectError, ray_start_timeout_message

        deadline = time.monotonic() + self._timeout_s
        try:
            while not self._done.wait(min(poll_s, max(deadline - time.monotonic(), 0.0))):
                try:
                    check()
                    if time.monotonic() >= deadline:
                        raise RayConnectError(ray_start_timeout_message(self._address, self._timeout_s))
                except BaseException:
                    self._gave_up = True
                    raise
        finally:
            if threading.current_thread() is threading.main_thread():
                for s, h in self._handlers.items():
                    if h is not None:
                        signal.signal(s, h)
        if self._error is not None:
            raise self._error
        return self._owned

    def shutdown(self, wait: bool = True) -> None:
        """Stop the Ray this run started, when the run failed before an actor pool took it over. With
        ``ray.init`` still running (:meth:`result` gave up on it, or ``wait`` is false: the command's stop
        came), or with its GCS or raylet gone (a signal to the process group), what it started is killed
        and RayLost raised: the process must end with os._exit (Ray's atexit shutdown would meet the
        unfinished ray.init, or wait on the dead GCS)."""
        # Not given up on yet (a run that failed while Ray started): its start gets its bound to finish.
        from asyncrl.actors.ray_loss import RayLost, call_bounded, kill_local_ray, local_ray_lost

        if not self._done.wait(self._timeout_s if wait and not self._gave_up else 0):
            kill_local_ray()
            raise RayLost()
        if self._owned:
            import ray

            # A signal to the process group killed its GCS too (serve-actors stopped during its pool's
            # start): ray.shutdown would wait on it until Ray's core worker aborted the process.
            if local_ray_lost():
                kill_local_ray()
                raise RayLost()
            call_bounded(ray.shutdown)

    def release(self) -> None:
        """Ray is down (or was never started here): let the thread end."""
        self._release.set()
