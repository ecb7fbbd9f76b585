"""`asyncrl eval` refuses a task without eval prompts before it loads a tokenizer or starts vLLM."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest

from asyncrl.config import ConfigError, load_config
from asyncrl.evaluate import eval_model_dir, evaluate_llm
from asyncrl.tasks import make_task

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("overrides", [["task.name=gsm8k"], ["task.name=copy", "task.eval_size=0"]])
def test_no_eval_prompts_is_a_config_error_naming_the_keys(tmp_path, overrides):
    cfg = load_config(overrides=overrides)
    name = cfg.task.name
    # A model dir that does not exist: loading its tokenizer or starting an engine would fail differently.
    with pytest.raises(
        ConfigError, match=rf"^task '{name}' has no eval prompts: set task\.eval_data_path"
    ) as e:
        eval_model_dir(cfg, str(tmp_path / "no-model"))
    assert "task.eval_fraction > 0" in str(e.value) and "task.eval_size > 0" in str(e.value)
    with pytest.raises(ConfigError, match="has no eval prompts"):  # the periodic eval's path says the same
        asyncio.run(evaluate_llm(None, None, make_task(cfg.task, 0), cfg))


def test_asyncrl_eval_cli_stops_before_tokenizer_and_engine(tmp_path):
    """The command a user runs: a clean error and exit code 2, with neither transformers nor vLLM imported."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "llama"}))
    code = (
        "import sys\nfrom asyncrl.cli import main\n"
        f"rc = main(['eval', {str(model)!r}, 'task.name=gsm8k'])\n"
        "print(rc, [m for m in ('vllm', 'transformers', 'asyncrl.actors.engine') if m in sys.modules])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert out.stdout.strip() == "2 []", out.stdout + out.stderr
    assert "asyncrl: error: task 'gsm8k' has no eval prompts: set task.eval_data_path" in out.stderr
    assert "Traceback" not in out.stderr
