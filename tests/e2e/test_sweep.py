"""`asyncrl sweep` end to end: the tiny sweep (2 cells x 2 seeds) on the real pipeline, then a resume.

Each run is a full `asyncrl run` (about a minute of engine start-up plus a 4-step budget), so this is
the one e2e test that pays four start-ups; everything else about the sweep (statistics, report,
retries) is unit-tested on synthetic run dirs.
"""

from __future__ import annotations

import csv
import subprocess
import sys
import time
from pathlib import Path

import pytest

from asyncrl.sweep import load_spec
from asyncrl.sweep_plots import PNGS
from asyncrl.sweep_report import columns, run_columns

REPO = Path(__file__).resolve().parents[2]


#: The user's command; relative paths in the sweep file are from the repo root.
SWEEP_CMD = [sys.executable, "-m", "asyncrl.cli", "sweep", "--config", "configs/sweep_tiny.yaml"]


def _sweep(out: Path, timeout: float) -> subprocess.CompletedProcess:
    cmd = [*SWEEP_CMD, f"sweep.dir={out}"]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_tiny_sweep_runs_reports_and_resumes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(REPO)
    out = tmp_path / "sweep"
    spec = load_spec(REPO / "configs" / "sweep_tiny.yaml", [f"sweep.dir={out}"])
    runs = spec.runs()
    r = _sweep(out, timeout=1700)
    assert r.returncode == 0, f"stdout:\n{r.stdout}\nstderr:\n{r.stderr}"
    # One status line per run.
    assert all(sum(run.name in line for line in r.stdout.splitlines()) == 1 for run in runs), r.stdout

    with (out / "runs.csv").open() as f:
        reader = csv.DictReader(f)
        assert reader.fieldnames == run_columns(spec.marks)
        table = {(row["cell"], int(row["seed"])): row for row in reader}
    assert sorted(table) == sorted((run.cell.name, run.seed) for run in runs)
    for run in runs:
        row = table[(run.cell.name, run.seed)]
        assert row["status"] == "ok" and int(row["steps"]) == 4, row
        assert row["final_reward"] != "" and row["reward_at_step_4"] != "" and row["startup_s"] != "", row
        # The staleness each run actually had is reported and respects its bound; with fill_window
        # the bound is reached, which is what makes the sweep measure anything.
        assert 1 <= int(row["staleness_max"]) <= run.cell.max_staleness, row
    with (out / "results.csv").open() as f:
        reader = csv.DictReader(f)
        assert reader.fieldnames == columns(spec.marks)
        cells = {row["cell"]: row for row in reader}
    for c in spec.cells():
        row = cells[c.name]
        assert row["seeds_ok"] == "2", row
        lo, mean, hi = (float(row["final_reward" + s]) for s in ("_lo", "", "_hi"))
        assert lo <= mean <= hi
    with (out / "comparison.csv").open() as f:
        comp = list(csv.DictReader(f))
    assert {(c["objective"], c["baseline"]) for c in comp} == {("full", "naive")} and all(
        c["n"] == "2" for c in comp
    )
    assert (out / "staleness.csv").read_text().count("\n") >= 3  # header + staleness 0 and 1 of a cell
    assert "| s1-full | 2/2 |" in (out / "results.md").read_text()
    for name in PNGS:
        assert (out / f"{name}.png").stat().st_size > 1000, name

    # Re-running skips every finished run: seconds, and no summary is rewritten.
    mtimes = {run.name: (run.dir / "summary.json").stat().st_mtime_ns for run in runs}
    t0 = time.monotonic()
    r2 = _sweep(out, timeout=300)
    took = time.monotonic() - t0
    assert r2.returncode == 0, f"stdout:\n{r2.stdout}\nstderr:\n{r2.stderr}"
    assert r2.stdout.count("skipped (done)") == len(runs), r2.stdout
    assert took < 60, f"re-run took {took:.0f}s"
    assert {run.name: (run.dir / "summary.json").stat().st_mtime_ns for run in runs} == mtimes
