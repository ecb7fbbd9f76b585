"""The adaptive staleness controller's state survives a checkpoint: LearnerState carries it, a restored
controller decides exactly as an uninterrupted one, and the decision log is cut back to the restored step.
(Redis and the learner loop: tests/integration/test_adaptive_resume_redis.py.)"""

from __future__ import annotations

import json
import random

from asyncrl.learner.adaptive import BOUND_LOG, StalenessController
from asyncrl.learner.checkpoint import LearnerState


def random_records(seed: int, n: int) -> list[dict]:
    """Step records that exercise every branch: starving and busy learners, good, bad, zero and missing
    ESS, fresh and stale KL buckets (some non-finite), windows without a fresh bucket."""
    rng = random.Random(seed)
    recs = []
    for step in range(1, n + 1):
        step_s = rng.uniform(0.1, 3.0)
        kl = {
            str(s): rng.choice([rng.expovariate(15.0), float("nan")])
            for s in rng.sample(range(5), rng.randint(0, 4))
        }
        ess = rng.choice([rng.uniform(0.2, 1.0), rng.uniform(0.2, 1.0), 0.0, float("nan"), None])
        recs.append({"step": step, "step_s": step_s, "wait_s": step_s * rng.choice([0.0, rng.random()]),
                     "ess": ess, "drift_kl": kl})  # fmt: skip
    return recs


def _ctrl() -> StalenessController:
    return StalenessController(
        6, min_bound=1, start=3, every_steps=3, target_idle=0.3, min_ess=0.5, max_drift_kl=0.05
    )


def test_controller_state_round_trips_through_learner_state() -> None:
    c = _ctrl()
    for r in random_records(1, 7):  # two decisions and one record of the third window
        c.observe(r)
    st = LearnerState(step=7, adaptive=c.state())
    back = LearnerState.from_dict(json.loads(json.dumps(st.__dict__, allow_nan=False)))  # JSON-safe: no NaN
    assert back.adaptive == c.state() and back.adaptive["step"] == 7 and len(back.adaptive["window"]) == 1
    # A checkpoint of an older asyncrl (no field) still loads: nothing to restore.
    old = {k: v for k, v in st.__dict__.items() if k != "adaptive"}
    assert LearnerState.from_dict(old).adaptive is None and LearnerState().adaptive is None


def test_restored_controller_decides_as_an_uninterrupted_one() -> None:
    reasons: set[str] = set()
    for seed in range(20):
        recs = random_records(seed, 60)
        ref = _ctrl()
        want = [ref.observe(r) for r in recs]
        cut = random.Random(seed).randint(1, 59)
        a = _ctrl()
        got = [a.observe(r) for r in recs[:cut]]
        b = _ctrl()  # a new process: the state went through the checkpoint's JSON
        b.restore(json.loads(json.dumps(a.state(), allow_nan=False)))
        assert b.bound == a.bound and b.last_step == cut
        got += [b.observe(r) for r in recs[cut:]]
        assert got == want, seed  # the same Decisions (bound, reason, idle, ess, KL) at the same steps
        reasons |= {d.reason for d in want if d}
    assert reasons == {"ess", "drift_kl", "starved", "hold", "at limit"}  # every branch was exercised


def test_restore_clips_a_bound_outside_a_changed_config() -> None:
    c = StalenessController(2, start=0)
    c.restore({"bound": 5, "window": [], "fresh_kl": None, "step": 4})
    assert c.bound == 2 and c.last_step == 4


def test_truncate_log_drops_discarded_steps_and_a_torn_line(tmp_path) -> None:
    from asyncrl.learner.adaptive import truncate_log

    path = tmp_path / BOUND_LOG
    rows = [{"step": s, "bound": s} for s in (3, 6, 9)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 12, "bo')
    truncate_log(path, 6)
    assert [json.loads(x) for x in path.read_text().splitlines()] == rows[:2]
    before = path.stat().st_mtime_ns, path.stat().st_ino
    truncate_log(path, 6)  # nothing to drop: left alone
    assert (path.stat().st_mtime_ns, path.stat().st_ino) == before
    truncate_log(tmp_path / "missing.jsonl", 0)
