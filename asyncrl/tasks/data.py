"""Prompt sets from data files, read with the Hugging Face ``datasets`` library.

``task.data_path`` may be

* a JSONL file (``.jsonl`` / ``.json``, one object per line),
* a Parquet file (``.parquet``),
* a directory written by ``Dataset.save_to_disk`` / ``DatasetDict.save_to_disk`` (a DatasetDict
  is indexed by ``task.split``; its ``task.eval_split``, when set, is the eval split).

The eval split is, in order of preference: ``task.eval_data_path`` (same formats), the saved
DatasetDict's ``task.eval_split``, or a seed-determined ``task.eval_fraction`` of the training rows.

Each row becomes a :class:`Prompt`: ``text`` = the ``task.prompt_column`` value, ``target`` = the
``task.target_column`` value as a string (empty when that option is empty), ``meta`` = every other
column (the reward function's ``metadata``). ``datasets`` is imported only when a file is read.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .base import FunctionTask, Prompt, RewardFn, Task, TaskDataError, holdout_split

__all__ = ["load_rows", "rows_to_prompts", "load_prompt_splits", "dataset_task"]


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
    elif p.suffix in (".jsonl", ".json"):
        ds = _read(datasets.Dataset.from_json, p)
    elif p.suffix == ".parquet":
        ds = _read(datasets.Dataset.from_parquet, p)
    else:
        raise TaskDataError(
            f"{p}: unknown data format; use .jsonl, .json, .parquet or a save_to_disk directory"
        )
    return ds.to_list()


def _read(reader: Any, p: Path) -> Any:
    try:
        # keep_in_memory: no Arrow cache files next to the user's data or in ~/.cache for a small set.
        return reader(str(p), keep_in_memory=True)
    except Exception as e:  # the datasets library raises many types for malformed files
        raise TaskDataError(f"{p}: cannot read ({type(e).__name__}: {e})") from None


def rows_to_prompts(rows: Sequence[dict[str, Any]], *, name: str, where: str, prompt_column: str,
                    target_column: str = "", id_prefix: str | None = None) -> list[Prompt]:  # fmt: skip
    """Prompts of ``rows``; a missing column or an empty prompt is a TaskDataError naming the row."""
    prefix = id_prefix or name
    out = []
    for i, row in enumerate(rows):
        for col in (prompt_column, target_column):
            if col and col not in row:
                raise TaskDataError(f"{where}: row {i} has no column {col!r}; columns: {', '.join(row)}")
        text = row[prompt_column]
        if not isinstance(text, str) or not text.strip():
            raise TaskDataError(f"{where}: row {i}: column {prompt_column!r} must be a non-empty string")
        meta = {k: v for k, v in row.items() if k not in (prompt_column, target_column)}
        target = "" if not target_column or row[target_column] is None else str(row[target_column])
        out.append(Prompt(f"{prefix}-{i}", text, target, {"task": name, **meta}))
    if not out:
        raise TaskDataError(f"{where}: no rows")
    return out


def load_prompt_splits(cfg: Any, seed: int, name: str) -> tuple[list[Prompt], list[Prompt]]:
    """(train, eval) prompts for a :class:`asyncrl.config.TaskConfig` that points at data."""
    if not cfg.data_path:
        raise TaskDataError(f"task {name!r} reads its prompts from task.data_path, which is empty")
    kw = {"name": name, "prompt_column": cfg.prompt_column, "target_column": cfg.target_column}
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
