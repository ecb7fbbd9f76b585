"""What results.md and comparison.csv answer: the grid, seeds and wall time up front, a wall_s column, and
each staleness level against staleness 0 of the same objective (reward and throughput), paired by seed."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import pytest

from asyncrl.config import load_config, to_yaml
from asyncrl.sweep_report import CellSpec, SeedRun, write_report
from asyncrl.sweep_runs import Marks
from tests.unit.test_sweep_spec import _boot_ref

G = 4  # actors.group_size of every run
GROUPS = [2, 3, 2, 4]  # groups trained per step


def _times(cell: int, seed: int) -> list[float]:
    return [30.0 + 2.5 * i * (1 + 0.3 * cell) + 0.7 * seed * i for i in range(4)]


def _rewards(cell: int, seed: int) -> list[float]:
    return [0.1 * i + 0.05 * cell + 0.013 * seed * seed for i in range(4)]


def test_results_header_wall_time_and_staleness_vs_zero_rows(tmp_path: Path):
    cells = [CellSpec(f"s{s}-{o}", s, o, tmp_path / f"s{s}-{o}") for s in (0, 3) for o in ("naive", "full")]
    config = to_yaml(load_config(overrides=[f"actors.group_size={G}"]))
    statuses, wall = {}, {}
    for ci, cell in enumerate(cells):
        for seed in (0, 1, 2):
            run = SeedRun(cell, seed)
            run.dir.mkdir(parents=True)
            recs = [dict(step=i + 1, version=i + 1, time=t, reward_mean=y, groups=g, tokens=80, staleness_mean=0,
                         staleness_max=0, dropped_stale=0, mismatch_kl=0, rollout_kl=0, wait_s=0.5)
                    for i, (t, y, g) in enumerate(zip(_times(ci, seed), _rewards(ci, seed), GROUPS, strict=True))]  # fmt: skip
            (run.dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
            (run.dir / "config.yaml").write_text(config)
            wall[run.name] = 50.0 + 10 * ci + seed
            (run.dir / "summary.json").write_text(json.dumps({"wall_s": wall[run.name], "finished": True}))
            statuses[run.name] = ("ok", 0)
    write_report(cells, [0, 1, 2], statuses, Marks(steps=(2, 4)), tmp_path, "naive", sweep_wall_s=12.4)

    md = (tmp_path / "results.md").read_text().splitlines()
    assert md[:3] == [
        "Grid: max_staleness {0, 3} x objective {naive, full}: 4 cells (s0-naive, s0-full, s3-naive, s3-full), "
        "seeds {0, 1, 2}.",
        "",
        f"Wall time: {math.fsum(wall.values()):.0f} s over 12 runs (sum of their wall_s); this sweep command 12 s",
    ]
    head = next(line for line in md if line.startswith("| cell |"))
    assert head.endswith("| dropped_groups | wall_s |")
    _, lo, hi = _boot_ref([70.0, 71.0, 72.0])  # s3-naive's wall_s over its seeds
    assert next(line for line in md if line.startswith("| s3-naive |")).endswith(
        f" | 71 [{lo:.3g}, {hi:.3g}] |"
    )

    with (tmp_path / "comparison.csv").open() as f:
        rows = {
            (r["max_staleness"], r["objective"], r["baseline"], r["metric"]): r for r in csv.DictReader(f)
        }
    for ci, obj in ((2, "naive"), (3, "full")):  # cell index at staleness 3; at 0 it is ci - 2
        keys = [k for k in rows if k[:3] == ("3", obj, f"{obj} at staleness 0")]
        assert [k[3] for k in keys] == ["final_reward", "reward_mean_steps", "reward_at_step_2", "reward_at_step_4",
                                        "reward_auc_time", "samples_per_s"]  # fmt: skip

        def ref(metric: str, c: int, s: int) -> float:
            t, y = _times(c, s), _rewards(c, s)
            if metric == "samples_per_s":  # trained samples over the window from the first step's end
                return math.fsum(GROUPS[1:]) * G / (t[-1] - t[0])
            return math.fsum(y[-3:]) / 3  # final_reward: the last 3 steps

        for metric in ("final_reward", "samples_per_s"):
            r = rows[("3", obj, f"{obj} at staleness 0", metric)]
            want = _boot_ref([ref(metric, ci, s) - ref(metric, ci - 2, s) for s in (0, 1, 2)])
            got = tuple(float(r[c]) for c in ("diff", "diff_lo", "diff_hi"))
            assert r["n"] == "3" and got == pytest.approx(want, rel=1e-5), metric
    assert rows[("3", "naive", "naive at staleness 0", "samples_per_s")]["excludes_zero"] == "True"  # faster
    assert not [k for k in rows if k[0] == "0" and "staleness 0" in k[2]]  # no staleness 0 - staleness 0
    assert not [k for k in rows if k[3] == "samples_per_s" and k[2] == "naive"]  # throughput: staleness rows
