"""The wait for Ray's start is bounded and ends at the command's stop, in `asyncrl run` and `asyncrl
serve-actors` alike, and so is the rest of the pool's start (the placement group's wait).

Real processes throughout: the command in a process group of its own, a Ray address that refuses
connections (ray.init retries it for good, with no error of its own: measured > 200 s), a real local Ray
whose placement group cannot be placed, a real Redis, real signals. serve-actors runs its pool with a
bare stand-in actor (no vLLM engine), as in tests/unit/test_ray_lost_teardown.py."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

pytest.importorskip("ray")


def _closed_port() -> int:
    """A local port nothing listens on (connections to it are refused)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _refuses(url: str) -> bool:
    host, port = url.rsplit("@", 1)[-1].split("//")[-1].split("/")[0].rsplit(":", 1)
    try:
        socket.create_connection((host, int(port)), timeout=1.0).close()
    except ConnectionRefusedError:
        return True
    return False


def _launch(cmd: list[str], log: Path, ready: Callable[[str], bool], act: Callable[[int], None] | None,
            limit_s: float = 25.0) -> tuple[int, float, str]:  # fmt: skip
    """Run ``cmd`` in a process group of its own; once ``ready(stdout line)`` (or at once for None), call
    ``act(pid)``. Returns its exit code, the seconds from ``act`` (or the start) to its exit, and its
    stderr. A command still running ``limit_s`` after that is killed (the old code waited for good)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log.open("wb"), text=True,
                            start_new_session=True)  # fmt: skip
    t0 = time.monotonic()
    timer = threading.Timer(90.0, os.killpg, (proc.pid, signal.SIGKILL))  # one that never gets ready
    timer.start()
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            if act is not None and ready(line):
                timer.cancel()
                t0 = time.monotonic()
                act(proc.pid)
                timer = threading.Timer(limit_s, os.killpg, (proc.pid, signal.SIGKILL))
                timer.start()
                act = None
    finally:
        timer.cancel()
        if proc.poll() is None:  # the test failed above: nothing of the command may outlive it
            os.killpg(proc.pid, signal.SIGKILL)
        code = proc.wait()
    return code, time.monotonic() - t0, log.read_text()


# `asyncrl run` that says READY once its embedded Redis is up (the model built): from there on it waits
# for Ray. Its learner is a stand-in that exits 0 on SIGTERM: a real one stopped in its first seconds can
# die inside DeepSpeed's JIT load of its shm op, holding torch's extension lock
# (~/.cache/torch_extensions/*/deepspeed_shm_comm/lock), and every later learner on the machine then
# waits on that lock for good.
_RUN = textwrap.dedent(
    """
    import subprocess, sys
    import asyncrl.run_supervisor
    from asyncrl.run_supervisor import Supervisor

    LEARNER = "import signal, sys, time; signal.signal(signal.SIGTERM, lambda *_: sys.exit(0)); time.sleep(600)"
    asyncrl.run_supervisor.start_learner_process = lambda *a, **k: subprocess.Popen(
        [sys.executable, "-c", LEARNER], start_new_session=True)
    start_redis = Supervisor.start_redis
    def start_redis_then_ready(self):
        url = start_redis(self)
        print("READY", flush=True)
        return url
    Supervisor.start_redis = start_redis_then_ready
    from asyncrl.cli import main
    sys.exit(main(["run", *sys.argv[1:]]))
    """
)


def _run(tmp_path: Path, act: Callable[[int], None] | None, *overrides: str) -> tuple[int, float, str, Path]:
    rdir = tmp_path / "run"
    args = [f"run.dir={rdir}", "run.name=bounded", f"ray.address=127.0.0.1:{_closed_port()}",
            "learner.stop_grace_s=5", *overrides]  # fmt: skip
    code, took, err = _launch([sys.executable, "-c", _RUN, *args], tmp_path / "run.log",
                              lambda line: line.startswith("READY"), act)  # fmt: skip
    return code, took, err, rdir


def test_run_stopped_while_it_waits_for_an_unreachable_ray_ends_at_once(tmp_path) -> None:
    """`asyncrl run` with a ray.address that refuses connections, SIGTERM while it waits for Ray: it
    waited for good (ray.init retries the address; the signal only set the stop event). Now it ends as
    any stopped run: exit code 0, summary.json 'interrupted', its learner (a stand-in) and Redis
    stopped."""
    code, took, err, rdir = _run(tmp_path, lambda pid: os.kill(pid, signal.SIGTERM))
    assert code == 0 and "Traceback" not in err, err[-4000:]
    assert took < 15, (took, err[-4000:])
    summary = json.loads((rdir / "summary.json").read_text())
    assert summary["status"] == "interrupted" and summary["learner_exit_code"] == 0, summary
    assert not (rdir / "redis.url").exists()


def test_run_gives_up_on_an_unreachable_ray_after_its_bound_naming_the_address(tmp_path) -> None:
    """Past ray.start_timeout_s `asyncrl run` fails with one line that names ray.address and what to
    check (exit code 1, summary.json 'failed'); it waited for good before (no such bound)."""
    code, took, err, rdir = _run(tmp_path, None, "ray.start_timeout_s=3")
    assert code == 1 and "Traceback" not in err, err[-4000:]
    line = next(ln for ln in err.splitlines() if ln.startswith("asyncrl: error:"))
    assert "ray.start_timeout_s=3s" in line and "ray.address=127.0.0.1:" in line and "ray status" in line
    assert took < 25, (took, err[-4000:])
    summary = json.loads((rdir / "summary.json").read_text())
    assert summary["status"] == "failed" and "ray.address=127.0.0.1:" in summary["error"], summary


# `asyncrl serve-actors` with a bare stand-in actor (no vLLM engine, no model build); it says READY as its
# placement group starts waiting, or as the pool's start begins (before Ray's start) with an address.
_SERVE = textwrap.dedent(
    """
    import asyncio, json, sys
    from pathlib import Path
    import asyncrl.tinymodel
    from asyncrl.actors import pool as pool_mod

    rdir = Path(sys.argv[1])

    class Actor:  # stands in for RayRolloutActor
        def __init__(self, *args, env=None):
            pass
        async def run(self, max_groups=None):
            await asyncio.Event().wait()

    pool_mod.RayRolloutActor = Actor

    def no_model(cfg, run_dir):
        if cfg.ray.address:  # Ray starts in the background now: it waits for Ray from here on
            print("READY", flush=True)
        return Path(run_dir) / "model"

    asyncrl.tinymodel.resolve_model_path = no_model
    placement_group = pool_mod.ActorPool._placement_group

    def placing_then_ready(self, *args, **kwargs):
        import ray
        node = ray._private.worker._global_node
        pids = [i.process.pid for kind in ("gcs_server", "raylet") for i in node.all_processes.get(kind, [])]
        (rdir / "ray.json").write_text(json.dumps({"pids": pids}))
        print("READY", flush=True)
        return placement_group(self, *args, **kwargs)

    pool_mod.ActorPool._placement_group = placing_then_ready
    from asyncrl.cli import main
    sys.exit(main(["serve-actors", "ray.num_cpus=1", "actors.num_actors=1", *sys.argv[2:]]))
    """
)


def _serve(tmp_path, redis_server, run_name, act, *overrides: str) -> tuple[int, float, str]:
    rdir = tmp_path / "run"
    rdir.mkdir()
    args = [
        str(rdir),
        f"redis.url={redis_server.url}",
        f"run.dir={tmp_path}",
        f"run.name={run_name}",
        *overrides,
    ]
    return _launch([sys.executable, "-c", _SERVE, *args], tmp_path / "serve.log",
                   lambda line: line.startswith("READY"), act)  # fmt: skip


def _lease_held(redis_server, run_name) -> bool:
    from asyncrl.buffer import ReplayBuffer

    return ReplayBuffer(redis_server.client(), run_name).pool_leases_held([0]) == [True]


def test_serve_actors_stopped_while_its_placement_group_waits_ends_at_once(
    tmp_path, redis_server, run_name
) -> None:
    """serve-actors whose pool cannot be placed (2 CPUs per actor on a 1-CPU local Ray), SIGTERM while
    its placement group waits: the signal was seen only when the wait gave up, 120 s later, and the
    command then failed (exit code 1). Now it stops within seconds: exit code 0, its local Ray's GCS and
    raylet gone, the pool's lease released."""
    code, took, err = _serve(tmp_path, redis_server, run_name, lambda pid: os.kill(pid, signal.SIGTERM),
                             "actors.num_cpus_per_actor=2")  # fmt: skip
    assert code == 0 and "Traceback" not in err, err[-4000:]
    assert took < 15, (took, err[-4000:])
    for pid in json.loads((tmp_path / "run" / "ray.json").read_text())["pids"]:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert not _lease_held(redis_server, run_name)


def test_serve_actors_stopped_while_it_waits_for_an_unreachable_ray_ends_at_once(
    tmp_path, redis_server, run_name
) -> None:
    """serve-actors with a ray.address that refuses connections, SIGINT while Ray starts: it waited for
    good (ray.init on the main thread, the signal only set the stop event). Now: exit code 0 within
    seconds, the pool's lease released."""
    code, took, err = _serve(tmp_path, redis_server, run_name, lambda pid: os.kill(pid, signal.SIGINT),
                             f"ray.address=127.0.0.1:{_closed_port()}")  # fmt: skip
    assert code == 0 and "Traceback" not in err, err[-4000:]
    assert took < 15, (took, err[-4000:])
    assert not _lease_held(redis_server, run_name)


def test_serve_actors_gives_up_on_an_unreachable_ray_after_its_bound(
    tmp_path, redis_server, run_name
) -> None:
    """Past ray.start_timeout_s serve-actors fails with one line naming ray.address (exit code 1), the
    pool's lease released; it waited for good before."""
    code, took, err = _serve(tmp_path, redis_server, run_name, None, f"ray.address=127.0.0.1:{_closed_port()}",
                             "ray.start_timeout_s=3")  # fmt: skip
    assert code == 1 and "Traceback" not in err, err[-4000:]
    assert "asyncrl: error: Ray did not start within ray.start_timeout_s=3s: ray.address=127.0.0.1:" in err
    assert took < 25, (took, err[-4000:])
    assert not _lease_held(redis_server, run_name)
