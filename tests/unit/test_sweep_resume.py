"""A resumed sweep refuses finished runs whose resolved run config changed under the same overrides: another
``sweep.base_config`` file, or the same file edited (both silently reused finished runs before)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import yaml

from asyncrl.config import ConfigError, load_config
from asyncrl.sweep import read_marker, run_sweep
from asyncrl.sweep_spec import SweepSpec, config_hash, flat_config, load_spec

REPO = Path(__file__).resolve().parents[2]

FAKE_RUN = """
import json, os, sys
d = dict(a.split("=", 1) for a in sys.argv[1:])["run.dir"]
with open(os.path.join(d, "metrics.jsonl"), "w") as f:
    for i in (1, 2):
        f.write(json.dumps(dict(step=i, version=i, time=5.0 * i, reward_mean=0.5, groups=4, tokens=80,
            staleness_mean=0, staleness_max=0, dropped_stale=0, mismatch_kl=0, rollout_kl=0, wait_s=0)) + "\\n")
json.dump({"wall_s": 10, "steps": 2, "finished": True, "status": "finished"}, open(os.path.join(d, "summary.json"), "w"))
"""


def _sweep(tmp_path: Path, base: Path) -> Path:
    p = tmp_path / "s.yaml"
    p.write_text(yaml.safe_dump({"sweep": {
        "name": "bc", "dir": str(tmp_path / "out"), "base_config": str(base), "seeds": [0],
        "grid": {"max_staleness": [0], "objective": ["full"]}, "objectives": {"full": []},
        "overrides": ["run.max_steps=2"]}}))  # fmt: skip
    return p


def _base(path: Path, **learner) -> Path:
    cfg = yaml.safe_load((REPO / "configs" / "default.yaml").read_text())
    cfg.setdefault("learner", {}).update(learner)
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_a_changed_base_config_refuses_the_finished_runs(tmp_path: Path, monkeypatch, capsys, caplog):
    monkeypatch.setattr(
        SweepSpec, "command", lambda self, run: [sys.executable, "-c", FAKE_RUN, *self.run_overrides(run)]
    )
    a = _base(tmp_path / "base_a.yaml")
    assert run_sweep(_sweep(tmp_path, a)) == 0
    spec = load_spec(_sweep(tmp_path, a))
    run = spec.runs()[0]
    marker = read_marker(run)
    want = flat_config(load_config(a, spec.run_overrides(run)))
    assert marker["config"] == json.loads(json.dumps(want)) and marker["config_hash"] == config_hash(want)
    assert "run.dir" not in marker["config"] and marker["config"]["learner.lr"] == 0.005
    mtime = (run.dir / "summary.json").stat().st_mtime_ns
    # Another base config with another learner.lr, then the same file edited so: both refused.
    b = _base(tmp_path / "base_b.yaml", lr=0.5)
    for base in (b, _base(a, lr=0.5)):
        with pytest.raises(ConfigError) as e:
            run_sweep(_sweep(tmp_path, base))
        assert str(e.value) == (
            f"sweep run {run.dir} finished with another run config than this sweep gives it now, under the same "
            f"overrides (learner.lr: 0.005 -> 0.5): the base config {base} is another file or was edited; the run "
            "would be skipped and reported under the new settings. Run the changed sweep in a new dir (e.g. "
            f"sweep.dir={tmp_path / 'out'}-v2, or a new sweep.name where the file sets no sweep.dir), or put the "
            "base config back as it was"
        )
    assert (run.dir / "summary.json").stat().st_mtime_ns == mtime  # nothing re-run
    # Put back, or another file with the same content: the finished run is reused.
    capsys.readouterr()
    for base in (_base(a), _base(b)):
        assert run_sweep(_sweep(tmp_path, base)) == 0 and "skipped (done)" in capsys.readouterr().out
    # A key only the recorded config has (an asyncrl with another schema): no change; a marker from before
    # the config was recorded: reused, with one warning.
    m = read_marker(run)
    (run.dir / "sweep_cell.json").write_text(json.dumps({**m, "config": {**m["config"], "learner.gone": 1},
                                                          "config_hash": "old"}))  # fmt: skip
    assert run_sweep(_sweep(tmp_path, a)) == 0 and "skipped (done)" in capsys.readouterr().out
    (run.dir / "sweep_cell.json").write_text(json.dumps({k: v for k, v in m.items() if k != "config"}))
    with caplog.at_level("WARNING", logger="asyncrl.sweep"):
        assert run_sweep(_sweep(tmp_path, b)) == 0
    assert [r.getMessage() for r in caplog.records if "no recorded run config" in r.getMessage()] == [
        "sweep bc: 1 finished runs have no recorded run config (made by an older asyncrl); reused without "
        "checking them against the base config"
    ]


def test_a_marker_with_relative_paths_is_no_change(tmp_path: Path, monkeypatch, capsys):
    """Markers written before config paths were recorded absolute (asyncrl.config.paths.absolute_paths)
    hold them as typed: the same dir named relatively is no change (it refused the finished runs), another
    one still is."""
    monkeypatch.setattr(
        SweepSpec, "command", lambda self, run: [sys.executable, "-c", FAKE_RUN, *self.run_overrides(run)]
    )
    monkeypatch.chdir(tmp_path)
    base = _base(tmp_path / "base.yaml")
    cfg = yaml.safe_load(base.read_text())
    cfg.setdefault("console", {})["log_dir"] = "logs"  # relative, as a user writes it
    base.write_text(yaml.safe_dump(cfg))
    assert run_sweep(_sweep(tmp_path, base)) == 0
    run = load_spec(_sweep(tmp_path, base)).runs()[0]
    m = read_marker(run)
    assert m["config"]["console.log_dir"] == str(tmp_path / "logs")
    # What an older asyncrl recorded: the path as typed.
    old = {**m, "config": {**m["config"], "console.log_dir": "logs"}, "config_hash": "old"}
    (run.dir / "sweep_cell.json").write_text(json.dumps(old))
    capsys.readouterr()
    assert run_sweep(_sweep(tmp_path, base)) == 0 and "skipped (done)" in capsys.readouterr().out
    other = {**m, "config": {**m["config"], "console.log_dir": "elsewhere"}, "config_hash": "old"}
    (run.dir / "sweep_cell.json").write_text(json.dumps(other))
    with pytest.raises(ConfigError, match="console.log_dir"):
        run_sweep(_sweep(tmp_path, base))


def test_changed_config_names_each_changed_key():
    from asyncrl.sweep_spec import changed_config

    old = {"a.x": 1, "a.y": [1, 2], "b": "s", "c": 0.001}
    assert changed_config(old, {"a.x": 1, "a.y": (1, 2), "b": "s", "c": 1e-3}) is None  # tuple/float as JSON
    assert changed_config(old, {**old, "a.x": 2, "b": None}) == 'a.x: 1 -> 2, b: "s" -> null'
    many = {f"k{i}": i for i in range(9)}
    assert (
        changed_config(many, {k: v + 1 for k, v in many.items()}, most=2)
        == "k0: 0 -> 1, k1: 1 -> 2 and 7 more"
    )
