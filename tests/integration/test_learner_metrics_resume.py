"""A resumed learner's /metrics on real Redis + a real learner (CPU): its counters count what this process
did, from 0, while metrics.jsonl keeps the run-wide totals restored from the checkpoint."""

from __future__ import annotations

import pytest
import torch

from asyncrl.buffer import ReplayBuffer
from asyncrl.learner.logprobs import load_hf_model
from asyncrl.learner.loop import learn
from asyncrl.learner.records import METRICS_FILE, read_jsonl
from asyncrl.metrics import LEARNER_METRICS
from asyncrl.metrics_export import LearnerExporter, learner_collectors
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
