"""Tasks: deterministic sharded resumable prompt sources, tiny-task rewards, math answer checking."""

from __future__ import annotations

import json
import random
import re
import subprocess
import sys
from decimal import Decimal

import pytest

from asyncrl.config import TaskConfig
from asyncrl.tasks import (
    TINY_TASKS,
    Gsm8kTask,
    PromptSource,
    TaskDataError,
    char_reward,
    extract_answer,
    load_gsm8k,
    make_task,
)


def test_tasks_import_without_heavy_deps():
    code = "import sys, asyncrl.tasks; print(sorted(m for m in ('torch','vllm','ray') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


# ------------------------------------------------------------------ prompt source


def test_prompt_set_is_deterministic_per_seed():
    a = make_task(TaskConfig(num_prompts=50), seed=3).prompts
    b = make_task(TaskConfig(num_prompts=50), seed=3).prompts
    c = make_task(TaskConfig(num_prompts=50), seed=4).prompts
    assert [p.text for p in a] == [p.text for p in b]
    assert [p.text for p in a] != [p.text for p in c]
    assert a[0].text.startswith("copy:") and a[0].text.endswith("=")


@pytest.mark.parametrize("num_shards", [1, 3, 4])
def test_shards_partition_each_epoch_without_overlap(num_shards):
    task = make_task(TaskConfig(num_prompts=23), seed=1)
    for epoch in (0, 1):
        seen = []
        for shard in range(num_shards):
            src = PromptSource(task.prompts, seed=1, shard=shard, num_shards=num_shards, cursor=(epoch, 0))
            seen.extend(p.prompt_id for p in src.take(len(src)))
        assert sorted(seen) == sorted(p.prompt_id for p in task.prompts)  # disjoint and complete
    sizes = [len(PromptSource(task.prompts, 1, shard=s, num_shards=num_shards)) for s in range(num_shards)]
    assert sum(sizes) == 23 and max(sizes) - min(sizes) <= 1


def test_epochs_reshuffle_and_cursor_resumes_exactly():
    task = make_task(TaskConfig(num_prompts=10), seed=7)
    src = task.source(seed=7, shard=0, num_shards=2)
    epoch0 = [p.prompt_id for p in src.take(5)]
    assert src.cursor == (1, 0)  # rolled into epoch 1
    epoch1 = [p.prompt_id for p in src.take(5)]
    # A fresh global permutation per epoch (shards are re-dealt, so their content changes too).
    assert epoch0 != epoch1 and len(set(epoch0)) == len(set(epoch1)) == 5
    assert epoch1 == [task.prompts[i].prompt_id for i in src.epoch_order(1)]
    # Resume mid-epoch from a saved cursor: the continuation is identical.
    ref = task.source(seed=7, shard=1, num_shards=2)
    ref.take(3)
    saved = ref.cursor
    rest = [p.prompt_id for p in ref.take(9)]
    resumed = task.source(seed=7, shard=1, num_shards=2, cursor=saved)
    assert saved == (0, 3)
    assert [p.prompt_id for p in resumed.take(9)] == rest


def test_prompt_source_rejects_bad_sharding():
    prompts = make_task(TaskConfig(num_prompts=3), seed=0).prompts
    with pytest.raises(ValueError, match="shard"):
        PromptSource(prompts, 0, shard=2, num_shards=2)
    with pytest.raises(ValueError, match="cannot be sharded"):
        PromptSource(prompts, 0, shard=0, num_shards=4)


# ------------------------------------------------------------------ tiny-task rewards


def test_char_reward_values():
    assert char_reward("abc", "abc", "abcd") == 1.0
    assert char_reward("", "abc", "abcd") == 0.0
    # 2 exact + 1 valid-symbol credit (0.25), right length.
    assert char_reward("abd", "abc", "abcd") == pytest.approx((2 + 0.25) / 3)
    # Right content then rambling: length factor 1 / (1 + 3/3) = 0.5.
    assert char_reward("abcabc", "abc", "abcd") == pytest.approx(0.5)
    # Too short: missing positions score 0, length factor 1 / (1 + 1/3).
    assert char_reward("ab", "abc", "abcd") == pytest.approx((2 / 3) * 0.75)
    assert char_reward("xyz", "abc", "abcd") == 0.0


@pytest.mark.parametrize("name", sorted(TINY_TASKS))
def test_tiny_tasks_reward_is_low_for_noise_and_one_for_targets(name):
    task = make_task(TaskConfig(name=name, num_prompts=300), seed=0)
    rng = random.Random(0)
    vocab = [chr(c) for c in range(32, 127)]
    noise = [task.reward(p, "".join(rng.choice(vocab) for _ in range(16))) for p in task.prompts]
    perfect = [task.reward(p, p.target) for p in task.prompts]
    assert sum(noise) / len(noise) < 0.05
    assert perfect == [1.0] * len(perfect)
    assert all(0.0 <= r <= 1.0 for r in noise)


def test_tiny_task_targets():
    cfg = TaskConfig(num_prompts=20)
    for p in make_task(cfg, 0).prompts:
        assert p.text == f"copy:{p.target}=" and set(p.target) <= set("abcd") and 2 <= len(p.target) <= 5
    for p in make_task(TaskConfig(name="reverse", num_prompts=20), 0).prompts:
        assert p.text == f"reverse:{p.target[::-1]}="
    for p in make_task(TaskConfig(name="count", num_prompts=20), 0).prompts:
        assert int(p.target) == len(p.text[len("count:") : -1])
    for p in make_task(TaskConfig(name="addition", num_prompts=20), 0).prompts:
        a, b = p.text[len("addition:") : -1].split("+")
        assert int(p.target) == int(a) + int(b)


def test_tiny_task_rejects_reserved_alphabet():
    with pytest.raises(ValueError, match="alphabet"):
        make_task(TaskConfig(alphabet="ab="), 0)


# ------------------------------------------------------------------ math


@pytest.mark.parametrize(
    "text,want",
    [
        ("so the answer is 12", "12"),
        ("3 + 4 = 7 #### 7", "7"),
        ("#### 1,550", "1550"),
        ("The total is $1,234.50.", "1234.50"),
        ("it costs $ 60", "60"),
        ("-5 degrees", "-5"),
        ("first 3, then 4, finally 2.5", "2.5"),
        ("#### 8\nrambling 99", "99"),  # after the last marker, the last number counts
        ("no number here", None),
        ("", None),
    ],
)
def test_extract_answer(text, want):
    got = extract_answer(text)
    assert got == (None if want is None else Decimal(want))


def test_gsm8k_shipped_examples_are_scored_exactly():
    task = Gsm8kTask()
    assert len(task.prompts) == 8
    targets = [p.target for p in task.prompts]
    assert targets == ["12", "8", "84", "60", "26", "1550", "2.5", "-5"]
    by_target = {p.target: p for p in task.prompts}
    assert task.reward(by_target["1550"], "1200 + 350 = 1,550 trees.\n#### 1,550") == 1.0
    assert task.reward(by_target["1550"], "The answer is 1550.0") == 1.0
    assert task.reward(by_target["60"], "$60") == 1.0
    assert task.reward(by_target["60"], "#### 61") == 0.0
    assert task.reward(by_target["2.5"], "2.50 kg") == 1.0
    assert task.reward(by_target["-5"], "it is 5 degrees") == 0.0
    assert task.reward(by_target["12"], "I don't know") == 0.0
    assert task.prompts[0].text.startswith("Question: ") and task.prompts[0].text.endswith("Answer:")


@pytest.mark.parametrize(
    "line,msg",
    [
        ("{not json", "not valid JSON"),
        ('["a list"]', "expected a JSON object"),
        ('{"question": "q?"}', "'answer'"),
        ('{"question": "q?", "answer": "42"}', "marker"),
        ('{"question": "q?", "answer": "#### many"}', "not a number"),
    ],
)
def test_gsm8k_malformed_lines_name_file_and_line(tmp_path, line, msg):
    good = json.dumps({"question": "1+1?", "answer": "1+1=2\n#### 2"})
    path = tmp_path / "data.jsonl"
    path.write_text(f"{good}\n\n{line}\n")
    with pytest.raises(TaskDataError, match=msg) as e:
        load_gsm8k(path)
    assert f"{path}:3:" in str(e.value)


def test_gsm8k_missing_file(tmp_path):
    with pytest.raises(TaskDataError, match="not found"):
        make_task(TaskConfig(name="gsm8k", data_path=str(tmp_path / "nope.jsonl")), 0)


GSM8K_ROWS = [{"question": f"{i} + {i}?", "answer": f"{i} + {i} = {2 * i}\n#### {2 * i}"} for i in range(10)]


@pytest.mark.parametrize("fmt", ["parquet", "saved_dict", "saved_dataset"])
def test_gsm8k_reads_parquet_and_saved_datasets(tmp_path, fmt):
    """task.data_path takes every format the docs advertise; these were read as text before."""
    import datasets

    ds = datasets.Dataset.from_list(GSM8K_ROWS)
    if fmt == "parquet":
        path = tmp_path / "train.parquet"
        ds.to_parquet(str(path))
    elif fmt == "saved_dict":  # e.g. Hugging Face's openai/gsm8k saved as is: train and test splits
        path = tmp_path / "gsm8k"
        test = datasets.Dataset.from_list([{"question": "7 * 3?", "answer": "#### 21"}])
        datasets.DatasetDict({"train": ds, "test": test}).save_to_disk(str(path))
    else:
        path = tmp_path / "gsm8k"
        ds.save_to_disk(str(path))
    extra = {"eval_split": "test"} if fmt == "saved_dict" else {"eval_fraction": 0.2}
    task = make_task(TaskConfig(name="gsm8k", data_path=str(path), **extra), 0)
    if fmt == "saved_dict":
        assert len(task.prompts) == 10 and [p.target for p in task.eval_prompts] == ["21"]
        assert task.eval_prompts[0].text == "Question: 7 * 3?\nAnswer:"
        # the split of a saved DatasetDict is task.split
        assert [p.target for p in load_gsm8k(path, "test")] == ["21"]
    else:
        assert len(task.prompts) == 8 and len(task.eval_prompts) == 2
        got = sorted(int(p.target) for p in task.prompts + task.eval_prompts)
        assert got == [2 * i for i in range(10)]
    p = task.prompts[0]
    assert task.reward(p, f"#### {p.target}") == 1.0


def test_gsm8k_bad_rows_and_files_are_clear_errors(tmp_path):
    import datasets

    path = tmp_path / "bad.parquet"
    datasets.Dataset.from_list([GSM8K_ROWS[0], {"question": "q?", "answer": "42"}]).to_parquet(str(path))
    with pytest.raises(
        TaskDataError, match=rf"^{re.escape(str(path))}: row 1: answer has no '#### <number>'"
    ):
        load_gsm8k(path)
    path = tmp_path / "cols.parquet"
    datasets.Dataset.from_list([{"prompt": "q?", "target": "1"}]).to_parquet(str(path))
    with pytest.raises(
        TaskDataError, match=rf"^{re.escape(str(path))}: row 0: missing or empty string field 'question'"
    ):
        make_task(TaskConfig(name="gsm8k", data_path=str(path)), 0)
    saved = tmp_path / "saved"
    datasets.DatasetDict({"train": datasets.Dataset.from_list(GSM8K_ROWS)}).save_to_disk(str(saved))
    with pytest.raises(TaskDataError, match="no split 'validation'; splits: train"):
        make_task(TaskConfig(name="gsm8k", data_path=str(saved), split="validation"), 0)
    binary = tmp_path / "data.arrow"
    binary.write_bytes(b"\xff\xfe\x00ARROW1\x00\x00\x9c")
    with pytest.raises(
        TaskDataError, match=rf"^{re.escape(str(binary))}: not a UTF-8 text file; gsm8k reads JSONL.*parquet"
    ):
        make_task(TaskConfig(name="gsm8k", data_path=str(binary)), 0)
    jsonl = tmp_path / "train.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in GSM8K_ROWS))
    with pytest.raises(
        TaskDataError, match=r"task\.eval_split='test' picks a split of a save_to_disk directory"
    ):
        make_task(TaskConfig(name="gsm8k", data_path=str(jsonl), eval_split="test"), 0)


def test_at_is_the_one_shard_order_by_position_and_leaves_the_cursor():
    """The actors serve the run's one order by claimed position: at(seq) is exactly what next() of a
    fresh source of shard 0 of 1 serves at that position (the synchronous reference loop's order),
    across epochs and in any claim order."""
    from asyncrl.tasks import Prompt

    prompts = [Prompt(str(i), f"t{i}") for i in range(7)]
    ref = PromptSource(prompts, seed=3).take(7 * 5)
    src = PromptSource(prompts, seed=3)
    positions = list(range(7 * 5))
    random.Random(0).shuffle(positions)
    assert [src.at(q).prompt_id for q in positions] == [ref[q].prompt_id for q in positions]
    assert src.cursor == (0, 0)
    with pytest.raises(ValueError):
        PromptSource(prompts, seed=3, shard=1, num_shards=2).at(0)
    with pytest.raises(ValueError):
        src.at(-1)
