"""A chat template that refuses the config is a one-line ConfigError before any role or engine starts.

Gemma's templates raise 'System role not supported' for a system turn: with task.system_prompt set,
`asyncrl run` crash-looped its actors (6 loop restarts per incarnation, 3 replacements, 0 learner
steps, never ending without run.max_wall_s) and `asyncrl eval` died with a Jinja traceback after its
engine had started. The start-up check renders the first prompt with the model's own tokenizer.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import ModuleType

import pytest

from asyncrl.config import ConfigError, load_config
from asyncrl.tasks import check_task

CHATML = ("{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }}\n{% endfor %}"
          "{% if add_generation_prompt %}a:{% endif %}")  # fmt: skip
GEMMA = (
    "{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
    + CHATML
)


def _model_dir(root: Path, template: str) -> Path:
    """A model directory as far as the checks read it: config.json and the tiny model's tokenizer."""
    from asyncrl.tinymodel import build_tokenizer

    tok = build_tokenizer()
    tok.chat_template = template
    tok.save_pretrained(root)
    (root / "config.json").write_text(json.dumps({"model_type": "qwen2", "max_position_embeddings": 4096}))
    return root


@pytest.fixture(scope="module")
def gemma(tmp_path_factory) -> Path:
    return _model_dir(tmp_path_factory.mktemp("gemma"), GEMMA)


def _cfg(model: Path, *overrides: str):
    return load_config(overrides=[f"model.path={model}", *overrides])


def test_a_template_refusing_the_system_turn_fails_the_task_check_with_the_keys(gemma: Path) -> None:
    with pytest.raises(ConfigError) as e:
        check_task(_cfg(gemma, "task.system_prompt=Be brief."))
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith(f"the chat template of {gemma} refuses the task's prompts: prompt 'copy-")
    assert (
        "(model.chat_template='auto', task.system_prompt='Be brief.'): TemplateError: System role not supported"
        in msg
    )
    assert msg.endswith("remove task.system_prompt (or put its text into the prompts themselves)")


def test_what_the_template_accepts_passes(gemma: Path, tmp_path: Path) -> None:
    check_task(_cfg(gemma))  # no system turn
    check_task(_cfg(gemma, "model.chat_template=off"))  # no template
    check_task(_cfg(_model_dir(tmp_path, CHATML), "task.system_prompt=Be brief."))


@pytest.mark.parametrize("how", ["off", "no template", "tiny"])
def test_a_system_prompt_that_plain_text_would_drop_fails_at_start(
    gemma: Path, tmp_path: Path, how: str
) -> None:
    """Only a chat template has a system turn: with plain-text prompts (model.chat_template=off, a
    tokenizer without a template under auto, the built-in tiny model) task.system_prompt was dropped
    without a word and the run trained and evaluated without it."""
    if how == "off":
        cfg, why = (
            _cfg(gemma, "task.system_prompt=Be brief.", "model.chat_template=off"),
            "model.chat_template='off'",
        )
    elif how == "no template":
        plain = _model_dir(tmp_path, None)
        cfg, why = (
            _cfg(plain, "task.system_prompt=Be brief."),
            f"the tokenizer of {plain} has no chat template",
        )
    else:
        cfg, why = (
            load_config(overrides=["task.system_prompt=Be brief."]),
            "the built-in tiny model has no chat",
        )
    with pytest.raises(ConfigError) as e:
        check_task(cfg)
    msg = str(e.value)
    assert msg.startswith("task.system_prompt='Be brief.' is set but the prompts are plain text (" + why), msg
    assert "\n" not in msg and msg.endswith("or use a model whose tokenizer has a chat template")


@pytest.mark.parametrize("cmd", ["run", "serve-actors", "eval"])
def test_the_cli_stops_before_any_role_with_one_line(cmd: str, gemma: Path, tmp_path: Path, capsys) -> None:
    from asyncrl.cli import main

    overrides = [f"run.dir={tmp_path}", "task.system_prompt=Be brief."]
    argv = [cmd, str(gemma), *overrides] if cmd == "eval" else [cmd, f"model.path={gemma}", *overrides]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert (
        len(err) == 1
        and err[0].startswith("asyncrl: error: the chat template of ")
        and ("System role not supported" in err[0])
    )
    assert not list(tmp_path.iterdir())  # nothing started, no run dir written


def test_eval_checks_before_its_engine_starts(gemma: Path, monkeypatch) -> None:
    """`asyncrl eval RUN_DIR` (an export in a temporary dir, no task check of the CLI's): the check
    runs on the tokenizer eval loaded, before the engine."""
    from asyncrl.evaluate import eval_model_dir

    fake = ModuleType("asyncrl.actors.engine")

    class Engine:
        @classmethod
        def from_config(cls, *a):
            raise AssertionError("the engine was started")

    fake.Engine = Engine
    monkeypatch.setitem(sys.modules, "asyncrl.actors.engine", fake)
    with pytest.raises(
        ConfigError, match=r"task.system_prompt='Hi'\): TemplateError: System role not supported"
    ):
        eval_model_dir(_cfg(gemma, "task.system_prompt=Hi"), str(gemma))


def _corrupt(model: Path) -> Path:
    """``model`` with its tokenizer.json cut in half (a copy interrupted, a disk filled up)."""
    text = (model / "tokenizer.json").read_text()
    (model / "tokenizer.json").write_text(text[: len(text) // 2])
    return model


@pytest.mark.parametrize(
    "template, overrides",
    [(CHATML, []), (CHATML, ["model.chat_template=off"]), ("", [])],
    ids=["chat-template", "template-off", "no-template"],
)
def test_a_tokenizer_that_cannot_load_fails_the_task_check_naming_model_path(
    tmp_path: Path, template: str, overrides: list[str]
) -> None:
    """Before, the check gave no verdict (or, without a template, never loaded it) and every actor then
    failed loading it: loop restarts and replacements for minutes, ending with transformers'
    'JSONDecodeError: Unterminated string ...', which names no file."""
    model = _corrupt(_model_dir(tmp_path / "m", template) if template else _plain_model_dir(tmp_path / "m"))
    with pytest.raises(ConfigError) as e:
        check_task(_cfg(model, *overrides))
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith(
        f"model.path={str(model)!r}: its tokenizer cannot be loaded ({model / 'tokenizer.json'} is not valid "
        "JSON (Unterminated string starting at: line "
    ), msg
    assert msg.endswith("every actor loads it before its engine starts: restore those files (copy them again "
                        "from the model's source)")  # fmt: skip


def _plain_model_dir(root: Path) -> Path:
    """A model directory whose tokenizer has no chat template (a base model)."""
    d = _model_dir(root, CHATML)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    (d / "chat_template.jinja").unlink(missing_ok=True)
    return d


def test_a_model_dir_without_tokenizer_files_fails_the_task_check(tmp_path: Path) -> None:
    """transformers makes an empty tokenizer (a vocabulary of 1) of a dir with config.json alone."""
    (tmp_path / "config.json").write_text(
        json.dumps({"model_type": "qwen2", "max_position_embeddings": 4096})
    )
    with pytest.raises(
        ConfigError, match=r"^model\.path='.*': no tokenizer files there \(none of tokenizer_config"
    ):
        check_task(_cfg(tmp_path))


@pytest.mark.parametrize("cmd", ["run", "serve-actors", "eval"])
def test_the_cli_stops_on_a_tokenizer_that_cannot_load_with_one_line(
    cmd: str, tmp_path: Path, capsys
) -> None:
    from asyncrl.cli import main

    model = _corrupt(_model_dir(tmp_path / "m", CHATML))
    runs = tmp_path / "runs"
    runs.mkdir()
    argv = [cmd, str(model)] if cmd == "eval" else [cmd, f"model.path={model}"]
    assert main([*argv, f"run.dir={runs}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(
        f"asyncrl: error: model.path={str(model)!r}: its tokenizer cannot"
    ), err
    assert not list(runs.iterdir())  # nothing started, no run dir written


def test_eval_of_an_export_names_the_model_dir_whose_tokenizer_cannot_load(tmp_path: Path) -> None:
    """`asyncrl eval RUN_DIR` loads the exported dir's tokenizer itself (no CLI task check there)."""
    from asyncrl.evaluate import eval_model_dir

    model = _corrupt(_model_dir(tmp_path / "m", CHATML))
    with pytest.raises(
        ConfigError, match=rf"^model dir '{model}': its tokenizer cannot be loaded \({model}/tok"
    ):
        eval_model_dir(load_config(), str(model))
