"""Start-time checks of a user's own task (users' walkthrough): each mistake below used to surface only
inside the actors, after Redis, Ray, vLLM and the learner had started.

* a reward function with the wrong signature failed every group until task.reward_failure_limit (64);
* prompts too long for model.max_model_len were dead-lettered one by one (all of them: 0 steps);
* verl / OpenRLHF message-list prompt columns were refused as "must be a non-empty string";
* model.chat_template=on with a tokenizer without a template advised removing task.system_prompt.
"""

from __future__ import annotations

import asyncio
import json
import logging
import textwrap
from pathlib import Path

import pytest

from asyncrl.config import ConfigError, load_config
from asyncrl.tasks import TaskDataError, check_task, make_task, prompt_token_ids
from tests.unit.test_prompt_rendering import _model_dir

TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")  # fmt: skip


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory) -> Path:
    return _model_dir(tmp_path_factory.mktemp("chat"), TEMPLATE)


def _plugin(tmp_path: Path, reward: str, rows: list[dict], name: str = "t") -> str:
    """A plug-in file whose data task reads ``rows`` with ``reward`` (source of a function named reward)."""
    (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / f"{name}.py").write_text(
        "from asyncrl.tasks import dataset_task\n\n"
        + textwrap.dedent(reward)
        + f"\n\ndef make_task(task_cfg, seed):\n    return dataset_task(task_cfg, seed, reward, name={name!r})\n"
    )
    return f"{tmp_path / name}.py:make_task"


def _cfg(tmp_path: Path, *overrides: str, reward: str = "def reward(prompt, completion, metadata):\n    return 1.0",
         rows: list[dict] | None = None):  # fmt: skip
    rows = rows if rows is not None else [{"prompt": f"say:{i}="} for i in range(10)]
    task = _plugin(tmp_path, reward, rows)
    return load_config(overrides=[f"task.name={task}", f"task.data_path={tmp_path / 't.jsonl'}", *overrides])


# --- the reward's signature -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "reward, expect",
    [
        ("def reward(prompt, completion):\n    return 1.0", "(prompt, completion) and cannot be called as"),
        (
            "def reward(prompt, completion, metadata, *, strict):\n    return 1.0",
            "a required argument: 'strict'",
        ),
        ("async def reward(prompt, completion, metadata, n):\n    return 1.0", "a required argument: 'n'"),
    ],
)
def test_a_reward_with_the_wrong_signature_fails_at_start_showing_the_expected_one(tmp_path, reward, expect):
    with pytest.raises(ConfigError) as e:
        check_task(_cfg(tmp_path, reward=reward))
    msg = str(e.value)
    assert msg.startswith(
        f"task.name='{tmp_path}/t.py:make_task': the reward function reward ({tmp_path}/t.py:3)"
    )
    assert "reward(prompt: str, completion: str, metadata: dict) -> float" in msg and expect in msg
    assert "\n" not in msg


def test_verls_compute_score_is_refused_with_the_wrapper_to_write(tmp_path):
    """It binds (three positional parameters and an optional fourth) and would get the prompt as data_source.
    Rewards the actors can call pass."""
    reward = "def reward(data_source, solution_str, ground_truth, extra_info=None):\n    return 1.0"
    with pytest.raises(
        ConfigError, match=r"has verl's signature .*'data_source'.*; wrap it: def reward\(prompt"
    ):
        check_task(_cfg(tmp_path, reward=reward))
    for i, reward in enumerate([  # what the actors can call passes
        "async def reward(prompt, completion, metadata):\n    return 1.0",
        "def reward(*args, **kw):\n    return 1.0",
        "def reward(prompt, solution_str, ground_truth):\n    return 1.0",  # only data_source is verl's tell
        "import functools\n\ndef _r(p, c, m, scale):\n    return scale\n\nreward = functools.partial(_r, scale=1.0)",
    ]):  # fmt: skip
        (tmp_path / str(i)).mkdir()
        check_task(_cfg(tmp_path / str(i), reward=reward))


def test_a_task_subclass_without_a_reward_or_with_a_wrong_one_fails_at_start(tmp_path):
    (tmp_path / "sub.py").write_text(textwrap.dedent("""
        from asyncrl.tasks import Prompt, Task

        class NoReward(Task):
            name = "none"

        class Wrong(Task):
            name = "wrong"
            def reward(self, completion_text):
                return 1.0

        def no_reward(cfg, seed):
            return NoReward([Prompt("a", "hi"), Prompt("b", "ho")])

        def wrong(cfg, seed):
            return Wrong([Prompt("a", "hi"), Prompt("b", "ho")])
    """))  # fmt: skip
    with pytest.raises(
        ConfigError, match=r"defines no reward method; a Task subclass defines reward\(self, prompt"
    ):
        check_task(load_config(overrides=[f"task.name={tmp_path}/sub.py:no_reward"]))
    with pytest.raises(
        ConfigError, match=r"signature \(completion_text\) and cannot be called as reward\(self, prompt"
    ):
        check_task(load_config(overrides=[f"task.name={tmp_path}/sub.py:wrong"]))


# --- prompt lengths -----------------------------------------------------------------------------------


def test_some_prompts_too_long_warn_at_start_with_count_row_length_and_keys(tmp_path, chat_model, caplog):
    rows = [{"prompt": "x" * n} for n in (5, 5, 60, 5, 40, 70, 5, 5)]  # the template adds 18 tokens
    cfg = _cfg(
        tmp_path, f"model.path={chat_model}", "model.max_model_len=64", "actors.max_tokens=16", rows=rows
    )
    with caplog.at_level(logging.WARNING, logger="asyncrl.tasks.length_check"):
        check_task(cfg)
    refused, cut = (r.getMessage() for r in caplog.records)
    assert refused.startswith("2 of 8 training prompts of task 't' are too long for model.max_model_len=64 ")
    assert (
        "first: prompt 't-2' (row 2), 78 tokens; raise model.max_model_len (to 104 for all: the longest + actors.max_tokens=16)"
        in refused
    )
    assert cut.startswith("1 of 8 training prompts of task 't' leave less than actors.max_tokens=16 tokens")
    assert (
        "first: prompt 't-4' (row 4), 58 tokens (room for 6); raise model.max_model_len or lower actors.max_tokens"
        in cut
    )


def test_all_prompts_too_long_fail_at_start(tmp_path, chat_model):
    rows = [{"prompt": "x" * n} for n in (50, 60, 70)]
    cfg = _cfg(
        tmp_path, f"model.path={chat_model}", "model.max_model_len=64", "actors.max_tokens=16", rows=rows
    )
    with pytest.raises(ConfigError) as e:
        check_task(cfg)
    assert str(e.value) == (
        "all 3 training prompts of task 't' are too long for model.max_model_len=64: the engine refuses a prompt "
        "of max_model_len tokens or more (the shortest has 68; first: prompt 't-0' (row 0), 68 tokens); raise "
        "model.max_model_len to at least 84 (the shortest + actors.max_tokens=16), or shorten the prompts"
    )


def test_eval_prompts_are_checked_when_the_command_evaluates(tmp_path, caplog):
    rows = [{"prompt": "y" * (300 if i in (0, 6) else 5)} for i in range(10)]  # tiny model: max_model_len 256
    cfg = _cfg(tmp_path, "task.eval_fraction=0.2", "eval.every=5", "run.seed=3", rows=rows)
    task = make_task(cfg.task, 3)
    assert {p.prompt_id for p in task.eval_prompts} == {"t-0", "t-6"}  # both held-out prompts too long
    with pytest.raises(
        ConfigError,
        match=r"^all 2 eval prompts of task 't' are too long .*\(the shortest \+ actors.max_tokens=\d+\)",
    ):
        check_task(cfg)
    cfg.eval.every = 0
    check_task(cfg)  # no eval: the eval prompts are not the run's business


def test_batched_lengths_are_the_actors(chat_model):
    from transformers import AutoTokenizer

    from asyncrl.tasks.chat import Conversation
    from asyncrl.tasks.length_check import prompt_lengths
    from asyncrl.tinymodel import build_tokenizer

    texts = ["copy:ab=", "héllo wörld", "a b\nc", Conversation([{"role": "user", "content": "hi"}])]
    tok = AutoTokenizer.from_pretrained(str(chat_model))
    for mode, sp in (("auto", ""), ("auto", "be brief")):
        assert prompt_lengths(tok, texts, mode, sp) == [
            len(prompt_token_ids(tok, t, mode, sp)) for t in texts
        ]
    bounds = prompt_lengths(tok, texts, "auto", "", at_least=1000)  # none tokenized: a bound at least as long
    assert all(b >= len(prompt_token_ids(tok, t, "auto")) for b, t in zip(bounds, texts, strict=True))
    assert prompt_lengths(tok, texts, "off") == [len(prompt_token_ids(tok, t, "off")) for t in texts[:3]] + [
        None
    ]
    tiny = build_tokenizer()
    assert prompt_lengths(tiny, texts[:3], "auto") == [
        len(prompt_token_ids(tiny, t, "auto")) for t in texts[:3]
    ]


# --- message-list prompts -------------------------------------------------------------------------------


VERL_ROWS = [
    {"prompt": [{"role": "system", "content": "Think."}, {"role": "user", "content": f"what is {i}+{i}?"}],
     "answer": str(2 * i), "data_source": "add"}
    for i in range(6)
]  # fmt: skip


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_verl_message_list_prompts_are_rendered_with_the_chat_template(tmp_path, chat_model, fmt):
    reward = "def reward(prompt, completion, metadata):\n    return float(completion == metadata['target'])"
    cfg = _cfg(
        tmp_path, f"model.path={chat_model}", "task.target_column=answer", reward=reward, rows=VERL_ROWS
    )
    if fmt == "parquet":
        import datasets

        datasets.Dataset.from_list(VERL_ROWS).to_parquet(str(tmp_path / "t.parquet"))
        cfg.task.data_path = str(tmp_path / "t.parquet")
    task = check_task(cfg)
    p = next(p for p in task.prompts if p.prompt_id == "t-3")
    from asyncrl.tasks.chat import Conversation

    assert p.text == "what is 3+3?" and isinstance(p.text, Conversation)  # the reward's prompt: the user turn
    assert p.meta == {"task": "t", "data_source": "add"} and p.target == "6"
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(chat_model))
    assert (
        tok.decode(prompt_token_ids(tok, p.text, "auto")) == "<system>Think.\n<user>what is 3+3?\n<assistant>"
    )
    assert asyncio.run(task.score(p, "6")) == 1.0


def test_message_lists_with_a_system_prompt_and_without_a_template(tmp_path, chat_model):
    rows = [{"prompt": [{"role": "user", "content": "hi"}]}, {"prompt": [{"role": "user", "content": "ho"}]}]
    task = check_task(_cfg(tmp_path, f"model.path={chat_model}", "task.system_prompt=Be brief.", rows=rows))
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(chat_model))
    ids = prompt_token_ids(tok, task.prompts[0].text, "auto", "Be brief.")
    assert tok.decode(ids).startswith("<system>Be brief.\n<user>h")
    with pytest.raises(
        TaskDataError, match=r"row 0: column 'prompt': has its own system message and task.system_prompt"
    ):
        check_task(_cfg(tmp_path, f"model.path={chat_model}", "task.system_prompt=Be brief.", rows=VERL_ROWS))
    with pytest.raises(
        ConfigError, match=r"chat-message lists .*\(the built-in tiny model has no chat template\)"
    ):
        check_task(_cfg(tmp_path, rows=rows))
    with pytest.raises(ConfigError, match=r"chat-message lists .*model.chat_template='off'"):
        check_task(_cfg(tmp_path, f"model.path={chat_model}", "model.chat_template=off", rows=rows))


@pytest.mark.parametrize(
    "cell, expect",
    [
        (
            [{"role": "user", "content": ["a", "b"]}],
            r"message 0 is \{'content': \['a', 'b'\], 'role': 'user'\}",
        ),
        ([{"role": "system", "content": "s"}], "no user message with text"),
        (
            [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
            "the last message is the assistant's",
        ),
        ([], "no user message"),
    ],
)
def test_malformed_message_lists_name_the_row_and_the_format(tmp_path, chat_model, cell, expect):
    rows = [{"prompt": [{"role": "user", "content": "ok"}]}, {"prompt": cell}]
    with pytest.raises(TaskDataError, match=rf"t.jsonl: row 1: column 'prompt': {expect}"):
        check_task(_cfg(tmp_path, f"model.path={chat_model}", rows=rows))


def test_a_prompt_cell_of_another_kind_says_what_is_expected(tmp_path):
    with pytest.raises(
        TaskDataError, match=r"row 0: column 'prompt' must be a non-empty string or a list of chat messages"
    ):
        check_task(_cfg(tmp_path, rows=[{"prompt": {"role": "user"}}]))


# --- model.chat_template=on without a template --------------------------------------------------------


def test_chat_template_on_without_a_template_says_so_not_remove_the_system_prompt(tmp_path):
    plain = _model_dir(tmp_path / "plain", None)
    cfg = _cfg(tmp_path, f"model.path={plain}", "model.chat_template=on", "task.system_prompt=Be brief.")
    with pytest.raises(ConfigError) as e:
        check_task(cfg)
    assert str(e.value) == (
        f"model.chat_template='on' but the tokenizer of {plain} has no chat template: set model.chat_template=auto "
        "(the template when there is one, else plain text) or off (plain text), or use a model whose tokenizer has "
        "a chat template (task.system_prompt needs one: with plain text, remove it)"
    )


def test_prompts_a_template_refuses_beyond_the_first_are_counted(tmp_path, chat_model):
    """The render check tries the first prompt; a template that refuses only some is found at start too."""
    from transformers import AutoTokenizer

    from asyncrl.tasks.length_check import check_prompt_lengths

    tok = AutoTokenizer.from_pretrained(str(chat_model))
    tok.chat_template = (
        "{% if 'BAD' in messages[-1]['content'] %}{{ raise_exception('no') }}{% endif %}" + TEMPLATE
    )
    cfg = _cfg(
        tmp_path, f"model.path={chat_model}", rows=[{"prompt": p} for p in ("ok", "BAD", "fine", "BAD")]
    )
    (w,) = check_prompt_lengths(cfg, make_task(cfg.task, 0), tok)
    assert w == (
        "2 of 4 training prompts of task 't' are refused by the chat template (model.chat_template='auto'): each is "
        "dead-lettered when its turn comes, never trained; first: prompt 't-1' (row 1)"
    )
