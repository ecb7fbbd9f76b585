"""Experiment tracking: TensorBoard event files hold every step record; W&B offline; eval results attach."""

from __future__ import annotations

import dataclasses

from asyncrl.config import Config
from asyncrl.learner import tracking
from asyncrl.learner.records import StepRecord


def read_scalars(logdir) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir))
    acc.Reload()
    return {t: [(e.step, e.value) for e in acc.Scalars(t)] for t in acc.Tags()["scalars"]}


class FakeActors:
    """The only buffer call attach_eval makes; the heartbeat payloads as actors write them."""

    def __init__(self):
        self.hb = {"actor-0": {"version": 3}, "actor-1": {"version": 3}}

    def actors(self):
        return self.hb


def test_tensorboard_and_wandb_offline_get_every_record(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = Config()
    cfg.tracking.wandb = True
    tracking._last_eval.clear()
    t = tracking.Tracker(cfg, tmp_path)
    buf = FakeActors()
    rewards = [0.1, 0.25, 0.5, 0.7]
    for step, r in enumerate(rewards, start=1):
        if step == 3:  # actor 0 reports an eval of version 2 between steps 2 and 3
            buf.hb["actor-0"]["eval"] = {"version": 2, "reward_mean": 0.4, "pass_at_k": 0.25, "length_mean": 3.5,
                                         "prompts": 8, "samples": 4, "seconds": 0.1}  # fmt: skip
        if step == 4:
            del buf.hb["actor-0"]["eval"]  # a restarted actor 0: the last result is carried forward
        rec = StepRecord(step=step, version=step, reward_mean=r, tokens_total=10 * step)
        tracking.attach_eval(rec, buf)
        t(rec)
        assert rec.eval_version == (-1 if step < 3 else 2)
    assert dataclasses.asdict(rec)["eval_reward_mean"] == 0.4
    t.close()
    s = read_scalars(tmp_path / tracking.TENSORBOARD_DIR)
    assert [(st, round(v, 6)) for st, v in s["train/reward_mean"]] == list(enumerate(rewards, 1))
    assert [x[0] for x in s["totals/tokens_total"]] == [1, 2, 3, 4]
    assert [(st, round(v, 6)) for st, v in s["eval/reward_mean"]] == [(3, 0.4)]  # logged once, when new
    by_version = read_scalars(tmp_path / tracking.TENSORBOARD_DIR / tracking.BY_VERSION_DIR)
    assert [(st, round(v, 6)) for st, v in by_version["eval/by_version/pass_at_k"]] == [(2, 0.25)]
    assert "train/eval_version" not in s and "train/step" not in s
    offline = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(offline) == 1 and list(offline[0].glob("*.wandb"))


def test_tensorboard_writes_one_event_per_step_with_every_scalar(tmp_path):
    """All of a step's scalars travel in one event (TensorBoard reads each value as its tag): ~64
    events per step cost the learner ~2 ms of CPU per step, one ~0.2 ms (asyncrl.learner.tracking)."""
    from tensorboard.backend.event_processing.event_file_loader import RawEventFileLoader
    from tensorboard.compat.proto.event_pb2 import Event

    tracking._last_eval.clear()
    t = tracking.Tracker(Config(), tmp_path)
    for step in (1, 2, 3):
        t(StepRecord(step=step, version=step, reward_mean=0.25 * step, step_time=1000.0 + step))
    t.close()
    (path,) = (tmp_path / tracking.TENSORBOARD_DIR).glob("events.out.tfevents.*")
    events = [Event.FromString(b) for b in RawEventFileLoader(str(path)).Load()]
    assert [e.step for e in events if e.HasField("session_log")] == [1]  # the purge marker (see below)
    events = [e for e in events if e.HasField("summary")]  # (the first one holds the file version)
    assert [e.step for e in events] == [1, 2, 3]
    assert [e.wall_time for e in events] == [1001.0, 1002.0, 1003.0]
    n = len(tracking._scalars(StepRecord(step=1)))
    assert n > 40 and all(len(e.summary.value) == n for e in events)
    reward = [v.simple_value for e in events for v in e.summary.value if v.tag == "train/reward_mean"]
    assert reward == [0.25, 0.5, 0.75]


def test_a_failing_tensorboard_write_is_logged_and_counted_and_training_goes_on(tmp_path, caplog):
    """A full disk under <run_dir>/tensorboard (the event file's path re-pointed at /dev/full, which
    fails every write with ENOSPC; TensorBoard appends to the path at each flush): its writer thread
    fails and re-raises on the next write. The Tracker logs it and counts it; it never raises into the learner's step loop (a crash
    there restarts the learner, which fails again one step later)."""
    import logging
    import os
    import time

    tracking._last_eval.clear()
    t = tracking.Tracker(Config(), tmp_path)
    t(StepRecord(step=1, version=1))
    t.tb.flush()
    (event_file,) = (tmp_path / tracking.TENSORBOARD_DIR).glob("events.out.tfevents.*")
    event_file.unlink()
    os.symlink("/dev/full", event_file)
    caplog.set_level(logging.ERROR, logger="asyncrl.learner.tracking")
    deadline = time.monotonic() + 30
    step = 2
    while t.errors == 0 and time.monotonic() < deadline:
        t(StepRecord(step=step, version=step))  # must never raise
        t.tb.flush() if step % 5 == 0 else None
        step += 1
        time.sleep(0.01)
    assert t.errors >= 1, "the ENOSPC never surfaced: the test did not inject the fault"
    assert any("TensorBoard write of step" in r.getMessage() for r in caplog.records)
    for k in range(5):  # and it keeps not raising
        t(StepRecord(step=step + k, version=step + k))
    try:
        t.close()
    except OSError:
        pass  # closing a writer whose disk is full may report it once more; the learner is done by then


def test_a_resumed_learners_steps_replace_the_discarded_ones_in_tensorboard(tmp_path):
    """Killed at step 9 with its checkpoint at step 5, the learner redoes steps 6-9. metrics.jsonl
    drops the old records; TensorBoard read both processes' event files, so steps 6-9 appeared twice
    and the x axis went 9 -> 6. Each process now starts with a purge marker at its first step. The
    by-version evals (their own run, never purged: versions only go up) keep the first process's."""
    import time

    def write(steps, reward, eval_at=None):
        tracking._last_eval.clear()
        t = tracking.Tracker(Config(), tmp_path)
        for step in steps:
            rec = StepRecord(step=step, version=step, reward_mean=reward, step_time=time.time())
            if step == eval_at:
                rec.eval_version, rec.eval_reward_mean = step, reward
            t(rec)
        t.close()
        time.sleep(1.1)  # event file names carry the second: the second process's file sorts after

    write(range(1, 10), 0.25, eval_at=8)
    write(range(6, 13), 0.75, eval_at=10)
    s = read_scalars(tmp_path / tracking.TENSORBOARD_DIR)
    got = [(st, round(v, 6)) for st, v in s["train/reward_mean"]]
    assert got == [(st, 0.25) for st in range(1, 6)] + [(st, 0.75) for st in range(6, 13)]
    assert [st for st, _ in s["eval/reward_mean"]] == [10]  # step 8's eval was of discarded work
    by_version = read_scalars(tmp_path / tracking.TENSORBOARD_DIR / tracking.BY_VERSION_DIR)
    assert [(st, round(v, 6)) for st, v in by_version["eval/by_version/reward_mean"]] == [
        (8, 0.25),
        (10, 0.75),
    ]
