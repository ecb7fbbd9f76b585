"""Task plug-ins: import paths, entry points, data files via `datasets`, eval splits, rewards, chat templates."""

from __future__ import annotations

import asyncio
import json
import math
import re
import subprocess
import sys
import textwrap
from decimal import Decimal
from pathlib import Path

import pytest

from asyncrl.config import ConfigError, TaskConfig, load_config
from asyncrl.tasks import (
    FunctionTask,
    Prompt,
    RewardExit,
    TaskDataError,
    TaskNotFound,
    check_task_config,
    holdout_split,
    load_prompt_splits,
    make_task,
    prompt_token_ids,
    resolve_factory,
)

FIXTURE = Path(__file__).resolve().parents[1] / "e2e" / "custom_task"
ROWS = [{"prompt": f"q{i}", "answer": str(i * i), "extra": [i, i + 1]} for i in range(20)]


def _score(task, prompt, text):
    return asyncio.run(task.score(prompt, text))


def test_import_path_task_with_async_reward():
    cfg = TaskConfig(name="tests.e2e.custom_task.echo_task:make_task", data_path=str(FIXTURE / "echo.jsonl"),
                     eval_fraction=0.1)  # fmt: skip
    load_config(overrides=[f"task.name={cfg.name}"])  # the name validates without importing the module
    task = make_task(cfg, seed=0)
    assert task.name == "echo" and len(task.prompts) == 180 and len(task.eval_prompts) == 20
    assert {p.prompt_id for p in task.prompts}.isdisjoint({p.prompt_id for p in task.eval_prompts})
    p = task.prompts[0]
    word = p.meta["word"]
    assert p.text == f"say:{word}=" and p.target == ""  # no target column configured: metadata carries it
    assert _score(task, p, word) == 1.0 and _score(task, p, "") == 0.0
    assert 0 < _score(task, p, word + "zz") < 1
    task2 = make_task(TaskConfig(name=cfg.name, data_path=cfg.data_path, target_column="word"), 0)
    q = task2.prompts[0]
    assert q.target == q.text[4:-1] and "word" not in q.meta  # the target column becomes Prompt.target


def test_file_path_task(tmp_path):
    f = tmp_path / "my_task.py"
    f.write_text(
        textwrap.dedent("""
        from asyncrl.tasks import FunctionTask, Prompt
        def make_task(cfg, seed):
            prompts = [Prompt(f"p{i}", f"n{i}", str(i)) for i in range(cfg.params["n"])]
            return FunctionTask("mine", prompts, lambda p, c, m: float(c == m["target"]))
    """)
    )
    cfg = load_config(overrides=[f"task.name={f}:make_task", "task.params={n: 5}"])
    task = make_task(cfg.task, 0)
    assert [p.text for p in task.prompts] == [f"n{i}" for i in range(5)]
    assert _score(task, task.prompts[3], "3") == 1.0 and _score(task, task.prompts[3], "4") == 0.0


def test_entry_point_plugin_is_found_and_listed(tmp_path):
    """An installed package's entry point (a dist-info on sys.path) resolves by its short name."""
    pkg = tmp_path / "epkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(
        "from asyncrl.tasks import FunctionTask, Prompt\n"
        "def make(cfg, seed):\n    return FunctionTask('ep', [Prompt('a', 'x')], lambda p, c, m: 0.5)\n"
    )
    dist = tmp_path / "epkg-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: epkg\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[asyncrl.tasks]\nmytask = epkg:make\n")
    code = (
        "import asyncio; from asyncrl.config import load_config, ConfigError; from asyncrl.tasks import make_task\n"
        "cfg = load_config(overrides=['task.name=mytask']); t = make_task(cfg.task, 0)\n"
        "print(t.name, asyncio.run(t.score(t.prompts[0], 'y')))\n"
        "try: load_config(overrides=['task.name=other'])\nexcept ConfigError as e: print(e)\n"
    )
    env = {"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=Path.cwd()
    )
    assert out.returncode == 0, out.stderr
    first, second = out.stdout.splitlines()
    assert first == "ep 0.5"
    assert "installed plug-ins (asyncrl.tasks): mytask" in second and "built-in tasks: copy" in second


def _install_plugin(root: Path, pkg: str, entry: str) -> None:
    """A package ``pkg`` on ``root`` whose dist-info registers ``entry = pkg:make`` under asyncrl.tasks."""
    (root / pkg).mkdir()
    (root / pkg / "__init__.py").write_text(
        "from asyncrl.tasks import FunctionTask, Prompt\n"
        "def make(cfg, seed):\n    return FunctionTask('mine', [Prompt('a', 'x')], lambda p, c, m: 0.5)\n"
    )
    dist = root / f"{pkg}-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {pkg}\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(f"[asyncrl.tasks]\n{entry} = {pkg}:make\n")


def test_plugin_named_like_a_builtin_is_an_error_not_silently_replaced(tmp_path, monkeypatch):
    """A plug-in registered as `echo` (the docs' old example) used to be replaced by the built-in echo."""
    pkg = f"shadow_{tmp_path.name.replace('-', '_')}"
    _install_plugin(tmp_path, pkg, "echo")
    monkeypatch.syspath_prepend(str(tmp_path))
    for call in (lambda: make_task(TaskConfig(name="echo"), 0), lambda: resolve_factory("echo")):
        with pytest.raises(ConfigError) as e:
            call()
        msg = str(e.value)
        assert "task.name='echo' is a built-in task" in msg and f"{pkg} also registers 'echo'" in msg
        assert f"task.name='{pkg}:make'" in msg  # the way to select the plug-in anyway
    assert pkg not in sys.modules  # the check read entry-point metadata only
    assert make_task(TaskConfig(name="copy"), 0).name == "copy"  # other built-ins are unaffected
    assert make_task(TaskConfig(name=f"{pkg}:make"), 0).name == "mine"  # the way out works
    sys.modules.pop(pkg, None)


def test_one_entry_point_scan_per_config_load_and_per_make_task(tmp_path, monkeypatch):
    """Scanning the installed distributions for entry points is the slow part of a task check (every
    dist-info on sys.path is read): config validation and make_task each scan once and pass the result
    on. A rejected name scanned twice at load, a built-in's make_task twice (check, then lookup). Not
    cached across calls: a plug-in installed after a first load is found by the next one."""
    from asyncrl.tasks import registry

    real, scans = registry.entry_points, []

    def counting(**kw):
        scans.append(kw.get("group"))
        return real(**kw)

    monkeypatch.setattr(registry, "entry_points", counting)

    def count(call) -> int:
        scans.clear()
        call()
        assert set(scans) <= {registry.ENTRY_POINT_GROUP}, scans
        return len(scans)

    def load(name: str):
        return lambda: load_config(overrides=[f"task.name={name}"])

    def rejected(name: str):
        def call():
            with pytest.raises(ConfigError, match="is not a known task"):
                load_config(overrides=[f"task.name={name}"])

        return call

    assert count(load("copy")) == 1  # a built-in (the shadowing check)
    assert count(load("tests.e2e.custom_task.echo_task:make_task")) == 1  # an import path
    entry = f"counted_{tmp_path.name.replace('-', '_')}"
    assert count(rejected(entry)) == 1  # names nothing (yet): the message lists the plug-ins too
    assert count(lambda: make_task(TaskConfig(name="copy"), 0)) == 1
    pkg = f"cpkg_{tmp_path.name.replace('-', '_')}"
    _install_plugin(tmp_path, pkg, entry)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert count(load(entry)) == 1  # installed after the loads above: found
    assert count(lambda: make_task(TaskConfig(name=entry), 0)) == 1
    sys.modules.pop(pkg, None)


@pytest.mark.parametrize("name", ["copy", "echo", "addition"])
@pytest.mark.parametrize(
    "key, value",
    [("data_path", "d.jsonl"), ("split", "test"), ("eval_data_path", "e.jsonl"), ("eval_split", "test"),
     ("eval_fraction", 0.1), ("prompt_column", "question"), ("target_column", "answer"), ("params", {"n": 1})],
)  # fmt: skip
def test_tiny_tasks_reject_data_keys_they_would_ignore(name, key, value):
    cfg = TaskConfig(name=name, **{key: value})
    with pytest.raises(
        ConfigError, match=rf"^task\.{key}=.*the built-in task '{name}' generates its prompts"
    ):
        make_task(cfg, 0)
    with pytest.raises(ConfigError, match=rf"^tasks\.x\.{key}="):
        check_task_config(cfg, prefix="tasks.x.")
    check_task_config(
        TaskConfig(name=name, eval_size=3, num_prompts=7, alphabet="xy")
    )  # what tiny tasks read
    if key in ("prompt_column", "target_column", "params"):  # gsm8k reads fixed columns: rejected too
        with pytest.raises(ConfigError, match=rf"^task\.{key}=.*'gsm8k' reads the GSM8K columns"):
            check_task_config(TaskConfig(name="gsm8k", **{key: value}))
    else:
        check_task_config(TaskConfig(name="gsm8k", **{key: value}))  # what gsm8k reads


def test_unknown_names_fail_clearly():
    with pytest.raises(TaskNotFound, match="built-in tasks: copy, reverse, count, addition, echo, gsm8k"):
        make_task(TaskConfig(name="chess"), 0)
    with pytest.raises(ConfigError, match="module 'no_such_mod' is not importable"):
        load_config(overrides=["task.name=no_such_mod:make"])
    with pytest.raises(TaskNotFound, match="has no callable 'nope'"):
        make_task(TaskConfig(name="asyncrl.tasks:nope"), 0)


def test_a_reward_function_named_as_the_task_says_what_task_name_wants(tmp_path):
    """verl users name their reward function (custom_reward_function); task.name wants a factory. Before:
    "TypeError: reward() missing 1 required positional argument: 'metadata'", or (with a default)
    "the factory returned float, not a Task", neither saying what to write instead."""
    f = tmp_path / "myreward.py"
    f.write_text(
        textwrap.dedent("""
        def reward(prompt, completion, metadata):
            return float(completion == metadata["answer"])
        def reward_with_default(prompt, completion, metadata=None):
            return 0.0
    """)
    )
    with pytest.raises(
        TaskNotFound, match=r"cannot be called as a task factory .*dataset_task\(task_cfg, seed, reward\)"
    ):
        make_task(TaskConfig(name=f"{f}:reward"), 0)
    with pytest.raises(TypeError, match=r"returned float, not a Task; task.name names a factory"):
        make_task(TaskConfig(name=f"{f}:reward_with_default"), 0)


@pytest.mark.parametrize("fmt", ["jsonl", "parquet", "saved"])
def test_data_formats_give_the_same_prompts(tmp_path, fmt):
    import datasets

    ds = datasets.Dataset.from_list(ROWS)
    if fmt == "jsonl":
        path = tmp_path / "d.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    elif fmt == "parquet":
        path = tmp_path / "d.parquet"
        ds.to_parquet(str(path))
    else:
        path = tmp_path / "saved"
        datasets.DatasetDict({"train": ds, "test": ds.select(range(3))}).save_to_disk(str(path))
    cfg = TaskConfig(data_path=str(path), target_column="answer", eval_split="test" if fmt == "saved" else "",
                     eval_fraction=0.0 if fmt == "saved" else 0.25)  # fmt: skip
    train, evals = load_prompt_splits(cfg, seed=3, name="sq")
    if fmt == "saved":
        assert len(train) == 20 and [p.text for p in evals] == ["q0", "q1", "q2"]
    else:
        assert len(train) == 15 and len(evals) == 5
        assert sorted(p.text for p in train + evals) == sorted(r["prompt"] for r in ROWS)
    p = next(p for p in train + evals if p.text == "q4")
    assert p.target == "16" and p.meta["extra"] == [4, 5] and p.meta["task"] == "sq"


def test_a_data_column_named_target_reaches_the_reward_and_a_collision_is_refused(tmp_path):
    """A row's own 'target' column (no task.target_column) was replaced by "" in the reward's metadata,
    so an exact-match reward scored 0 on the right answer and training went on without an error."""
    import asyncio

    from asyncrl.tasks import dataset_task

    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"prompt": "say:ab=", "target": "ab", "answer": "xy"}) + "\n")
    seen: list[dict] = []

    def reward(prompt, completion, metadata):
        seen.append(metadata)
        return float(completion == metadata["target"])

    task = dataset_task(TaskConfig(data_path=str(data)), 0, reward, name="mine")
    assert asyncio.run(task.score(task.prompts[0], "ab")) == 1.0 and seen[-1]["target"] == "ab"
    task = dataset_task(TaskConfig(data_path=str(data), target_column="target"), 0, reward, name="mine")
    assert asyncio.run(task.score(task.prompts[0], "ab")) == 1.0 and seen[-1]["answer"] == "xy"
    # target_column names another column: metadata['target'] is its value, which would hide the row's own
    with pytest.raises(TaskDataError, match="has a column 'target' and task.target_column is 'answer'"):
        dataset_task(TaskConfig(data_path=str(data), target_column="answer"), 0, reward, name="mine")
    plain = tmp_path / "p.jsonl"
    plain.write_text(json.dumps({"prompt": "q", "answer": "xy"}) + "\n")
    task = dataset_task(TaskConfig(data_path=str(plain)), 0, reward, name="mine")
    assert asyncio.run(task.score(task.prompts[0], "")) == 1.0 and seen[-1]["target"] == ""  # none: ""


@pytest.mark.parametrize("fmt", ["jsonl", "json"])
def test_numbers_of_a_mixed_int_float_json_column_reach_the_reward_as_the_file_writes_them(tmp_path, fmt):
    """Arrow reads a column holding 3 and 2.5 as floats: the target of the row written 3 was "3.0", so an
    exact-match reward scored 0 on the model's right answer "3" (and an int past 2**53 lost digits)."""
    import asyncio

    from asyncrl.tasks import dataset_task

    rows = [{"prompt": "1+2", "answer": 3, "level": 1}, {"prompt": "5/2", "answer": 2.5, "level": 1.5},
            {"prompt": "big", "answer": 12345678901234567, "level": 2}, {"prompt": "neg", "answer": -7, "level": 2},
            {"prompt": "float", "answer": 3.0, "level": 3},
            {"prompt": "para\u2028sep", "answer": 4, "level": 4}]  # fmt: skip
    data = tmp_path / f"d.{fmt}"
    if fmt == "jsonl":  # unescaped U+2028 (legal inside a JSON string; str.splitlines() cuts there)
        data.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" + ("\n" if i == 1 else "")
                                for i, r in enumerate(rows)), encoding="utf-8")  # fmt: skip
    else:
        data.write_text(json.dumps(rows, indent=1))
    seen: list[dict] = []

    def exact(prompt, completion, metadata):
        seen.append(metadata)
        return float(completion.strip() == metadata["target"])

    task = dataset_task(TaskConfig(data_path=str(data), target_column="answer"), 0, exact, name="arith")
    by_text = {p.text: p for p in task.prompts}
    assert {t: p.target for t, p in by_text.items()} == {
        "1+2": "3", "5/2": "2.5", "big": "12345678901234567", "neg": "-7", "float": "3.0", "para\u2028sep": "4",
    }  # fmt: skip
    assert asyncio.run(task.score(by_text["1+2"], " 3")) == 1.0 and seen[-1]["target"] == "3"
    assert asyncio.run(task.score(by_text["float"], "3.0")) == 1.0  # a float the file writes stays one
    levels = {t: p.meta["level"] for t, p in by_text.items()}  # the other columns too (the reward's metadata)
    assert levels == {"1+2": 1, "5/2": 1.5, "big": 2, "neg": 2, "float": 3, "para\u2028sep": 4}
    assert all(type(v) is int for t, v in levels.items() if t != "5/2")


def test_eval_data_path_and_size_cap(tmp_path):
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    b.write_text("".join(json.dumps({"prompt": f"e{i}"}) + "\n" for i in range(10)))
    train, evals = load_prompt_splits(
        TaskConfig(data_path=str(a), eval_data_path=str(b), eval_size=4), 0, "t"
    )
    assert len(train) == 20 and [p.text for p in evals] == ["e0", "e1", "e2", "e3"]
    assert all(p.prompt_id.startswith("t-eval-") for p in evals)


def test_bad_data_is_a_clear_error(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"question": "x"}) + "\n")
    with pytest.raises(TaskDataError, match="row 0 has no column 'prompt'; columns: question"):
        load_prompt_splits(TaskConfig(data_path=str(bad)), 0, "t")
    empty = tmp_path / "e.jsonl"
    empty.write_text(json.dumps({"prompt": "  "}) + "\n")
    with pytest.raises(TaskDataError, match="row 0: column 'prompt' must be a non-empty string"):
        load_prompt_splits(TaskConfig(data_path=str(empty)), 0, "t")
    with pytest.raises(TaskDataError, match="not found"):
        load_prompt_splits(TaskConfig(data_path=str(tmp_path / "nope.jsonl")), 0, "t")
    with pytest.raises(TaskDataError, match="unknown data format"):
        load_prompt_splits(
            TaskConfig(data_path=str(bad.with_suffix(".csv").touch() or bad.with_suffix(".csv"))), 0, "t"
        )


def test_holdout_split_is_a_seeded_partition():
    prompts = [Prompt(str(i), f"t{i}") for i in range(50)]
    tr, ev = holdout_split(prompts, 0.2, seed=1)
    tr2, ev2 = holdout_split(prompts, 0.2, seed=1)
    _, ev3 = holdout_split(prompts, 0.2, seed=2)
    assert len(ev) == 10 and ev == ev2 and ev != ev3
    assert sorted(p.prompt_id for p in tr + ev) == sorted(p.prompt_id for p in prompts)
    assert holdout_split(prompts[:2], 0.99, 0)[1] and holdout_split(prompts[:2], 0.99, 0)[0]


def test_rewards_must_be_finite_numbers():
    p = Prompt("a", "x")
    for bad in (math.nan, math.inf, "1", None, True):
        task = FunctionTask("t", [p], lambda *_, v=bad: v)
        with pytest.raises(ValueError, match="not a finite number"):
            _score(task, p, "y")
    # Finite, but past what the fp32 step can train (the record contract refuses it as well).
    for big in (1e39, -2e9, 10**12):
        with pytest.raises(ValueError, match=r"is -?[0-9.e+]+, beyond \+-1e\+09 \(rescale it\)"):
            _score(FunctionTask("t", [p], lambda *_, v=big: v), p, "y")
    assert _score(FunctionTask("t", [p], lambda *_: -1e9), p, "y") == -1e9

    async def slow(prompt, completion, meta):
        await asyncio.sleep(0.01)
        return len(completion)

    assert _score(FunctionTask("t", [p], slow), p, "abc") == 3.0


def test_tiny_task_eval_split_is_separate_and_deterministic():
    t = make_task(TaskConfig(num_prompts=30, eval_size=16), 0)
    t2 = make_task(TaskConfig(num_prompts=300, eval_size=16), 0)
    assert len(t.eval_prompts) == 16 and [p.text for p in t.eval_prompts] == [p.text for p in t2.eval_prompts]
    assert all(p.prompt_id.startswith("copy-eval-") for p in t.eval_prompts)
    assert make_task(TaskConfig(eval_size=0), 0).eval_prompts == []


def test_chat_template_rendering(tmp_path):
    from asyncrl.tinymodel import build_tokenizer

    tok = build_tokenizer()
    assert (
        prompt_token_ids(tok, "copy:ab=", "auto", "sys") == tok("copy:ab=")["input_ids"]
    )  # tiny: no template
    with pytest.raises(ValueError, match="has no chat template"):
        prompt_token_ids(tok, "copy:ab=", "on")
    tok.chat_template = (
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    ids = prompt_token_ids(tok, "copy:ab=", "auto", "be brief")
    assert tok.decode(ids) == "<system>be brief\n<user>copy:ab=\n<assistant>"
    assert tok.decode(prompt_token_ids(tok, "hi", "on")) == "<user>hi\n<assistant>"
    assert prompt_token_ids(tok, "hi", "off", "be brief") == tok("hi")["input_ids"]


def test_tasks_and_config_stay_light():
    """asyncrl.tasks and a config load naming a plug-in import neither torch/vllm/ray nor `datasets`."""
    code = (
        "import sys, asyncrl.tasks\nfrom asyncrl.config import load_config\n"
        "load_config(overrides=['task.name=tests.e2e.custom_task.echo_task:make_task'])\n"
        "print(sorted(m for m in ('torch', 'vllm', 'ray', 'datasets', 'tests.e2e.custom_task.echo_task')"
        " if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[2]).stdout  # fmt: skip
    assert out.strip() == "[]"


def test_task_score_takes_any_real_number_and_a_sys_exit_is_an_error():
    """Task.score (asyncrl eval's path) refused np.float32 / np.int64 / Decimal, and a reward's sys.exit
    ended the scoring process."""
    import numpy as np

    p = Prompt("a", "x")
    for value, want in ((np.float32(0.5), 0.5), (np.int64(2), 2.0), (Decimal("0.25"), 0.25)):
        got = _score(FunctionTask("t", [p], lambda *_, v=value: v), p, "y")
        assert got == want and type(got) is float
    for bad in (np.bool_(True), Decimal("NaN"), 10**400):
        with pytest.raises(ValueError, match="not a finite number"):
            _score(FunctionTask("t", [p], lambda *_, v=bad: v), p, "y")

    def exits(*_):
        sys.exit(2)

    with pytest.raises(RewardExit, match=r"the reward function called sys.exit\(2\)"):
        _score(FunctionTask("t", [p], exits), p, "y")


def _jsonl(path: Path, rows=ROWS) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_splits_of_data_without_splits_are_refused_naming_the_key(tmp_path):
    """task.eval_split on a file made the eval set the training set, and task.split on a file was ignored
    (gsm8k refused the first; neither refused the second)."""
    import datasets

    jsonl = _jsonl(tmp_path / "d.jsonl")
    parquet = tmp_path / "d.parquet"
    datasets.Dataset.from_list(ROWS).to_parquet(str(parquet))
    for data in (jsonl, parquet):
        with pytest.raises(TaskDataError, match=rf"^task\.eval_split='test' picks a split .* task\.data_path='{data}' is a file.*task\.eval_data_path"):  # fmt: skip
            load_prompt_splits(TaskConfig(data_path=str(data), eval_split="test"), 0, "t")
        with pytest.raises(TaskDataError, match=r"^task\.split='validation' picks a split .* is a file"):
            load_prompt_splits(TaskConfig(data_path=str(data), split="validation"), 0, "t")
    with pytest.raises(
        TaskDataError, match=r"^task\.eval_split='test' .* task\.eval_data_path='.*' is a file.*remove"
    ):
        load_prompt_splits(
            TaskConfig(data_path=str(jsonl), eval_data_path=str(parquet), eval_split="test"), 0, "t"
        )
    gsm8k = _jsonl(tmp_path / "g.jsonl", [{"question": "1 + 1?", "answer": "#### 2"}] * 2)
    with pytest.raises(TaskDataError, match=r"^task\.split='test' picks a split"):
        make_task(TaskConfig(name="gsm8k", data_path=str(gsm8k), split="test"), 0)
    with pytest.raises(
        TaskDataError, match=r"^task\.split='test' .* task\.data_path is empty \(the task's own examples\)"
    ):
        make_task(TaskConfig(name="gsm8k", split="test"), 0)
    # A saved single Dataset has no splits either; a DatasetDict's eval split must not be its training split.
    single = tmp_path / "single"
    datasets.Dataset.from_list(ROWS).save_to_disk(str(single))
    with pytest.raises(TaskDataError, match="a saved Dataset has no splits.*'validation'"):
        load_prompt_splits(TaskConfig(data_path=str(single), split="validation"), 0, "t")
    saved = tmp_path / "saved"
    datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS)}).save_to_disk(str(saved))
    with pytest.raises(TaskDataError, match=r"^task\.eval_split='train' is also task\.split"):
        load_prompt_splits(TaskConfig(data_path=str(saved), eval_split="train"), 0, "t")
    # What stays allowed: a file as the default 'train' split, with its own eval file or a held-out share.
    train, evals = load_prompt_splits(TaskConfig(data_path=str(jsonl), eval_data_path=str(parquet)), 0, "t")
    assert len(train) == len(evals) == 20


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        (
            "latin1.jsonl",
            '{"prompt": "ok"}\n{"prompt": "caf\xe9"}\n'.encode("latin-1"),
            r":2: not UTF-8 text \(byte 0xe9\)",
        ),
        ("empty.jsonl", b"", ": the file is empty"),
        ("blank.jsonl", b"\n  \n", ": the file is empty"),
        (
            "bad_line.jsonl",
            b'{"prompt": "a"}\n\n{"prompt": "b",\n',
            r":3: not valid JSON \(Expecting property name",
        ),
        ("list_line.jsonl", b'{"prompt": "a"}\n[1, 2]\n', ":2: expected a JSON object, got list"),
        ("array.json", b'[{"prompt": "a"},\n {"prompt": }]', r":2: not valid JSON \(Expecting value"),
    ],
)
def test_unreadable_json_data_names_the_file_and_line(tmp_path, capfd, name, content, message):
    """Non-UTF-8 data was a raw UnicodeDecodeError naming no file; an empty file 'cannot read (StopIteration: )';
    a bad line a DatasetGenerationError with no line number (and datasets' own log line before it)."""
    path = tmp_path / name
    path.write_bytes(content)
    capfd.readouterr()
    with pytest.raises(TaskDataError, match=f"^{re.escape(str(path))}{message}"):
        load_prompt_splits(TaskConfig(data_path=str(path)), 0, "t")
    assert "Failed to load JSON" not in capfd.readouterr().err


@pytest.mark.parametrize("fmt", ["jsonl-missing", "jsonl-null", "parquet-nan"])
def test_a_row_without_a_target_is_refused_naming_the_row(tmp_path, fmt):
    """With task.target_column set, a row whose target is absent (a JSON Lines row without the key),
    null or a Parquet NaN was read as "": an exact-match reward then paid 1.0 for an empty completion,
    silently. It is a TaskDataError naming the row, the column and the key."""
    from asyncrl.tasks import dataset_task

    rows = [
        {"question": "q0", "answer": 1.5},
        {"question": "q1", "answer": 2.5},
        {"question": "q2", "answer": 3.5},
    ]
    if fmt == "jsonl-missing":
        del rows[2]["answer"]
    else:
        rows[2]["answer"] = None if fmt == "jsonl-null" else float("nan")
    if fmt.startswith("jsonl"):
        path = tmp_path / "d.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        path = tmp_path / "d.parquet"
        pq.write_table(pa.Table.from_pylist(rows), path)
    cfg = TaskConfig(data_path=str(path), prompt_column="question", target_column="answer")
    with pytest.raises(TaskDataError, match=r"row 2: column 'answer' \(task.target_column\) is empty"):
        dataset_task(cfg, 0, lambda p, c, m: 0.0, name="mine")
    rows[2]["answer"] = 0.0  # a real value, even a falsy one, is a target
    path = tmp_path / "ok.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = TaskConfig(data_path=str(path), prompt_column="question", target_column="answer")
    task = dataset_task(cfg, 0, lambda p, c, m: 0.0, name="mine")
    assert sorted(p.target for p in task.prompts + task.eval_prompts) == ["0.0", "1.5", "2.5"]
