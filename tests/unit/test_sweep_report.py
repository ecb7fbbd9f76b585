"""Sweep report math and sweep-file validation, on synthetic run dirs (no processes are started)."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import yaml

from asyncrl.config import ConfigError, load_config, to_yaml
from asyncrl.sweep import SweepSpec, is_finished, load_spec, parse_spec
from asyncrl.sweep_report import (
    HEAD_COLUMNS,
    TAIL_COLUMNS,
    CellSpec,
    columns,
    final_reward,
    reward_at,
    reward_auc,
    write_report,
)

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


def _make_cell(
    tmp: Path, name: str, s: int, obj: str, recs: list[dict], summary: dict | None = None
) -> CellSpec:
    d = tmp / name
    d.mkdir(parents=True)
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    (d / "config.yaml").write_text(to_yaml(load_config(overrides=[f"actors.group_size={GROUP_SIZE}"])))
    if summary is not None:
        (d / "summary.json").write_text(json.dumps(summary))
    return CellSpec(name, s, obj, d)


# Irregular times and rewards so that an off-by-one in a window shows.
TIMES = [62.0, 70.0, 75.0, 90.0, 130.0]
REWARDS = [0.1, 0.3, 0.2, 0.6, 0.5]


def _ref_trapz(t: list[float], y: list[float]) -> float:
    return sum((t[i + 1] - t[i]) * (y[i] + y[i + 1]) / 2 for i in range(len(t) - 1)) / (t[-1] - t[0])


def test_reward_math_against_reference():
    recs = [_record(i + 1, t, r) for i, (t, r) in enumerate(zip(TIMES, REWARDS, strict=True))]
    assert final_reward(recs) == pytest.approx((0.2 + 0.6 + 0.5) / 3)
    assert reward_auc(recs) == pytest.approx(_ref_trapz(TIMES, REWARDS))
    assert reward_at(recs, 60) is None  # nothing finished by 60 s
    assert reward_at(recs, 62) == pytest.approx(0.1)  # a step finishing exactly at the mark counts
    assert reward_at(recs, 80) == pytest.approx((0.1 + 0.3 + 0.2) / 3)
    assert reward_at(recs, 100) == pytest.approx((0.3 + 0.2 + 0.6) / 3)
    assert reward_at(recs, 1e9) == final_reward(recs)
    assert reward_auc(recs[:1]) == pytest.approx(0.1)
    assert final_reward([]) is None and reward_auc([]) is None


def test_report_csv_md_and_plots(tmp_path: Path):
    recs = [
        _record(
            i + 1, t, r, staleness_mean=float(i % 2), staleness_max=i % 3, dropped_stale=i, wait_s=0.5 * i
        )
        for i, (t, r) in enumerate(zip(TIMES, REWARDS, strict=True))
    ]
    summary = {
        "wall_s": 140.0,
        "actors": {"actor-0": {"generated_tokens": 700}, "actor-1": {"generated_tokens": 700}},
    }
    good = _make_cell(tmp_path, "s2-corrected", 2, "corrected", recs, summary)
    one = _make_cell(tmp_path, "s0-naive", 0, "naive", recs[:1], {"wall_s": 70.0})
    failed = _make_cell(tmp_path, "s2-naive", 2, "naive", [], {"wall_s": 5.0})
    marks = [60.0, 100.0]
    rows = write_report(
        [one, failed, good],
        {"s0-naive": ("ok", 0), "s2-naive": ("failed", 1), "s2-corrected": ("ok", 0)},
        marks,
        tmp_path,
    )
    with (tmp_path / "results.csv").open() as f:
        table = list(csv.DictReader(f))
    assert list(table[0]) == columns(marks)
    assert list(table[0]) == [*HEAD_COLUMNS, "reward_at_60s", "reward_at_100s", *TAIL_COLUMNS]
    assert [r["cell"] for r in table] == ["s0-naive", "s2-naive", "s2-corrected"]
    g = table[2]
    window = TIMES[-1] - TIMES[0]
    assert int(g["max_staleness"]) == 2 and g["objective"] == "corrected" and g["status"] == "ok"
    assert int(g["steps"]) == 5
    assert float(g["final_reward"]) == pytest.approx((0.2 + 0.6 + 0.5) / 3, rel=1e-5)
    assert g["reward_at_60s"] == ""
    assert float(g["reward_at_100s"]) == pytest.approx((0.3 + 0.2 + 0.6) / 3, rel=1e-5)
    assert float(g["reward_auc"]) == pytest.approx(_ref_trapz(TIMES, REWARDS), rel=1e-5)
    # Rates over the training window: steps after the first, between first and last step ends.
    assert float(g["samples_per_s"]) == pytest.approx(4 * 2 * GROUP_SIZE / window, rel=1e-5)
    assert float(g["trained_tokens_per_s"]) == pytest.approx(4 * 50 / window, rel=1e-5)
    assert float(g["learner_wait_frac"]) == pytest.approx(0.5 * (1 + 2 + 3 + 4) / window, rel=1e-5)
    assert float(g["gen_tokens_per_s"]) == pytest.approx(1400 / 140.0, rel=1e-5)
    assert float(g["staleness_mean"]) == pytest.approx(sum(i % 2 for i in range(5)) / 5, rel=1e-5)
    assert int(g["staleness_max"]) == 2
    assert float(g["mismatch_kl_mean"]) == pytest.approx(0.01) and float(
        g["rollout_kl_mean"]
    ) == pytest.approx(0.02)
    assert int(g["dropped_groups"]) == 0 + 1 + 2 + 3 + 4
    assert float(g["wall_s"]) == 140.0
    # One step: no window, so no rates; no actor info, so no generated tokens/s.
    assert table[0]["samples_per_s"] == "" and table[0]["gen_tokens_per_s"] == ""
    assert float(table[0]["reward_auc"]) == pytest.approx(0.1)
    f = table[1]
    assert f["status"] == "failed" and f["exit_code"] == "1" and f["steps"] == "0" and f["final_reward"] == ""
    assert rows[2]["cell"] == "s2-corrected"
    md = (tmp_path / "results.md").read_text().splitlines()
    assert len(md) == 2 + 3 and "s2-corrected" in md[-1]
    for png in ("reward_vs_step", "reward_vs_time", "final_reward_vs_staleness", "throughput_vs_staleness"):
        p = tmp_path / f"{png}.png"
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


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
    ov = spec.cell_overrides(cells[2])
    assert ov[:2] == ["run.max_steps=3", "learner.loss.is_mode=none"]
    assert "buffer.max_staleness=2" in ov and "run.name=s2-naive" in ov and "run.progress=false" in ov
    cmd = spec.command(cells[2])
    assert cmd[1:4] == ["-m", "asyncrl.cli", "run"] and "--config" not in cmd
    spec2 = parse_spec(_raw(), ["sweep.grid.max_staleness=[4]", "sweep.dir=/tmp/x"])
    assert spec2.max_staleness == [4] and spec2.dir == Path("/tmp/x")


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
        (_raw(overrides=["run.seed=1", "buffer.max_staleness=3"]), "sweep.overrides[1]"),
        (_raw(objectives={"naive": ["run.dir=/x"], "corrected": []}), "sweep.objectives.naive[0]"),
        (_raw(marks_s=[60, -1]), "sweep.marks_s"),
        (_raw(cell_timeout_s=-5), "sweep.cell_timeout_s"),
        (_raw(name="a b"), "sweep.name"),
        (_raw(base_config="/no/such.yaml"), "sweep.base_config"),
    ],
)
def test_parse_spec_errors_name_the_key(raw, needle):
    with pytest.raises(ConfigError) as e:
        parse_spec(raw)
    assert needle in str(e.value)


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


@pytest.mark.parametrize("name", ["sweep_staleness.yaml", "sweep_tiny.yaml"])
def test_shipped_sweep_configs_validate(name, monkeypatch):
    monkeypatch.chdir(REPO)
    spec = load_spec(REPO / "configs" / name)
    assert spec.objectives["naive"] and spec.objectives["corrected"] == []
    assert any(o.startswith("learner.fill_window=") for o in spec.overrides)
    n = 10 if name == "sweep_staleness.yaml" else 4
    assert len(spec.cells()) == n


def test_finished_means_summary_and_no_failure_marker(tmp_path: Path):
    cell = CellSpec("s0-naive", 0, "naive", tmp_path / "s0-naive")
    cell.dir.mkdir()
    assert not is_finished(cell)
    (cell.dir / "summary.json").write_text("{}")
    assert is_finished(cell)  # a summary without a marker: finished (the sweep died after the cell)
    for status, done in (("running", False), ("failed", False), ("interrupted", False), ("ok", True)):
        (cell.dir / "sweep_cell.json").write_text(json.dumps({"status": status}))
        assert is_finished(cell) is done


# A stand-in for `asyncrl run`: writes a run dir like the orchestrator does (summary.json even when it
# fails, as the real one does) and exits non-zero for the cells named in FAIL_CELLS.
FAKE_RUN = """
import json, os, sys
args = dict(a.split("=", 1) for a in sys.argv[1:])
d = args["run.dir"]
with open(os.path.join(d, "metrics.jsonl"), "w") as f:
    for i in range(1, 5):
        f.write(json.dumps(dict(step=i, version=i, time=10.0 * i, reward_mean=0.1 * i, groups=4, tokens=80,
            staleness_mean=0.0, staleness_max=int(args["buffer.max_staleness"]), dropped_stale=0,
            mismatch_kl=0.0, rollout_kl=0.0, wait_s=1.0)) + "\\n")
with open(os.path.join(d, "summary.json"), "w") as f:
    json.dump({"wall_s": 45.0, "start_reward": 0.2, "end_reward": 0.3}, f)
print("fake run", d)
sys.exit(1 if args["run.name"] in os.environ.get("FAIL_CELLS", "").split(",") else 0)
"""


def test_run_sweep_failure_row_retry_and_skip(tmp_path: Path, monkeypatch, capsys):
    import sys

    from asyncrl.sweep import run_sweep

    monkeypatch.setattr(
        SweepSpec, "command", lambda self, cell: [sys.executable, "-c", FAKE_RUN, *self.cell_overrides(cell)]
    )
    p = tmp_path / "s.yaml"
    p.write_text(yaml.safe_dump(_raw(dir=str(tmp_path / "out"))))
    monkeypatch.setenv("FAIL_CELLS", "s2-naive")
    assert run_sweep(p) == 1  # one failed cell does not stop the others
    with (tmp_path / "out" / "results.csv").open() as f:
        table = {r["cell"]: r for r in csv.DictReader(f)}
    assert (
        len(table) == 4 and table["s2-naive"]["status"] == "failed" and table["s2-naive"]["exit_code"] == "1"
    )
    assert all(table[c]["status"] == "ok" for c in ("s0-naive", "s0-corrected", "s2-corrected"))
    assert float(table["s0-naive"]["final_reward"]) == pytest.approx(0.3)
    assert "FAILED (exit 1)" in capsys.readouterr().out
    mtimes = {c: (tmp_path / "out" / c / "summary.json").stat().st_mtime_ns for c in table}
    monkeypatch.setenv("FAIL_CELLS", "")
    assert run_sweep(p) == 0  # the failed cell is retried from scratch, the others skipped
    out = capsys.readouterr().out
    assert out.count("skipped (done)") == 3
    assert (tmp_path / "out" / "s2-naive.failed" / "run.log").exists()
    for c, m in mtimes.items():
        assert ((tmp_path / "out" / c / "summary.json").stat().st_mtime_ns == m) == (c != "s2-naive")
    with (tmp_path / "out" / "results.csv").open() as f:
        assert all(r["status"] == "ok" for r in csv.DictReader(f))
