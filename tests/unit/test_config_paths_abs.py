"""A run dir's config.yaml holds its paths absolute (asyncrl.launch.redacted), so `asyncrl export` /
`asyncrl eval` of the run dir work from any directory; a resume compares paths absolute; an old run dir's
relative path not found from here is one clear error, never another directory's file taken silently; an
export of published weights records the learner step that published them. Real files, no engines."""

from __future__ import annotations

import dataclasses
import json
import re
import typing
from pathlib import Path

import pytest

from asyncrl.cli import main
from asyncrl.config import Config, ConfigError, load_config, to_yaml
from asyncrl.config.resume import check_resume
from asyncrl.export import export_version, load_run_config
from asyncrl.launch import redacted
from asyncrl.learner.records import CHECKPOINT_DIR, POINTER

PATHS = ["model.path=./m", "task.data_path=data/d.jsonl", "task.eval_data_path=data/e.jsonl",
         "task.name=tasks/t.py:make_task", "console.log_dir=logs", "redis.tls_ca_certs=certs/ca.pem",
         "redis.tls_certfile=certs/c.pem", "redis.tls_keyfile=certs/k.pem", "run.dir=runs/exp"]  # fmt: skip


def _schema_str_fields(cls: type, prefix: str = "") -> list[str]:
    out = []
    for f in dataclasses.fields(cls):
        tp = typing.get_type_hints(cls)[f.name]
        if dataclasses.is_dataclass(tp):
            out += _schema_str_fields(tp, f"{prefix}{f.name}.")
        elif tp is str:
            out.append(f"{prefix}{f.name}")
    return out


def test_every_path_field_of_the_schema_is_a_path_key() -> None:
    from asyncrl.config.paths import PATH_KEYS

    named_like_a_path = {k for k in _schema_str_fields(Config) if re.search(r"(path|dir|file|certs)$", k)}
    assert named_like_a_path == set(PATH_KEYS) - {"task.name"}


def _work(tmp_path: Path) -> Path:
    """The directory a run was started in: its model dir, data and task file, relative to it."""
    work = tmp_path / "work"
    (work / "m").mkdir(parents=True)
    (work / "m" / "config.json").write_text("{}")
    (work / "data").mkdir()
    for name in ("d.jsonl", "e.jsonl"):
        (work / "data" / name).write_text(json.dumps({"prompt": "q"}) + "\n")
    (work / "tasks").mkdir()
    (work / "tasks" / "t.py").write_text("def make_task(cfg, seed):\n    raise NotImplementedError\n")
    return work


def test_the_saved_config_holds_paths_absolute_and_no_secret(tmp_path, monkeypatch) -> None:
    work = _work(tmp_path)
    monkeypatch.chdir(work)
    cfg = load_config(
        None, [*PATHS, "redis.password=s3cret", "redis.url=redis://u:s3cret@h:1"], validate=False
    )
    text = to_yaml(redacted(cfg))
    assert "s3cret" not in text and "redis://u@h:1" in text
    monkeypatch.chdir(tmp_path)  # read from elsewhere: the same files
    (tmp_path / "config.yaml").write_text(text)
    saved = load_config(tmp_path / "config.yaml", validate=False)
    assert saved.model.path == str(work / "m") and saved.task.data_path == str(work / "data" / "d.jsonl")
    assert saved.task.eval_data_path == str(work / "data" / "e.jsonl")
    assert saved.task.name == f"{work / 'tasks' / 't.py'}:make_task" and saved.run.dir == str(
        work / "runs/exp"
    )
    assert saved.console.log_dir == str(work / "logs") and saved.redis.tls_keyfile == str(
        work / "certs/k.pem"
    )
    assert saved.model.tiny_cache_dir == "~/.cache/asyncrl/tiny-models"  # not relative to the cwd: as typed
    plain = load_config(None, ["task.name=copy"], validate=False)
    assert to_yaml(redacted(plain)) == to_yaml(plain)  # nothing to make absolute: the same file


def _run_dir(rdir: Path, text: str) -> Path:
    """An interrupted run's dir: its config.yaml and a committed checkpoint pointer."""
    (rdir / CHECKPOINT_DIR).mkdir(parents=True)
    (rdir / "config.yaml").write_text(text)
    (rdir / CHECKPOINT_DIR / POINTER).write_text(json.dumps({"step": 3, "tag": "step-3"}))
    return rdir


def test_resume_compares_paths_absolute(tmp_path, monkeypatch) -> None:
    work = _work(tmp_path)
    monkeypatch.chdir(work)
    rel = ["model.path=./m", "task.name=tasks/t.py:make_task"]
    absolute = [f"model.path={work / 'm'}", f"task.name={work / 'tasks' / 't.py'}:make_task"]
    # An old run dir (paths saved as typed) resumed from its start dir with the same paths made absolute.
    old = _run_dir(tmp_path / "old", to_yaml(load_config(None, rel, validate=False)))
    assert "path: ./m" in (old / "config.yaml").read_text()
    assert check_resume(load_config(None, absolute, validate=False), old, data=False) == []
    assert check_resume(load_config(None, rel, validate=False), old, data=False) == []
    # A new run dir (absolute), resumed with ./m or m/ from the same dir: the same model.
    new = _run_dir(tmp_path / "new", to_yaml(redacted(load_config(None, rel, validate=False))))
    for again in (rel, ["model.path=m/", "task.name=./tasks/t.py:make_task"]):
        assert check_resume(load_config(None, again, validate=False), new, data=False) == []
    # Another model is still refused, naming both (absolute) paths.
    (work / "m2").mkdir()
    with pytest.raises(ConfigError, match=rf"model.path '{work / 'm'}' -> '{work / 'm2'}' \(cannot change\)"):
        check_resume(load_config(None, ["model.path=m2", rel[1]], validate=False), new, data=False)


def test_an_old_run_dirs_relative_path_not_found_from_here_names_key_path_and_what_to_pass(
    tmp_path, monkeypatch, capsys
) -> None:
    work = _work(tmp_path)
    rdir = work / "runs" / "exp"
    rdir.mkdir(parents=True)
    (rdir / "config.yaml").write_text(to_yaml(load_config(None, ["model.path=m"], validate=False)))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    with pytest.raises(ConfigError) as e:
        export_version(rdir, tmp_path / "out")
    msg = str(e.value)
    assert "\n" not in msg and "model.path='m'" in msg and f"tried {elsewhere / 'm'}" in msg
    # found from the dir the run was started in (runs/..): said, not used
    assert f"'model.path: {work / 'm'}' if that is the run's" in msg and not (tmp_path / "out").exists()
    assert f"write the absolute path into {rdir / 'config.yaml'}" in msg
    # the key given on the command line (asyncrl eval's overrides) is the caller's
    assert load_run_config(rdir, [f"model.path={work / 'm'}"]).model.path == str(work / "m")
    # the absolute path written into config.yaml, as the message says: exported from here
    (rdir / "config.yaml").write_text(f"model:\n  path: {work / 'm'}\n")
    assert load_run_config(rdir, need=("model.path",)).model.path == str(work / "m")
    # `asyncrl eval`: the task's data too (tiny model: model.path empty)
    cfg = load_config(None, ["task.name=tasks/t.py:make_task", "task.data_path=data/d.jsonl"], validate=False)
    (rdir / "config.yaml").write_text(to_yaml(cfg))
    assert main(["eval", str(rdir)]) == 2
    err = capsys.readouterr().err
    assert "task.name='tasks/t.py:make_task'" in err and f"tried {elsewhere / 'tasks' / 't.py'}" in err
    assert f"'task.name: {work / 'tasks' / 't.py'}:make_task' if that is the run's" in err
    # from the dir the run was started in: read, absolute
    monkeypatch.chdir(work)
    got = load_run_config(rdir)
    assert got.task.data_path == str(work / "data" / "d.jsonl") and got.task.name.startswith(str(work))


def _records(rdir: Path, rows: list[tuple[int, int, bool]]) -> None:
    lines = [json.dumps({"step": s, "version": v, "published": p}) for s, v, p in rows]
    (rdir / "metrics.jsonl").write_text("\n".join(lines) + "\n")


def _checkpoint(rdir: Path, step: int, version: int, since: int) -> None:
    tag = rdir / CHECKPOINT_DIR / f"step{step:08d}"
    tag.mkdir(parents=True)
    (tag / "mp_rank_00_model_states.pt").write_bytes(b"")
    (tag / "learner_state.json").write_text(
        json.dumps({"step": step, "version": version, "since_publish": since})
    )


def test_published_step_from_the_records_and_the_checkpoints(tmp_path) -> None:
    from asyncrl.export import published_step

    rdir = tmp_path / "run"
    rdir.mkdir()
    (rdir / "config.yaml").write_text(to_yaml(Config()))
    # publish_every 2: v1 at step 2, v2 at 4; crash, resumed from step 4's checkpoint after v3 (step 6) was
    # published: forked to v4 at step 4; v5 at step 6; checkpoint at 7 (v5 + 1 step).
    _records(rdir, [(1, 0, False), (2, 1, True), (3, 1, False), (4, 2, True), (5, 4, False), (6, 5, True),
                    (7, 5, False)])  # fmt: skip
    assert [published_step(rdir, v) for v in range(6)] == [0, 2, 4, None, 4, 6]
    (rdir / "metrics.jsonl").unlink()
    _checkpoint(rdir, 7, 5, 1)
    assert [published_step(rdir, v) for v in (0, 4, 5)] == [0, None, 6]


def test_an_export_of_published_weights_records_their_step(tmp_path) -> None:
    import torch
    from safetensors.torch import save_file

    from asyncrl.buffer.weights import MANIFEST_FILENAME, build_manifest

    base = _work(tmp_path) / "m"
    rdir = tmp_path / "run"
    v2 = rdir / "weights" / "v2"
    v2.mkdir(parents=True)
    (rdir / "config.yaml").write_text(to_yaml(load_config(None, [f"model.path={base}"], validate=False)))
    save_file({"w": torch.ones(2)}, str(v2 / "model.safetensors"), metadata={"format": "pt"})
    (v2 / MANIFEST_FILENAME).write_bytes(build_manifest(2, v2 / "model.safetensors", "float32").to_bytes())
    _records(rdir, [(1, 1, True), (2, 1, False), (3, 2, True), (4, 2, False)])
    info = json.loads((export_version(rdir, tmp_path / "out", 2) / "asyncrl_export.json").read_text())
    assert (info["version"], info["step"], info["source"]) == (2, 3, "published")
    # No record of the step left (metrics.jsonl gone, no checkpoint of v2): null, not a made-up -1.
    (rdir / "metrics.jsonl").unlink()
    info = json.loads((export_version(rdir, tmp_path / "out2", 2) / "asyncrl_export.json").read_text())
    assert (info["version"], info["step"]) == (2, None)
