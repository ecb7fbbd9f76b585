"""A multi-node run on one machine with Ray's own tools.

A Ray cluster of three nodes (``ray.cluster_utils.Cluster``: a head without CPUs for actors and two
worker nodes, each with its own custom resource plus a shared ``rollout_node`` one), one shared Redis,
``asyncrl serve-actors ray.address=<cluster>`` whose two actors are placed by a STRICT_SPREAD placement
group asking for ``rollout_node`` (so: one per worker node, never the head), and a 2-rank learner under
torchrun (gloo) on its own. Checks: the run learns, the staleness bound holds, each actor runs on a
different worker node, and each actor's /metrics answers at the address it advertises in Redis, which
is the node's address (not a loopback or wildcard string).
"""

from __future__ import annotations

import signal
import subprocess
import sys
import urllib.request
import uuid

import pytest

from asyncrl.buffer import EmbeddedRedis, ReplayBuffer
from asyncrl.config import load_config
from asyncrl.launch import _free_port
from asyncrl.metrics_export import WILDCARD_HOSTS
from tests.e2e.procs import ROOT, asyncrl_cmd, marked_env, read_jsonl, wait_for, wait_no_orphans

pytestmark = pytest.mark.slow

STEPS = 40
ETA = 1


def test_actors_on_worker_nodes_two_rank_learner_one_redis(tmp_path) -> None:
    from ray.cluster_utils import Cluster

    from asyncrl.tinymodel import resolve_model_path

    marker = uuid.uuid4().hex
    name = f"multinode-{marker[:8]}"
    rdir = tmp_path / "run"
    env = marked_env(marker, OMP_NUM_THREADS="1")
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
    workers = [
        cluster.add_node(num_cpus=1, resources={"rollout_node": 1, f"worker_{i}": 1}) for i in range(2)
    ]
    procs: list[subprocess.Popen] = []
    try:
        cluster.wait_for_nodes()
        with EmbeddedRedis(tmp_path / "redis") as srv:
            common = ["--config", str(ROOT / "configs" / "default.yaml"), f"redis.url={srv.url}",
                      f"run.name={name}", f"run.dir={rdir}", f"run.max_steps={STEPS}",
                      f"buffer.max_staleness={ETA}"]  # fmt: skip
            resolve_model_path(load_config(None, common[2:]), rdir)  # built once, before 3 processes race
            alog, llog = tmp_path / "actors.log", tmp_path / "learner.log"
            actors = subprocess.Popen(
                asyncrl_cmd("serve-actors", *common, f"ray.address={cluster.address}", "actors.num_actors=2",
                            "actors.resources={rollout_node: 1}", "actors.placement_strategy=STRICT_SPREAD",
                            "metrics.host=0.0.0.0"),
                env=env, stdout=alog.open("wb"), stderr=subprocess.STDOUT,
            )  # fmt: skip
            procs.append(actors)
            learner = subprocess.Popen(
                [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                 str(_free_port()), "-m", "asyncrl.cli", "learn", *common, "learner.torch_threads=1"],
                env=env, stdout=llog.open("wb"), stderr=subprocess.STDOUT, cwd=tmp_path,
            )  # fmt: skip
            procs.append(learner)
            buf = ReplayBuffer.connect(srv.url, name)
            wait_for(lambda: len(buf.actors()) == 2 and all(a.get("metrics_addr") for a in buf.actors().values()),
                     300, "two actor heartbeats", actors, alog)  # fmt: skip

            # Placement: one actor on each worker node, none on the head (Ray's actor table, read from GCS).
            table = cluster.global_state.actor_table(None).values()
            placed = [a["Address"]["NodeID"] for a in table
                      if a["State"] == "ALIVE" and a["ActorClassName"] == "RayRolloutActor"]  # fmt: skip
            assert sorted(placed) == sorted(w.node_id for w in workers), (placed, cluster.head_node.node_id)

            # Every actor's /metrics answers at the address it advertises: the node's, never 0.0.0.0.
            for info in buf.actors().values():
                host, port = info["metrics_addr"].rsplit(":", 1)
                assert host not in WILDCARD_HOSTS and not host.startswith("127."), info["metrics_addr"]
                assert host in {w.node_ip_address for w in workers}
                with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=10) as r:
                    assert b"asyncrl_actor_generated_tokens_total" in r.read()

            rc = learner.wait(timeout=600)
            assert rc == 0, llog.read_text()[-4000:]
            assert actors.poll() is None, alog.read_text()[-3000:]
            actors.send_signal(signal.SIGTERM)
            assert actors.wait(timeout=180) == 0, alog.read_text()[-4000:]
            buf.close()
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        cluster.shutdown()
    recs = read_jsonl(rdir / "metrics.jsonl")
    assert [r["step"] for r in recs] == list(range(1, STEPS + 1))
    assert all(r["staleness_max"] <= ETA for r in recs), "staleness bound"
    first = sum(r["reward_mean"] for r in recs[:5]) / 5
    last = sum(r["reward_mean"] for r in recs[-5:]) / 5
    assert last > first + 0.1, (first, last)
    assert not wait_no_orphans(marker)
