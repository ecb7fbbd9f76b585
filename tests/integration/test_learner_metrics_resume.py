"""What a real learner (CPU) on real Redis shows while it runs: a resumed learner's /metrics counters count
what this process did, from 0 (metrics.jsonl keeps the run-wide totals restored from the checkpoint), and
asyncrl status says whether it waits for data or trains, and since when."""

from __future__ import annotations

import re
import threading
import time

import pytest
import torch

from asyncrl.buffer import ReplayBuffer
from asyncrl.learner.logprobs import load_hf_model
from asyncrl.learner.loop import learn
from asyncrl.learner.records import METRICS_FILE, read_jsonl
from asyncrl.metrics import LEARNER_METRICS
from asyncrl.metrics_export import LearnerExporter, learner_collectors
from asyncrl.status import collect_status, format_status
from asyncrl.tinymodel import resolve_model_path
from tests.integration.learner_helpers import dist_env, sample_groups, tiny_config

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::FutureWarning")

#: Exposed name -> snapshot key (the step record's run-wide field) of every learner counter.
COUNTERS = {m.name: m.key for m in LEARNER_METRICS if m.kind == "counter"}


@pytest.fixture(scope="module")
def sampler(tmp_path_factory: pytest.TempPathFactory) -> torch.nn.Module:
    d = tmp_path_factory.mktemp("sampler")
    return load_hf_model(resolve_model_path(tiny_config(d), d))


def _counters(exporter: LearnerExporter) -> dict[str, float]:
    (col, _buf) = learner_collectors(exporter, dict)
    return {s.name: s.value for fam in col.collect() for s in fam.samples if s.name in COUNTERS}


@pytest.mark.timeout(300)
def test_a_resumed_learner_exports_this_process_s_counts(
    redis_client, redis_url, run_name, sampler, tmp_path
):
    rdir = tmp_path / "run"
    cfg = tiny_config(rdir, redis_url, run_name, checkpoint_every=1)
    cfg.buffer.max_staleness = 1
    buf = ReplayBuffer(redis_client, run_name)
    dist_env()
    for g in sample_groups(sampler, 4, max_tokens=6, seed=51):
        buf.put(g)
    cfg.run.max_steps = 2
    assert learn(cfg, rdir).step == 2  # v2 now: groups sampled with v0 are 2 > max_staleness stale
    restored = read_jsonl(rdir / METRICS_FILE)[-1]
    for g in sample_groups(sampler, 2, max_tokens=6, seed=52, version=0):  # dropped as too stale
        buf.put(g)
    for g in sample_groups(sampler, 4, max_tokens=6, seed=53, version=2):
        buf.put(g)

    exporter = LearnerExporter(cfg.buffer.max_staleness)
    at_first_wait: list[dict[str, float]] = []
    cfg.run.max_steps = 4
    state = learn(cfg, rdir, resume=True, on_step=[exporter],
                  on_wait=[lambda t: t and not at_first_wait and at_first_wait.append(_counters(exporter))])  # fmt: skip
    assert state.step == 4
    last = read_jsonl(rdir / METRICS_FILE)[-1]
    assert last["step"] == 4 and last["dropped_stale_total"] - restored["dropped_stale_total"] == 2
    # Before its first step the restarted learner exports 0 for every counter ...
    assert at_first_wait == [dict.fromkeys(COUNTERS, 0.0)]
    # ... and then exactly the increase of the run-wide totals since the checkpoint it restored.
    got = _counters(exporter)
    assert got["asyncrl_learner_steps_total"] == 2
    assert got["asyncrl_learner_trained_groups_total"] == 4
    assert got["asyncrl_learner_dropped_stale_total"] == 2
    for name, key in COUNTERS.items():
        assert got[name] == pytest.approx(last[key] - restored[key], abs=1e-9), name
    assert got["asyncrl_learner_trained_tokens_total"] > 0


@pytest.mark.timeout(300)
def test_status_tells_a_learner_waiting_for_data_from_a_stuck_one(
    redis_client, redis_url, run_name, sampler, tmp_path
):
    """The learner writes its status as a state begins (no heartbeat meanwhile), so "last seen 78s ago"
    was all status said of a live learner waiting for data, as of a frozen one. It now says "waiting for
    data for 78s" (a stuck step says "training step N for 78s"), from one write per wait, not per poll."""
    rdir = tmp_path / "run"
    cfg = tiny_config(rdir, redis_url, run_name, checkpoint_every=1)
    buf = ReplayBuffer(redis_client, run_name)
    dist_env()
    stop = threading.Event()
    learner = threading.Thread(target=learn, args=(cfg, rdir), kwargs={"stop_event": stop}, daemon=True)
    learner.start()
    try:
        deadline = time.monotonic() + 120
        while collect_status(cfg, redis_url)["learner"].get("state") != "waiting":
            assert learner.is_alive() and time.monotonic() < deadline
            time.sleep(0.1)
        first = collect_status(cfg, redis_url)["learner"]
        time.sleep(2.5)
        st = collect_status(cfg, redis_url)
        assert st["learner"]["updated"] == first["updated"] and st["learner"]["since"] == first["since"]
        line = next(ln for ln in format_status(cfg, st).splitlines() if ln.startswith("learner"))
        # "last seen" is its newest stamp: the heartbeat thread's "alive" (every 5 s) may be newer.
        assert re.fullmatch(
            r"learner  step 0   version v0   waiting for data for [23]s   last seen [0-3]s ago", line
        )
        assert st["learner"]["alive"] >= first["since"] - 6.0

        for g in sample_groups(sampler, 2, max_tokens=6, seed=61):
            buf.put(g)
        while (ln := collect_status(cfg, redis_url)["learner"]).get("step") != 1 or ln.get(
            "state"
        ) != "waiting":
            assert learner.is_alive() and time.monotonic() < deadline
            time.sleep(0.05)
        assert ln["since"] > first["since"]
    finally:
        stop.set()
        learner.join(60)
    ln = collect_status(cfg, redis_url)["learner"]
    assert ln["state"] == "stopped" and ln["step"] == 1
