"""Prompt sets from data files, read with the Hugging Face ``datasets`` library.

``task.data_path`` may be

* a JSONL file (``.jsonl`` / ``.json``, one object per line),
* a Parquet file (``.parquet``),
* a directory written by ``Dataset.save_to_disk`` / ``DatasetDict.save_to_disk`` (a DatasetDict
  is indexed by ``task.split``; its ``task.eval_split``, when set, is the eval split).

The eval split is, in order of preference: ``task.eval_data_path`` (same formats), the saved
DatasetDict's ``task.eval_split``, or a seed-determined ``task.eval_fraction`` of the training rows.

Only a saved DatasetDict has splits. A file (or a saved single Dataset) is read whole, as the
``train`` split: ``task.split`` other than ``train``, or ``task.eval_split`` naming a split of a file,
is a :class:`TaskDataError` naming the key (:func:`check_splits`), not silently ignored (which trained
on the whole file, or evaluated on the training prompts). An eval set of its own is a file of its own:
``task.eval_data_path``.

A file that cannot be read is a :class:`TaskDataError` naming it; for JSON Lines also the first bad
line (not UTF-8, not JSON, not an object) or that the file is empty.

Each row becomes a :class:`Prompt`: ``text`` = the ``task.prompt_column`` value (a string, or a verl /
OpenRLHF list of chat messages: a :class:`~asyncrl.tasks.chat.Conversation`), ``target`` = the
``task.target_column`` value as a string (empty when that option is empty), ``meta`` = every other
column (the reward function's ``metadata``). ``datasets`` is imported only when a file is read.

A JSON (Lines) number reaches the task as the file writes it: ``3`` as the int 3 (target ``"3"``) and
``2.5`` as 2.5, also where one column mixes them (``datasets`` reads such a column as floats:
:func:`_json_ints` puts the file's ints back). Parquet and saved datasets have typed columns: a float
column's ``3.0`` is ``"3.0"``.
"""

from __future__ import annotations

import json
import logging
import math
import reprlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .base import FunctionTask, Prompt, RewardFn, Task, TaskDataError, holdout_split
from .chat import Conversation

__all__ = [
    "load_rows",
    "rows_to_prompts",
    "to_conversation",
    "check_splits",
    "load_prompt_splits",
    "dataset_task",
]


def load_rows(path: str | Path, split: str = "train") -> list[dict[str, Any]]:
    """The rows of a JSONL / Parquet file or a saved (dict of) dataset, as plain dicts."""
    import datasets

    datasets.disable_progress_bars()  # a bar per small file would flood the actors' logs
    p = Path(path).expanduser()
    if not p.exists():
        raise TaskDataError(f"{p}: task data not found")
    if p.is_dir():
        try:
            ds = datasets.load_from_disk(str(p))
        except FileNotFoundError as e:
            raise TaskDataError(f"{p}: not a dataset saved with save_to_disk ({e})") from None
        if isinstance(ds, datasets.DatasetDict):
            if split not in ds:
                raise TaskDataError(f"{p}: no split {split!r}; splits: {', '.join(ds)}")
            ds = ds[split]
        elif split != "train":
            raise TaskDataError(f"{p}: a saved Dataset has no splits (only a saved DatasetDict does); "
                                f"split {split!r} cannot be read from it")  # fmt: skip
        return ds.to_list()
    if p.suffix in (".jsonl", ".json"):
        reader = datasets.Dataset.from_json
    elif p.suffix == ".parquet":
        reader = datasets.Dataset.from_parquet
    else:
        raise TaskDataError(
            f"{p}: unknown data format; use .jsonl, .json, .parquet or a save_to_disk directory"
        )
    if split != "train":
        raise TaskDataError(f"{p}: a file has no splits (it is read whole); split {split!r} cannot be read")
    rows = _read(reader, p)
    return _json_ints(p, rows) if reader is datasets.Dataset.from_json else rows


def _json_ints(p: Path, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``rows`` of JSON (Lines) file ``p`` with each top-level number an int where the file writes an int.

    Why: Arrow gives a column one type, so ``datasets`` reads a column holding ``3`` and ``2.5`` as
    floats: row one's target reached the reward as ``"3.0"`` (an exact-match reward then refused the
    model's ``3``), and an int past 2**53 lost digits. Such a column holds integral floats, so only
    then is the file parsed again (the standard ``json`` module keeps each number's own type) and the
    file's ints put back, row by row, in every top-level column (the reward's metadata too); a float
    the file writes (``3.0``) stays one. Rows that cannot be matched to the file's (the same count)
    are left as ``datasets`` read them."""
    if not any(isinstance(v, float) and v.is_integer() for row in rows for v in row.values()):
        return rows
    text = p.read_text(encoding="utf-8-sig")  # read by datasets already: valid UTF-8 JSON
    try:
        if text.lstrip().startswith("["):  # one JSON document: a list of rows
            raw = json.loads(text)
        else:
            # "\n" only: splitlines() also cuts at U+2028/U+2029/\x85, legal unescaped inside JSON strings.
            raw = [json.loads(line) for line in text.split("\n") if line.strip()]
    except ValueError:
        return rows
    if len(raw) != len(rows) or not all(isinstance(r, dict) for r in raw):
        return rows
    for row, src in zip(rows, raw, strict=True):
        for key, value in row.items():
            own = src.get(key)
            if isinstance(value, float) and type(own) is int and float(own) == value:
                row[key] = own
    return rows


def _read(reader: Any, p: Path) -> list[dict[str, Any]]:
    """The rows of file ``p``; any failure, to_list() included, a TaskDataError naming the file."""
    log = logging.getLogger("datasets")
    level = log.level
    # The json builder logs its own "Failed to load JSON" line before raising: the TaskDataError below
    # says it once, naming the line.
    log.setLevel(logging.CRITICAL)
    try:
        # keep_in_memory: no Arrow cache files next to the user's data or in ~/.cache for a small set.
        # to_list() inside the try: pyarrow decodes strings only there, so non-UTF-8 text fails there.
        return reader(str(p), keep_in_memory=True).to_list()
    except Exception as e:  # the datasets library raises many types for malformed files
        why = _json_problem(p) if p.suffix in (".jsonl", ".json") else None
        if why is None:
            cause = e.__cause__ or e.__context__  # DatasetGenerationError hides pyarrow's reason there
            detail = f"{type(e).__name__}: {e}" + (f"; {type(cause).__name__}: {cause}" if cause else "")
            why = f"{p}: cannot read ({detail})"
        raise TaskDataError(why) from None
    finally:
        log.setLevel(level)


def _json_problem(p: Path) -> str | None:
    """What is wrong with JSON / JSON Lines file ``p``, naming the 1-based line; None when nothing is found.

    Called only after ``datasets`` failed (its errors name no line, or nothing at all: an empty file is a
    StopIteration), so a successful read never pays for this second pass."""
    data = p.read_bytes()
    try:
        text = data.decode("utf-8-sig")  # a BOM is fine: datasets reads it
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        return f"{p}:{line}: not UTF-8 text (byte {data[e.start]:#04x}); save the file as UTF-8"
    if not text.strip():
        return f"{p}: the file is empty (no rows)"
    try:
        json.loads(text)
        return None  # one valid JSON document (an array of rows): the problem is not its syntax
    except json.JSONDecodeError as e:
        if text.lstrip().startswith("["):  # one document, not one object per line: its own position
            return f"{p}:{e.lineno}: not valid JSON ({e.msg}, column {e.colno})"
    for lineno, line in enumerate(text.split("\n"), start=1):  # as JSON Lines: \n only
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            return (
                f"{p}:{lineno}: not valid JSON ({e.msg}, column {e.colno}); JSON Lines is one object per line"
            )
        if not isinstance(row, dict):
            return f"{p}:{lineno}: expected a JSON object, got {type(row).__name__}"
    return None


def _missing(value: Any) -> bool:
    """A cell with no value: None (a JSON null, a key missing from some JSON Lines rows) or a float NaN."""
    return value is None or (isinstance(value, float) and math.isnan(value))


def _kind(value: Any) -> str:
    return "an empty string" if isinstance(value, str) else f"{type(value).__name__} {reprlib.repr(value)}"


def to_conversation(messages: Sequence[Any], where: str, system_prompt: str = "") -> Conversation:
    """A message-list prompt cell as a :class:`Conversation`; a TaskDataError (``where`` and what to write)
    when it is not a non-empty list of ``{"role": str, "content": str}`` with a user turn, ending in one
    the model answers (not ``assistant``), or holds a system message while ``task.system_prompt`` is set.
    Keys whose value is None (Parquet gives every message every key of the column's struct) are dropped."""
    expected = ("expected a list of chat messages [{'role': 'system'|'user'|'assistant', 'content': str}, ...] "
                "with a user turn, or a plain string")  # fmt: skip
    msgs = []
    for j, m in enumerate(messages):
        if (
            not isinstance(m, dict)
            or not isinstance(m.get("role"), str)
            or not isinstance(m.get("content"), str)
        ):
            raise TaskDataError(f"{where}: message {j} is {reprlib.repr(m)}; {expected}")
        msgs.append({k: v for k, v in m.items() if v is not None})
    if not msgs or not any(m["role"] == "user" and m["content"].strip() for m in msgs):
        raise TaskDataError(f"{where}: no user message with text; {expected}")
    if msgs[-1]["role"] == "assistant":
        raise TaskDataError(f"{where}: the last message is the assistant's; the model answers the conversation, "
                            "so it ends with a user (or tool) message")  # fmt: skip
    if system_prompt and any(m["role"] == "system" for m in msgs):
        raise TaskDataError(
            f"{where}: has its own system message and task.system_prompt is set, which would be dropped for "
            "it; remove task.system_prompt, or the system messages of the data"
        )
    return Conversation(msgs)


def rows_to_prompts(rows: Sequence[dict[str, Any]], *, name: str, where: str, prompt_column: str,
                    target_column: str = "", id_prefix: str | None = None,
                    system_prompt: str = "") -> list[Prompt]:  # fmt: skip
    """Prompts of ``rows``; a missing column or an empty prompt is a TaskDataError naming the row. A prompt
    cell holding a list of chat messages becomes a :class:`Conversation` (:func:`to_conversation`)."""
    prefix = id_prefix or name
    out = []
    for i, row in enumerate(rows):
        for col in (prompt_column, target_column):
            if col and col not in row:
                key = "task.prompt_column" if col == prompt_column else "task.target_column"
                raise TaskDataError(
                    f"{where}: row {i} has no column {col!r}; columns: {', '.join(row)}; set {key} to one of them"
                )
        text = row[prompt_column]
        if isinstance(text, list | tuple):  # verl / OpenRLHF: [{"role": ..., "content": ...}, ...]
            text = to_conversation(text, f"{where}: row {i}: column {prompt_column!r}", system_prompt)
        elif not isinstance(text, str) or not text.strip():
            raise TaskDataError(
                f"{where}: row {i}: column {prompt_column!r} must be a non-empty string or a list of chat "
                f"messages [{{'role': ..., 'content': ...}}, ...], not {_kind(text)}"
            )
        if target_column and target_column != "target" and "target" in row:
            # The reward's metadata["target"] is the target column's value: this column would be hidden.
            raise TaskDataError(
                f"{where}: row {i} has a column 'target' and task.target_column is {target_column!r}: the reward's "
                f"metadata['target'] is task.target_column's value; rename that column or set task.target_column=target"
            )
        if target_column and _missing(row[target_column]):
            # Read as "" it scored against an empty target: an exact-match reward paid 1.0 for an empty
            # completion, silently (JSON Lines rows without the key, null, a Parquet/pandas NaN).
            raise TaskDataError(
                f"{where}: row {i}: column {target_column!r} (task.target_column) is empty (null or NaN); every "
                "row needs a target: fill or drop such rows, or leave task.target_column empty"
            )
        meta = {k: v for k, v in row.items() if k not in (prompt_column, target_column)}
        target = str(row[target_column]) if target_column else ""
        out.append(Prompt(f"{prefix}-{i}", text, target, {"task": name, **meta}))
    if not out:
        raise TaskDataError(f"{where}: no rows")
    return out


def check_splits(data_path: str, split: str, eval_data_path: str, eval_split: str) -> None:
    """``task.split`` / ``task.eval_split`` name splits of a saved DatasetDict directory: a TaskDataError
    naming the key when they are set for data that has none (a file, or ``data_path`` empty: a task's
    built-in examples), or when ``eval_split`` is ``split`` (the eval prompts would be the training ones).

    Before this, a file ignored them: ``task.split=validation`` trained on the whole file and
    ``task.eval_split=test`` evaluated on the training prompts. A path that does not exist is left to
    the reader's "not found"."""

    def no_splits(path: str) -> bool:
        return not path or (Path(path).expanduser().exists() and not Path(path).expanduser().is_dir())

    def where(key: str, path: str) -> str:
        return f"task.{key}={path!r} is a file" if path else f"task.{key} is empty (the task's own examples)"

    if split != "train" and no_splits(data_path):
        raise TaskDataError(
            f"task.split={split!r} picks a split of a save_to_disk directory, but {where('data_path', data_path)}, "
            "read whole; remove task.split, or point task.data_path at that split's own file"
        )
    if not eval_split:
        return
    key, path = ("eval_data_path", eval_data_path) if eval_data_path else ("data_path", data_path)
    if no_splits(path):
        fix = ("remove task.eval_split (the whole eval file is the eval set)" if eval_data_path else
               "put the eval prompts in a file of their own, task.eval_data_path, or hold out task.eval_fraction")  # fmt: skip
        raise TaskDataError(
            f"task.eval_split={eval_split!r} picks a split of a save_to_disk directory, but "
            f"{where(key, path)}, which has no splits; {fix}"
        )
    if not eval_data_path and eval_split == split:
        raise TaskDataError(
            f"task.eval_split={eval_split!r} is also task.split: the eval prompts would be the training "
            "prompts; name another split, or set task.eval_data_path or task.eval_fraction"
        )


def load_prompt_splits(cfg: Any, seed: int, name: str) -> tuple[list[Prompt], list[Prompt]]:
    """(train, eval) prompts for a :class:`asyncrl.config.TaskConfig` that points at data."""
    if not cfg.data_path:
        raise TaskDataError(f"task {name!r} reads its prompts from task.data_path, which is empty")
    check_splits(cfg.data_path, cfg.split, cfg.eval_data_path, cfg.eval_split)
    kw = {"name": name, "prompt_column": cfg.prompt_column, "target_column": cfg.target_column,
          "system_prompt": getattr(cfg, "system_prompt", "")}  # fmt: skip
    train = rows_to_prompts(load_rows(cfg.data_path, cfg.split), where=cfg.data_path, **kw)
    if cfg.eval_data_path:
        evals = rows_to_prompts(load_rows(cfg.eval_data_path, cfg.eval_split or "train"),
                                where=cfg.eval_data_path, id_prefix=f"{name}-eval", **kw)  # fmt: skip
    elif cfg.eval_split:
        evals = rows_to_prompts(load_rows(cfg.data_path, cfg.eval_split),
                                where=f"{cfg.data_path}[{cfg.eval_split}]", id_prefix=f"{name}-eval", **kw)  # fmt: skip
    else:
        train, evals = holdout_split(train, cfg.eval_fraction, seed)
    return train, evals[: cfg.eval_size] if cfg.eval_size else evals


def dataset_task(cfg: Any, seed: int, reward_fn: RewardFn, name: str | None = None) -> Task:
    """A :class:`FunctionTask` over the configured data with ``reward_fn`` (a plug-in's one-liner)."""
    name = name or getattr(reward_fn, "__module__", "dataset").rsplit(".", 1)[-1]
    train, evals = load_prompt_splits(cfg, seed, name)
    return FunctionTask(name, train, reward_fn, evals)
