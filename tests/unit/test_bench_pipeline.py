"""asyncrl bench's pipeline rows: steady-state window, overlap bound, back-to-back limit and the start-up
breakdown, on a run dir written here with known timestamps (the real runs are in the full bench)."""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

import pytest

from asyncrl.bench.pipeline import back_to_back, overlap_bound, startup_phases, steady
from asyncrl.bench.report import table
from asyncrl.learner.loop import STARTUP_FILE

T0 = 1_790_000_000.25  # the run's start (unix s)


def _local(t: float, fmt: str, sep: str) -> str:
    return time.strftime(fmt, time.localtime(t)) + f"{sep}{round((t % 1) * 1000):03d}"


def _run_dir(tmp: Path, eta: int, steps: int, rng: random.Random) -> tuple[Path, list[dict]]:
    rdir = tmp / f"eta{eta}"
    (rdir / "redis").mkdir(parents=True)
    (rdir / "logs").mkdir()
    (rdir / "config.yaml").write_text(f"buffer:\n  max_staleness: {eta}\n")
    recs, t = [], 30.0
    for s in range(1, steps + 1):
        wait, train, pub = rng.uniform(0, 0.05), rng.uniform(0.02, 0.08), rng.uniform(0.005, 0.02)
        step_s = wait + train + pub + rng.uniform(0, 0.01)
        t += step_s
        recs.append({"step": s, "time": t, "step_time": T0 + t, "step_s": step_s, "wait_s": wait, "train_s": train,
                     "publish_s": pub, "published": True, "checkpointed": s % 50 == 0, "tokens": 150 + s % 7,
                     "sequences": 32, "staleness_hist": {"0": 100, "1": 50 + s % 3}})  # fmt: skip
    (rdir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    (rdir / "redis" / "redis.log").write_text(
        f"7:C {_local(T0 + 0.1, '%d %b %Y %H:%M:%S', '.')} # oO0OoO0OoO0Oo Redis is starting\n"
        f"7:M {_local(T0 + 0.4, '%d %b %Y %H:%M:%S', '.')} * Ready to accept connections tcp\n"
    )
    for i, (start, up, run) in enumerate([(9.5, 28.0, 28.5), (9.7, 29.25, 29.5)]):
        lines = [f"{_local(T0 + start, '%Y-%m-%d %H:%M:%S', ',')} asyncrl.actors.actor INFO actor-{i}: starting",
                 "(EngineCore pid=1) INFO 11-23 14:35:41 [core.py:133] noise",
                 f"{_local(T0 + up, '%Y-%m-%d %H:%M:%S', ',')} asyncrl.actors.actor INFO actor-{i}: waiting_for_weights",
                 f"{_local(T0 + run, '%Y-%m-%d %H:%M:%S', ',')} asyncrl.actors.actor INFO actor-{i}: running"]  # fmt: skip
        (rdir / "logs" / f"actor-{i}.log").write_text("\n".join(lines) + "\n")
    marks = {"start_time": T0, "learner_started": T0 + 5.0, "deepspeed_ready": T0 + 8.0,
             "weights_published": T0 + 8.5, "first_batch": T0 + 30.0, "first_step": T0 + 30.1}  # fmt: skip
    (rdir / STARTUP_FILE).write_text(json.dumps(marks))
    return rdir, recs


def test_startup_phases_from_the_logs_the_run_writes(tmp_path: Path) -> None:
    rdir, recs = _run_dir(tmp_path, 1, 20, random.Random(0))
    s = startup_phases(rdir)
    want = {"redis_ready": 0.4, "learner_started": 5.0, "deepspeed_ready": 8.0, "weights_published": 8.5,
            "actor_started": 9.7, "engine_up": 29.25, "actor_serving_v0": 29.5, "first_batch": 30.0,
            "first_step": recs[0]["time"]}  # fmt: skip
    assert s == pytest.approx(want, abs=2e-3)  # the last actor to reach a state counts


def test_startup_phases_tolerate_missing_logs(tmp_path: Path) -> None:
    rdir, recs = _run_dir(tmp_path, 1, 5, random.Random(1))
    for p in [rdir / STARTUP_FILE, rdir / "redis" / "redis.log", *(rdir / "logs").iterdir()]:
        p.unlink()
    s = startup_phases(rdir)
    assert s.pop("first_step") == pytest.approx(recs[0]["time"])
    assert set(s.values()) == {None}


@pytest.mark.parametrize("seed", range(5))
def test_steady_state_window_against_a_plain_reference(tmp_path: Path, seed: int) -> None:
    rng = random.Random(seed)
    steps = rng.randint(10, 200)
    rdir, recs = _run_dir(tmp_path, 0, steps, rng)
    got = steady(rdir)
    k = min(max(3, steps // 10), steps - 2)  # calibrate.default_warmup
    win = recs[k:]
    dur = win[-1]["time"] - recs[k - 1]["time"]
    assert got["window_steps"] == len(win) and got["window_s"] == pytest.approx(dur)
    assert got["steps_per_s"] == pytest.approx(len(win) / dur)
    assert got["samples_per_s"] == pytest.approx(32 * len(win) / dur)
    assert got["wait_s_mean"] == pytest.approx(sum(r["wait_s"] for r in win) / len(win))
    assert got["learner_s_mean"] == pytest.approx(sum(r["step_s"] - r["wait_s"] for r in win) / len(win))
    assert got["train_publish_s_mean"] == pytest.approx(
        sum(r["train_s"] + r["publish_s"] for r in win) / len(win)
    )
    train = sorted(r["train_s"] for r in win)
    n = len(train)
    assert got["train_s_median"] == pytest.approx((train[(n - 1) // 2] + train[n // 2]) / 2)


def test_overlap_bound_and_back_to_back() -> None:
    rng = random.Random(3)
    for _ in range(100):
        g, t = rng.uniform(1e-3, 1), rng.uniform(1e-3, 1)
        b = overlap_bound(g, t)
        assert 1.0 < b <= 2.0 and b == pytest.approx((g + t) / max(g, t))
    assert overlap_bound(0.05, 0.05) == 2.0 and overlap_bound(1.0, 1e-9) == pytest.approx(1.0)
    # A sync step shorter than T_gen + T_train (the learner's records overlap the actors' generation):
    # the bound is the sync step over the busier role, e.g. 0.111 s vs max(0.074, 0.055).
    assert overlap_bound(0.074, 0.055, 0.111) == pytest.approx(0.111 / 0.074)
    b2b = back_to_back(0.038, 0.026, 0.005, 0.012)  # the numbers: ~12 steps/s
    assert b2b["per_step_s"] == pytest.approx(0.081) and b2b["steps_per_s"] == pytest.approx(1 / 0.081)


def test_table_marks_met_and_missed_targets() -> None:
    run = {"window_steps": 100, "window_s": 10.0, "steps_per_s": 10.0, "samples_per_s": 320.0,
           "train_s_median": 0.03, "max_staleness": 1, "over_back_to_back": 0.5,
           "train_in_pipeline_over_alone": 1.2, "speedup_vs_sync": 1.4, "speedup_over_bound": 0.97,
           "startup": {"redis_ready": 0.4, "first_step": 31.0}}  # fmt: skip
    res = {"weights": [], "buffer": [], "pipeline": {
        "runs": {"1": run}, "T_gen_s": 0.05, "T_train_s": 0.04, "overlap_bound": 1.8,
        "back_to_back": back_to_back(0.038, 0.026, 0.005, 0.012)}}  # fmt: skip
    lines = {ln.split("  ")[0]: ln for ln in table(res)[1:]}
    assert lines["pipeline eta=1: steps/s / back-to-back limit"].split()[-4:] == [
        "0.50x",
        ">=",
        "0.90x",
        "NO",
    ]
    assert lines["pipeline eta=1: async/sync 1.40x / overlap bound"].endswith("yes")
    first = next(v for k, v in lines.items() if "first learner step" in k)
    assert first.endswith("NO") and "<= 25.0" in first
    assert next(v for k, v in lines.items() if "inside the pipeline" in k).endswith("yes")


def _fake_runs(monkeypatch, placements):
    """pipeline_rows over fake steady-state numbers (the derivations only; the real runs are the bench's)."""
    from asyncrl.bench import pipeline

    fake = {(0, None): {"steps_per_s": 13.0, "learner_s_mean": 0.03, "train_publish_s_mean": 0.028,
                        "wait_s_mean": 0.045, "train_s_median": 0.0215, "window_steps": 100, "window_s": 7.7,
                        "samples_per_s": 416.0, "max_staleness": 0},
            (0, "engine"): {"steps_per_s": 12.0, "learner_s_mean": 0.03, "train_publish_s_mean": 0.0283,
                            "wait_s_mean": 0.05, "train_s_median": 0.0215, "window_steps": 100, "window_s": 8.3,
                            "samples_per_s": 384.0, "max_staleness": 0},
            (1, None): {"steps_per_s": 16.0, "learner_s_mean": 0.03, "train_publish_s_mean": 0.028,
                        "wait_s_mean": 0.03, "train_s_median": 0.021, "window_steps": 100, "window_s": 6.2,
                        "samples_per_s": 512.0, "max_staleness": 1}}  # fmt: skip
    calls = []

    def run_demo(config, eta, steps, root, frontend=None, swap_min_lag=None):
        calls.append((eta, frontend) if swap_min_lag is None else (eta, frontend, swap_min_lag))
        return (eta, frontend) if swap_min_lag is None else (eta, frontend, swap_min_lag)

    monkeypatch.setattr(pipeline, "run_demo", run_demo)
    monkeypatch.setattr(pipeline, "steady", lambda key: dict(fake[key]))
    monkeypatch.setattr(pipeline, "startup_phases", lambda key: {"first_step": 18.0})
    monkeypatch.setattr(pipeline, "frontend_placements", lambda config: placements)
    return pipeline, calls


def test_sync_learner_step_is_also_compared_with_alone_after_an_idle_gap(tmp_path: Path, monkeypatch) -> None:
    """The eta=0 run gets a second reference (the alone step after the sync run's idle gap), a context
    row with no target; async runs do not."""
    pipeline, calls = _fake_runs(monkeypatch, (None, None))
    res = pipeline.pipeline_rows(None, (0, 1), 10, tmp_path, None, 0.0165, 0.0215)
    assert calls == [(0, None), (1, None)]  # nothing placed: no extra run
    assert res["runs"]["0"]["train_in_pipeline_over_alone"] == pytest.approx(0.0215 / 0.0165)
    assert res["runs"]["0"]["train_in_pipeline_over_alone_idle_gap"] == pytest.approx(1.0)
    assert "train_in_pipeline_over_alone_idle_gap" not in res["runs"]["1"]
    lines = table({"weights": [], "buffer": [], "pipeline": res})
    gap = [ln for ln in lines if "alone after the same idle gap" in ln]
    assert len(gap) == 1 and "eta=0" in gap[0] and gap[0].split()[-1] == "1.00x"


def test_overlap_bound_holds_the_front_end_placement_fixed(tmp_path: Path, monkeypatch) -> None:
    """When the default sync run places the front end elsewhere than the async runs (auto), the bound
    comes from one more sync run placed as the async runs; the eta=0 rows stay the default run's."""
    pipeline, calls = _fake_runs(monkeypatch, ("learner", "engine"))
    res = pipeline.pipeline_rows(None, (0, 1), 10, tmp_path, None, 0.0165)
    assert calls == [(0, None), (1, None), (0, "engine")]
    t_sync = 1 / 12.0  # the same-placement run's step, not the default's 1 / 13
    assert res["T_sync_s"] == pytest.approx(t_sync)
    assert res["overlap_bound"] == pytest.approx(t_sync / max(t_sync - 0.0283, 0.03))
    r1 = res["runs"]["1"]
    assert r1["speedup_vs_sync"] == pytest.approx(16.0 / 12.0)
    assert r1["speedup_vs_default_sync"] == pytest.approx(16.0 / 13.0)
    lines = table({"weights": [], "buffer": [], "pipeline": res})
    assert any("front end on the engine's cores" in ln and ln.split()[-1] == "12.00" for ln in lines)
    assert any("front end as async" in ln for ln in lines)
    assert any(ln.startswith("pipeline eta=1: steps/s / the default eta=0 run's") for ln in lines)


def test_largest_eta_runs_once_more_with_lazy_swaps_as_a_context_row(tmp_path: Path, monkeypatch) -> None:
    """At eta 4 one more run with actors.swap_min_lag=4: steps/s over the limit and over the default eta-4
    run, with both runs' mean token staleness; rows without a target. Not at eta <= 1 (nothing to skip)."""
    pipeline, calls = _fake_runs(monkeypatch, (None, None))
    monkeypatch.setattr(pipeline, "steady", lambda key: {
        (0, None): {"steps_per_s": 8.0, "learner_s_mean": 0.03, "train_publish_s_mean": 0.028, "wait_s_mean": 0.08,
                    "train_s_median": 0.03, "window_steps": 135, "window_s": 16.9, "samples_per_s": 256.0,
                    "max_staleness": 0, "staleness_mean": 0.0},
        (4, None): {"steps_per_s": 10.0, "learner_s_mean": 0.03, "train_publish_s_mean": 0.028, "wait_s_mean": 0.04,
                    "train_s_median": 0.033, "window_steps": 135, "window_s": 13.5, "samples_per_s": 320.0,
                    "max_staleness": 4, "staleness_mean": 2.0},
        (1, None): {"steps_per_s": 9.0, "learner_s_mean": 0.03, "train_publish_s_mean": 0.028, "wait_s_mean": 0.04,
                    "train_s_median": 0.033, "window_steps": 135, "window_s": 15.0, "samples_per_s": 288.0,
                    "max_staleness": 1, "staleness_mean": 0.9},
        (4, None, 4): {"steps_per_s": 14.0, "learner_s_mean": 0.03, "train_publish_s_mean": 0.028,
                       "wait_s_mean": 0.02, "train_s_median": 0.03, "window_steps": 135, "window_s": 9.6,
                       "samples_per_s": 448.0, "max_staleness": 4, "staleness_mean": 2.5},
    }[key])  # fmt: skip
    b2b = {"steps_per_s": 10.0, "gen_s": 0.045, "train_s": 0.03, "publish_s": 0.004, "reload_s": 0.021}
    res = pipeline.pipeline_rows(None, (0, 4), 10, tmp_path, b2b, 0.03)
    assert calls == [(0, None), (4, None), (4, None, 4)]
    lz = res["lazy_swaps"]
    assert (lz["swap_min_lag"], lz["over_back_to_back"], lz["speedup_vs_default"]) == (4, 1.4, 1.4)
    assert lz["default_staleness_mean"] == 2.0
    lines = {
        ln[:78].rstrip(): ln[78:].split() for ln in table({"weights": [], "buffer": [], "pipeline": res})
    }
    assert lines["pipeline eta=4, actors.swap_min_lag=4: steps/s (context)"] == ["14.00"]
    assert lines["pipeline eta=4, actors.swap_min_lag=4: steps/s / back-to-back limit"] == ["1.40x"]
    assert lines["pipeline eta=4: swap_min_lag=4 / 1, steps/s (staleness 2.50 / 2.00)"] == ["1.40x"]
    calls.clear()
    assert "lazy_swaps" not in pipeline.pipeline_rows(None, (0, 1), 10, tmp_path, b2b, 0.03)
    assert calls == [(0, None), (1, None)]


def test_publish_to_serving_target_only_from_300m_params() -> None:
    # The <= 3x target is stated for >= 300M parameters; a tiny model's microsecond copy floor is
    # dwarfed by fixed costs, so its row is context (no target, no "NO").
    def w(size: str, params: int, ratio: float) -> dict:
        return {"size": size, "params": params, "bytes": params * 4, "transport": "shm", "staging": False,
                "ratio_to_floor": ratio, "pause_s": 0.002}  # fmt: skip

    lines = {
        ln[:78].rstrip(): ln[78:].split()
        for ln in table({"weights": [w("tiny", 300_000, 200.0), w("300M", 302_000_000, 2.5)], "buffer": []})
    }
    tiny = "weights tiny (0.3M params, 1.1 MiB) shm: publish-to-serving / copy floor"
    big = "weights 300M (302.0M params, 1152.0 MiB) shm: publish-to-serving / copy floor"
    assert lines[tiny] == ["200.00x"]
    assert lines[big] == ["2.50x", "<=", "3.00x", "yes"]
