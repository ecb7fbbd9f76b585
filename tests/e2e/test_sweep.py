"""`asyncrl sweep` end to end: the tiny 2 x 2 staleness sweep on the real pipeline, then a resume.

Each cell is a full `asyncrl run` (about a minute of engine start-up plus a 6-step budget), so this is
the one e2e test that pays four start-ups; everything else about the sweep is unit-tested on fakes.
"""

from __future__ import annotations

import csv
import subprocess
import sys
import time
from pathlib import Path

import pytest

from asyncrl.sweep import load_spec
from asyncrl.sweep_report import columns

REPO = Path(__file__).resolve().parents[2]
PNGS = ("reward_vs_step", "reward_vs_time", "final_reward_vs_staleness", "throughput_vs_staleness")


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
    cells = spec.cells()
    r = _sweep(out, timeout=1700)
    assert r.returncode == 0, f"stdout:\n{r.stdout}\nstderr:\n{r.stderr}"
    # One status line per cell.
    assert all(sum(c.name in line for line in r.stdout.splitlines()) == 1 for c in cells), r.stdout

    with (out / "results.csv").open() as f:
        reader = csv.DictReader(f)
        assert reader.fieldnames == columns(spec.marks_s)
        rows = {row["cell"]: row for row in reader}
    assert sorted(rows) == sorted(c.name for c in cells)
    for c in cells:
        row = rows[c.name]
        assert row["status"] == "ok" and int(row["steps"]) >= 1, row
        assert row["final_reward"] != "" and row["reward_auc"] != "", row
        # The staleness each cell actually had is reported and respects its bound; with fill_window
        # the bound is reached, which is what makes the sweep measure anything.
        smax = int(row["staleness_max"])
        assert smax <= c.max_staleness, row
        if c.max_staleness > 0 and int(row["steps"]) > c.max_staleness + 1:
            assert smax >= 1, f"{c.name}: fill_window did not make the data stale: {row}"
    assert (out / "results.md").read_text().count("|\n") == len(cells) + 2
    for name in PNGS:
        assert (out / f"{name}.png").stat().st_size > 1000, name

    # Re-running skips every finished cell: seconds, and no summary is rewritten.
    mtimes = {c.name: (c.dir / "summary.json").stat().st_mtime_ns for c in cells}
    t0 = time.monotonic()
    r2 = _sweep(out, timeout=300)
    took = time.monotonic() - t0
    assert r2.returncode == 0, f"stdout:\n{r2.stdout}\nstderr:\n{r2.stderr}"
    assert r2.stdout.count("skipped (done)") == len(cells), r2.stdout
    assert took < 60, f"re-run took {took:.0f}s"
    assert {c.name: (c.dir / "summary.json").stat().st_mtime_ns for c in cells} == mtimes
