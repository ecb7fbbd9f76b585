"""asyncrl.actors.engine_fork: an engine process forked from a preloaded server is what a spawn would
have made (environment, CPUs), and any start that could differ at load time is spawned instead.

Real processes throughout: a forkserver preloading a stdlib module (the mechanism is the one the actor
uses with vLLM; the engine itself is covered by the e2e run test, whose engine core must be forked)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from asyncrl.actors.engine_fork import load_time_diff, predicted_env

# Runs in a fresh interpreter: the forkserver is per process and would outlive the test here.
_SCRIPT = textwrap.dedent(
    """
    import json, logging, os, sys
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    from asyncrl.actors import engine_fork

    def child(q):
        q.put({"ppid": os.getppid(), "env": os.environ.get("ASYNCRL_TEST_LATE"),
               "omp": os.environ.get("OMP_NUM_THREADS"), "cpus": sorted(os.sched_getaffinity(0)),
               "json_loaded": "json.decoder" in sys.modules, "comm": open("/proc/self/comm").read().strip(),
               "proc_environ_token": b"ASYNCRL_TEST_TOKEN=t0" in open("/proc/self/environ", "rb").read()})

    def sleeper():
        import time
        time.sleep(600)

    if __name__ == "__main__":
        import multiprocessing
        mode, gomp = sys.argv[1], json.loads(sys.argv[2])
        if mode == "orphan":  # report the pids, then wait to be killed
            server = engine_fork.start_server({}, preload=("asyncrl.actors.forkserver_init", "json"))
            p = engine_fork.EngineProcess(target=sleeper, name="EngineCore")
            p.start()
            print(json.dumps({"server": server, "child": p.pid}), flush=True)
            import time
            time.sleep(600)
        all_cpus = sorted(os.sched_getaffinity(0))
        os.environ["ASYNCRL_TEST_TOKEN"] = "t0"  # as asyncrl.lifetime's reaper token: set before the server
        load = {"OMP_NUM_THREADS": "3", **gomp}
        server = engine_fork.start_server(load, preload=("asyncrl.actors.forkserver_init", "json"))
        os.sched_setaffinity(0, all_cpus[:1])  # the parent binds itself after starting the server
        os.environ["ASYNCRL_TEST_LATE"] = "set-after-the-server-started"
        os.environ.update(load)
        os.environ["OMP_NUM_THREADS"] = "3" if mode == "same" else "5"
        q = multiprocessing.get_context("spawn").Queue()
        p = engine_fork.EngineProcess(target=child, args=(q,), name="EngineCore")
        p.start()
        got = q.get(timeout=60)
        p.join(60)
        status = open(f"/proc/{server}/status").read()
        server_cpus = status.split("Cpus_allowed_list:")[1].split()[0]
        got.update(parent=os.getpid(), server=server, exitcode=p.exitcode, parent_cpus=all_cpus[:1],
                   all_cpus=all_cpus, server_cpus=server_cpus)
        print(json.dumps(got))
    """
)


def _run(tmp_path, mode: str, gomp: dict | None = None) -> tuple[dict, str]:
    script = tmp_path / "fork_check.py"
    script.write_text(_SCRIPT)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "GOMP_", "KMP_", "LD_PRELOAD"))}
    cmd = [sys.executable, str(script), mode, json.dumps(gomp or {})]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr


def test_a_matching_start_is_forked_from_the_server_with_the_parents_environment_and_cpus(tmp_path):
    got, log = _run(tmp_path, "same")
    assert got["exitcode"] == 0
    assert got["ppid"] == got["server"] != got["parent"]  # forked by the server, not spawned by us
    assert got["json_loaded"]  # with what the server preloaded
    assert (
        got["env"] == "set-after-the-server-started"
    )  # the parent's environment at start(), not the server's
    assert got["omp"] == "3"
    assert got["cpus"] == got["parent_cpus"]  # no libgomp here: the parent's CPUs at start()
    assert got["comm"] == "VLLM::EngineCor"  # named as vLLM names its engine core (ps, the e2e tests)
    assert got["proc_environ_token"]  # the reaper still finds it by its token
    assert "spawned, not forked" not in log


def test_a_start_whose_load_time_environment_differs_is_spawned_and_says_why(tmp_path):
    got, log = _run(tmp_path, "differs")
    assert got["exitcode"] == 0
    assert got["ppid"] == got["parent"]  # spawned by the parent, as vLLM would
    assert got["omp"] == "5" and got["env"] == "set-after-the-server-started"
    assert "EngineCore: spawned, not forked from the preloaded server (OMP_NUM_THREADS='5' here, '3'" in log


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs to tell the bindings apart")
def test_a_server_bound_by_libgomp_at_load_imports_on_every_cpu_and_its_children_get_libgomps_binding(
    tmp_path,
):
    """libgomp (preloaded, as vLLM does for an engine core) binds the server to the OpenMP list's first CPU
    as it loads: the server widens itself back for its imports, and a forked child starts bound as a
    spawned engine core would be (libgomp's CPU, not its parent's)."""
    last = sorted(os.sched_getaffinity(0))[-1]
    libgomp = predicted_env(str(last))["LD_PRELOAD"]
    got, log = _run(tmp_path, "same", {"LD_PRELOAD": libgomp, "GOMP_CPU_AFFINITY": str(last)})
    assert got["ppid"] == got["server"]
    assert got["cpus"] == [last] != got["parent_cpus"]
    lo, hi = got["all_cpus"][0], got["all_cpus"][-1]
    assert got["server_cpus"] in (f"{lo}-{hi}", ",".join(map(str, got["all_cpus"])))  # widened after load


def test_a_kill_9_of_the_actor_takes_its_server_and_the_forked_engine_with_it(tmp_path):
    """The server dies with the process that started it, and a forked engine core with its server
    (PR_SET_PDEATHSIG): nothing outlives a killed actor, whatever holds the server's pipes."""
    import signal
    import time

    script = tmp_path / "fork_check.py"
    script.write_text(_SCRIPT)
    proc = subprocess.Popen([sys.executable, str(script), "orphan", "{}"], stdout=subprocess.PIPE, text=True)
    try:
        pids = json.loads(proc.stdout.readline())
        assert all(os.path.exists(f"/proc/{p}") for p in pids.values())
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        deadline = time.monotonic() + 10
        while (alive := [p for p in pids.values() if _alive(p)]) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not alive, pids
    finally:
        if proc.poll() is None:
            proc.kill()


def _alive(pid: int) -> bool:
    try:
        stat = open(f"/proc/{pid}/stat").read()
    except FileNotFoundError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


def test_load_time_diff_compares_load_time_variables_and_existing_search_path_entries(tmp_path):
    base = {"PATH": "/bin", "OMP_NUM_THREADS": "1", "LD_PRELOAD": "/x/libgomp.so.1"}
    assert load_time_diff(base, dict(base)) is None
    assert (
        load_time_diff({**base, "PATH": "/usr/bin", "RAY_ADDRESS": "a"}, base) is None
    )  # read later: restored
    assert "LD_PRELOAD" in load_time_diff({**base, "LD_PRELOAD": ""}, base)
    assert "MALLOC_ARENA_MAX" in load_time_diff({**base, "MALLOC_ARENA_MAX": "2"}, base)
    # An import may prepend a directory that does not exist (opencv's cv2/../../lib64): nothing changes.
    missing, real = str(tmp_path / "nope"), str(tmp_path)
    assert load_time_diff({**base, "LD_LIBRARY_PATH": f"{missing}:"}, base) is None
    assert "LD_LIBRARY_PATH" in load_time_diff({**base, "LD_LIBRARY_PATH": f"{real}:{missing}"}, base)


@pytest.mark.parametrize(("bind", "cpus"), [("0", "0"), ("2", "2"), ("0-2,5", "0 1 2 5"), ("1,3", "1 3")])
def test_predicted_environment_is_vllms_gnu_openmp_binding_with_torchs_libgomp(bind, cpus):
    env = predicted_env(bind)
    torch_lib = os.path.join(os.path.dirname(__import__("importlib").util.find_spec("torch").origin), "lib")
    assert env is not None
    assert env["GOMP_CPU_AFFINITY"] == cpus and env["OMP_NUM_THREADS"] == str(len(cpus.split()))
    assert env["LD_PRELOAD"].split(":")[-1].startswith(os.path.join(torch_lib, "libgomp"))


@pytest.mark.parametrize("bind", [None, "", "auto", "nobind", "0|1", "0,x"])
def test_no_prediction_where_vllm_decides_at_run_time(bind):
    assert predicted_env(bind) is None
    assert predicted_env("0", ld_preload="/opt/intel/libiomp5.so") is None
