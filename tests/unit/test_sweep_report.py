"""Sweep report math and sweep-file validation, on synthetic run dirs (no processes are started)."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import yaml

from asyncrl.config import ConfigError, load_config, to_yaml
from asyncrl.sweep import disk_status, is_finished
from asyncrl.sweep_plots import PNGS
from asyncrl.sweep_report import CellSpec, SeedRun, columns, run_columns, write_report
from asyncrl.sweep_runs import (
    Marks,
    final_reward,
    metric_columns,
    reward_at,
    reward_at_step,
    reward_auc,
    staleness_hist,
    startup_s,
)
from asyncrl.sweep_spec import SweepSpec, load_spec, parse_spec

REPO = Path(__file__).resolve().parents[2]
GROUP_SIZE = 4


def _record(step: int, t: float, reward: float, **kw) -> dict:
    rec = dict(
        step=step,
        version=step,
        time=t,
        reward_mean=reward,
        groups=2,
        tokens=50,
        staleness_mean=0.5,
        staleness_max=1,
        dropped_stale=0,
        ratio_mean=1.0,
        mismatch_kl=0.01,
        rollout_kl=0.02,
        dppo_masked_frac=0.0,
        is_weight_mean=1.0,
        ess=1.0,
        entropy=1.0,
        loss=0.1,
        grad_norm=1.0,
        skipped_nonfinite=0,
        wait_s=1.0,
    )
    rec.update(kw)
    return rec


def _make_run(tmp: Path, cell: CellSpec, seed: int, recs: list[dict], summary: dict | None = None) -> SeedRun:
    run = SeedRun(cell, seed)
    run.dir.mkdir(parents=True)
    (run.dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    (run.dir / "config.yaml").write_text(to_yaml(load_config(overrides=[f"actors.group_size={GROUP_SIZE}"])))
    if summary is not None:
        (run.dir / "summary.json").write_text(json.dumps(summary))
    return run


# Irregular times and rewards so that an off-by-one in a window shows.
TIMES = [62.0, 70.0, 75.0, 90.0, 130.0]
REWARDS = [0.1, 0.3, 0.2, 0.6, 0.5]


def _ref_trapz(t: list[float], y: list[float]) -> float:
    return sum((t[i + 1] - t[i]) * (y[i] + y[i + 1]) / 2 for i in range(len(t) - 1)) / (t[-1] - t[0])


def test_reward_math_against_reference():
    recs = [_record(i + 1, t, r) for i, (t, r) in enumerate(zip(TIMES, REWARDS, strict=True))]
    assert final_reward(recs) == pytest.approx((0.2 + 0.6 + 0.5) / 3)
    assert reward_auc(recs) == pytest.approx(_ref_trapz(TIMES, REWARDS))
    # The clock starts when the first batch was ready: first step end minus its train and publish time.
    assert startup_s(recs) == 62.0
    timed = [dict(r, train_s=1.5, publish_s=0.5) if r["step"] == 1 else r for r in recs]
    assert startup_s(timed) == 60.0
    assert reward_at(timed, 1.0) is None  # the first step ended 2 s after start-up
    assert reward_at(recs, 0) == pytest.approx(0.1)  # a step finishing exactly at the mark counts
    assert reward_at(recs, 18) == pytest.approx((0.1 + 0.3 + 0.2) / 3)
    assert reward_at(recs, 38) == pytest.approx((0.3 + 0.2 + 0.6) / 3)
    assert reward_at(recs, TIMES[-1] - 62.0) == final_reward(recs)  # the last step ends at the mark
    assert reward_at(recs, TIMES[-1] - 62.0 + 0.5) is None  # past the run's end: not measured
    assert reward_at(recs, 1e9) is None  # (was the final reward, as if measured there)
    # Equal-steps view: the last 3 steps up to step n; a run that stopped before n has no value.
    assert reward_at_step(recs, 1) == pytest.approx(0.1)
    assert reward_at_step(recs, 4) == pytest.approx((0.3 + 0.2 + 0.6) / 3)
    assert reward_at_step(recs, 6) is None
    assert reward_auc(recs[:1]) == pytest.approx(0.1)
    assert final_reward([]) is None and reward_auc([]) is None and reward_at_step([], 1) is None
    h = [_record(1, 1.0, 0.0, staleness_hist={"0": 3, "2": 1}), _record(2, 2.0, 0.0, staleness_hist={"2": 4})]
    assert staleness_hist(h) == {0: 3, 2: 5}


def test_report_runs_cells_intervals_comparison_and_plots(tmp_path: Path):
    from asyncrl.sweep_stats import bootstrap_ci, paired_ci

    marks = Marks(seconds=(10.0, 40.0), steps=(2, 5))
    cells = [CellSpec(n, s, o, tmp_path / n) for n, s, o in
             (("s0-naive", 0, "naive"), ("s2-naive", 2, "naive"), ("s2-full", 2, "full"))]  # fmt: skip
    statuses = {}
    rewards: dict[tuple[str, int], list[float]] = {}
    for ci, cell in enumerate(cells):
        for seed in (0, 1, 2):
            rw = [r + 0.05 * seed + 0.1 * ci for r in REWARDS]
            recs = [_record(i + 1, t, y, staleness_hist={"0": 10, "1": 5 * i}, dropped_stale=i, wait_s=0.5 * i)
                    for i, (t, y) in enumerate(zip(TIMES, rw, strict=True))]  # fmt: skip
            if (cell.name, seed) == ("s2-naive", 2):  # a failed seed: no steps, not in any mean
                recs = []
            rewards[(cell.name, seed)] = rw
            _make_run(
                tmp_path, cell, seed, recs, {"wall_s": 140.0, "actors": {"a": {"generated_tokens": 700}}}
            )
            failed = (cell.name, seed) == ("s2-naive", 2)
            statuses[SeedRun(cell, seed).name] = ("failed", 1) if failed else ("ok", 0)
    rows = write_report(cells, [0, 1, 2], statuses, marks, tmp_path, baseline="naive")

    with (tmp_path / "runs.csv").open() as f:
        runs = list(csv.DictReader(f))
    assert list(runs[0]) == run_columns(marks) and len(runs) == 9
    r = next(x for x in runs if x["cell"] == "s2-full" and x["seed"] == "1")
    window = TIMES[-1] - TIMES[0]
    assert int(r["steps"]) == 5 and r["status"] == "ok"
    assert float(r["final_reward"]) == pytest.approx(sum(rewards[("s2-full", 1)][-3:]) / 3, rel=1e-5)
    assert float(r["reward_mean_steps"]) == pytest.approx(sum(rewards[("s2-full", 1)]) / 5, rel=1e-5)
    assert float(r["reward_at_step_2"]) == pytest.approx(sum(rewards[("s2-full", 1)][:2]) / 2, rel=1e-5)
    assert float(r["reward_at_10s"]) == pytest.approx(
        sum(rewards[("s2-full", 1)][:2]) / 2, rel=1e-5
    )  # t <= 72
    assert float(r["samples_per_s"]) == pytest.approx(4 * 2 * GROUP_SIZE / window, rel=1e-5)
    assert float(r["learner_wait_frac"]) == pytest.approx(0.5 * (1 + 2 + 3 + 4) / window, rel=1e-5)
    # Token-weighted staleness from the distribution: 50 tokens at 0, 5*(0+1+2+3+4)=50 at 1.
    assert float(r["staleness_mean"]) == pytest.approx(0.5) and int(r["staleness_max"]) == 1
    assert int(r["dropped_groups"]) == 10 and float(r["gen_tokens_per_s"]) == pytest.approx(5.0)

    with (tmp_path / "results.csv").open() as f:
        table = {x["cell"]: x for x in csv.DictReader(f)}
    assert list(next(iter(table.values()))) == columns(marks)
    for cell in cells:
        ok = [s for s in (0, 1, 2) if statuses[SeedRun(cell, s).name][0] == "ok"]
        finals = [sum(rewards[(cell.name, s)][-3:]) / 3 for s in ok]
        ci = bootstrap_ci(finals)
        row = table[cell.name]
        assert int(row["seeds"]) == 3 and int(row["seeds_ok"]) == len(ok)
        for sfx, v in (("", ci.mean), ("_lo", ci.lo), ("_hi", ci.hi)):
            assert float(row["final_reward" + sfx]) == pytest.approx(v, rel=1e-5)
        for col in metric_columns(marks):  # every column has its interval, and it brackets the mean
            if row[col] != "":
                assert float(row[col + "_lo"]) <= float(row[col]) + 1e-9 <= float(row[col + "_hi"]) + 2e-9, (
                    col
                )
    assert table["s2-naive"]["seeds_ok"] == "2"
    assert rows[0]["cell"] == "s0-naive"

    with (tmp_path / "comparison.csv").open() as f:
        every = list(csv.DictReader(f))
    comp = [c for c in every if c["baseline"] == "naive"]  # the others: s2-naive - s0-naive
    assert {c["baseline"] for c in every} == {"naive", "naive at staleness 0"}
    assert {(c["max_staleness"], c["objective"]) for c in every if c["baseline"] != "naive"} == {
        ("2", "naive")
    }
    assert {c["max_staleness"] for c in comp} == {"2"} and {c["objective"] for c in comp} == {"full"}
    fin = next(c for c in comp if c["metric"] == "final_reward")
    want = paired_ci({s: sum(rewards[("s2-full", s)][-3:]) / 3 for s in (0, 1, 2)},
                     {s: sum(rewards[("s2-naive", s)][-3:]) / 3 for s in (0, 1)})  # fmt: skip
    assert int(fin["n"]) == 2 and float(fin["diff"]) == pytest.approx(0.1, rel=1e-5) == want.mean
    assert fin["excludes_zero"] == "True"  # +0.1 on both paired seeds
    assert {c["metric"] for c in comp} >= {
        "final_reward",
        "reward_at_step_5",
        "reward_auc_time",
        "reward_at_40s",
    }

    with (tmp_path / "staleness.csv").open() as f:
        dist = [x for x in csv.DictReader(f) if x["cell"] == "s0-naive"]
    assert [(d["staleness"], d["tokens"]) for d in dist] == [("0", "150"), ("1", "150")]
    md = (tmp_path / "results.md").read_text()
    assert "| s2-naive | 2/3 |" in md and "Paired difference" in md and "[" in md
    for png in PNGS:
        assert (tmp_path / f"{png}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", png


def _raw(**sweep) -> dict:
    base = {
        "name": "t",
        "dir": "runs/t",
        "grid": {"max_staleness": [0, 2], "objective": ["naive", "corrected"]},
        "objectives": {"naive": ["learner.loss.is_mode=none"], "corrected": []},
        "overrides": ["run.max_steps=3"],
        "marks_s": [120, 60],
    }
    base.update(sweep)
    return {"sweep": {k: v for k, v in base.items() if v is not None}}


def test_parse_spec_builds_cells_and_overrides():
    spec = parse_spec(_raw())
    assert isinstance(spec, SweepSpec) and spec.marks_s == [60.0, 120.0]
    cells = spec.cells()
    assert [c.name for c in cells] == ["s0-naive", "s0-corrected", "s2-naive", "s2-corrected"]
    assert all(c.dir == spec.dir / c.name for c in cells)
    assert spec.seeds == [0, 1, 2] and spec.baseline == "naive"
    runs = spec.runs()  # seeds outer: a sweep interrupted half-way has whole grids for its first seeds
    assert [r.name for r in runs[:5]] == [*(f"{c.name}/seed0" for c in cells), "s0-naive/seed1"]
    ov = spec.run_overrides(runs[2 + 4])
    assert ov[:2] == ["run.max_steps=3", "learner.loss.is_mode=none"]
    assert "buffer.max_staleness=2" in ov and "run.name=s2-naive-seed1" in ov and "run.progress=false" in ov
    assert "run.seed=1" in ov and f"run.dir={spec.dir / 's2-naive' / 'seed1'}" in ov
    cmd = spec.command(runs[2])
    assert cmd[1:4] == ["-m", "asyncrl.cli", "run"] and "--config" not in cmd
    spec2 = parse_spec(_raw(), ["sweep.grid.max_staleness=[4]", "sweep.dir=/tmp/x"])
    assert spec2.max_staleness == [4] and spec2.dir == Path("/tmp/x")
    assert spec.out_dir == spec.dir and spec2.out_dir == Path("/tmp/x")
    spec3 = parse_spec(_raw(), ["sweep.dir=/tmp/x", "sweep.report_dir=/tmp/x/sub"])
    assert spec3.dir == Path("/tmp/x") and spec3.out_dir == Path("/tmp/x/sub")
    assert spec3.cells()[0].dir == Path("/tmp/x/s0-naive")  # runs stay in dir


@pytest.mark.parametrize(
    "raw, needle",
    [
        ({"nope": {}}, "sweep"),
        ({**_raw(), "extra": 1}, "extra"),
        (_raw(gridd={}), "sweep.gridd"),
        (_raw(grid={"max_staleness": [], "objective": ["naive"]}), "sweep.grid.max_staleness"),
        (_raw(grid={"max_staleness": [0], "objective": []}), "sweep.grid.objective"),
        (_raw(grid={"max_staleness": [0]}), "sweep.grid.objective"),
        (_raw(grid={}), "sweep.grid"),
        (_raw(grid={"max_staleness": [0], "objective": ["naive"], "lr": [1]}), "sweep.grid.lr"),
        (_raw(grid={"max_staleness": [0, -1], "objective": ["naive"]}), "sweep.grid.max_staleness"),
        (_raw(grid={"max_staleness": [1, 1], "objective": ["naive"]}), "sweep.grid.max_staleness"),
        (_raw(grid={"max_staleness": [0], "objective": ["magic"]}), "sweep.objectives.magic"),
        (_raw(objectives={"naive": "learner.lr=1", "corrected": []}), "sweep.objectives.naive"),
        (_raw(overrides=["run.max_steps"]), "sweep.overrides[0]"),
        (_raw(overrides=["run.max_steps=1", "buffer.max_staleness=3"]), "sweep.overrides[1]"),
        (_raw(overrides=["run.seed=1"]), "sweep.overrides[0]"),
        (_raw(seeds=[0, 0]), "sweep.seeds"),
        (_raw(seeds=[-1]), "sweep.seeds"),
        (_raw(seeds=[]), "sweep.seeds"),
        (_raw(step_marks=[0]), "sweep.step_marks"),
        (_raw(baseline="nope"), "sweep.baseline"),
        (_raw(objectives={"naive": ["run.dir=/x"], "corrected": []}), "sweep.objectives.naive[0]"),
        (_raw(marks_s=[60, -1]), "sweep.marks_s"),
        (_raw(cell_timeout_s=-5), "sweep.cell_timeout_s"),
        (_raw(name="a b"), "sweep.name"),
        (_raw(base_config="/no/such.yaml"), "sweep.base_config"),
        (_raw(report_dir=3), "sweep.report_dir"),
        (_raw(extra_cells=[4, "naive"]), "sweep.extra_cells[0]"),
        (_raw(extra_cells="4,naive"), "sweep.extra_cells"),
        (_raw(extra_cells=[[4, "naive", 1]]), "sweep.extra_cells[0]"),
        (_raw(extra_cells=[[-1, "naive"]]), "sweep.extra_cells[0]"),
        (_raw(extra_cells=[[True, "naive"]]), "sweep.extra_cells[0]"),
        (_raw(extra_cells=[[4, "magic"]]), "sweep.extra_cells[0]"),
        (_raw(extra_cells=[[2, "naive"]]), "sweep.extra_cells[0]"),  # already a grid point
        (_raw(extra_cells=[[4, "naive"], [4, "naive"]]), "sweep.extra_cells[1]"),
    ],
)
def test_parse_spec_errors_name_the_key(raw, needle):
    with pytest.raises(ConfigError) as e:
        parse_spec(raw)
    assert needle in str(e.value)


def test_a_stopped_run_gets_its_learners_stop_grace_and_a_margin():
    from asyncrl.sweep import STOP_MARGIN_S, stop_grace_s

    spec = parse_spec(_raw())
    run = spec.runs()[0]
    assert stop_grace_s(spec, run) == 60.0 + STOP_MARGIN_S  # learner.stop_grace_s's default
    spec.overrides.append("learner.stop_grace_s=900")  # a big model's final checkpoint
    assert stop_grace_s(spec, run) == 900.0 + STOP_MARGIN_S  # before: a fixed 120 s
    # A config that stopped loading mid-sweep: the default's grace, no error (the run fails on it itself).
    spec.overrides.append("learner.no_such_key=1")
    assert stop_grace_s(spec, run) == 60.0 + STOP_MARGIN_S


def test_extra_cells_join_the_grid_in_run_order(tmp_path: Path):
    objectives = {
        "naive": ["learner.loss.is_mode=none"],
        "corrected": [],
        "adaptive": ["buffer.adaptive.enabled=true"],
    }
    spec = parse_spec(
        _raw(objectives=objectives, extra_cells=[[4, "adaptive"], [2, "adaptive"], [4, "naive"]])
    )
    names = [c.name for c in spec.cells()]
    # Staleness outer (grid bounds first, then new ones), grid objectives, then that bound's extras.
    assert names == [
        "s0-naive",
        "s0-corrected",
        "s2-naive",
        "s2-corrected",
        "s2-adaptive",
        "s4-adaptive",
        "s4-naive",
    ]
    assert list(spec.objectives) == ["naive", "corrected", "adaptive"] and spec.grid_objectives == [
        "naive",
        "corrected",
    ]
    cell = {c.name: c for c in spec.cells()}["s4-adaptive"]
    ov = spec.run_overrides(SeedRun(cell, 1))
    assert "buffer.adaptive.enabled=true" in ov and "buffer.max_staleness=4" in ov
    assert len(spec.runs()) == 7 * 3
    # A grid override keeps the extra cells (they are separate), `sweep.extra_cells=[]` drops them.
    only = parse_spec(
        _raw(objectives=objectives, extra_cells=[[4, "adaptive"]]), ["sweep.grid.max_staleness=[4]"]
    )
    assert [c.name for c in only.cells()] == ["s4-naive", "s4-corrected", "s4-adaptive"]
    none = parse_spec(_raw(objectives=objectives, extra_cells=[[4, "adaptive"]]), ["sweep.extra_cells=[]"])
    assert [c.name for c in none.cells()] == ["s0-naive", "s0-corrected", "s2-naive", "s2-corrected"]
    cli = parse_spec(_raw(objectives=objectives), ["sweep.extra_cells=[[16,adaptive]]"])
    assert (
        cli.extra_cells == [(16, "adaptive")]
        and "adaptive" not in parse_spec(_raw(objectives=objectives)).objectives
    )


def test_load_spec_checks_cell_configs(tmp_path: Path):
    p = tmp_path / "s.yaml"
    p.write_text(yaml.safe_dump(_raw(overrides=["learner.lrr=1"])))
    with pytest.raises(ConfigError, match="learner.lrr"):
        load_spec(p)
    p.write_text(yaml.safe_dump(_raw()))
    with pytest.raises(ConfigError, match="learner.nope"):
        load_spec(p, ["learner.nope=1"])  # a non-sweep CLI override joins every cell
    spec = load_spec(p, ["run.max_steps=5", "sweep.name=u"])
    assert spec.name == "u" and spec.overrides == ["run.max_steps=3", "run.max_steps=5"]
    # Lazy swaps as an objective: fine at eta 4 (an extra cell), refused at start in a grid cell whose
    # bound it exceeds, naming the cell and the key.
    lazy = {"naive": [], "lazy": ["actors.swap_min_lag=4"]}
    grid = {"max_staleness": [0, 4], "objective": ["naive"]}
    p.write_text(yaml.safe_dump(_raw(objectives=lazy, grid=grid, extra_cells=[[4, "lazy"]])))
    assert [c.name for c in load_spec(p).cells()] == ["s0-naive", "s4-naive", "s4-lazy"]
    p.write_text(yaml.safe_dump(_raw(objectives=lazy, grid={**grid, "objective": ["naive", "lazy"]})))
    with pytest.raises(
        ConfigError, match=r"sweep cell s0-lazy: actors.swap_min_lag=4 must be <= max\(1, buffer"
    ):
        load_spec(p)
    # A task data error (a TaskDataError, not a ConfigError) names its cell too.
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    p.write_text(yaml.safe_dump(_raw(overrides=["task.name=gsm8k", f"task.data_path={empty}"])))
    with pytest.raises(ConfigError, match=r"^sweep cell s\d+-\w+: .*empty\.jsonl: no problems in the data"):
        load_spec(p)


SHIPPED = [
    "sweep_staleness.yaml",
    "sweep_staleness_full.yaml",
    "sweep_staleness_ladder.yaml",
    "sweep_tiny.yaml",
]


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_sweep_configs_validate(name, monkeypatch):
    monkeypatch.chdir(REPO)
    spec = load_spec(REPO / "configs" / name)
    assert spec.objectives["naive"] and spec.objectives["full"] == [] and spec.baseline == "naive"
    assert "learner.fill_window=true" in spec.overrides
    if name == "sweep_staleness_full.yaml":  # the full grid (documented, not run)
        main = load_spec(REPO / "configs" / "sweep_staleness.yaml")  # its runs are a subset of this grid
        assert spec.dir == main.dir and spec.out_dir != main.out_dir and spec.overrides == main.overrides
        assert {c.name for c in main.cells()} < {c.name for c in spec.cells()}
        assert spec.max_staleness == [0, 1, 2, 4, 8, 16] and list(spec.objectives) == [
            "naive",
            "dppo",
            "dppo-k2",
            "full",
            "full-adaptive",
        ]
    elif name == "sweep_staleness.yaml":  # the grid behind the README table
        assert spec.max_staleness == [0, 1, 2, 4, 8, 16] and spec.grid_objectives == ["naive", "full"]
        assert spec.extra_cells == [(4, "full-adaptive"), (16, "full-adaptive")]
        assert spec.objectives["full-adaptive"] == ["buffer.adaptive.enabled=true"]
    elif name == "sweep_staleness_ladder.yaml":  # shares the runs of sweep_staleness.yaml
        main = load_spec(REPO / "configs" / "sweep_staleness.yaml")
        assert spec.dir == main.dir and spec.out_dir != main.out_dir and spec.overrides == main.overrides
        assert spec.max_staleness == [4, 16] and list(spec.objectives) == ["naive", "dppo", "dppo-k2", "full"]
        assert spec.seeds == main.seeds and spec.objectives["naive"] == main.objectives["naive"]
    else:
        assert len(spec.cells()) == 2 and len(spec.seeds) == 2
    if name != "sweep_tiny.yaml":
        assert len(spec.seeds) >= 3 and spec.step_marks and spec.marks_s
        assert "task.name=echo" in spec.overrides


def test_finished_means_summary_finished_and_no_failure_marker(tmp_path: Path):
    cell = SeedRun(CellSpec("s0-naive", 0, "naive", tmp_path / "s0-naive"), 1)
    cell.dir.mkdir(parents=True)
    assert not is_finished(cell) and disk_status(cell) == "missing"
    # What the orchestrator writes when run.max_wall_s stops a run (and `asyncrl run` exits 0).
    (cell.dir / "summary.json").write_text(
        json.dumps({"steps": 3, "finished": False, "status": "wall_budget"})
    )
    assert not is_finished(cell) and disk_status(cell) == "incomplete"
    (cell.dir / "sweep_cell.json").write_text(
        json.dumps({"status": "ok"})
    )  # a marker from before "incomplete"
    assert not is_finished(cell) and disk_status(cell) == "incomplete"
    (cell.dir / "summary.json").write_text("{}")  # no "finished" key: not known to be finished
    assert not is_finished(cell) and disk_status(cell) == "incomplete"
    (cell.dir / "sweep_cell.json").unlink()
    (cell.dir / "summary.json").write_text(json.dumps({"steps": 5, "finished": True, "status": "finished"}))
    assert is_finished(cell)  # a finished summary without a marker: finished (the sweep died after the cell)
    for status, done in (("running", False), ("failed", False), ("interrupted", False), ("incomplete", False),
                         ("ok", True)):  # fmt: skip
        (cell.dir / "sweep_cell.json").write_text(json.dumps({"status": status}))
        assert is_finished(cell) is done and disk_status(cell) == status


def test_run_one_marks_a_wall_budget_stop_incomplete(tmp_path: Path, monkeypatch):
    """`asyncrl run` exits 0 on a wall-budget stop; the sweep must not count that run as ok."""
    import sys

    from asyncrl.sweep import read_marker, run_one

    spec = parse_spec(_raw(dir=str(tmp_path / "out"), seeds=[0]))
    run = spec.runs()[0]
    for finished, want in ((False, "incomplete"), (True, "ok")):
        summary = {"steps": 2 if not finished else 4, "finished": finished,
                   "status": "finished" if finished else "wall_budget"}  # fmt: skip
        script = f"import json, sys; open(sys.argv[1], 'w').write(json.dumps({summary!r}))"
        cmd = [sys.executable, "-c", script, str(run.dir / "summary.json")]
        monkeypatch.setattr(SweepSpec, "command", lambda self, r, cmd=cmd: cmd)
        assert run_one(spec, run) == (want, 0)
        marker = read_marker(run)
        assert marker["status"] == want and marker["run_status"] == summary["status"]
        assert marker["steps"] == summary["steps"] and is_finished(run) is finished


# A stand-in for `asyncrl run`: writes a run dir like the orchestrator does (summary.json even when it
# fails, as the real one does) and exits non-zero for the cells named in FAIL_CELLS; the cells named in
# WALL_CELLS stop on their wall budget: exit 0, summary "finished": false (as the real one does).
FAKE_RUN = """
import json, os, sys
args = dict(a.split("=", 1) for a in sys.argv[1:])
d = args["run.dir"]
with open(os.path.join(d, "metrics.jsonl"), "w") as f:
    for i in range(1, 5):
        f.write(json.dumps(dict(step=i, version=i, time=10.0 * i, reward_mean=0.1 * i, groups=4, tokens=80,
            staleness_mean=0.0, staleness_max=int(args["buffer.max_staleness"]), dropped_stale=0,
            mismatch_kl=0.0, rollout_kl=0.0, wait_s=1.0)) + "\\n")
wall = args["run.name"] in os.environ.get("WALL_CELLS", "").split(",")
with open(os.path.join(d, "summary.json"), "w") as f:
    json.dump({"wall_s": 45.0, "start_reward": 0.2, "end_reward": 0.3, "steps": 2 if wall else 4,
               "finished": not wall, "status": "wall_budget" if wall else "finished"}, f)
print("fake run", d)
sys.exit(1 if args["run.name"] in os.environ.get("FAIL_CELLS", "").split(",") else 0)
"""


FAKE_OVERRIDES = ["run.max_steps=4"]  # the steps FAKE_RUN writes


def _fake_sweep(monkeypatch, path: Path, **sweep) -> Path:
    """A sweep file at ``path`` (``_raw(**sweep)``) whose runs are FAKE_RUN instead of `asyncrl run`."""
    import sys

    sweep.setdefault("overrides", FAKE_OVERRIDES)  # a run of more steps than run.max_steps is failed

    monkeypatch.setattr(
        SweepSpec, "command", lambda self, run: [sys.executable, "-c", FAKE_RUN, *self.run_overrides(run)]
    )
    path.write_text(yaml.safe_dump(_raw(**sweep)))
    return path


def test_run_sweep_failure_row_retry_and_skip(tmp_path: Path, monkeypatch, capsys):
    from asyncrl.sweep import run_sweep

    p = _fake_sweep(monkeypatch, tmp_path / "s.yaml", dir=str(tmp_path / "out"), seeds=[0, 1])
    monkeypatch.setenv("FAIL_CELLS", "s2-naive-seed1")
    assert run_sweep(p) == 1  # one failed run does not stop the others
    with (tmp_path / "out" / "runs.csv").open() as f:
        runs = {(r["cell"], r["seed"]): r for r in csv.DictReader(f)}
    assert (
        len(runs) == 8
        and runs[("s2-naive", "1")]["status"] == "failed"
        and runs[("s2-naive", "1")]["exit_code"] == "1"
    )
    assert sum(r["status"] == "ok" for r in runs.values()) == 7
    with (tmp_path / "out" / "results.csv").open() as f:
        table = {r["cell"]: r for r in csv.DictReader(f)}
    assert table["s2-naive"]["seeds_ok"] == "1" and table["s0-naive"]["seeds_ok"] == "2"
    assert float(table["s0-naive"]["final_reward"]) == pytest.approx(0.3)
    assert "FAILED (exit 1)" in capsys.readouterr().out
    dirs = [tmp_path / "out" / c / f"seed{s}" for c, s in runs]
    mtimes = {d: (d / "summary.json").stat().st_mtime_ns for d in dirs}
    monkeypatch.setenv("FAIL_CELLS", "")
    assert run_sweep(p) == 0  # the failed run is retried from scratch, the others skipped
    out = capsys.readouterr().out
    assert out.count("skipped (done)") == 7
    assert (tmp_path / "out" / "s2-naive" / "seed1.failed" / "run.log").exists()
    for d, m in mtimes.items():
        assert ((d / "summary.json").stat().st_mtime_ns == m) == (
            d.parent.name != "s2-naive" or d.name != "seed1"
        )
    with (tmp_path / "out" / "results.csv").open() as f:
        assert all(r["seeds_ok"] == "2" for r in csv.DictReader(f))


def test_run_sweep_leaves_wall_budget_stops_out_and_redoes_them(tmp_path: Path, monkeypatch, capsys):
    from asyncrl.sweep import run_sweep

    p = _fake_sweep(monkeypatch, tmp_path / "s.yaml", dir=str(tmp_path / "out"), seeds=[0, 1])
    monkeypatch.setenv("FAIL_CELLS", "")
    monkeypatch.setenv("WALL_CELLS", "s2-corrected-seed0")
    assert run_sweep(p) == 1  # not every run finished
    out = capsys.readouterr()
    assert "INCOMPLETE (stopped at step 2, status wall_budget; raise run.max_wall_s" in out.out
    assert "not ok: s2-corrected/seed0" in out.err
    with (tmp_path / "out" / "runs.csv").open() as f:
        runs = {(r["cell"], r["seed"]): r for r in csv.DictReader(f)}
    assert (
        runs[("s2-corrected", "0")]["status"] == "incomplete"
        and runs[("s2-corrected", "0")]["exit_code"] == "0"
    )
    assert sum(r["status"] == "ok" for r in runs.values()) == 7
    with (tmp_path / "out" / "results.csv").open() as f:
        table = {r["cell"]: r for r in csv.DictReader(f)}
    assert table["s2-corrected"]["seeds_ok"] == "1" and table["s2-naive"]["seeds_ok"] == "2"
    with (tmp_path / "out" / "comparison.csv").open() as f:  # the truncated seed is in no pair
        assert {
            r["n"]
            for r in csv.DictReader(f)
            if r["objective"] == "corrected" and r["max_staleness"] == "2" and r["baseline"] == "naive"
        } == {"1"}
    md = (tmp_path / "out" / "results.md").read_text()
    assert "- s2-corrected/seed0: incomplete (stopped before run.max_steps, e.g. by run.max_wall_s)" in md
    monkeypatch.setenv("WALL_CELLS", "")
    assert run_sweep(p) == 0  # the incomplete run is redone from scratch, the others skipped
    assert capsys.readouterr().out.count("skipped (done)") == 7
    assert (tmp_path / "out" / "s2-corrected" / "seed0.failed" / "summary.json").exists()
    with (tmp_path / "out" / "runs.csv").open() as f:
        assert all(r["status"] == "ok" for r in csv.DictReader(f))
    assert "Left out" not in (tmp_path / "out" / "results.md").read_text()


def test_second_sweep_file_shares_runs_and_reports_elsewhere(tmp_path: Path, monkeypatch, capsys):
    # configs/sweep_staleness_ladder.yaml's pattern: same dir (finished runs skipped), own report_dir.
    from asyncrl.sweep import run_sweep

    monkeypatch.setenv("FAIL_CELLS", "")
    main = _fake_sweep(monkeypatch, tmp_path / "main.yaml", dir=str(tmp_path / "out"), seeds=[0, 1])
    sub = tmp_path / "sub.yaml"
    assert run_sweep(main) == 0
    before = (tmp_path / "out" / "results.csv").read_text()
    sub.write_text(yaml.safe_dump(_raw(dir=str(tmp_path / "out"), seeds=[0, 1], report_dir=str(tmp_path / "out" / "r"), overrides=FAKE_OVERRIDES,
                                       grid={"max_staleness": [2], "objective": ["naive", "corrected"]})))  # fmt: skip
    capsys.readouterr()
    assert run_sweep(sub) == 0
    assert capsys.readouterr().out.count("skipped (done)") == 4  # nothing re-run
    assert (tmp_path / "out" / "results.csv").read_text() == before  # the first report is untouched
    with (tmp_path / "out" / "r" / "results.csv").open() as f:
        assert [r["cell"] for r in csv.DictReader(f)] == ["s2-naive", "s2-corrected"]


def test_adaptive_cell_is_compared_with_its_ceiling_and_the_best_fixed_bound(tmp_path: Path):
    from asyncrl.sweep_report import comparisons, run_row

    marks = Marks()
    # Reward per step of each cell (seed k adds 0.01 k). full@0 has the best final reward but the
    # worst mean over steps; full@2 and full@8 tie on the mean: the lower bound is the best fixed one.
    curves = {
        ("full", 0): [0.2, 0.2, 0.9, 0.9],
        ("full", 2): [0.6, 0.6, 0.6, 0.6],
        ("full", 4): [0.5, 0.5, 0.5, 0.5],
        ("full", 8): [0.6, 0.6, 0.6, 0.6],
        ("full-adaptive", 4): [0.75, 0.75, 0.75, 0.75],
        ("full-adaptive", 2): [0.7, 0.7, 0.7, 0.7],
    }
    cells, runs = [], {}
    for (obj, s), ys in curves.items():
        cell = CellSpec(f"s{s}-{obj}", s, obj, tmp_path / f"s{s}-{obj}")
        cells.append(cell)
        for seed in (0, 1):
            recs = [_record(i + 1, 10.0 * i, y + 0.01 * seed) for i, y in enumerate(ys)]
            _make_run(tmp_path, cell, seed, recs, {"wall_s": 50.0})
        runs[cell.name] = [run_row(SeedRun(cell, seed), marks, "ok", 0) for seed in (0, 1)]
    every = [c for c in comparisons(cells, runs, marks, None) if c["metric"] == "final_reward"]
    rows = [c for c in every if c["baseline"] != "full at staleness 0"]
    # The fixed bounds against bound 0 (the adaptive cells have no bound-0 cell of their own).
    assert [(c["max_staleness"], c["objective"]) for c in every if c not in rows] == [
        (2, "full"),
        (4, "full"),
        (8, "full"),
    ]
    got = {(r["max_staleness"], r["baseline"]): r for r in rows}
    # Ceiling 4: against full@4 and against the best fixed bound (2); ceiling 2 IS the best: once.
    assert sorted(got) == [(2, "full at best fixed bound 2"), (4, "full at best fixed bound 2"),
                           (4, "full at fixed bound 4")]  # fmt: skip
    assert all(r["objective"] == "full-adaptive" and r["n"] == 2 for r in rows)
    assert got[(4, "full at fixed bound 4")]["diff"] == pytest.approx(0.25)
    assert got[(4, "full at best fixed bound 2")]["diff"] == pytest.approx(0.15)
    assert got[(2, "full at best fixed bound 2")]["diff"] == pytest.approx(0.1)
    assert all(r["excludes_zero"] for r in rows)  # the same shift on every seed


def test_run_metrics_leave_out_steps_that_measured_no_ess(tmp_path: Path):
    """A step without loss tokens records ESS NaN, which metrics.jsonl holds as the string "nan"; the
    sweep's ess_mean is over the measured steps (a TypeError before; 0.0 had been averaged in earlier)."""
    import json
    import math

    from asyncrl.learner.records import StepRecord
    from asyncrl.sweep_runs import Marks, run_metrics

    recs = [StepRecord(step=i, time=float(i), ess=math.nan if i == 1 else 0.9) for i in range(3)]
    assert recs[1].to_dict()["ess"] == "nan"
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r.to_dict()) + "\n" for r in recs))
    assert run_metrics(tmp_path, Marks())["ess_mean"] == pytest.approx(0.9)


def test_non_finite_step_values_are_left_out_of_every_mean_and_the_report_is_written(tmp_path: Path):
    """A step the learner skipped as non-finite writes its KL (and maybe reward) as "nan"/"inf" strings
    (StepRecord.to_dict); every per-step mean is over the finite values, and write_report completes
    (a TypeError in mismatch_kl_mean/rollout_kl_mean aborted it, on every re-run too)."""
    import math

    from asyncrl.learner.records import StepRecord
    from asyncrl.sweep_runs import run_metrics

    rows = [  # (reward, rollout_kl, mismatch_kl, staleness_mean)
        (0.1, 0.02, 0.01, 0.5),
        (0.2, math.nan, math.inf, math.nan),
        (math.nan, 0.04, 0.03, 1.5),
        (0.4, 0.06, 0.05, 2.5),
    ]
    recs = [
        StepRecord(
            step=i + 1,
            version=i + 1,
            time=10.0 + i,
            reward_mean=rw,
            rollout_kl=rk,
            mismatch_kl=mk,
            mismatch_tokens=10,
            staleness_mean=sm,
            staleness_max=3,
        )  # fmt: skip
        for i, (rw, rk, mk, sm) in enumerate(rows)
    ]
    assert recs[1].to_dict()["mismatch_kl"] == "inf" and recs[2].to_dict()["reward_mean"] == "nan"
    cell = CellSpec("s0-naive", 0, "naive", tmp_path / "s0-naive")
    run = _make_run(tmp_path, cell, 0, [r.to_dict() for r in recs], {"finished": True, "wall_s": 20.0})
    m = run_metrics(run.dir, Marks())

    def ref(col: int) -> float:  # obvious reference: the mean of the finite floats of one column
        vals = [r[col] for r in rows if math.isfinite(r[col])]
        return sum(vals) / len(vals)

    assert m["rollout_kl_mean"] == pytest.approx(ref(1)) == pytest.approx(0.04)
    assert m["mismatch_kl_mean"] == pytest.approx(ref(2)) == pytest.approx(0.03)
    assert m["reward_mean_steps"] == pytest.approx(ref(0)) == pytest.approx(0.7 / 3)
    assert m["staleness_mean"] == pytest.approx(ref(3)) == pytest.approx(1.5)
    assert m["final_reward"] == pytest.approx((0.2 + 0.4) / 2)  # last 3 steps, the NaN one left out
    # Time-averaged reward: the trapezoid bridges the NaN step (t=12) from t=11 to t=13.
    assert m["reward_auc_time"] == pytest.approx(((0.1 + 0.2) / 2 + 2 * (0.2 + 0.4) / 2) / 3)
    write_report([cell], [0], {"s0-naive/seed0": ("ok", 0)}, Marks(), tmp_path, "naive")
    with (tmp_path / "runs.csv").open() as f:
        (row,) = csv.DictReader(f)
    assert float(row["rollout_kl_mean"]) == pytest.approx(0.04)


def test_mismatch_kl_is_token_weighted_over_the_steps_that_measured_it(tmp_path: Path):
    """A step with no staleness-0 token writes mismatch_kl=0.0, mismatch_tokens=0 (learner/step.py
    _drift_split): it measured nothing and must not pull the run's mismatch KL towards 0 (more such
    steps at a higher max_staleness would read as "less mismatch")."""
    from asyncrl.sweep_runs import run_metrics, token_weighted_kl

    steps = [(1e-3, 500), (0.0, 0), (4e-3, 100), (0.0, 0)]  # (mismatch_kl, mismatch_tokens)
    recs = [_record(i + 1, 10.0 + i, 0.1, mismatch_kl=k, mismatch_tokens=n) for i, (k, n) in enumerate(steps)]
    run = _make_run(tmp_path, CellSpec("s4-naive", 4, "naive", tmp_path / "c"), 0, recs, {"finished": True})
    want = (1e-3 * 500 + 4e-3 * 100) / 600
    assert run_metrics(run.dir, Marks())["mismatch_kl_mean"] == pytest.approx(want) == pytest.approx(1.5e-3)
    # No step measured it: no value (the report shows "-"), not 0.0.
    assert token_weighted_kl([_record(1, 1.0, 0.1, mismatch_kl=0.0, mismatch_tokens=0)]) is None
    assert token_weighted_kl([_record(1, 1.0, 0.1, mismatch_kl="nan", mismatch_tokens=7)]) is None


def test_status_line_staleness_mean_skips_non_finite_steps(tmp_path: Path):
    from asyncrl.sweep import _status_line

    recs = [_record(1, 1.0, 0.1, staleness_mean=1.0), _record(2, 2.0, 0.1, staleness_mean="nan"),
            _record(3, 3.0, 0.1, staleness_mean=2.0, staleness_max=3)]  # fmt: skip
    run = _make_run(tmp_path, CellSpec("s4-naive", 4, "naive", tmp_path / "c"), 0, recs, {"finished": True})
    assert "staleness 1.50/3 (bound 4)" in _status_line(run, "ok", 0, 5.0)


@pytest.mark.parametrize(
    "raw, overrides, needles",
    [
        (_raw(baseline=["naive"]), [], ("sweep.baseline", "['naive']", "naive, corrected")),
        (_raw(baseline={"a": 1}), [], ("sweep.baseline", "naive, corrected")),
        (_raw(), ["sweep.baseline=[naive]"], ("sweep.baseline", "naive, corrected")),
        # A value that is not YAML: yaml's ParserError escaped as a traceback.
        (_raw(), ["sweep.name=t", "sweep.seeds=[0,,1]"], ("sweep config: overrides: 'sweep.seeds=[0,,1]'",)),
    ],
)
def test_parse_spec_refuses_unhashable_baseline_and_malformed_overrides(raw, overrides, needles):
    with pytest.raises(ConfigError) as e:
        parse_spec(raw, overrides)
    assert all(n in str(e.value) for n in needles), str(e.value)
    assert "\n" not in str(e.value)  # one line after "asyncrl: error:"


def test_resume_refuses_finished_runs_made_with_other_overrides(tmp_path: Path, monkeypatch, capsys, caplog):
    """An edited sweep (a common learner.lr changed) silently skipped the runs made with the old value and
    reported them under the new one; now it stops before running anything, naming the run and the change."""
    from asyncrl.sweep import read_marker, run_sweep

    monkeypatch.setenv("FAIL_CELLS", "")
    out = tmp_path / "out"
    p = _fake_sweep(monkeypatch, tmp_path / "s.yaml", dir=str(out), seeds=[0], overrides=["learner.lr=1e-6"])
    assert run_sweep(p) == 0
    spec = load_spec(p)
    run = spec.runs()[0]
    assert read_marker(run)["overrides"] == spec.run_overrides(run)
    mtimes = {r.dir: (r.dir / "summary.json").stat().st_mtime_ns for r in spec.runs()}
    p.write_text(yaml.safe_dump(_raw(dir=str(out), seeds=[0], overrides=["learner.lr=1e-5"])))
    with pytest.raises(ConfigError) as e:
        run_sweep(p)
    msg = str(e.value)
    assert f"sweep run {out / 's0-naive' / 'seed0'} finished with other overrides" in msg
    assert "(ran with learner.lr=1e-6; now learner.lr=1e-5)" in msg
    assert f"sweep.dir={out}-v2" in msg and "put the overrides back" in msg
    assert {
        r.dir: (r.dir / "summary.json").stat().st_mtime_ns for r in spec.runs()
    } == mtimes  # nothing re-run
    # The suggested way out: the edited sweep in a new dir runs every cell; the old dir's runs stay.
    capsys.readouterr()
    assert run_sweep(p, [f"sweep.dir={out}-v2"]) == 0
    assert capsys.readouterr().out.count("skipped (done)") == 0
    # Or the overrides put back: the finished runs are reused again.
    p.write_text(yaml.safe_dump(_raw(dir=str(out), seeds=[0], overrides=["learner.lr=1e-6"])))
    assert run_sweep(p) == 0 and capsys.readouterr().out.count("skipped (done)") == len(spec.runs())
    # A marker from an older asyncrl has no overrides: reused as before, with one warning for all of them.
    for r in spec.runs():
        m = read_marker(r)
        del m["overrides"]
        (r.dir / "sweep_cell.json").write_text(json.dumps(m))
    p.write_text(yaml.safe_dump(_raw(dir=str(out), seeds=[0], overrides=["learner.lr=1e-5"])))
    caplog.clear()
    with caplog.at_level("WARNING", logger="asyncrl.sweep"):
        assert run_sweep(p) == 0
    assert capsys.readouterr().out.count("skipped (done)") == len(spec.runs())
    warned = [r.getMessage() for r in caplog.records if "no recorded overrides" in r.getMessage()]
    assert warned == [f"sweep t: {len(spec.runs())} finished runs have no recorded overrides (made by an older "
                      "asyncrl); reused without checking them against the sweep file"]  # fmt: skip


def test_changed_overrides_ignores_where_the_run_dir_is_but_not_the_order():
    from asyncrl.sweep import changed_overrides

    a = ["learner.lr=1e-6", "run.max_steps=4", "run.dir=/a/s0-naive/seed0", "run.progress=false"]
    assert changed_overrides(a, [*a[:2], "run.dir=/moved/s0-naive/seed0", "run.progress=false"]) is None
    assert changed_overrides(a, ["run.max_steps=4", "learner.lr=1e-6", a[2]]).startswith(
        "the same overrides in another order"
    )
    assert changed_overrides(a, ["run.max_steps=4"]) == "ran with learner.lr=1e-6"
    assert changed_overrides(a, [*a, "learner.kl=0.1"]) == "now learner.kl=0.1"


def test_one_seed_has_no_interval_and_the_report_says_so(tmp_path: Path, monkeypatch, capsys):
    """1 seed (users' walkthrough): no interval can be estimated; results.md said "-0.08 [-0.08, -0.08]"
    with "interval excludes 0: no", and paired_diff.png was empty without a word. Time marks past a run's
    end are empty, as step marks are: reward_at_120s (FAKE_RUN's steps end 30 s after start-up) was
    its final reward."""
    from asyncrl.sweep import run_sweep
    from asyncrl.sweep_plots import paired_note

    p = _fake_sweep(monkeypatch, tmp_path / "s.yaml", dir=str(tmp_path / "out"), seeds=[0], marks_s=[20, 120])
    assert run_sweep(p) == 0
    assert "only 1 finished seed: no uncertainty can be estimated" in capsys.readouterr().err
    md = (tmp_path / "out" / "results.md").read_text()
    assert "**Warning: every cell has only 1 finished seed" in md and "run more seeds" in md
    assert "n/a (1 seed)" in md and "| no |" not in md and "| yes |" not in md
    with (tmp_path / "out" / "results.csv").open() as f:
        table = list(csv.DictReader(f))
    assert all(r["final_reward"] != "" and r["final_reward_lo"] == r["final_reward_hi"] == "" for r in table)
    assert all(r["reward_at_20s"] != "" and r["reward_at_120s"] == "" for r in table)
    with (tmp_path / "out" / "comparison.csv").open() as f:
        comps = list(csv.DictReader(f))
    assert comps and all(
        c["n"] in ("0", "1") and c["diff_lo"] == c["diff_hi"] == c["excludes_zero"] == "" for c in comps
    )
    # Compared at the last time mark some run reached, not at one no run reached (all empty).
    assert {c["metric"] for c in comps} >= {"reward_at_20s"} and "reward_at_120s" not in {
        c["metric"] for c in comps
    }
    one = [dict(c, n=int(c["n"])) for c in comps if c["baseline"] == "naive"]
    assert "1 paired seed" in paired_note(one) and "no objective - baseline pair" in paired_note([])
    assert paired_note([dict(c, n=3) for c in one]) is None


def test_shipped_staleness_sweep_loads_from_any_dir(tmp_path: Path, monkeypatch):
    """Users' walkthrough: from /tmp/user2 the shipped sweep failed with "sweep.base_config: file not found:
    /tmp/user2/configs/default.yaml", while `asyncrl run` without -c works anywhere. Its cells now start
    from the built-in default config (no --config), the same resolved config as from the repo root."""
    monkeypatch.chdir(tmp_path)
    spec = load_spec(REPO / "configs" / "sweep_staleness.yaml")
    assert spec.base_config is None
    run = spec.runs()[0]
    assert "--config" not in spec.command(run)
    overrides = spec.run_overrides(run)
    assert to_yaml(load_config(None, overrides)) == to_yaml(
        load_config(REPO / "configs" / "default.yaml", overrides)
    )
    # A relative base_config is still read from the current dir, and the error says what empty means.
    with pytest.raises(ConfigError, match=r"sweep.base_config.*unset or empty = the built-in default config"):
        parse_spec(_raw(base_config="configs/default.yaml"))
