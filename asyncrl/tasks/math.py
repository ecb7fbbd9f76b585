"""GSM8K-format math word problems with an exact final-answer reward.

Data: JSONL, one object per line with ``question`` (str) and ``answer`` (str whose final answer
follows a ``#### `` marker, as in GSM8K). Blank lines are skipped; anything else that is not such
an object is a :class:`TaskDataError` naming the file and the 1-based line number.

Reward: 1.0 when the number extracted from the completion equals the reference number exactly
(as decimals, so ``1,000`` == ``1000`` == ``1000.0`` and ``$5`` == ``5``), else 0.0.
"""

from __future__ import annotations

import json
import re
from decimal import Decimal, InvalidOperation
from importlib import resources
from pathlib import Path

from .base import Prompt, Task, TaskDataError, holdout_split

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


def load_gsm8k(path: str | Path | None = None) -> list[Prompt]:
    """Prompts of a GSM8K-format JSONL file (default: the shipped examples)."""
    if path:
        p = Path(path).expanduser()
        if not p.exists():
            raise TaskDataError(f"{p}: task data file not found")
        text, name = p.read_text(encoding="utf-8"), str(p)
    else:
        res = resources.files("asyncrl.data").joinpath(EXAMPLES_FILE)
        text, name = res.read_text(encoding="utf-8"), str(res)
    prompts: list[Prompt] = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{name}:{lineno}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise TaskDataError(f"{where}: not valid JSON ({e.msg})") from None
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
        raise TaskDataError(f"{name}: no problems in the file")
    return prompts


class Gsm8kTask(Task):
    """Math word problems scored 1/0 on the extracted final answer."""

    name = "gsm8k"

    def __init__(self, path: str | Path | None = None, *, eval_path: str | Path | None = None,
                 eval_fraction: float = 0.0, eval_size: int = 0, seed: int = 0) -> None:  # fmt: skip
        """Train on ``path``; evaluate on ``eval_path``, else on a held-out ``eval_fraction`` of it."""
        prompts = load_gsm8k(path)
        if eval_path:
            evals = load_gsm8k(eval_path)
        else:
            prompts, evals = holdout_split(prompts, eval_fraction, seed)
        super().__init__(prompts, evals[:eval_size] if eval_size else evals)

    def reward(self, prompt: Prompt, completion_text: str) -> float:
        got = extract_answer(completion_text)
        return 1.0 if got is not None and got == Decimal(prompt.target) else 0.0
