"""What `asyncrl eval` tells the user before its engine starts (users' walkthrough): how many eval prompts
it scores out of how many, and the key that sets it (task.eval_size's default cap of 64 was applied
silently to a data eval split); and that its console is quieted as `asyncrl run`'s is (vLLM's INFO lines
off, its result alone on stdout; tests/integration/test_eval_rewards.py checks a real engine's output)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from asyncrl.cli import main
from asyncrl.config import ConfigError, load_config
from asyncrl.evaluate import eval_model_dir

REPO = Path(__file__).resolve().parents[2]
ECHO = ["task.name=tests.e2e.custom_task.echo_task:make_task",
        f"task.data_path={REPO / 'tests/e2e/custom_task/echo.jsonl'}", "task.eval_fraction=0.5"]  # fmt: skip
QUIET = ("VLLM_LOGGING_LEVEL", "VLLM_LOGGING_STREAM", "HF_HUB_DISABLE_PROGRESS_BARS")


@pytest.mark.parametrize(
    ("overrides", "line"),
    [
        (ECHO, "asyncrl eval: 64 of 100 eval prompts x 4 samples (eval.samples): task.eval_size=64 caps the "
               "eval set; task.eval_size=0 scores all 100"),  # fmt: skip
        ([*ECHO, "task.eval_size=0", "eval.samples=2"], "asyncrl eval: 100 eval prompts x 2 samples (eval.samples)"),
        ([*ECHO, "task.eval_size=100"], "asyncrl eval: 100 eval prompts x 4 samples (eval.samples)"),
        (["task.name=copy", "task.eval_size=8"],
         "asyncrl eval: 8 eval prompts x 4 samples (eval.samples); the tiny task draws task.eval_size=8 of them"),
    ],
    ids=["capped", "uncapped", "cap-not-reached", "tiny"],
)  # fmt: skip
def test_eval_says_how_many_prompts_of_how_many_and_the_key(tmp_path, capsys, overrides, line):
    cfg = load_config(overrides=overrides)
    # A model dir that does not exist: the line comes first, before the tokenizer (and the engine) fail.
    with pytest.raises(ConfigError):
        eval_model_dir(cfg, str(tmp_path / "no-model"))
    assert capsys.readouterr().err.splitlines()[0] == line


@pytest.mark.parametrize("verbose", [False, True])
def test_eval_quiets_vllm_before_anything_starts_it(tmp_path, monkeypatch, capsys, verbose):
    for var in QUIET:
        monkeypatch.setenv(var, "")  # restored after the test
        monkeypatch.delenv(var)
    from asyncrl.console import quiet_engine_console

    restore = quiet_engine_console(verbose)  # what asyncrl eval calls first, before anything starts vLLM
    assert os.environ["VLLM_LOGGING_STREAM"] == "ext://sys.stderr"  # stdout: the result alone
    assert os.environ.get("VLLM_LOGGING_LEVEL") == (None if verbose else "WARNING")
    restore()
    assert all(v not in os.environ for v in QUIET)
    # The command puts the environment back on return: main() may run in-process (tests, notebooks).
    assert main(["eval", str(tmp_path / "nothing"), *(["-v"] if verbose else [])]) == 2
    assert "neither a run dir" in capsys.readouterr().err
    assert all(v not in os.environ for v in QUIET)
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "DEBUG")  # the user's own choice wins
    restore = quiet_engine_console(verbose)
    assert os.environ["VLLM_LOGGING_LEVEL"] == "DEBUG"
    restore()
    main(["eval", str(tmp_path / "nothing")])
    assert os.environ["VLLM_LOGGING_LEVEL"] == "DEBUG"
