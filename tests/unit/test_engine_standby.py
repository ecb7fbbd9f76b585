"""asyncrl.actors.engine_standby: the engine process vLLM starts is run by a spawned standby that
imported beside its parent, and is then what a spawn at start() would have made (environment, CPUs of
every thread, libgomp's binding at load, name, exit code, signals); a start the standby cannot make
equivalent is spawned, saying why.

Real processes throughout, in a fresh interpreter (the standby is per process): a standby preloading a
stdlib module and a module that starts a thread while it is imported (as torch's import may). The
engine itself is covered by the e2e run tests, whose engine core is the standby's (their actor log)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

_SCRIPT = textwrap.dedent(
    """
    import json, logging, multiprocessing, os, sys, time
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    from asyncrl.actors import engine_standby, engine_start, standby_init

    PRELOAD = ("asyncrl.actors.standby_init", "json", "threaded_import")

    def report(path):
        cpus = set()
        for tid in os.listdir("/proc/self/task"):
            status = open(f"/proc/self/task/{tid}/status").read()
            cpus |= {line.split()[1] for line in status.splitlines() if line.startswith("Cpus_allowed_list")}
        with open(path, "w") as f:
            json.dump({"pid": os.getpid(), "ppid": os.getppid(), "late": os.environ.get("ASYNCRL_TEST_LATE"),
                       "omp": os.environ.get("OMP_NUM_THREADS"), "threads": len(os.listdir("/proc/self/task")),
                       "widen": os.environ.get("ASYNCRL_STANDBY_CPUS"), "cpus": sorted(cpus),
                       "preloaded": "threaded_import" in sys.modules,
                       "name": multiprocessing.current_process().name,
                       "comm": open("/proc/self/comm").read().strip(),
                       "proc_environ_token": b"ASYNCRL_TEST_TOKEN=t0" in open("/proc/self/environ", "rb").read(),
                       "bound_at_load": standby_init.BOUND_AT_LOAD, "load_cpus": standby_init.LOAD_CPUS}, f)

    def exit_with(code, *_):
        sys.exit(code)

    def alive(pid):
        try:
            return open(f"/proc/{pid}/status").read().split("State:")[1].split()[0] not in ("Z", "X")
        except FileNotFoundError:
            return False

    def sleeper():
        time.sleep(600)

    if __name__ == "__main__":
        mode, out, gomp = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
        all_cpus = sorted(os.sched_getaffinity(0))
        os.environ["ASYNCRL_TEST_TOKEN"] = "t0"  # as asyncrl.lifetime's reaper token: set before the standby
        load = {"OMP_NUM_THREADS": "3", **gomp}
        standby = engine_standby.start_standby(load, PRELOAD)
        if mode == "orphan":  # report the standby's pid, then wait to be killed
            print(json.dumps({"standby": standby}), flush=True)
            time.sleep(600)
        os.sched_setaffinity(0, all_cpus[:1])  # the parent binds itself after starting the standby
        os.environ["ASYNCRL_TEST_LATE"] = "set-after-the-standby-started"
        os.environ.update(load)
        if mode == "differs":
            os.environ["OMP_NUM_THREADS"] = "5"
        if mode == "exit":
            target, args = exit_with, (3,)
        elif mode == "term":
            target, args = sleeper, ()
        elif mode == "queue":  # a queue's pipe is passed to a spawned child at exec
            target, args = exit_with, (0, multiprocessing.get_context("spawn").Queue())
        else:
            target, args = report, (out,)
        p = engine_start.EngineProcess(target=target, args=args, name="EngineCore")
        p.start()
        got = {"parent": os.getpid(), "standby": standby, "child": p.pid, "all_cpus": all_cpus}
        if mode == "term":
            time.sleep(1)
            p.terminate()
        p.join(60)
        got["exitcode"] = p.exitcode
        got["waiting"] = engine_standby.standby_pid()
        engine_standby.discard()
        got["standby_alive_after_discard"] = engine_standby.standby_pid() is not None or alive(standby)
        print(json.dumps(got), flush=True)
    """
)

_THREADED_IMPORT = (
    "import threading, time\nthreading.Thread(target=time.sleep, args=(600,), daemon=True).start()\n"
)


def _files(tmp_path):
    script = tmp_path / "standby_check.py"
    script.write_text(_SCRIPT)
    (tmp_path / "threaded_import.py").write_text(_THREADED_IMPORT)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "GOMP_", "KMP_", "LD_PRELOAD"))}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), os.getcwd(), env.get("PYTHONPATH", "")])
    return script, env


def _run(tmp_path, mode: str, gomp: dict | None = None) -> tuple[dict, dict | None, str]:
    script, env = _files(tmp_path)
    out = tmp_path / "child.json"
    proc = subprocess.run([sys.executable, str(script), mode, str(out), json.dumps(gomp or {})],
                          capture_output=True, text=True, timeout=120, env=env)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    child = json.loads(out.read_text()) if out.exists() else None
    return json.loads(proc.stdout.strip().splitlines()[-1]), child, proc.stderr


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="the CPU check needs two cores to tell apart")
def test_the_standby_runs_the_engine_process_as_a_spawn_at_start_would_have(tmp_path):
    got, child, log = _run(tmp_path, "adopt")
    assert got["child"] == got["standby"] == child["pid"]  # no new process: the standby ran it
    assert child["ppid"] == got["parent"] and got["exitcode"] == 0
    assert child["preloaded"] and child["name"] == "EngineCore"
    assert child["comm"] == "VLLM::EngineCor"  # named as vLLM names its engine core (ps, the e2e tests)
    assert child["proc_environ_token"]  # the reaper still finds it by its token
    # The parent's environment as of start(), not the standby's own (its widening variable is gone).
    assert child["late"] == "set-after-the-standby-started" and child["omp"] == "3" and child["widen"] is None
    # Every thread on the parent's CPUs at start(), the one its import started included.
    assert child["threads"] >= 2 and child["cpus"] == [str(got["all_cpus"][0])], child
    assert "run by the standby" in log
    assert got["waiting"] is None and not got["standby_alive_after_discard"]


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs to tell the bindings apart")
def test_a_standby_bound_by_libgomp_at_load_imports_on_every_cpu_and_its_engine_gets_libgomps_binding(
    tmp_path,
):
    """libgomp (preloaded, as vLLM does for an engine core) binds the standby to the OpenMP list's first
    CPU as it loads: the standby widens itself back for its imports, and the engine process it runs is
    bound as a spawned engine core would be (libgomp's CPU, not its parent's), every thread of it."""
    from asyncrl.actors.engine_start import predicted_env

    last = sorted(os.sched_getaffinity(0))[-1]
    libgomp = predicted_env(str(last))["LD_PRELOAD"]
    got, child, log = _run(tmp_path, "adopt", {"LD_PRELOAD": libgomp, "GOMP_CPU_AFFINITY": str(last)})
    assert got["child"] == got["standby"] == child["pid"], log[-2000:]
    assert child["bound_at_load"] and child["load_cpus"] == [last]
    assert child["cpus"] == [str(last)] and last != got["all_cpus"][0], child
    assert child["threads"] >= 2


def test_the_exit_code_and_the_signals_reach_the_process_object(tmp_path):
    got, _, _ = _run(tmp_path, "exit")
    assert got["child"] == got["standby"] and got["exitcode"] == 3
    got, _, _ = _run(tmp_path, "term")
    assert got["child"] == got["standby"] and got["exitcode"] == -signal.SIGTERM


@pytest.mark.parametrize(
    ("mode", "reason"),
    [("differs", "OMP_NUM_THREADS='5' here, '3'"), ("queue", "its arguments hold a file descriptor")],
)
def test_a_start_the_standby_cannot_run_as_a_spawn_is_spawned_and_the_standby_discarded(
    tmp_path, mode, reason
):
    got, _, log = _run(tmp_path, mode)
    assert got["child"] != got["standby"], got
    assert "spawned, not the standby's" in log and reason in log, log[-2000:]
    assert got["waiting"] == got["standby"]  # still waiting until the engine is up, then discarded
    assert not got["standby_alive_after_discard"]


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/status").read_text().split("State:")[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False


def test_a_kill_9_of_the_parent_takes_the_standby_with_it(tmp_path):
    script, env = _files(tmp_path)
    proc = subprocess.Popen([sys.executable, str(script), "orphan", str(tmp_path / "x.json"), "{}"],
                            stdout=subprocess.PIPE, text=True, env=env)  # fmt: skip
    try:
        standby = json.loads(proc.stdout.readline())["standby"]
        assert _alive(standby)
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        deadline = time.monotonic() + 10
        while _alive(standby) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(standby), "the standby outlived its parent"
    finally:
        if proc.poll() is None:
            proc.kill()
