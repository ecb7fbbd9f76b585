"""Config schema: defaults load, overrides apply, bad keys/values fail naming the key path."""

import dataclasses
import subprocess
import sys

import pytest

from asyncrl.config import Config, ConfigError, explain, from_yaml, load_config, to_yaml


def test_default_yaml_loads_and_overrides_apply():
    cfg = load_config(
        overrides=["learner.lr=1e-5", "buffer.max_staleness=3", "learner.loss.beta_rollout_kl=0.01"]
    )
    assert cfg.learner.lr == pytest.approx(1e-5)
    assert cfg.buffer.max_staleness == 3
    assert cfg.learner.loss.beta_rollout_kl == pytest.approx(0.01)
    assert from_yaml(to_yaml(cfg)) == cfg


@pytest.mark.parametrize(
    "override, needle",
    [
        ("learner.lrr=1", "learner.lrr"),
        ("nosection.x=1", "nosection"),
        ("learner.zero_stage=5", "learner.zero_stage"),
        ("actors.temperature=0", "actors.temperature"),
        ("actors.top_p=1.5", "actors.top_p"),
        ("buffer.max_staleness=-1", "buffer.max_staleness"),
        ("task.name=chess", "task.name"),
        ("learner.loss.is_mode=magic", "learner.loss.is_mode"),
        ("model.tiny.num_heads=8", "model.tiny.num_heads"),
        ("learner.lr=abc", "learner.lr"),
        # Accepted before: a non-finite float, a group of one (advantage 0: nothing learned), a run name
        # that is no directory name (empty made the run dir runs/ itself), a completion budget with no
        # room for a prompt.
        ("learner.lr=inf", "learner.lr=inf must be a finite number"),
        ("actors.temperature=nan", "actors.temperature=nan must be a finite number"),
        ("actors.group_size=1", "actors.group_size=1 is out of range; must be >= 2"),
        ("run.name=", "run.name=''"),
        ("run.name=a/b", "run.name='a/b'"),
        ("run.name=a b", "run.name='a b'"),
        ("actors.max_tokens=256", "actors.max_tokens=256 must be < model.max_model_len=256"),
        ("eval.max_tokens=1000", "eval.max_tokens=1000 must be < model.max_model_len=256"),
        # A value that is not YAML: a yaml.ParserError traceback before.
        ("learner.lr=[0,,1]", "learner.lr='[0,,1]': not a YAML value"),
    ],
)
def test_bad_values_fail_with_key_path(override, needle):
    with pytest.raises(ConfigError) as e:
        load_config(overrides=[override])
    assert needle in str(e.value)


def test_choice_errors_list_allowed_values():
    with pytest.raises(ConfigError, match="allowed values: 'float32', 'bfloat16'"):
        load_config(overrides=["model.dtype=fp8"])


def test_unknown_task_name_lists_the_builtins():
    with pytest.raises(
        ConfigError, match="task.name='chess' is not a known task; built-in tasks: copy, reverse"
    ):
        load_config(overrides=["task.name=chess"])


def test_every_field_is_documented_and_typed():
    def walk(obj):
        for f in dataclasses.fields(obj):
            assert f.metadata.get("doc"), f"{type(obj).__name__}.{f.name} has no doc"
            assert f.type is not None
            v = getattr(obj, f.name)
            if dataclasses.is_dataclass(v):
                walk(v)

    walk(Config())
    lines = explain()
    assert any(line.strip().startswith("buffer.max_staleness = 1") for line in lines)


@pytest.mark.parametrize(
    "text, needle",
    [
        ("run:\n\tname: x\n", "found character that cannot start any token (line 2, column 1)"),
        ("run:\n  name: a\n  name: b\n", "found duplicate key name (line 3, column 3)"),
        ("- run\n- actors\n", "the top level must be a mapping of sections"),
        (b"\xff\xfe\x00bad", "not a valid YAML file: 'utf-8' codec can't decode"),
    ],
)
def test_malformed_yaml_is_a_config_error_naming_the_file_and_line(tmp_path, text, needle):
    """Before: a PyYAML ScannerError / ConstructorError, a TypeError or a UnicodeDecodeError traceback."""
    path = tmp_path / "bad.yaml"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert str(path) in str(e.value) and needle in str(e.value), str(e.value)


def test_missing_config_file_names_the_path(tmp_path):
    with pytest.raises(ConfigError, match="nope.yaml"):
        load_config(tmp_path / "nope.yaml")


def test_light_modules_import_without_torch_vllm_ray():
    code = (
        "import sys, asyncrl.config, asyncrl.buffer, asyncrl.tasks, asyncrl.cli, asyncrl.metrics, "
        "asyncrl.metrics_export, asyncrl.sweep, asyncrl.sweep_state\n"
        "bad = [m for m in ('torch', 'vllm', 'ray', 'deepspeed') if m in sys.modules]\n"
        # a sweep reads its runs' summaries; it drives `asyncrl run` as a subprocess, never the orchestrator
        "bad += [m for m in ('asyncrl.orchestrator',) if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_cli_bad_config_fails_fast_with_key(tmp_path):
    r = subprocess.run([sys.executable, "-m", "asyncrl.cli", "run", "buffer.groups_per_step=0"],
                       capture_output=True, text=True, timeout=60)  # fmt: skip
    assert r.returncode == 2
    assert "buffer.groups_per_step" in r.stderr and ">= 1" in r.stderr


def test_cli_missing_model_path_names_the_path(tmp_path):
    missing = tmp_path / "no-such-model"
    r = subprocess.run(
        [sys.executable, "-m", "asyncrl.cli", "learn", f"model.path={missing}", "redis.url=redis://127.0.0.1:1/0",
         f"run.dir={tmp_path / 'run'}"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 2, r.stderr[-2000:]
    assert str(missing) in r.stderr


@pytest.mark.parametrize(
    "name", ["default.yaml", "gpu_qwen2.5_0.5b_gsm8k.yaml", "gpu_qwen2.5_1.5b_gsm8k.yaml"]
)
def test_shipped_configs_load(name):
    from asyncrl.config import CONFIG_DIR

    cfg = load_config(CONFIG_DIR / name)
    if name.startswith("gpu"):
        assert cfg.model.dtype == "bfloat16" and cfg.learner.zero_stage >= 2 and cfg.task.name == "gsm8k"


def test_swap_min_lag_is_checked_against_the_bound_and_the_transport():
    with pytest.raises(ConfigError, match=r"actors.swap_min_lag=0 is out of range; must be >= 1"):
        load_config(overrides=["actors.swap_min_lag=0"])
    with pytest.raises(
        ConfigError, match=r"actors.swap_min_lag=2 must be <= max\(1, buffer.max_staleness=1\)"
    ):
        load_config(overrides=["actors.swap_min_lag=2", "buffer.max_staleness=1"])
    with pytest.raises(
        ConfigError, match=r"actors.swap_min_lag=5 must be <= max\(1, buffer.max_staleness=4\)"
    ):
        load_config(overrides=["actors.swap_min_lag=5", "buffer.max_staleness=4"])
    with pytest.raises(ConfigError, match="learner.publish_policy='steps'"):
        load_config(
            overrides=["actors.swap_min_lag=2", "buffer.max_staleness=4", "learner.publish_policy=taken"]
        )
    with pytest.raises(ConfigError, match="weight_transport in 'auto', 'file', 'shm'"):
        load_config(overrides=["actors.swap_min_lag=2", "buffer.max_staleness=4", "learner.weight_transport=nccl",
                               "actors.num_gpus_per_actor=1"])  # fmt: skip
    cfg = load_config(overrides=["actors.swap_min_lag=4", "buffer.max_staleness=4"])
    assert cfg.actors.swap_min_lag == 4
    # 1 (every version) is always allowed, also synchronous and with taken; it is the default.
    assert (
        load_config(overrides=["buffer.max_staleness=0", "learner.publish_policy=taken"]).actors.swap_min_lag
        == 1
    )


def test_publish_policy_taken_is_checked_against_the_keys_it_depends_on():
    with pytest.raises(ConfigError, match="allowed values: 'steps', 'taken'"):
        load_config(overrides=["learner.publish_policy=lazy"])
    with pytest.raises(ConfigError, match=r"learner.publish_every must be 1 \(got 2\)"):
        load_config(overrides=["learner.publish_policy=taken", "learner.publish_every=2"])
    with pytest.raises(ConfigError, match="learner.exact_prox=true"):
        load_config(overrides=["learner.publish_policy=taken", "learner.mini_batches=2"])
    with pytest.raises(ConfigError, match="learner.publish_max_steps=0 is out of range; must be >= 1"):
        load_config(overrides=["learner.publish_policy=taken", "learner.publish_max_steps=0"])
    cfg = load_config(
        overrides=["learner.publish_policy=taken", "learner.mini_batches=2", "learner.exact_prox=true"]
    )
    assert (cfg.learner.publish_policy, cfg.learner.publish_max_steps) == ("taken", 4)
    assert load_config().learner.publish_policy == "steps"  # the default keeps publishing every step
