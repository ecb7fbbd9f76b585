"""``asyncrl bench --startup-only``: per-phase median and spread over samples, its table rows, and the
argument errors (the real short runs are the same ``run_demo`` the full bench's pipeline rows use)."""

from __future__ import annotations

import statistics

import pytest

from asyncrl.bench import main
from asyncrl.bench.report import FIRST_STEP_TARGET_S, table
from asyncrl.bench.startup import summarize


def test_summarize_takes_median_and_spread_per_phase_over_the_samples_that_reached_it() -> None:
    samples = [
        {"redis_ready": 5.0, "engine_up": 20.0, "first_step": 23.0},
        {"redis_ready": 6.0, "engine_up": None, "first_step": 26.0},
        {"redis_ready": 4.0, "engine_up": 22.0, "first_step": 24.0},
        {"redis_ready": 9.0, "engine_up": 21.0, "first_step": 30.0, "first_batch": None},
    ]
    s = summarize(samples)
    assert s["redis_ready"] == {"median": 5.5, "min": 4.0, "max": 9.0, "n": 4}
    assert s["engine_up"] == {"median": 21.0, "min": 20.0, "max": 22.0, "n": 3}  # the None is not a sample
    assert s["first_step"]["median"] == statistics.median([23.0, 26.0, 24.0, 30.0]) == 25.0
    assert s["first_batch"] is None  # no sample reached it


def test_table_prints_one_row_per_phase_with_the_first_step_target() -> None:
    samples = [{"redis_ready": 5.0, "first_step": 23.0}, {"redis_ready": 6.0, "first_step": 27.5}]
    lines = table({"startup": {"runs": samples, "summary": summarize(samples), "steps_per_run": 3}})
    redis = [ln for ln in lines if "embedded Redis ready" in ln]
    first = [ln for ln in lines if "first learner step" in ln]
    assert len(redis) == 1 and "5.0-6.0" in redis[0] and redis[0].split()[-1] == "5.5"
    assert len(first) == 1 and "23.0-27.5" in first[0]
    # median 25.25 against the 25 s target: the row says it is not met
    assert f"<= {FIRST_STEP_TARGET_S:.1f}" in first[0] and first[0].rstrip().endswith("NO")
    assert not any("weights" in ln for ln in lines[1:])  # no other family printed


@pytest.mark.parametrize(
    "argv, msg",
    [
        (["--startup-only", "0"], "at least 1 run"),
        (["--startup-only", "2", "--weights-only"], "drop --weights-only"),
        (["--startup-only", "2", "--quick"], "drop --weights-only"),
    ],
)
def test_startup_only_rejects_bad_arguments_before_running_anything(argv, msg, capsys) -> None:
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2 and msg in capsys.readouterr().err
