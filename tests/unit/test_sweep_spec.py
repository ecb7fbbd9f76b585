"""Sweep-file loading: YAML errors and step marks a cell cannot reach are ConfigErrors naming the key."""

from __future__ import annotations

from pathlib import Path

import pytest

from asyncrl.config import ConfigError
from asyncrl.sweep_spec import load_spec

REPO = Path(__file__).resolve().parents[2]
GRID = "  grid: {max_staleness: [1], objective: [full]}\n"


def test_a_duplicate_key_in_the_sweep_file_is_a_config_error(tmp_path: Path):
    p = tmp_path / "s.yaml"
    p.write_text(f"sweep:\n{GRID}  objectives:\n    full: []\n    full: [learner.lr=1]\n")
    with pytest.raises(ConfigError) as e:  # was yaml's ConstructorError, a traceback
        load_spec(p)
    assert (
        str(e.value)
        == f"sweep config {p}: not a valid YAML file: found duplicate key full (line 5, column 5)"
    )
    p.write_text(f"sweep:\n{GRID}\tobjectives: {{full: []}}\n")  # a tab
    with pytest.raises(
        ConfigError, match=rf"^sweep config {p}: not a valid YAML file: .*\(line 3, column 1\)"
    ):
        load_spec(p)


def _spec_file(tmp_path: Path, step_marks: list[int]) -> Path:
    p = tmp_path / "s.yaml"
    p.write_text(
        "sweep:\n  grid: {max_staleness: [0, 2], objective: [naive, short]}\n"
        "  objectives: {naive: [learner.loss.is_mode=none], short: [run.max_steps=40]}\n"
        f"  overrides: [run.max_steps=150]\n  step_marks: {step_marks}\n"
    )
    return p


def test_a_step_mark_past_a_cells_max_steps_is_refused(tmp_path: Path):
    """A typo (1500 for 150) was accepted: its column empty in every run, and the only mark compared."""
    with pytest.raises(ConfigError) as e:
        load_spec(_spec_file(tmp_path, [50, 1500]))
    assert str(e.value) == (
        "sweep config: sweep.step_marks: 1500 is past run.max_steps=150 of cell s0-naive: no run of it reaches that step"
    )
    with pytest.raises(ConfigError) as e:  # one objective's own budget
        load_spec(_spec_file(tmp_path, [40, 50]))
    assert str(e.value).endswith(
        "50 is past run.max_steps=40 of cell s0-short: no run of it reaches that step"
    )
    assert load_spec(_spec_file(tmp_path, [10, 40])).step_marks == [10, 40]


def _boot_ref(vals: list[float]) -> tuple[float, float, float]:
    """Mean and exact percentile-bootstrap interval by enumeration, float64 and math.fsum."""
    import itertools
    import math

    n = len(vals)
    means = sorted(math.fsum(vals[i] for i in idx) / n for idx in itertools.product(range(n), repeat=n))

    def pct(q: float) -> float:
        pos = q * (len(means) - 1)
        k = int(math.floor(pos))
        return means[k] + (means[min(k + 1, len(means) - 1)] - means[k]) * (pos - k)

    return math.fsum(vals) / n, pct(0.025), pct(0.975)


def test_the_comparison_covers_every_step_mark_that_has_data():
    from asyncrl.sweep_report import CellSpec, comparisons
    from asyncrl.sweep_runs import Marks, metric_columns

    marks = Marks(steps=(2, 4, 9))  # no run reached step 9
    cells = [CellSpec(f"s1-{o}", 1, o, Path("/nowhere")) for o in ("naive", "full")]
    value = {  # (cell, seed) -> (reward_at_step_2, reward_at_step_4)
        ("s1-naive", 0): (0.10, 0.30), ("s1-naive", 1): (0.20, 0.25), ("s1-naive", 2): (0.15, 0.50),
        ("s1-full", 0): (0.31, 0.42), ("s1-full", 1): (0.12, 0.61), ("s1-full", 2): (0.40, 0.55),
    }  # fmt: skip
    runs = {c.name: [] for c in cells}
    for (cell, seed), (at2, at4) in value.items():
        row = dict.fromkeys(metric_columns(marks), 0.5)
        row.update(seed=seed, status="ok", reward_at_step_2=at2, reward_at_step_4=at4, reward_at_step_9=None)
        runs[cell].append(row)
    comps = {c["metric"]: c for c in comparisons(cells, runs, marks, "naive")}
    assert "reward_at_step_9" not in comps and comps["final_reward"]["diff"] == 0.0
    for i, n in enumerate((2, 4)):
        c = comps[f"reward_at_step_{n}"]
        diffs = [value[("s1-full", s)][i] - value[("s1-naive", s)][i] for s in (0, 1, 2)]
        assert c["n"] == 3 and c["baseline"] == "naive" and c["objective"] == "full"
        assert (c["diff"], c["diff_lo"], c["diff_hi"]) == pytest.approx(_boot_ref(diffs), abs=1e-12)
