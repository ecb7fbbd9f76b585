"""`asyncrl plot`: the plotted series of a run's metrics.jsonl, its non-finite values and edge run dirs."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from asyncrl.config import ConfigError
from asyncrl.learner.records import StepRecord
from asyncrl.plot import eval_points, figure, plot_run, series


def _write(run_dir: Path, recs: list[StepRecord]) -> list[dict]:
    """As MetricsWriter writes them: non-finite floats become the strings "nan"/"inf"."""
    rows = [json.loads(json.dumps(r.to_dict())) for r in recs]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return rows


def _same(got: list[float], want: list[float]) -> bool:  # NaN == NaN here: a gap where a gap is due
    return len(got) == len(want) and all(
        (math.isnan(a) and math.isnan(b)) or a == b for a, b in zip(got, want, strict=True)
    )


def test_non_finite_values_are_float_gaps_and_the_kl_axis_stays_numeric(tmp_path: Path):
    nan = math.nan
    # fmt: off
    recs = [
        StepRecord(step=1, time=11.0, reward_mean=0.1, rollout_kl=0.02, mismatch_kl=0.01, mismatch_tokens=40),
        StepRecord(step=2, time=12.0, reward_mean=nan, rollout_kl=nan, mismatch_kl=math.inf, mismatch_tokens=30,
                   eval_version=1, eval_reward_mean=nan),
        StepRecord(step=3, time=13.0, reward_mean=0.3, rollout_kl=0.04, mismatch_kl=0.0, mismatch_tokens=0,
                   eval_version=2, eval_reward_mean=0.5),
        StepRecord(step=4, time=14.0, reward_mean=0.4, rollout_kl=0.05, mismatch_kl=0.03, mismatch_tokens=20),
    ]
    # fmt: on
    rows = _write(tmp_path, recs)
    assert rows[1]["rollout_kl"] == "nan" and rows[1]["eval_reward_mean"] == "nan"
    s = series(rows)
    assert s["reward"][0] == [11.0, 12.0, 13.0, 14.0] and _same(s["reward"][1], [0.1, nan, 0.3, 0.4])
    assert s["rollout_kl"][0] == [1.0, 2.0, 3.0, 4.0] and _same(s["rollout_kl"][1], [0.02, nan, 0.04, 0.05])
    # Step 3 measured no mismatch (mismatch_tokens=0, its 0.0 is no measurement): left out, not a zero.
    assert s["mismatch_kl"] == ([1.0, 2.0, 4.0], [0.01, math.inf, 0.03])
    assert all(isinstance(v, float) for xs, ys in s.values() for v in (*xs, *ys))
    e = eval_points(rows)
    assert [(t, v) for t, _, v in e] == [(12.0, 1), (13.0, 2)] and _same([y for _, y, _ in e], [nan, 0.5])
    fig = figure(rows, "run")
    try:
        kl = fig.axes[2]
        # A "nan" string among the values made matplotlib's axis categorical (StrCategoryConverter).
        assert kl.yaxis.units is None and fig.axes[0].yaxis.units is None
        assert kl.get_ylabel() == "KL(mu || pi), k3 estimate (nats)"
    finally:
        import matplotlib.pyplot as plt

        plt.close(fig)
    assert plot_run(tmp_path).read_bytes()[:4] == b"\x89PNG"


def test_records_from_before_mismatch_tokens_keep_every_kl_point():
    rows = [{"step": i, "time": float(i), "mismatch_kl": 0.01 * i} for i in (1, 2)]
    assert series(rows)["mismatch_kl"] == ([1.0, 2.0], [0.01, 0.02])


@pytest.mark.parametrize("text", ["", '{"step": 1, "ti'])  # empty; a torn first line only
def test_a_run_without_steps_is_a_user_error(tmp_path: Path, text: str):
    (tmp_path / "metrics.jsonl").write_text(text)
    with pytest.raises(ConfigError, match="metrics.jsonl has no steps yet"):
        plot_run(tmp_path)
    r = subprocess.run([sys.executable, "-m", "asyncrl.cli", "plot", str(tmp_path)],
                       capture_output=True, text=True, timeout=120)  # fmt: skip
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr  # rc 1 and a traceback before
    assert r.stderr.strip() == f"asyncrl: error: {tmp_path}/metrics.jsonl has no steps yet"


def test_a_resumed_runs_reward_is_drawn_against_running_time_not_folded_back():
    """Each session's records count ``time`` from its own start: after a resume the reward curve went
    back to the left over itself. Sessions (told by step_time - time) continue where the last ended."""
    from asyncrl.plot import running_time, series

    t0, t1 = 1_000_000.0, 1_000_500.0  # the second session starts 500 s later (downtime left out)
    first = [{"step": s, "time": 5.0 + s, "step_time": t0 + 5.0 + s, "reward_mean": 0.1} for s in range(1, 4)]
    second = [
        {"step": s, "time": 4.0 + s, "step_time": t1 + 4.0 + s, "reward_mean": 0.2} for s in range(3, 6)
    ]
    recs = first + second
    assert running_time(recs) == [6.0, 7.0, 8.0, 15.0, 16.0, 17.0]
    assert series(recs)["reward"][0] == [6.0, 7.0, 8.0, 15.0, 16.0, 17.0]
    # Without step_time (older records): a time that goes backwards starts a session.
    old = [{k: v for k, v in r.items() if k != "step_time"} for r in recs]
    assert running_time(old) == [6.0, 7.0, 8.0, 15.0, 16.0, 17.0]
    # One session: the times as written.
    assert running_time(first) == [6.0, 7.0, 8.0]
