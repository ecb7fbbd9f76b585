"""The adaptive staleness bound against a real redis-server: the admission Lua script reads it."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from asyncrl.buffer import ReplayBuffer
from asyncrl.config import load_config
from asyncrl.learner import adaptive
from asyncrl.learner.records import StepRecord
from asyncrl.metrics import BUFFER_METRICS
from asyncrl.metrics_export import SnapshotCollector


def _admit_all(buf: ReplayBuffer, **kw) -> int:
    n = 0
    while buf.try_admit(**kw):
        n += 1
        assert n < 1000
    return n


def test_bound_in_redis_moves_admission(redis_client, run_name) -> None:
    plain = ReplayBuffer(redis_client, run_name + "-plain", max_staleness=4, groups_per_step=2)
    buf = ReplayBuffer(redis_client, run_name, max_staleness=4, groups_per_step=2)
    try:
        # No adaptive bound: (V + 4 + 1) * 2 = 10 groups at V = 0.
        assert _admit_all(plain) == 10 and plain.stats()["staleness_bound"] == 4
        buf.set_staleness_bound(1)  # (0 + 1 + 1) * 2 = 4
        assert _admit_all(buf) == 4
        st = buf.stats()
        assert (st["staleness_bound"], st["bound"]) == (1, 4) and buf.admission_bound() == 4
        buf.set_staleness_bound(3)  # raised at run time: 4 more slots, no restart of anything
        assert _admit_all(buf) == 4
        buf.set_staleness_bound(99)  # above max_staleness: clipped to it, never looser
        assert _admit_all(buf) == 2 and buf.staleness_bound() == 4
        # The sampler-weights checks use the adaptive bound too: at V = 4 and bound 1 (count bound
        # (4 + 1 + 1) * 2 = 12, 10 admitted), weights v2 are too stale now (4 - 2 > 1), and v3 would be
        # at the version that trains slot 11 (ceil(11 / 2) - 1 = 5; 5 - 3 > 1); v4 are not. Under the
        # ceiling 4, v3 would be 2 <= 4 stale there and is admitted.
        buf.set_version(4)
        buf.set_staleness_bound(1)
        assert not buf.try_admit(sampler_version=2) and not buf.try_admit(sampler_version=3)
        assert buf.try_admit(sampler_version=4)
        buf.set_staleness_bound(4)
        assert buf.try_admit(sampler_version=3)
        buf.set_staleness_bound(None)
        assert buf.stats()["staleness_bound"] == 4
        # Exported with the buffer's gauges.
        buf.set_staleness_bound(2)
        fams = {f.name: f for f in SnapshotCollector(BUFFER_METRICS, buf.stats).collect()}
        assert fams["asyncrl_buffer_staleness_bound_steps"].samples[0].value == 2
    finally:
        buf.delete_run()
        plain.delete_run()


def test_learner_callback_writes_decisions_to_redis_and_log(redis_client, run_name, tmp_path) -> None:
    cfg = load_config(overrides=["buffer.max_staleness=3", "buffer.groups_per_step=1", "buffer.adaptive.enabled=true",
                                 "buffer.adaptive.start=0", "buffer.adaptive.every_steps=2"])  # fmt: skip
    buf = ReplayBuffer(redis_client, run_name, max_staleness=3, groups_per_step=1)
    try:
        on_step = adaptive.install(cfg, buf, tmp_path)
        assert on_step is not None and buf.staleness_bound() == 0
        assert _admit_all(buf) == 1
        starving = StepRecord(step=1, wait_s=0.9, step_s=1.0, ess=0.9)
        for s in range(1, 5):
            on_step(replace(starving, step=s))
        assert buf.staleness_bound() == 2 and _admit_all(buf) == 2  # bound 0 -> 1 -> 2: two more slots
        log = [json.loads(x) for x in (tmp_path / adaptive.BOUND_LOG).read_text().splitlines()]
        assert [(d["step"], d["bound"], d["reason"]) for d in log] == [(2, 1, "starved"), (4, 2, "starved")]
        off = load_config(overrides=["buffer.max_staleness=3"])
        assert adaptive.install(off, buf, tmp_path) is None and buf.staleness_bound() == 3  # cleared
    finally:
        buf.delete_run()


@pytest.mark.parametrize("bound", [-1, 1.5, True])
def test_bad_bound_is_refused(redis_client, run_name, bound) -> None:
    buf = ReplayBuffer(redis_client, run_name, max_staleness=2, groups_per_step=1)
    with pytest.raises(ValueError):
        buf.set_staleness_bound(bound)


def test_admission_unit_is_groups_per_version_with_publish_every(redis_server, run_name) -> None:
    """publish_every = k: the learner trains k steps of groups per version, so admission widens by
    k * groups_per_step per version. With groups_per_step alone the window closed after
    ~(eta + 1) * k / (k - 1) steps and the run deadlocked (found by the `asyncrl plan` simulator)."""
    for k in (1, 3):
        cfg = load_config(
            overrides=[
                f"run.name={run_name}-k{k}",
                "buffer.max_staleness=1",
                "buffer.groups_per_step=2",
                f"learner.publish_every={k}",
            ]  # fmt: skip
        )
        buf = ReplayBuffer.from_config(cfg, redis_server.url)
        try:
            assert _admit_all(buf) == (0 + 1 + 1) * 2 * k  # V = 0
            assert buf.admission_bound() == 4 * k
        finally:
            buf.close()
