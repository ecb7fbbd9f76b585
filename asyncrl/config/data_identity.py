"""The identity of a run's task data: a digest of ``task.data_path``'s contents.

The config's resume check (:mod:`asyncrl.config.resume`) compares keys, i.e. the data files' *names*.
But a run's prompts depend on the files' contents: the held-out eval prompts (``task.eval_fraction``)
are drawn by a shuffle over the row count and the prompt order is one order per run, by position. A
file with rows appended or edited between a stop and its resume moved prompts the policy had trained
on into the eval set (measured: 27 of 44 eval prompts after 400 -> 440 rows) and reshuffled the order
mid-epoch, silently. So the first start records a digest of ``task.data_path`` in
``<run_dir>/task_data.json`` and a resume refuses a digest that changed, as it refuses a changed
identity key (``--allow-config-change task.data_path`` accepts it on purpose).

A file is hashed whole (BLAKE2b, ~1 GB/s: a few seconds for a multi-GB dataset, at each start); a
directory (``save_to_disk``) by its files' relative paths and contents (not the cache and lock files
``datasets`` may add there). A path that does not exist has
no digest (loading the task reports it). Imports neither torch, vllm nor ray.
"""

from __future__ import annotations

import hashlib
import json
import os
import uuid
from pathlib import Path
from typing import Any

__all__ = ["DATA_IDENTITY", "DATA_KEYS", "data_identity", "read_identity", "write_identity"]

#: Where the first start records the digests (in the run dir).
DATA_IDENTITY = "task_data.json"
#: The task keys whose files define the run's prompts. Not ``task.eval_data_path``: a separate eval file
#: moves no training row and no prompt position, and that key may change on resume (eval only).
DATA_KEYS = ("task.data_path",)
_CHUNK = 4 << 20


def _file_digest(path: Path, h: Any) -> None:
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)


def _derived(name: str) -> bool:
    """Files ``datasets`` itself may add to a saved dataset's directory (a map/filter cache, a lock): not data."""
    return (name.startswith("cache-") and name.endswith(".arrow")) or name.endswith(".lock")


def _digest(path: Path) -> str:
    h = hashlib.blake2b(digest_size=20)
    if path.is_dir():
        for f in sorted(p for p in path.rglob("*") if p.is_file() and not _derived(p.name)):
            h.update(str(f.relative_to(path)).encode() + b"\0")
            _file_digest(f, h)
            h.update(b"\0")
    else:
        _file_digest(path, h)
    return h.hexdigest()


def data_identity(cfg: Any) -> dict[str, str]:
    """``{key: digest}`` of every set and existing data path of ``cfg.task`` (empty for a task with no files)."""
    out = {}
    for key in DATA_KEYS:
        value = getattr(cfg.task, key.split(".", 1)[1])
        path = Path(value).expanduser() if value else None
        if path is not None and path.exists():
            out[key] = _digest(path)
    return out


def read_identity(rdir: Path) -> dict[str, str] | None:
    """The digests the run's first start recorded (None: none recorded, e.g. a run from before them)."""
    path = Path(rdir) / DATA_IDENTITY
    if not path.is_file():
        return None
    loaded = json.loads(path.read_text())
    return {str(k): str(v) for k, v in loaded.items()} if isinstance(loaded, dict) else None


def write_identity(rdir: Path, identity: dict[str, str]) -> None:
    path = Path(rdir) / DATA_IDENTITY
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex}")  # concurrent starts (serve-actors)
    tmp.write_text(json.dumps(identity, indent=1, sort_keys=True) + "\n")
    tmp.replace(path)
