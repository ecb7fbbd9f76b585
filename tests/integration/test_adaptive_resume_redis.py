"""A learner restart keeps the adaptive staleness bound (real redis-server): the bound written to Redis
at start is the checkpoint's, and the resumed controller decides as an uninterrupted one would."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from asyncrl.buffer import ReplayBuffer
from asyncrl.config import load_config
from asyncrl.learner import adaptive
from asyncrl.learner.records import METRICS_FILE, MetricsWriter, StepRecord, read_jsonl
from tests.unit.test_adaptive_resume import random_records

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::FutureWarning")
OVERRIDES = ["buffer.max_staleness=6", "buffer.groups_per_step=1", "buffer.adaptive.enabled=true",
             "buffer.adaptive.start=3", "buffer.adaptive.min_bound=1", "buffer.adaptive.every_steps=3",
             "buffer.adaptive.target_idle=0.3"]  # fmt: skip


def _records(seed: int, n: int) -> list[StepRecord]:
    return [
        StepRecord(**{**r, "ess": float("nan") if r["ess"] is None else r["ess"]})
        for r in random_records(seed, n)
    ]


def _decisions(run_dir: Path) -> list[dict]:
    return read_jsonl(run_dir / adaptive.BOUND_LOG)


def _run(cfg, buf, run_dir: Path, recs, every: int, saved=None, start: int = 0, crash_at: int = 0):
    """The learner loop's order per step: checkpoint (due steps), metrics.jsonl, then the callbacks.
    Returns the Redis bound after each step and the controller state of the last checkpoint."""
    writer = MetricsWriter(run_dir, "s")
    writer.truncate_after(start)
    on_step = adaptive.install(cfg, buf, run_dir, saved, start)
    bounds, ckpt = {start: buf.staleness_bound()}, None
    for rec in recs[start:]:
        if rec.step % every == 0:
            ckpt = (rec.step, on_step.state())
        writer.write(rec)
        on_step(rec)
        bounds[rec.step] = buf.staleness_bound()
        if rec.step == crash_at:
            break
    return bounds, ckpt


@pytest.mark.parametrize("seed", range(6))
def test_resumed_bound_and_decisions_match_an_uninterrupted_run(
    redis_client, run_name, tmp_path, seed
) -> None:
    cfg = load_config(overrides=OVERRIDES)
    recs = _records(seed, 40)
    rng = random.Random(seed)
    every = rng.choice([2, 4, 5])  # checkpoint_every: a checkpoint mid-window, and one at a decision
    crash = rng.randint(every + 1, 38)
    ref_buf = ReplayBuffer(redis_client, run_name + "-ref", max_staleness=6, groups_per_step=1)
    buf = ReplayBuffer(redis_client, run_name, max_staleness=6, groups_per_step=1)
    try:
        want, _ = _run(cfg, ref_buf, tmp_path / "ref", recs, every)
        rdir = tmp_path / "run"
        # Killed at step `crash` (after its record and decision), the checkpoint of step c in force.
        _, (c, saved) = _run(cfg, buf, rdir, recs, every, crash_at=crash)
        assert saved["step"] == c - 1  # taken before step c's record reached the controller
        saved = json.loads(json.dumps(saved, allow_nan=False))
        on_restart = adaptive.install(cfg, buf, rdir, saved, c)  # what the restarted learner's start writes
        assert buf.staleness_bound() == want[c], "the bound written at start is not the checkpoint's"
        assert max((d["step"] for d in _decisions(rdir)), default=0) <= c  # discarded steps' decisions gone
        assert on_restart.ctrl.last_step == c  # step c's record was read again from metrics.jsonl
        got, _ = _run(cfg, buf, rdir, recs, every, saved, c)
        assert got == {s: b for s, b in want.items() if s >= c}
        assert _decisions(rdir) == _decisions(tmp_path / "ref")  # each decision once, the same ones
        assert [r["step"] for r in read_jsonl(rdir / METRICS_FILE)] == list(range(1, 41))
    finally:
        buf.delete_run()
        ref_buf.delete_run()


def test_checkpoint_without_controller_state_restarts_from_the_start_bound(
    redis_client, run_name, tmp_path
) -> None:
    cfg = load_config(overrides=OVERRIDES)
    buf = ReplayBuffer(redis_client, run_name, max_staleness=6, groups_per_step=1)
    try:
        buf.set_staleness_bound(1)
        (tmp_path / adaptive.BOUND_LOG).write_text('{"step": 3}\n{"step": 9}\n')
        assert adaptive.install(cfg, buf, tmp_path, None, 6) is not None  # an older asyncrl's checkpoint
        assert buf.staleness_bound() == 3 and [d["step"] for d in _decisions(tmp_path)] == [3]
    finally:
        buf.delete_run()


@pytest.fixture(scope="module")
def sampler(tmp_path_factory: pytest.TempPathFactory):
    from asyncrl.learner.logprobs import load_hf_model
    from asyncrl.tinymodel import resolve_model_path
    from tests.integration.learner_helpers import tiny_config

    d = tmp_path_factory.mktemp("sampler")
    return load_hf_model(resolve_model_path(tiny_config(d), d))


def test_learner_resume_restores_the_bound_and_decides_as_an_uninterrupted_run(
    redis_url, redis_client, run_name, sampler, tmp_path
) -> None:
    """learn() on real Redis + DeepSpeed (CPU). The learner always waits a little for data, so with
    target_idle 0 every decision (each 2 steps) raises the bound by 1 from 0. Stopped after the checkpoint
    of step 3 (taken before step 3's record reached the controller), with a decision of a discarded
    step 4 in the log and a bound of the discarded lineage in Redis, and resumed to step 6: it must
    start at the restored bound and decide at steps 4 and 6 like the uninterrupted run."""
    from asyncrl.learner.loop import learn
    from tests.integration.learner_helpers import dist_env, sample_groups, tiny_config

    def config(rdir: Path, name: str, max_steps: int):
        cfg = tiny_config(rdir, redis_url, name, checkpoint_every=3, publish_every=100)
        ac = cfg.buffer.adaptive
        ac.enabled, ac.start, ac.every_steps, ac.target_idle, ac.min_ess = True, 0, 2, 0.0, 0.0
        cfg.run.max_steps = max_steps
        return cfg

    def key(rdir: Path) -> list[tuple]:
        return [(d["step"], d["previous"], d["bound"], d["reason"]) for d in _decisions(rdir)]

    dist_env()
    ref_dir, rdir = tmp_path / "ref", tmp_path / "run"
    kw = {"max_staleness": 4, "groups_per_step": 2}  # tiny_config's
    ref_buf, buf = (
        ReplayBuffer(redis_client, run_name + "-ref", **kw),
        ReplayBuffer(redis_client, run_name, **kw),
    )
    try:
        for g in sample_groups(sampler, 12, max_tokens=6, seed=5):
            ref_buf.put(g)
        learn(config(ref_dir, run_name + "-ref", 6), ref_dir)
        assert key(ref_dir) == [(2, 0, 1, "starved"), (4, 1, 2, "starved"), (6, 2, 3, "starved")]

        groups = sample_groups(sampler, 12, max_tokens=6, seed=5)
        for g in groups[:6]:
            buf.put(g)
        learn(config(rdir, run_name, 3), rdir)
        # A lineage that went on to step 4 and died: its decision and bound are discarded by the resume.
        with (rdir / adaptive.BOUND_LOG).open("a") as f:
            f.write(json.dumps({"step": 4, "previous": 1, "bound": 4, "reason": "starved"}) + "\n")
        buf.set_staleness_bound(4)
        for g in groups[6:]:
            buf.put(g)
        at_start: list[int | None] = []
        state = learn(config(rdir, run_name, 6), rdir, resume=True,
                      on_wait=[lambda t: at_start.append(buf.staleness_bound()) if t and not at_start else None])  # fmt: skip
        assert at_start == [1], "the resumed learner did not start from the checkpoint's bound"
        assert state.step == 6 and key(rdir) == key(ref_dir)
        assert buf.staleness_bound() == ref_buf.staleness_bound() == 3
        assert (
            state.adaptive == {"bound": 3, "window": [], "fresh_kl": None, "step": 6}
            or state.adaptive["step"] == 5
        )
    finally:
        buf.delete_run()
        ref_buf.delete_run()
