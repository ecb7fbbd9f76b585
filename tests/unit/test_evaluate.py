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


@pytest.mark.parametrize(
    "overrides", [["task.name=gsm8k"], ["task.name=copy", "task.eval_size=0"]], ids=["gsm8k", "tiny"]
)
def test_a_periodic_eval_without_eval_prompts_fails_at_start_naming_eval_every(tmp_path, capsys, overrides):
    """eval.every > 0 and a task without eval prompts: before, actor 0 logged a warning and the run went on
    without the evaluation it was asked for; now `asyncrl run` / `serve-actors` stop before any role."""
    from asyncrl.cli import main
    from asyncrl.evaluate import PeriodicEval
    from asyncrl.tasks import check_task

    cfg = load_config(overrides=[*overrides, "eval.every=5"])
    want = (
        f"eval.every=5 asks for a periodic eval, but task '{cfg.task.name}' has no eval prompts: set "
        "task.eval_data_path, task.eval_split (a saved DatasetDict) or task.eval_fraction > 0 (data tasks such "
        "as gsm8k), or task.eval_size > 0 (tiny tasks); or set eval.every=0 (no periodic eval)"
    )
    with pytest.raises(ConfigError) as e:
        check_task(cfg)
    assert str(e.value) == want
    with pytest.raises(ConfigError) as e:  # the actor's own path says the same, never a warning
        PeriodicEval.for_actor(cfg, make_task(cfg.task, 0), 0)
    assert str(e.value) == want
    for cmd in ("run", "serve-actors"):
        assert main([cmd, f"run.dir={tmp_path}", *overrides, "eval.every=5"]) == 2
        assert capsys.readouterr().err.strip() == f"asyncrl: error: {want}"
        assert not list(tmp_path.iterdir())  # nothing started, no run dir written
    # eval.every=0 asks for none: the same task starts.
    check_task(load_config(overrides=[*overrides, "eval.every=0"]))


def test_a_periodic_eval_with_eval_prompts_starts_and_the_shipped_configs_have_them(tmp_path):
    from asyncrl.config import CONFIG_DIR
    from asyncrl.evaluate import require_eval_prompts
    from asyncrl.tasks import check_task

    data = REPO / "asyncrl" / "data" / "gsm8k_examples.jsonl"
    check_task(load_config(overrides=["task.name=gsm8k", f"task.data_path={data}", "task.eval_fraction=0.25",
                                      "eval.every=5"]))  # fmt: skip
    check_task(load_config(overrides=["task.name=copy", "eval.every=5"]))  # tiny: task.eval_size=64
    asked = 0
    for path in sorted(CONFIG_DIR.glob("*.yaml")):
        if path.name.startswith(("sweep_", "plan_")):  # a sweep spec / plan inputs, not run configs
            continue
        cfg = load_config(path)
        if cfg.task.data_path:  # on a GPU box (/data/gsm8k): the shipped examples stand in
            cfg.task.data_path = str(data)
        if cfg.eval.every:
            asked += 1
            require_eval_prompts(make_task(cfg.task, cfg.run.seed), cfg.eval.every)
    assert asked >= 2  # the GPU gsm8k configs evaluate every 25 versions
