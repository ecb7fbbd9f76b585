"""GSM8K-format math word problems with an exact final-answer reward.

Data: rows with ``question`` (str) and ``answer`` (str whose final answer follows a ``#### `` marker,
as in GSM8K), in any format ``task.data_path`` takes (asyncrl.tasks.data): a JSONL file, one object
per line (blank lines skipped; a bad line is a :class:`TaskDataError` naming the file and its 1-based
line number), a Parquet file, or a ``save_to_disk`` directory (a DatasetDict indexed by ``task.split``,
e.g. Hugging Face's ``openai/gsm8k`` saved as is; a bad row is an error naming the 0-based row).

Reward: 1.0 when the number extracted from the completion equals the reference number exactly
(as decimals, so ``1,000`` == ``1000`` == ``1000.0`` and ``$5`` == ``5``), else 0.0.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from decimal import Decimal, InvalidOperation
from importlib import resources
from pathlib import Path
from typing import Any

from .base import Prompt, Task, TaskDataError, holdout_split
from .data import check_splits

__all__ = ["extract_answer", "parse_number", "load_gsm8k", "Gsm8kTask", "EXAMPLES_FILE", "PROMPT_TEMPLATE"]

EXAMPLES_FILE = "gsm8k_examples.jsonl"
PROMPT_TEMPLATE = "Question: {question}\nAnswer:"

# A number as people write it in answers: optional sign and currency sign, digits with optional
# thousands separators, optional decimals. "1,234.5", "-$3", "$1,000", ".5", "12." all match.
_NUMBER = re.compile(r"-?\$?\s?(?:\d{1,3}(?:,\d{3})+|\d+)?(?:\.\d+)?")
_MARKER = "####"


def parse_number(text: str) -> Decimal | None:
    """``text`` as a Decimal after removing ``$``, commas and spaces; None if it is not a number."""
    cleaned = text.replace("$", "").replace(",", "").replace(" ", "").strip().rstrip(".")
    if not cleaned or cleaned in "-+":
        return None
    try:
        value = Decimal(cleaned)
    except InvalidOperation:
        return None
    return value if value.is_finite() else None


def extract_answer(text: str) -> Decimal | None:
    """The final numeric answer in ``text``.

    If the text contains a ``####`` marker, only what follows the last marker counts (so the
    working before it cannot be mistaken for the answer); the answer is then the last number in
    that part. Returns None when there is no number.
    """
    if _MARKER in text:
        text = text.rsplit(_MARKER, 1)[1]
    last = None
    for m in _NUMBER.finditer(text):
        if any(ch.isdigit() for ch in m.group(0)):
            last = m.group(0)
    return None if last is None else parse_number(last)


def load_gsm8k(path: str | Path | None = None, split: str = "train") -> list[Prompt]:
    """Prompts of GSM8K-format data (see the module doc; default: the shipped examples).

    ``split`` picks the split of a saved DatasetDict directory; files have none."""
    if not path:
        res = resources.files("asyncrl.data").joinpath(EXAMPLES_FILE)
        return _jsonl_problems(res.read_text(encoding="utf-8"), str(res))
    p = Path(path).expanduser()
    if not p.exists():
        raise TaskDataError(f"{p}: task data file not found")
    if p.is_dir() or p.suffix == ".parquet":
        # Columnar data goes through the loader every data-backed task uses (``datasets``, imported only
        # here): reading it as text failed with a UnicodeDecodeError or IsADirectoryError.
        from .data import load_rows

        rows = load_rows(p, split)
        return _problems(((f"{p}: row {i}", row) for i, row in enumerate(rows)), str(p))
    if split != "train":  # a JSONL file has no splits: reading it whole for "test" hid a mistake
        raise TaskDataError(f"{p}: a file has no splits (it is read whole); split {split!r} cannot be read")
    try:
        text = p.read_text(encoding="utf-8-sig")  # a BOM (Windows editors) is fine, as for plug-in data
    except UnicodeDecodeError:
        raise TaskDataError(
            f"{p}: not a UTF-8 text file; gsm8k reads JSONL (one object per line), .parquet or a "
            "save_to_disk directory"
        ) from None
    return _jsonl_problems(text, str(p))


def _jsonl_problems(text: str, name: str) -> list[Prompt]:
    def objects():
        for lineno, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            where = f"{name}:{lineno}"
            try:
                yield where, json.loads(line)
            except json.JSONDecodeError as e:
                raise TaskDataError(f"{where}: not valid JSON ({e.msg})") from None

    return _problems(objects(), name)


def _problems(objects: Iterable[tuple[str, Any]], name: str) -> list[Prompt]:
    """Prompts of ``(where, object)`` pairs; ``where`` (file and line, or row) names a bad one."""
    prompts: list[Prompt] = []
    for where, obj in objects:
        if not isinstance(obj, dict):
            raise TaskDataError(f"{where}: expected a JSON object, got {type(obj).__name__}")
        for key in ("question", "answer"):
            if not isinstance(obj.get(key), str) or not obj[key].strip():
                raise TaskDataError(f"{where}: missing or empty string field {key!r}")
        if _MARKER not in obj["answer"]:
            raise TaskDataError(f"{where}: answer has no '{_MARKER} <number>' final-answer marker")
        value = parse_number(obj["answer"].rsplit(_MARKER, 1)[1])
        if value is None:
            raise TaskDataError(f"{where}: final answer after '{_MARKER}' is not a number")
        prompts.append(
            Prompt(
                f"gsm8k-{len(prompts)}",
                PROMPT_TEMPLATE.format(question=obj["question"].strip()),
                str(value),
                {"task": "gsm8k"},
            )
        )
    if not prompts:
        raise TaskDataError(f"{name}: no problems in the data")
    return prompts


class Gsm8kTask(Task):
    """Math word problems scored 1/0 on the extracted final answer."""

    name = "gsm8k"

    def __init__(self, path: str | Path | None = None, *, eval_path: str | Path | None = None,
                 eval_fraction: float = 0.0, eval_size: int = 0, seed: int = 0, split: str = "train",
                 eval_split: str = "") -> None:  # fmt: skip
        """Train on ``path`` (its ``split`` when it is a saved DatasetDict); evaluate on ``eval_path``, else on
        the saved DatasetDict's ``eval_split``, else on a held-out ``eval_fraction`` of the training data (the
        order asyncrl.tasks.data.load_prompt_splits uses)."""
        check_splits(str(path or ""), split, str(eval_path or ""), eval_split)
        prompts = load_gsm8k(path, split)
        if eval_path:
            evals = load_gsm8k(eval_path, eval_split or "train")
        elif eval_split:
            evals = load_gsm8k(path, eval_split)
        else:
            prompts, evals = holdout_split(prompts, eval_fraction, seed)
        super().__init__(prompts, evals[:eval_size] if eval_size else evals)

    def reward(self, prompt: Prompt, completion_text: str) -> float:
        got = extract_answer(completion_text)
        return 1.0 if got is not None and got == Decimal(prompt.target) else 0.0
