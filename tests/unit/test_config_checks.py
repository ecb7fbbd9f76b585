"""Config surface: overrides keep their text, cross-field and file checks at start, CLI error paths."""

import json
import tomllib
from pathlib import Path

import pytest

from asyncrl import cli
from asyncrl.config import ConfigError, from_yaml, load_config, to_yaml
from asyncrl.tasks import TaskDataError

REPO = Path(__file__).resolve().parents[2]


# ------------------------------------------------------------------ overrides keep a str field's text


@pytest.mark.parametrize(
    "override, key, want",
    [
        ("task.alphabet=0123", "alphabet", "0123"),  # YAML: octal 83
        ("task.alphabet=01", "alphabet", "01"),  # YAML: 1
        ("task.system_prompt=yes", "system_prompt", "yes"),  # YAML: True
        ("task.system_prompt='quoted'", "system_prompt", "quoted"),  # a quoted value is still unquoted
    ],
)
def test_str_overrides_keep_their_text(override, key, want):
    assert getattr(load_config(overrides=[override]).task, key) == want


def test_run_name_overrides_keep_their_text():
    assert load_config(overrides=["run.name=1e3"]).run.name == "1e3"  # YAML: 1000.0
    cfg = load_config(overrides=["run.name=on"])  # YAML: True
    assert cfg.run.name == "on"
    assert from_yaml(to_yaml(cfg)) == cfg


def test_str_fields_of_a_yaml_file_keep_their_text(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text(
        "run:\n  name: 007\n  dir: 2024\ntask:\n  alphabet: 0123\n  system_prompt: yes\n"
        "buffer:\n  max_staleness: 0x2\n"
    )  # YAML: 7, 2024, 83, True; an int field keeps YAML's reading
    cfg = load_config(f)
    assert (cfg.run.name, cfg.run.dir, cfg.task.alphabet) == ("007", "2024", "0123")
    f.write_text("run:\n  name: 1e3\n")  # a float to OmegaConf's loader (not to PyYAML's SafeLoader)
    assert load_config(f).run.name == "1e3"
    f.write_text(
        "run:\n  name: 007\n  dir: 2024\ntask:\n  alphabet: 0123\n  system_prompt: yes\n"
        "buffer:\n  max_staleness: 0x2\n"
    )
    assert (cfg.task.system_prompt, cfg.buffer.max_staleness) == ("yes", 2)
    f.write_text("run:\n  name: '007'\n")  # quoted: YAML's str, as written
    assert load_config(f).run.name == "007"
    assert from_yaml(to_yaml(cfg)) == cfg
    # Overrides on top of the file still win, with their own text.
    assert load_config(f, overrides=["run.name=08"]).run.name == "08"


def test_appendfsync_no_from_the_command_line_and_from_a_file(tmp_path):
    cfg = load_config(overrides=["redis.appendfsync=no"])
    assert cfg.redis.appendfsync == "no"
    assert from_yaml(to_yaml(cfg)).redis.appendfsync == "no"
    f = tmp_path / "c.yaml"
    f.write_text("redis:\n  appendfsync: no\nmodel:\n  chat_template: off\n")  # YAML 1.1 booleans
    cfg = load_config(f)
    assert cfg.redis.appendfsync == "no" and cfg.model.chat_template == "off"


@pytest.mark.parametrize(
    "override, key", [("learner=foo", "learner"), ("run=3", "run"), ("model.tiny=3", "model.tiny")]
)
def test_a_section_given_a_value_names_the_key(override, key):
    with pytest.raises(ConfigError) as e:
        load_config(overrides=[override])
    msg = str(e.value)
    assert "None" not in msg and msg.startswith(f"{key}=") and "section" in msg


def test_a_bad_value_in_a_file_names_the_file(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("run: 3\n")
    with pytest.raises(ConfigError) as e:
        load_config(f)
    assert str(e.value).startswith(f"{f}: ") and "None" not in str(e.value)


def test_non_str_overrides_are_still_typed():
    # task.params is a plug-in's: with a built-in task it would be refused (check_task_config).
    cfg = load_config(
        overrides=[
            "learner.lr=1e-5",
            "task.name=tests.e2e.custom_task.echo_task:make_task",
            "task.params.k=3",
            "tracking.wandb=on",
        ]
    )
    assert (
        cfg.learner.lr == pytest.approx(1e-5) and cfg.task.params == {"k": 3} and cfg.tracking.wandb is True
    )


# ------------------------------------------------------------------ cross-field checks at load


@pytest.mark.parametrize(
    "overrides, needle",
    [
        (["task.min_len=6", "task.max_len=2"], "task.min_len=6 must be <= task.max_len=2"),
        (["task.alphabet=ab="], "task.alphabet='ab=': characters ['=']"),
        (["task.alphabet="], "task.alphabet must not be empty"),
        (["model.chat_template=on"], "allowed values here are 'auto', 'off'"),
        (
            ["model.max_model_len=512"],
            "model.max_model_len=512 must be <= model.tiny.max_position_embeddings=256",
        ),
        (["redis.url=http://foo:6379/0"], "redis.url='http://foo:6379/0': allowed schemes are redis://"),
        (["redis.url=unix:///tmp/redis.sock"], "unix sockets are not supported"),
        (["redis.url=rediss://h:6380/0", "redis.tls_certfile=c.pem"], "redis.tls_keyfile"),
        # Accepted before, and failed only as a role built its Redis client (or first read the buffer)
        # with names that are not config keys; the adaptive start was clamped silently.
        (
            ["redis.url=redis://h:6379/0", "redis.tls_ca_certs=ca.pem"],
            "redis.tls_ca_certs need TLS: set redis.tls=true or a rediss:// redis.url",
        ),
        (
            ["redis.tls_certfile=c.pem", "redis.tls_keyfile=k.pem"],
            "redis.tls_certfile, redis.tls_keyfile need TLS",
        ),
        (["learner.consumer="], "learner.consumer='' is not allowed"),
        (["learner.consumer= "], "is not allowed: a non-empty consumer name"),
        (
            ["buffer.adaptive.enabled=true", "buffer.max_staleness=1", "buffer.adaptive.start=5"],
            "buffer.adaptive.start=5 must be in [buffer.adaptive.min_bound=0, buffer.max_staleness=1]",
        ),
        (
            [
                "buffer.adaptive.enabled=true",
                "buffer.max_staleness=4",
                "buffer.adaptive.min_bound=2",
                "buffer.adaptive.start=1",
            ],
            "buffer.adaptive.start=1 must be in [buffer.adaptive.min_bound=2",
        ),  # fmt: skip
        (["actors.temperature=1e-6"], "actors.temperature=1e-06 is out of range; must be >= 1e-05"),
    ],
)
def test_cross_field_mistakes_fail_at_load(overrides, needle):
    with pytest.raises(ConfigError) as e:
        load_config(overrides=overrides)
    assert needle in str(e.value)


def test_cross_field_checks_allow_what_is_valid():
    load_config(overrides=["redis.url=rediss://h:6380/0", "redis.tls_ca_certs=ca.pem"])
    load_config(overrides=["redis.tls=true", "redis.tls_certfile=c.pem", "redis.tls_keyfile=k.pem"])
    for start in (-1, 2, 4):
        load_config(overrides=["buffer.adaptive.enabled=true", "buffer.max_staleness=4",
                               "buffer.adaptive.min_bound=2", f"buffer.adaptive.start={start}"])  # fmt: skip
    load_config(overrides=["buffer.max_staleness=1", "buffer.adaptive.start=5"])  # not enabled: unused
    load_config(overrides=["model.max_model_len=512", "model.tiny.max_position_embeddings=512"])
    load_config(overrides=["redis.url=redis+cluster://h:7000/0", "task.min_len=3", "task.max_len=3"])
    # A plug-in may give the alphabet another meaning: the tiny tasks' rule is not applied to it.
    load_config(overrides=["task.name=tests.e2e.custom_task.echo_task:make_task", "task.alphabet=1+2"])


def test_the_reviewers_command_now_fails(capsys):
    argv = ["config", "task.min_len=6", "task.max_len=2", "model.chat_template=on", "model.max_model_len=512"]
    assert cli.main(argv) == 2
    assert "task.min_len" in capsys.readouterr().err


# ------------------------------------------------------------------ model and data files before a role starts


def _model_dir(tmp_path, max_pos=1024, template=False, **extra):
    """A model dir as far as the start-up checks read it: config.json and a tokenizer that loads (the
    tiny model's; the checks load it as every actor does), with a chat template when ``template``."""
    from asyncrl.tinymodel import build_tokenizer

    d = tmp_path / "model"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps({"max_position_embeddings": max_pos, **extra}))
    tok = build_tokenizer()
    tok.chat_template = "{{ messages[0]['content'] }}" if template else None
    tok.save_pretrained(d)
    return d


def test_model_dir_checks(tmp_path):
    d = _model_dir(tmp_path)
    cli._check_model_path(load_config(overrides=[f"model.path={d}", "model.max_model_len=1024"]))
    with pytest.raises(ConfigError, match="model.max_model_len=2048 must be <= 1024"):
        cli._check_model_path(load_config(overrides=[f"model.path={d}", "model.max_model_len=2048"]))
    with pytest.raises(ConfigError, match="model.chat_template='on' but the tokenizer"):
        cli._check_model_path(load_config(overrides=[f"model.path={d}", "model.chat_template=on"]))
    d = _model_dir(
        tmp_path,
        template=True,
        rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024},
    )
    cli._check_model_path(load_config(overrides=[f"model.path={d}", "model.chat_template=on",
                                                 "model.max_model_len=4096"]))  # fmt: skip


def test_missing_data_paths_fail_before_the_roles_that_read_them(tmp_path):
    missing = tmp_path / "nope.jsonl"
    for key in ("data_path", "eval_data_path"):
        cfg = load_config(
            overrides=["task.name=gsm8k", f"task.{key}={missing}"]
        )  # loads: status needs no data
        with pytest.raises(ConfigError, match=f"task.{key}="):
            cli._check_model_path(cfg)
        cli._check_model_path(cfg, data=False)  # the learner never reads the task's data


# ------------------------------------------------------------------ CLI


def test_eval_errors_are_one_line_not_tracebacks(tmp_path, capsys, monkeypatch):
    d = _model_dir(tmp_path)
    assert cli.main(["eval", str(d), "task.name=gsm8k", f"task.data_path={tmp_path / 'x.jsonl'}"]) == 2
    assert "asyncrl: error: task.data_path=" in capsys.readouterr().err

    from asyncrl.tasks.base import TaskDataError
    from asyncrl.tasks.registry import TaskNotFound

    for exc in (TaskDataError("bad rows"), TaskNotFound("no such task")):

        def boom(*a, exc=exc, **k):
            raise exc

        monkeypatch.setattr("asyncrl.evaluate.eval_model_dir", boom)
        assert cli.main(["eval", str(d)]) == 2
        assert f"asyncrl: error: {exc}" in capsys.readouterr().err


def test_eval_checks_the_model_dir_it_scores_not_the_tiny_model(tmp_path, monkeypatch):
    d = _model_dir(tmp_path, max_pos=1024, template=True)
    seen = {}

    class Result:
        def to_dict(self):
            return {}

    def fake_eval(cfg, model_dir, version):
        seen["cfg"] = cfg
        return Result()

    monkeypatch.setattr("asyncrl.evaluate.eval_model_dir", fake_eval)
    # Both would be refused for the tiny model of configs/default.yaml; the scored dir allows them.
    assert cli.main(["eval", str(d), "model.chat_template=on", "model.max_model_len=1024"]) == 0
    assert seen["cfg"].model.path == str(d)
    assert cli.main(["eval", str(d), "model.max_model_len=2048"]) == 2


def test_eval_rejects_config_for_a_run_dir(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(to_yaml(load_config()))
    assert cli.main(["eval", str(run), "-c", str(REPO / "configs" / "default.yaml")]) == 2
    assert "--config applies to a model dir" in capsys.readouterr().err


def test_config_explain_shows_the_loaded_values(capsys):
    assert cli.main(["config", "--explain", "buffer.max_staleness=3"]) == 0
    out = capsys.readouterr().out
    assert any(line.strip().startswith("buffer.max_staleness = 3") for line in out.splitlines())


def test_sweep_help_and_required_config(capsys):
    with pytest.raises(SystemExit):
        cli.main(["sweep", "--help"])
    out = capsys.readouterr().out
    assert "default: configs/default.yaml" not in out and "sweep YAML" in out
    with pytest.raises(SystemExit) as e:
        cli.main(["sweep"])
    assert e.value.code == 2 and "--config" in capsys.readouterr().err


# ------------------------------------------------------------------ packaging


def test_missing_default_yaml_is_an_error_not_the_schema_defaults(tmp_path, monkeypatch):
    monkeypatch.setattr("asyncrl.config.loading.CONFIG_DIR", tmp_path)
    with pytest.raises(ConfigError, match="default.yaml is missing.*--config"):
        load_config()


def test_every_package_data_pattern_matches_a_file():
    data = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    for pkg, patterns in data.items():
        for pattern in patterns:
            assert list((REPO / pkg).glob(pattern)), f"package-data {pkg}: {pattern} matches nothing"


# ------------------------------------------------------------------ the task is built before a role starts

ECHO_TASK = "task.name=tests.e2e.custom_task.echo_task:make_task"


def test_bad_task_data_fails_before_any_role_starts(tmp_path, capsys):
    """Data with no `prompt` column passed check_data_paths (the file exists) and failed only in the actors,
    after Redis, Ray and the learner had started: 4 Ray tracebacks and a run dir the next run resumed."""
    data = tmp_path / "data.jsonl"
    data.write_text('{"question": "say cat", "word": "cat"}\n')
    overrides = [ECHO_TASK, f"task.data_path={data}", f"run.dir={tmp_path / 'run'}"]
    with pytest.raises(
        TaskDataError, match="row 0 has no column 'prompt'; columns: question, word; set task.prompt_column"
    ):
        cli._check_model_path(load_config(overrides=overrides))
    cli._check_model_path(
        load_config(overrides=overrides), data=False
    )  # the learner never reads the task's data
    assert cli.main(["serve-actors", *overrides]) == 2
    err = capsys.readouterr().err
    assert err.startswith("asyncrl: error: ") and "no column 'prompt'" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "run").exists()
    # Prompts for fewer actors than configured: what actor 0's PromptSource refused, after start-up.
    data.write_text('{"prompt": "say cat", "word": "cat"}\n')
    with pytest.raises(
        TaskDataError, match=r"actors\.num_actors=2 failed: ValueError: 1 prompts cannot be sharded"
    ):
        cli._check_model_path(load_config(overrides=[*overrides, "actors.num_actors=2"]))
    cli._check_model_path(load_config(overrides=overrides))
    # `asyncrl eval` of a model dir has no actors: its prompts are not sharded, whatever num_actors says.
    cli._check_model_path(load_config(overrides=[*overrides, "actors.num_actors=2"]), shard=False)


def test_a_plugin_factory_bug_is_one_line_naming_the_task_and_the_line(tmp_path):
    plugin = tmp_path / "plugin.py"
    plugin.write_text("def make_task(task_cfg, seed):\n    return task_cfg.params['rows']\n")
    cfg = load_config(overrides=[f"task.name={plugin}:make_task"])
    with pytest.raises(TaskDataError) as e:
        cli._check_model_path(cfg)
    assert str(e.value) == (
        f"task.name='{plugin}:make_task': building the task failed: KeyError: 'rows' (at {plugin}:2)"
    )
