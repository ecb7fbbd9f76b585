"""Learner checkpoints: DeepSpeed engine state + learner state, committed by one atomic pointer.

Layout (``<run_dir>/checkpoints``)::

    step00000010/            DeepSpeed checkpoint (tag) of every rank: module, optimizer (ZeRO shards)
    step00000010/learner_state.json   step, version, consumer, counters, ids of the groups it includes
    step00000010/rng_rank{r}.json     torch / numpy / python RNG states of rank r
    latest.json              {"tag", "step", "version"}: written LAST (tmp + rename + fsync)

A checkpoint exists only once ``latest.json`` names it, so a crash while saving leaves the previous
checkpoint in force. The learner acknowledges the buffer entries a checkpoint includes right after
``latest.json`` is written; ``learner_state.json`` lists those entry ids (``entry_ids``) so a crash
between the two is repaired on resume by acknowledging them again (XACK is idempotent).

No pickle is read from anywhere but the learner's own checkpoint directory (DeepSpeed's files).
"""

from __future__ import annotations

import base64
import json
import os
import random
import re
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from asyncrl.learner.engine import LearnerEngine

__all__ = ["LearnerState", "save_checkpoint", "load_checkpoint", "read_latest", "CHECKPOINT_DIR"]

CHECKPOINT_DIR = "checkpoints"
POINTER = "latest.json"
STATE_FILE = "learner_state.json"
_TAG = re.compile(r"^step(\d{8,})$")


@dataclass
class LearnerState:
    """Everything besides the engine that a resumed learner needs."""

    step: int = 0  # learner steps completed
    version: int = 0  # policy version V after ``step``
    applied_steps: int = 0  # optimizer updates applied (LR warm-up position)
    consumer: str = ""  # Redis consumer name; a resume reads its pending entries
    entry_ids: list[str] = field(default_factory=list)  # buffer entries first included by this checkpoint
    group_ids: list[str] = field(default_factory=list)  # their group ids
    counters: dict[str, float] = field(default_factory=dict)  # cumulative StepRecord counters
    world_size: int = 1
    created: float = 0.0

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> LearnerState:
        known = {k: d[k] for k in cls.__dataclass_fields__ if k in d}
        return cls(**known)


def _tag(step: int) -> str:
    return f"step{step:08d}"


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _rng_state() -> dict[str, Any]:
    np_state = np.random.get_state()
    return {
        "torch": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode(),
        "numpy": [np_state[0], np_state[1].tolist(), int(np_state[2]), int(np_state[3]), float(np_state[4])],
        "python": [random.getstate()[0], list(random.getstate()[1]), random.getstate()[2]],
    }


def _set_rng_state(d: dict[str, Any]) -> None:
    torch.set_rng_state(torch.frombuffer(bytearray(base64.b64decode(d["torch"])), dtype=torch.uint8))
    n = d["numpy"]
    np.random.set_state((n[0], np.asarray(n[1], dtype=np.uint32), n[2], n[3], n[4]))
    p = d["python"]
    random.setstate((p[0], tuple(p[1]), p[2]))


def _barrier(le: LearnerEngine) -> None:
    if le.world_size > 1:
        dist.barrier()


def read_latest(run_dir: str | os.PathLike[str]) -> tuple[Path, LearnerState] | None:
    """(tag directory, learner state) of the committed checkpoint, or None if there is none."""
    root = Path(run_dir) / CHECKPOINT_DIR
    pointer = root / POINTER
    if not pointer.exists():
        return None
    tag = json.loads(pointer.read_text())["tag"]
    tag_dir = root / tag
    return tag_dir, LearnerState.from_dict(json.loads((tag_dir / STATE_FILE).read_text()))


def save_checkpoint(
    le: LearnerEngine, run_dir: str | os.PathLike[str], state: LearnerState, keep: int = 2
) -> Path:
    """Save engine + state as tag ``step{state.step}`` on every rank, then commit it (collective)."""
    root = Path(run_dir) / CHECKPOINT_DIR
    tag = _tag(state.step)
    tag_dir = root / tag
    if le.rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        if tag_dir.exists():  # an uncommitted leftover of a crashed lineage with the same step
            shutil.rmtree(tag_dir)
    _barrier(le)
    le.engine.save_checkpoint(
        str(root), tag=tag, client_state={"asyncrl_step": state.step}, save_latest=False
    )
    tag_dir.mkdir(parents=True, exist_ok=True)
    _atomic_write(tag_dir / f"rng_rank{le.rank}.json", json.dumps(_rng_state()))
    if le.rank == 0:
        state.created = time.time()
        state.world_size = le.world_size
        _atomic_write(tag_dir / STATE_FILE, json.dumps(asdict(state)))
    _barrier(le)  # every rank's shards and RNG are on disk before the commit
    if le.rank == 0:
        _atomic_write(root / POINTER, json.dumps({"tag": tag, "step": state.step, "version": state.version}))
        tags = sorted((p for p in root.iterdir() if p.is_dir() and _TAG.match(p.name)), key=lambda p: p.name)
        for old in tags[:-keep] if keep > 0 else []:
            if old.name != tag:
                shutil.rmtree(old, ignore_errors=True)
    _barrier(le)
    return tag_dir


def load_checkpoint(le: LearnerEngine, run_dir: str | os.PathLike[str]) -> LearnerState | None:
    """Restore the committed checkpoint into ``le`` (collective); None when there is none."""
    found = read_latest(run_dir)
    if found is None:
        return None
    tag_dir, state = found
    load_path, _client = le.engine.load_checkpoint(
        str(tag_dir.parent), tag=tag_dir.name, load_optimizer_states=True, load_lr_scheduler_states=False
    )
    if load_path is None:
        raise RuntimeError(f"DeepSpeed could not load checkpoint {tag_dir}")
    rng = tag_dir / f"rng_rank{le.rank}.json"
    if rng.exists():  # absent when resuming with more ranks than saved
        _set_rng_state(json.loads(rng.read_text()))
    return state
