"""Scale-out settings: the shipped 7B 8+8 config validates, actor bundles are sized for tensor and
pipeline parallelism, and /metrics endpoints are advertised at an address another machine can reach."""

from __future__ import annotations

import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from asyncrl.actors.pool import ActorPool
from asyncrl.config import ConfigError, load_config
from asyncrl.metrics_export import WILDCARD_HOSTS, metrics_endpoint, node_address, serve

REPO = Path(__file__).resolve().parents[2]
FLEET = REPO / "configs" / "gpu_qwen2.5_7b_8x8.yaml"


def test_7b_fleet_config_passes_asyncrl_config_validation() -> None:
    r = subprocess.run([sys.executable, "-m", "asyncrl.cli", "config", "-c", str(FLEET)], cwd=REPO,
                       capture_output=True, text=True, timeout=60)  # fmt: skip
    assert r.returncode == 0, r.stderr
    cfg = load_config(FLEET)
    a = cfg.actors
    # 8 actor GPUs (engines x TP x PP x GPUs per worker) and a ZeRO-3 bf16 learner.
    assert a.num_actors * a.tensor_parallel_size * a.pipeline_parallel_size * a.num_gpus_per_actor == 8
    assert cfg.learner.zero_stage == 3 and cfg.model.dtype == "bfloat16"
    assert a.resources == {"rollout_node": 1.0} and cfg.metrics.host in WILDCARD_HOSTS


@pytest.mark.parametrize(("tp", "pp", "gpus"), [(1, 1, 1.0), (2, 1, 2.0), (4, 2, 8.0), (2, 2, 4.0)])
def test_actor_bundle_reserves_every_gpu_of_its_engine(tp: int, pp: int, gpus: float) -> None:
    cfg = load_config(FLEET, [f"actors.tensor_parallel_size={tp}", f"actors.pipeline_parallel_size={pp}",
                              f"actors.num_actors={8 // (tp * pp)}"])  # fmt: skip
    b = ActorPool(cfg, "/nonexistent", redis_url="redis://127.0.0.1:1/0").bundle()
    assert b == {"CPU": 8.0, "GPU": gpus, "rollout_node": 1.0}
    cpu = load_config(None, ["actors.resources={rack_a: 0.5}"])  # the CPU demo: no GPU key at all
    assert ActorPool(cpu, "/nonexistent", redis_url="redis://127.0.0.1:1/0").bundle() == {
        "CPU": 1.0,
        "rack_a": 0.5,
    }


def test_bad_parallel_and_placement_settings_fail_naming_the_key() -> None:
    with pytest.raises(ConfigError, match="actors.tensor_parallel_size"):
        load_config(None, ["actors.tensor_parallel_size=0"])
    with pytest.raises(ConfigError, match="actors.placement_strategy"):
        load_config(None, ["actors.placement_strategy=ANYWHERE"])
    with pytest.raises(ConfigError, match="actors.resources"):
        load_config(None, ["actors.resources={gpu_node: lots}"])


@pytest.mark.parametrize("host", ["0.0.0.0", "node"])
def test_metrics_are_advertised_at_the_node_address_and_reachable_there(host: str) -> None:
    bind, advertised = metrics_endpoint(host)
    assert advertised not in WILDCARD_HOSTS and advertised == node_address()
    port, stop = serve([], bind, 0)
    try:
        with urllib.request.urlopen(f"http://{advertised}:{port}/metrics", timeout=10) as r:
            assert r.status == 200
    finally:
        stop()
    # An explicit host is taken at its word; a caller that knows better (Ray's node IP) wins.
    assert metrics_endpoint("127.0.0.1") == ("127.0.0.1", "127.0.0.1")
    assert metrics_endpoint("0.0.0.0", "10.0.0.7") == ("0.0.0.0", "10.0.0.7")
