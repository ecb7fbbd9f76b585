"""Learner checkpoints: DeepSpeed engine state + learner state, committed by one atomic pointer.

Layout (``<run_dir>/checkpoints``)::

    step00000010/            DeepSpeed checkpoint (tag) of every rank: module, optimizer (ZeRO shards)
    step00000010/learner_state.json   step, version, consumer, counters, ids of the groups it includes,
                                      the adaptive staleness controller's state
    step00000010/rng_rank{r}.json     torch / numpy / python RNG states of rank r
    latest.json              {"tag", "step", "version"}: written LAST (tmp + rename + fsync)

A checkpoint exists only once ``latest.json`` names it, so a crash while saving leaves the previous
checkpoint in force. Every file of the tag directory (DeepSpeed's shards included) and the directory
itself are fsynced before ``latest.json`` is written, so after a power loss the pointer never names
files that are not on disk. The learner acknowledges the buffer entries a checkpoint includes right
after ``latest.json`` is written; ``learner_state.json`` lists those entry ids (``entry_ids``) so a
crash between the two is repaired on resume by acknowledging them again (XACK is idempotent).

Ledger: ``learner_state.json`` also keeps the ids of the most recently trained groups
(``trained_ids``, the last ``learner.ledger_size``). A Redis crash can undo an acknowledgement (see
the README, "Durability"): the entry is then delivered again although its effect is already in the
weights. The learner recognises it from this ledger and does not train it again.

Fallback: :func:`load_checkpoint` restores the newest checkpoint that loads. One that fails (missing
or corrupt files) is skipped with a warning and the previous one (``keep`` >= 2) is used instead.

No pickle is read from anywhere but the learner's own checkpoint directory (DeepSpeed's files).
"""

from __future__ import annotations

import base64
import json
import logging
import os
import random
import re
import shutil
import time
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from asyncrl.learner.engine import LearnerEngine
from asyncrl.learner.file_transport import remove_tree
from asyncrl.learner.records import CHECKPOINT_DIR, POINTER

__all__ = [
    "LearnerState",
    "TrainedLedger",
    "save_checkpoint",
    "load_checkpoint",
    "read_latest",
    "CHECKPOINT_DIR",
    "Skipped",
    "prune_checkpoints",
]

log = logging.getLogger(__name__)

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
    trained_ids: list[str] = field(default_factory=list)  # ledger: last trained group ids, oldest first
    counters: dict[str, float] = field(default_factory=dict)  # cumulative StepRecord counters
    version_skew: int = 0  # forks' skipped versions minus unpublished steps (asyncrl.buffer.admission)
    # Learner steps since the weights were last published: the restored weights are that far past V
    # (publish_every > 1, publish_policy=taken, a final save on stop). -1 = not recorded (a checkpoint
    # of an older asyncrl): step % publish_every, as those assumed.
    since_publish: int = -1
    # The adaptive staleness controller's state (asyncrl.learner.adaptive.StalenessController.state:
    # its bound, the window so far, the fresh-bucket KL, its last step), restored on resume so the bound
    # in Redis does not snap back to its start value. None = adaptive off, or a checkpoint of an older
    # asyncrl: the controller restarts from buffer.adaptive.start.
    adaptive: dict[str, Any] | None = None
    world_size: int = 1
    created: float = 0.0

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> LearnerState:
        known = {k: d[k] for k in cls.__dataclass_fields__ if k in d}
        return cls(**known)


class TrainedLedger:
    """The ids of the last ``size`` trained groups, in training order, with O(1) membership.

    Restored from the checkpoint (``LearnerState.trained_ids``) and extended with every trained step.
    A redelivered group found here already has its effect in the weights (a Redis crash undid its
    acknowledgement, or its delivery, after it was trained): it must not be trained again.
    """

    def __init__(self, size: int, ids: list[str] | None = None) -> None:
        self.size = size
        self._ids: dict[str, None] = {}
        self.extend(ids or [])

    def extend(self, ids: list[str]) -> None:
        for gid in ids:
            self._ids.pop(gid, None)
            self._ids[gid] = None
        while len(self._ids) > self.size:
            del self._ids[next(iter(self._ids))]

    def __contains__(self, gid: object) -> bool:
        return gid in self._ids

    def __len__(self) -> int:
        return len(self._ids)

    def ids(self) -> list[str]:
        return list(self._ids)


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


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(tag_dir: Path) -> None:
    """fsync every file and directory under ``tag_dir``, then its parent (which holds its entry).

    DeepSpeed writes with plain ``torch.save``: without this, a power loss after ``latest.json`` was
    committed could leave the pointer naming shards that never reached the disk.
    """
    for dirpath, _dirs, files in os.walk(tag_dir):
        for name in files:
            try:
                fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            except FileNotFoundError:
                # Another rank's temporary file, renamed between the listing and the open: that rank
                # fsyncs its own files (_atomic_write before the rename, and its own walk after it).
                continue
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(Path(dirpath))
    _fsync_dir(tag_dir.parent)


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


def _candidates(root: Path) -> list[Path]:
    """Committed tag directories, newest first: the pointer's tag, then the older ones still on disk.

    Tags newer than the pointer are uncommitted leftovers of a crash while saving: never candidates.
    An unreadable pointer (torn by a crash of the filesystem) falls back to the newest tag on disk.
    """
    tags = sorted((p for p in root.iterdir() if p.is_dir() and _TAG.match(p.name)), key=lambda p: p.name)
    try:
        newest = json.loads((root / POINTER).read_text())["tag"]
    except FileNotFoundError:
        return []
    except (OSError, ValueError, KeyError, TypeError) as e:
        log.warning("checkpoint pointer %s is unreadable (%s): trying the tags on disk", root / POINTER, e)
        newest = tags[-1].name if tags else ""
    return [p for p in reversed(tags) if p.name <= newest]


@dataclass
class Skipped:
    """A committed checkpoint that failed to load (``load_checkpoint`` fell back past it)."""

    tag_dir: Path
    step: int
    reason: str
    state: LearnerState | None  # its learner state, when that file was still readable


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
        # Shallow: the fields are JSON values already, and asdict's deep copy of the ledger's ids
        # (learner.ledger_size, 16384 strings) cost ~2.6 ms of every checkpoint (py-spy, demo).
        _atomic_write(
            tag_dir / STATE_FILE, json.dumps({f.name: getattr(state, f.name) for f in fields(state)})
        )
    _fsync_tree(tag_dir)
    _barrier(le)  # every rank's shards and RNG are durable on disk before the commit
    if le.rank == 0:
        _atomic_write(root / POINTER, json.dumps({"tag": tag, "step": state.step, "version": state.version}))
        prune_checkpoints(root, tag, keep)
    _barrier(le)
    return tag_dir


def prune_checkpoints(root: Path, tag: str, keep: int) -> list[Path]:
    """Remove the tags older than the newest ``keep`` committed ones (``tag`` the newest) and the
    uncommitted ones newer than ``tag``; returns the tags that could not be removed (fully).

    A tag that cannot be removed (permissions, an immutable file, a busy mount) is logged with the
    error and left: the next save lists the tags again and retries it, so nothing is lost and the
    step loop never stops for it. It was ``rmtree(ignore_errors=True)``: such tags piled up
    silently, a checkpoint's worth of disk each time, in a run meant to last days."""
    tags = sorted((p for p in root.iterdir() if p.is_dir() and _TAG.match(p.name)), key=lambda p: p.name)
    # Tags newer than this one are uncommitted leftovers of a crashed save (a resume fell back past
    # them): never candidates, so garbage; counted among the kept they would push out a good one.
    committed = [p for p in tags if p.name <= tag]
    doomed = [p for p in tags if p.name > tag] + (committed[:-keep] if keep > 0 else [])
    failed = []
    for old in doomed:
        if old.name == tag:
            continue
        errors = remove_tree(old)
        if errors:
            failed.append(old)
            log.warning("old checkpoint %s could not be removed (%d error(s), first: %s); retried at the "
                        "next checkpoint", old, len(errors), errors[0])  # fmt: skip
    return failed


def _all_ranks_ok(le: LearnerEngine, ok: bool) -> bool:
    if le.world_size == 1:
        return ok
    # On the engine's device: a CUDA learner's group has only an NCCL backend, which reduces device
    # tensors; a CPU tensor fails there ("No backend type associated with device type cpu").
    flag = torch.tensor([1 if ok else 0], dtype=torch.int64, device=le.device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def _load_one(le: LearnerEngine, tag_dir: Path) -> LearnerState:
    state = LearnerState.from_dict(json.loads((tag_dir / STATE_FILE).read_text()))
    load_path, _client = le.engine.load_checkpoint(
        str(tag_dir.parent), tag=tag_dir.name, load_optimizer_states=True, load_lr_scheduler_states=False
    )
    if load_path is None:
        raise RuntimeError(f"DeepSpeed found no checkpoint files in {tag_dir}")
    rng = tag_dir / f"rng_rank{le.rank}.json"
    if rng.exists():  # absent when resuming with more ranks than saved
        _set_rng_state(json.loads(rng.read_text()))
    return state


def load_checkpoint(
    le: LearnerEngine, run_dir: str | os.PathLike[str], skipped: list[Skipped] | None = None
) -> LearnerState | None:
    """Restore the newest committed checkpoint that loads into ``le`` (collective); None when there is none.

    A checkpoint that fails to load on any rank (missing, truncated or corrupt files) is skipped with
    a warning and the previous one is restored; then the pointer is rewritten to name it and the ones
    passed over are renamed ``<tag>.corrupt-<time>`` (kept for inspection, never tried again).
    ``skipped`` receives what was passed over, so the caller can account for the work that was lost
    with it. Raises when no checkpoint loads although some were committed, renaming nothing: the
    failure may be transient or the environment's (an OOM, a changed world size or DeepSpeed), and a
    retry must find the same checkpoints; starting from scratch silently would discard the whole run.
    A pointer whose checkpoints are all gone raises too.
    """
    root = Path(run_dir) / CHECKPOINT_DIR
    if not root.is_dir():
        return None
    candidates = _candidates(root)
    if not candidates and (root / POINTER).exists():
        raise RuntimeError(
            f"{root / POINTER} names a committed checkpoint but no step* directory at or before it is left "
            f"in {root} (deleted, or renamed *.corrupt-*): restore one, or remove {root} to start over"
        )
    if le.world_size > 1:  # every rank must walk the same list (rank 0's view of the shared dir)
        box = [[str(p) for p in candidates]]
        dist.broadcast_object_list(box, src=0)
        candidates = [Path(p) for p in box[0]]
    errors: list[str] = []
    failed: list[Path] = []
    for tag_dir in candidates:
        try:
            state, err = _load_one(le, tag_dir), ""
        except Exception as e:  # a corrupt checkpoint raises whatever its reader raises
            state, err = None, f"{type(e).__name__}: {e}"
        if _all_ranks_ok(le, state is not None):
            # Every rank is past reading the failed ones (the all-reduce above): set them aside now,
            # once an older checkpoint has really taken their place.
            if failed and le.rank == 0:
                _atomic_write(root / POINTER, json.dumps({"tag": tag_dir.name, "step": state.step,
                                                           "version": state.version}))  # fmt: skip
                for bad in failed:
                    os.replace(bad, bad.with_name(f"{bad.name}.corrupt-{int(time.time())}"))
            return state
        err = err or "failed to load on another rank"
        errors.append(f"{tag_dir.name}: {err}")
        log.warning("checkpoint %s does not load (%s): falling back to the previous checkpoint", tag_dir, err)
        if skipped is not None:
            try:
                old = LearnerState.from_dict(json.loads((tag_dir / STATE_FILE).read_text()))
            except (OSError, ValueError, TypeError):
                old = None
            skipped.append(Skipped(tag_dir, int(_TAG.match(tag_dir.name).group(1)), err, old))
        failed.append(tag_dir)
    if errors:
        raise RuntimeError(f"no checkpoint in {root} loads: " + "; ".join(errors))
    return None
