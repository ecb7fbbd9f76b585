"""`asyncrl run`'s teardown once the local Ray it started lost its GCS and raylet (a SIGTERM to the whole
process group kills them with the command): nothing may wait on the dead GCS, and nothing of the run's
end may depend on outliving Ray's core worker, which ends the driver a while after its GCS died.

Each Ray case runs in a child process (its Ray is killed under it, and it must end with os._exit as
`asyncrl run` does, in a process group of its own that the test sends SIGTERM): a real local Ray started
by asyncrl.actors.pool.init_ray, a real embedded redis-server and a learner process of its own session
(as asyncrl.launch.start_learner_process starts it)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from asyncrl.config import ConfigError, load_config

pytest.importorskip("ray")

# Common to the children: a one-CPU local Ray started as `asyncrl run` starts it, and the signal.
_PRELUDE = textwrap.dedent(
    """
    import json, os, signal, subprocess, sys, time
    from pathlib import Path
    import ray
    from asyncrl.config import load_config

    rdir = Path(sys.argv[1])
    cfg = load_config(overrides=["ray.num_cpus=1", "learner.stop_grace_s=300"])
    cfg.console.log_dir = str(rdir / "logs")

    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))  # asyncrl run's handler: a stop event

    # The test sends SIGTERM to this process's group (Ray's GCS and raylet are in it); back once the loss
    # shows (the raylet drains for ~10 s; the GCS stops serving at once, its process lingers).
    def group_sigterm():
        from asyncrl.actors.pool import local_ray_lost
        print("READY", flush=True)
        while not stop:
            time.sleep(0.05)
        deadline = time.monotonic() + 60
        while not local_ray_lost():
            assert time.monotonic() < deadline, "the group SIGTERM did not take Ray's raylet down"
            time.sleep(0.2)

    def ray_pids():
        node = ray._private.worker._global_node
        return [i.process.pid for kind in ("gcs_server", "raylet") for i in node.all_processes.get(kind, [])]

    def gone(pids):
        left = []
        for pid in pids:
            try:
                os.kill(pid, 0)
                left.append(pid)
            except ProcessLookupError:
                pass
        return not left

    def done(result):
        print("RESULT " + json.dumps(result), flush=True)
        os._exit(0)
    """
)

# The learner: when told to stop (SIGTERM) it looks at the run dir, as a run's last step and checkpoint
# would take a while, and exits 0.
_LEARNER = textwrap.dedent(
    """
    import json, signal, sys, time
    from pathlib import Path
    rdir = Path(sys.argv[1])
    def on_term(*_):
        seen = {"summary": (rdir / "summary.json").exists(), "redis_url": (rdir / "redis.url").exists()}
        (rdir / "learner_saw.json").write_text(json.dumps(seen))
        sys.exit(0)
    signal.signal(signal.SIGTERM, on_term)
    print("up", flush=True)
    time.sleep(600)
    """
)


def _child(tmp_path, body: str, timeout: float = 120.0) -> dict:
    """Run ``body`` after the prelude in a child process of its own process group; SIGTERM that group
    when the child says READY (``group_sigterm()``); the child's RESULT line."""
    rdir = tmp_path / "run"
    rdir.mkdir()
    (tmp_path / "learner.py").write_text(_LEARNER)
    script = _PRELUDE + textwrap.dedent(body)
    log = tmp_path / "child.log"
    proc = subprocess.Popen([sys.executable, "-c", script, str(rdir), str(tmp_path / "learner.py")],
                            stdout=subprocess.PIPE, stderr=log.open("wb"), text=True,
                            start_new_session=True)  # fmt: skip
    timer = threading.Timer(timeout, os.killpg, (proc.pid, signal.SIGKILL))  # a child waiting on the dead GCS
    timer.start()
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith("READY"):
                os.killpg(proc.pid, signal.SIGTERM)
            if line.startswith("RESULT "):
                result = json.loads(line[len("RESULT ") :])
                break
        else:
            why = (
                f"still running after {timeout:.0f} s" if not timer.is_alive() else f"exit code {proc.wait()}"
            )
            pytest.fail(f"no result: {why}\n{log.read_text()[-4000:]}")
        proc.wait(timeout)
    finally:
        timer.cancel()
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, log.read_text()[-4000:]
    return result


def test_the_driver_of_a_local_ray_waits_for_a_lost_gcs_longer_than_the_learners_grace(tmp_path) -> None:
    """Ray's core worker ends the driver ``gcs_rpc_server_reconnect_timeout_s`` after its GCS died
    (std::_Exit(1)); at Ray's default, 60 s, the learner's final checkpoint (its grace: 300 s here) was
    cut short and the run ended without summary.json. The local head asyncrl starts carries a timeout
    that covers the grace; a cluster it attaches to is left alone (Ray refuses the setting there)."""
    result = _child(
        tmp_path,
        """
        from asyncrl.actors.pool import driver_gcs_timeout_s, init_ray
        assert init_ray(cfg, driver_gcs_timeout_s(cfg))  # as asyncrl run starts it (asyncrl.launch.EarlyRay)
        done({"timeout": ray._private.state.state.get_system_config().get("gcs_rpc_server_reconnect_timeout_s")})
        """,
    )
    from asyncrl.actors.pool import driver_gcs_timeout_s, local_head_system_config

    assert result["timeout"] == 300 + 120, result
    assert driver_gcs_timeout_s(load_config(overrides=["learner.stop_grace_s=0.5"])) == 121
    assert local_head_system_config(load_config(overrides=["ray.address=10.0.0.1:6379"]), 121) is None
    # Without one (serve-actors: no learner to wait for): Ray's default, a blind driver lives no longer.
    assert local_head_system_config(load_config()) is None


def test_a_lost_ray_writes_the_summary_and_drops_redis_url_before_the_learner_stops(tmp_path) -> None:
    """The teardown after the group signal: the pool's stop does not enter ray.shutdown once the loss
    shows (it waited on the dead GCS), and summary.json is written and redis.url removed
    before the learner is told to stop: the learner finds both done, whatever becomes of the driver
    during its final checkpoint. Then the learner's stop and Redis's stop run as before."""
    result = _child(
        tmp_path,
        """
        from asyncrl.actors.pool import ActorPool, init_ray
        from asyncrl.orchestrator import Supervisor, _teardown, write_summary
        assert init_ray(cfg)
        start = time.time()
        sup = Supervisor(cfg, rdir, rdir / "config.yaml", start, lambda msg: None)
        url = sup.start_redis()
        sup.learner = subprocess.Popen([sys.executable, sys.argv[2], str(rdir)], stdout=subprocess.PIPE,
                                       start_new_session=True)  # as asyncrl run starts it
        assert sup.learner.stdout.readline() == b"up\\n"
        pool = ActorPool(cfg, rdir, redis_url=url, owns_ray=True)
        pids = ray_pids()
        group_sigterm()
        t0 = time.monotonic()
        interim = lambda: write_summary(rdir, [], start, time.time(), {"status": "interrupted"})
        rc = _teardown(pool, sup, None, None, on_ray_lost=interim)
        done({"rc": rc, "took": time.monotonic() - t0, "ray_lost": pool.ray_lost, "ray_gone": gone(pids),
              "learner_saw": json.loads((rdir / "learner_saw.json").read_text()),
              "redis_running": sup.redis_srv.running, "redis_url": (rdir / "redis.url").exists()})
        """,
    )
    assert result["ray_lost"] and result["ray_gone"], result
    assert result["learner_saw"] == {"summary": True, "redis_url": False}, result
    assert result["rc"] == 0 and not result["redis_running"] and not result["redis_url"], result
    assert result["took"] < 30, result


def test_ray_started_early_is_shut_down_bounded_when_it_is_lost(tmp_path) -> None:
    """A run that fails before its pool took Ray over (model build, Redis, learner start) shuts down the
    Ray it started early: with the GCS gone that shutdown waited until Ray ended the process; now it is
    abandoned and reported (the run then ends with os._exit)."""
    result = _child(
        tmp_path,
        """
        from asyncrl.launch import EarlyRay
        from asyncrl.orchestrator import _shutdown_early_ray
        early = EarlyRay(cfg)
        assert early.result()
        pids = ray_pids()
        group_sigterm()
        t0 = time.monotonic()
        abandoned = _shutdown_early_ray(early)
        done({"abandoned": abandoned, "took": time.monotonic() - t0, "ray_gone": gone(pids)})
        """,
    )
    assert result["abandoned"] and result["ray_gone"] and result["took"] < 30, result


def test_an_error_after_a_lost_ray_is_reported_as_the_cli_would_then_the_process_ends(tmp_path) -> None:
    """An error escaping `asyncrl run` after its Ray was lost: the process ends at once (os._exit; Ray's
    atexit shutdown would wait on the dead GCS) with the CLI's message and exit code."""
    for error, code, shown in ((ConfigError("bad key"), 2, "asyncrl: error: bad key"),
                               (ValueError("boom"), 1, "ValueError: boom")):  # fmt: skip
        script = (
            "import atexit, sys\n"
            "from asyncrl.config import ConfigError\n"
            "from asyncrl.orchestrator import _exit_now\n"
            "atexit.register(lambda: print('atexit ran', file=sys.stderr))\n"
            f"_exit_now(0, {type(error).__name__}({str(error)!r}))\n"
        )
        out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
        assert out.returncode == code and shown in out.stderr and "atexit ran" not in out.stderr, out


# `asyncrl serve-actors` with its pool's actor swapped for a bare one (no vLLM engine, no model): it starts
# its own local Ray (in its process group) and says READY once its actor runs.
_SERVE = textwrap.dedent(
    """
    import asyncio, json, sys
    from pathlib import Path
    import ray
    import asyncrl.tinymodel
    from asyncrl.actors import pool as pool_mod

    rdir = Path(sys.argv[1])

    class Actor:  # stands in for RayRolloutActor: runs until stopped
        def __init__(self, *args, env=None):
            self.stopped = None
        async def run(self, max_groups=None):
            self.stopped = asyncio.Event()
            await self.stopped.wait()
            return {}
        async def stop(self, abort=True):
            self.stopped.set()
        async def stats(self):
            return {}

    pool_mod.RayRolloutActor = Actor
    asyncrl.tinymodel.resolve_model_path = lambda cfg, run_dir: Path(run_dir) / "model"
    start = pool_mod.ActorPool.start

    def start_then_ready(self, *args, **kwargs):
        start(self, *args, **kwargs)
        ray.get(self.actors[0].stats.remote())  # its process is up
        node = ray._private.worker._global_node
        pids = [i.process.pid for kind in ("gcs_server", "raylet") for i in node.all_processes.get(kind, [])]
        timeout = ray._private.state.state.get_system_config().get("gcs_rpc_server_reconnect_timeout_s")
        (rdir / "ray.json").write_text(json.dumps({"pids": pids, "timeout": timeout}))
        print("READY", flush=True)
        return self

    pool_mod.ActorPool.start = start_then_ready
    from asyncrl.cli import main
    sys.exit(main(["serve-actors", "ray.num_cpus=1", "actors.num_actors=1", *sys.argv[2:]]))
    """
)


def _serve_then(
    tmp_path, redis_server, run_name, act, script: str = ""
) -> tuple[subprocess.Popen, float, str]:
    """Run `_SERVE` (serve-actors with a bare actor) in a process group of its own, call ``act(pid)`` when
    it says READY; the process, the seconds from ``act`` to its exit and its stderr."""
    rdir = tmp_path / "run"
    rdir.mkdir()
    log = tmp_path / "child.log"
    args = [str(rdir), f"redis.url={redis_server.url}", f"run.dir={tmp_path}", f"run.name={run_name}"]
    proc = subprocess.Popen([sys.executable, "-c", script or _SERVE, *args], stdout=subprocess.PIPE,
                            stderr=log.open("wb"), text=True, start_new_session=True)  # fmt: skip
    timer = threading.Timer(90, os.killpg, (proc.pid, signal.SIGKILL))  # one waiting on the dead GCS
    timer.start()
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith("READY"):
                acted = time.monotonic()
                act(proc.pid)
        proc.wait()
        took = time.monotonic() - acted
    finally:
        timer.cancel()
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return proc, took, log.read_text()


def test_serve_actors_stopped_by_a_group_sigterm_ends_at_once_with_exit_code_0(
    tmp_path, redis_server, run_name
):
    """`asyncrl serve-actors` under a SIGTERM to its whole process group (``timeout``, systemd, scancel),
    which kills its local Ray's GCS and raylet too: its pool's stop waited on the dead GCS, then raised
    (a RuntimeError traceback, exit code 1) and the process hung in Ray's exit handler until Ray's core
    worker aborted it (~2 min). Now the stop is abandoned once the loss shows, Ray's processes killed and
    the process ends with the exit code of a stop (0), its log lines flushed. Its local Ray keeps Ray's
    GCS reconnect timeout (the longer one covers `asyncrl run`'s learner stop)."""
    rdir = tmp_path / "run"
    proc, took, err = _serve_then(
        tmp_path, redis_server, run_name, lambda pid: os.killpg(pid, signal.SIGTERM)
    )
    ray_info = json.loads((rdir / "ray.json").read_text())
    assert proc.returncode == 0 and "Traceback" not in err, err[-4000:]
    assert took < 45, (took, err[-4000:])
    assert "the local Ray lost its GCS or raylet" in err, err[-4000:]  # logged, flushed before os._exit
    assert ray_info["timeout"] in (None, 60), ray_info
    for pid in ray_info["pids"]:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_the_loss_shows_as_soon_as_the_gcs_closes_its_port(tmp_path) -> None:
    """A SIGTERM'd GCS closes its port at once while its process lingers; the raylet exits ~10 s later,
    and in one CI run not within the core worker's 60 s (serve-actors then died with exit code 1). The
    loss must show from the refused connection alone: here only the GCS gets the signal (the raylet
    stays up) and local_ray_lost() turns true within 3 s. Before, it waited for a process to exit."""
    result = _child(
        tmp_path,
        """
        from asyncrl.actors.pool import init_ray, local_ray_lost
        assert init_ray(cfg)
        node = ray._private.worker._global_node
        gcs = node.all_processes["gcs_server"][0].process
        raylet = node.all_processes["raylet"][0].process
        before = local_ray_lost()
        os.kill(gcs.pid, signal.SIGTERM)
        t0 = time.monotonic()
        while not local_ray_lost() and time.monotonic() - t0 < 20:
            time.sleep(0.1)
        done({"before": before, "took": time.monotonic() - t0, "raylet_alive": raylet.poll() is None})
        """,
    )
    assert result["before"] is False, result
    assert result["took"] < 3 and result["raylet_alive"], result


def test_serve_actors_whose_gcs_dies_without_a_signal_ends_at_once_with_one_line(
    tmp_path, redis_server, run_name
):
    """The GCS of serve-actors' own local Ray killed alone (kill -9: the OOM killer, a crash), no signal
    to serve-actors: its supervision loop waited on the dead GCS until Ray's core worker aborted it 60 s
    later (exit 1, Ray's abort text, its pool lease left to lapse). Now the loss ends it within
    seconds: exit code 1, one `asyncrl: error:` line naming the GCS, no traceback, the lease released."""

    def kill_the_gcs(pid: int) -> None:
        os.kill(json.loads((tmp_path / "run" / "ray.json").read_text())["pids"][0], signal.SIGKILL)

    proc, took, err = _serve_then(tmp_path, redis_server, run_name, kill_the_gcs)
    assert proc.returncode == 1 and "Traceback" not in err, err[-4000:]
    assert took < 30, (took, err[-4000:])
    assert "asyncrl: error: the local Ray's GCS or raylet exited" in err, err[-4000:]
    from asyncrl.buffer import ReplayBuffer

    assert ReplayBuffer(redis_server.client(), run_name).pool_leases_held([0]) == [False]


# _SERVE whose model build (the pool's start, beside Ray's start in a thread) says READY once Ray is up and
# then takes 8 s: a signal lands while the start still runs, with Ray's GCS and raylet up.
_SERVE_SLOW_BUILD = _SERVE.replace(
    'asyncrl.tinymodel.resolve_model_path = lambda cfg, run_dir: Path(run_dir) / "model"',
    """def slow_build(cfg, run_dir):
    import time
    end = time.monotonic() + 30
    while not ray.is_initialized() and time.monotonic() < end:
        time.sleep(0.1)
    node = ray._private.worker._global_node
    pids = [i.process.pid for kind in ("gcs_server", "raylet") for i in node.all_processes.get(kind, [])]
    (rdir / "ray.json").write_text(json.dumps({"pids": pids, "timeout": None}))
    print("READY", flush=True)
    time.sleep(8)
    return Path(run_dir) / "model"
asyncrl.tinymodel.resolve_model_path = slow_build""",
)


def test_serve_actors_stopped_by_a_group_sigterm_during_its_start_ends_with_exit_code_0(
    tmp_path, redis_server, run_name
):
    """A SIGTERM to serve-actors' process group while its pool still starts (the model build) with its
    Ray already up: the start is given up at the stop, and shutting that Ray down waited on the GCS the
    signal had killed until Ray's core worker aborted the process (60 s, exit code 1). Now the loss is
    seen first: Ray's processes killed, exit code 0, the pool lease released."""
    assert _SERVE_SLOW_BUILD != _SERVE
    proc, took, err = _serve_then(
        tmp_path, redis_server, run_name, lambda pid: os.killpg(pid, signal.SIGTERM), _SERVE_SLOW_BUILD
    )
    assert proc.returncode == 0 and "Traceback" not in err, err[-4000:]
    assert took < 30, (took, err[-4000:])
    for pid in json.loads((tmp_path / "run" / "ray.json").read_text())["pids"]:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    from asyncrl.buffer import ReplayBuffer

    assert ReplayBuffer(redis_server.client(), run_name).pool_leases_held([0]) == [False]


def test_the_gcs_port_probe_reads_ipv6_addresses() -> None:
    """Ray writes an IPv6 GCS address as "[::1]:port"; with the brackets kept the lookup failed and the
    probe said 'not refused' for ever (the slow detection again)."""
    import socket

    from asyncrl.actors.ray_loss import _refuses_connections

    try:
        s = socket.socket(socket.AF_INET6)
        s.bind(("::1", 0))
    except OSError:
        pytest.skip("no IPv6 loopback")
    s.listen()
    port = s.getsockname()[1]
    assert _refuses_connections(f"[::1]:{port}") is False  # listening
    s.close()
    assert _refuses_connections(f"[::1]:{port}") is True  # closed: refused
