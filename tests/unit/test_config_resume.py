"""Resuming a run dir with a changed config (asyncrl.config.resume): keys that define the run are refused
before the run dir changes, the others are accepted and logged. Real files, no mocks."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from asyncrl.config import Config, ConfigError, load_config, to_yaml
from asyncrl.config.resume import FREE, RULES, _defaults, check_resume, kind_of
from asyncrl.launch import redacted
from asyncrl.learner.records import CHECKPOINT_DIR, POINTER


def _run_dir(tmp_path: Path, cfg: Config) -> Path:
    """A run dir as an interrupted `asyncrl run` leaves it: config.yaml (redacted) and a committed pointer."""
    rdir = tmp_path / "run"
    (rdir / CHECKPOINT_DIR).mkdir(parents=True)
    (rdir / "config.yaml").write_text(to_yaml(redacted(cfg)))
    (rdir / CHECKPOINT_DIR / POINTER).write_text(json.dumps({"step": 3, "tag": "step-3"}))
    return rdir


def _cfg(*overrides: str) -> Config:
    """configs/default.yaml with the values the tests name as "old" pinned, then ``overrides``."""
    pinned = ["run.max_steps=100", "learner.lr=0.005", "buffer.max_staleness=1", "task.max_len=5",
              "actors.group_size=8", "model.tiny.hidden_size=128", "run.seed=0"]  # fmt: skip
    return load_config(None, [*pinned, *overrides])


def test_identical_config_is_no_change(tmp_path) -> None:
    rdir = _run_dir(tmp_path, _cfg())
    assert check_resume(_cfg(), rdir) == []


def test_identity_key_changed_is_refused_naming_key_old_and_new(tmp_path) -> None:
    rdir = _run_dir(tmp_path, _cfg())
    with pytest.raises(ConfigError) as e:
        check_resume(_cfg("actors.group_size=4", "buffer.max_staleness=3"), rdir)
    msg = str(e.value)
    assert "\n" not in msg
    assert "actors.group_size 8 -> 4" in msg and "run.name=" in msg and "--allow-config-change" in msg
    assert "max_staleness" not in msg  # an allowed key is not among the refused ones


def test_allowed_keys_are_accepted_and_logged_one_line_each(tmp_path) -> None:
    rdir = _run_dir(tmp_path, _cfg())
    lines = check_resume(_cfg("buffer.max_staleness=3", "run.max_steps=400", "learner.lr=2e-5"), rdir)
    assert sorted(lines) == sorted(
        [
            "config change on resume: buffer.max_staleness: 1 -> 3",
            "config change on resume: run.max_steps: 100 -> 400",
            "config change on resume: learner.lr: 0.005 -> 2e-05",
        ]
    ), lines


def test_redacted_password_is_not_a_change(tmp_path) -> None:
    secret = ("redis.password=hunter2", "redis.url=redis://bob:hunter2@10.0.0.1:6379/0")
    rdir = _run_dir(tmp_path, _cfg(*secret))  # saved redacted: no password, URL without it
    assert "hunter2" not in (rdir / "config.yaml").read_text()
    assert check_resume(_cfg(*secret), rdir) == []
    # Another password alone is not compared either; the log line of a changed URL shows none.
    lines = check_resume(_cfg("redis.password=other", "redis.url=redis://bob:other@10.0.0.2:6379/0"), rdir)
    assert lines == [
        "config change on resume: redis.url: 'redis://bob@10.0.0.1:6379/0' -> 'redis://bob@10.0.0.2:6379/0'"
    ]


def test_nested_model_tiny_change_is_refused_even_when_allowed(tmp_path) -> None:
    rdir = _run_dir(tmp_path, _cfg())
    with pytest.raises(ConfigError, match=r"model\.tiny\.hidden_size 128 -> 64 \(cannot change\)") as e:
        check_resume(_cfg("model.tiny.hidden_size=64"), rdir, allow=["model"])
    assert "--allow-config-change" not in str(e.value)  # no way around it to suggest
    with pytest.raises(ConfigError, match=r"run\.seed 0 -> 1"):
        check_resume(_cfg("run.seed=1"), rdir, allow=["run.seed"])


def test_allow_config_change_accepts_an_identity_key_and_says_so(tmp_path) -> None:
    rdir = _run_dir(tmp_path, _cfg())
    lines = check_resume(_cfg("task.max_len=7", "learner.loss.entropy_coef=0.01"), rdir,
                         allow=["task.max_len", "learner.loss"])  # fmt: skip
    assert sorted(lines) == [
        "config change on resume: learner.loss.entropy_coef: 0.0 -> 0.01 (allowed by --allow-config-change)",
        "config change on resume: task.max_len: 5 -> 7 (allowed by --allow-config-change)",
    ]
    with pytest.raises(ConfigError, match="not a config key"):
        check_resume(_cfg(), rdir, allow=["learner.los"])


def test_no_state_of_an_earlier_start_is_not_a_resume(tmp_path) -> None:
    rdir = tmp_path / "run"
    rdir.mkdir()
    (rdir / "config.yaml").write_text(to_yaml(_cfg()))  # written, but the run never got anywhere
    assert check_resume(_cfg("actors.group_size=4"), rdir) == []
    (rdir / "metrics.jsonl").write_text('{"step": 1}\n')
    with pytest.raises(ConfigError, match="actors.group_size"):
        check_resume(_cfg("actors.group_size=4"), rdir)


def test_every_schema_key_has_a_rule_and_the_identity_list_holds() -> None:
    """A key the schema gains must be classified in RULES (unclassified ones are refused on resume)."""
    for key in _defaults():
        assert any(key == p or key.startswith(p + ".") for p in RULES), f"{key}: no rule in RULES"
    for key in ("model.path", "model.tiny.num_layers", "model.dtype", "run.seed", "task.name",
                "actors.group_size", "buffer.groups_per_step", "learner.zero_stage", "learner.loss.policy_loss"):  # fmt: skip
        assert kind_of(key) != FREE, key
    for key in ("run.max_steps", "run.max_wall_s", "learner.lr", "buffer.max_staleness", "actors.num_actors",
                "metrics.port", "eval.every", "console.mode", "task.eval_size"):  # fmt: skip
        assert kind_of(key) == FREE, key


@pytest.mark.parametrize("cmd", ["run", "learn"])
def test_cli_refuses_a_changed_group_size_before_touching_the_run_dir(tmp_path, cmd) -> None:
    base = [f"run.dir={tmp_path / 'run'}", "run.cpu_binding=off", "console.mode=off"]
    rdir = _run_dir(tmp_path, _cfg(*base))
    (rdir / "model").mkdir()
    (rdir / "model" / "spec.json").write_text("{}")  # stands for the built tiny model
    files = [rdir / "config.yaml", rdir / "model" / "spec.json", rdir / CHECKPOINT_DIR / POINTER]
    before = {f: (f.read_bytes(), f.stat().st_mtime_ns) for f in files}
    # run.max_wall_s: were the change let through, the run would stop on its own.
    r = subprocess.run(
        [sys.executable, "-m", "asyncrl.cli", cmd, *base, "actors.group_size=4", "run.max_wall_s=5"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert r.returncode == 2, r.stderr[-3000:]
    assert "actors.group_size 8 -> 4" in r.stderr and r.stderr.startswith("asyncrl: error:"), r.stderr[-3000:]
    assert {f: (f.read_bytes(), f.stat().st_mtime_ns) for f in files} == before
    assert sorted(p.name for p in (rdir / "model").iterdir()) == ["spec.json"]
    assert sorted(p.name for p in rdir.iterdir()) == [CHECKPOINT_DIR, "config.yaml", "model"]


def test_a_data_file_changed_between_stop_and_resume_is_refused(tmp_path) -> None:
    """The eval hold-out (task.eval_fraction) and the prompt order depend on the data file's rows, not
    its name: rows appended between a stop and its resume put trained prompts into the eval set, and
    only the name was compared. The first start records a digest; a resume refuses another one."""
    from asyncrl.config.data_identity import DATA_IDENTITY

    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"q{i}", "answer": str(i)}) + "\n" for i in range(40)))
    over = (f"task.data_path={data}", "task.name=gsm8k")
    rdir = tmp_path / "run"
    assert check_resume(_cfg(*over), rdir) == []  # the first start: nothing to resume, the digest recorded
    recorded = json.loads((rdir / DATA_IDENTITY).read_text())
    assert set(recorded) == {"task.data_path"}
    rdir = _run_dir(tmp_path, _cfg(*over))  # stopped with state; task_data.json kept
    assert check_resume(_cfg(*over), rdir) == []  # the same rows: resumes
    with data.open("a") as f:
        f.write(json.dumps({"prompt": "q40", "answer": "40"}) + "\n")
    with pytest.raises(ConfigError) as e:
        check_resume(_cfg(*over), rdir)
    msg = str(e.value)
    assert "\n" not in msg and "task.data_path's contents" in msg and "--allow-config-change" in msg
    assert json.loads((rdir / DATA_IDENTITY).read_text()) == recorded  # a refusal writes nothing
    # The learner's role never reads the data (its machine may have none): no check, nothing written.
    assert check_resume(_cfg(*over), rdir, data=False) == []
    # On purpose: accepted, logged, and the new digest is the one the next resume compares with.
    lines = check_resume(_cfg(*over), rdir, allow=("task.data_path",))
    assert lines == [
        "config change on resume: task.data_path: its contents changed (allowed by --allow-config-change)"
    ]
    assert check_resume(_cfg(*over), rdir) == []
    # A run from before the digests (no task_data.json) resumes, and records the digest from now on.
    (rdir / DATA_IDENTITY).unlink()
    assert check_resume(_cfg(*over), rdir) == [] and (rdir / DATA_IDENTITY).is_file()
    data.write_text("changed\n")
    with pytest.raises(ConfigError, match="task.data_path's contents"):
        check_resume(_cfg(*over), rdir)


def test_the_tiny_task_records_no_data_digest(tmp_path) -> None:
    rdir = tmp_path / "run"
    assert check_resume(_cfg(), rdir) == [] and not rdir.exists()  # nothing written for the demo's task


def test_a_saved_dataset_directory_is_digested_by_its_data_not_its_caches(tmp_path) -> None:
    from asyncrl.config.data_identity import data_identity

    d = tmp_path / "ds"
    d.mkdir()
    (d / "data-00000-of-00001.arrow").write_bytes(b"rows")
    (d / "state.json").write_text("{}")
    cfg = _cfg(f"task.data_path={d}", "task.name=gsm8k")
    first = data_identity(cfg)
    (d / "cache-0123abcd.arrow").write_bytes(b"a map's cache")  # written by datasets, not data
    (d / "dataset.lock").write_text("")
    assert data_identity(cfg) == first
    (d / "data-00000-of-00001.arrow").write_bytes(b"other rows")
    assert data_identity(cfg) != first
    assert data_identity(_cfg(f"task.data_path={tmp_path / 'missing'}", "task.name=gsm8k")) == {}


def test_a_separate_eval_file_may_change_on_resume(tmp_path) -> None:
    """task.eval_data_path is FREE (eval only): a new or edited eval file moves no training row and no
    prompt position, so its contents are not part of the run's identity (the review's false refusal)."""
    data, ev = tmp_path / "data.jsonl", tmp_path / "eval.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"q{i}", "answer": str(i)}) + "\n" for i in range(10)))
    ev.write_text(json.dumps({"prompt": "e0", "answer": "0"}) + "\n")
    over = (f"task.data_path={data}", "task.name=gsm8k")
    rdir = tmp_path / "run"
    check_resume(_cfg(*over, f"task.eval_data_path={ev}"), rdir)
    rdir = _run_dir(tmp_path, _cfg(*over, f"task.eval_data_path={ev}"))
    ev.write_text(json.dumps({"prompt": "e1", "answer": "1"}) + "\n")
    assert check_resume(_cfg(*over, f"task.eval_data_path={ev}"), rdir) == []
