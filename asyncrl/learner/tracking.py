"""Experiment tracking: every step record to TensorBoard (on by default) and Weights & Biases.

:class:`Tracker` is an ``on_step`` callback of :func:`asyncrl.learner.loop.learn` (rank 0): each
:class:`~asyncrl.learner.records.StepRecord` becomes scalars at ``global_step = record.step``:

* ``train/<field>`` for every numeric field (reward_mean, loss, staleness_mean, ...; the cumulative
  ``*_total`` counters under ``totals/``);
* ``eval/reward_mean``, ``eval/pass_at_k``, ``eval/length_mean`` once per new periodic eval, at the step
  it arrived (and ``eval/by_version/*`` with the evaluated version as the x axis, in the run
  ``<run_dir>/tensorboard/by_version``: see below).

A resumed learner redoes the steps after its checkpoint, and metrics.jsonl drops their old records
(``MetricsWriter.truncate_after``); TensorBoard reads every event file of the directory, so the old
lineage's events stayed and the step axis went back (…, 8, 9, 6, 7, …). Each learner process
therefore starts with a purge marker at its first step (what ``SummaryWriter(purge_step=...)``
writes: a ``SessionLog.START``), at which TensorBoard drops every earlier-written event of that step or
later. The by-version evals live in their own run, which no purge touches: versions only go up, so
that axis never goes back, and a purge at a step would drop valid evals of higher-numbered versions.

TensorBoard event files go to ``<run_dir>/tensorboard`` (``tensorboard --logdir runs/``), one event
per step holding all of its scalars (what TensorFlow's merged summaries write; TensorBoard shows each
value under its own tag). Why not one ``add_scalar`` each: ~64 events per step cost the learner ~2 ms
of CPU per step (each built, queued to the writer thread, blocking when its queue is full, and
CRC'd in pure Python), on the core it shares with the actors' front end in a CPU run; one event
costs ~0.2 ms. W&B runs in
offline mode when no API key is configured (``wandb sync <run_dir>/wandb/offline-run-*`` uploads it
later); the run id is derived from the run dir, so a resumed learner continues the same W&B run.

:func:`attach_eval` copies the newest periodic eval result (carried in actor 0's heartbeat, see
:mod:`asyncrl.evaluate`) into a record before it is written.
"""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path
from typing import Any

from asyncrl.learner.records import StepRecord

__all__ = ["Tracker", "attach_eval", "EVAL_FIELDS", "TENSORBOARD_DIR", "BY_VERSION_DIR"]

log = logging.getLogger(__name__)
TENSORBOARD_DIR = "tensorboard"
BY_VERSION_DIR = "by_version"  # under TENSORBOARD_DIR: the eval/by_version/* run
#: StepRecord field -> key of the eval result (asyncrl.evaluate.EvalResult).
EVAL_FIELDS = {"eval_version": "version", "eval_reward_mean": "reward_mean", "eval_pass_at_k": "pass_at_k",
               "eval_length_mean": "length_mean"}  # fmt: skip
_last_eval: dict[str, Any] = {}


def attach_eval(rec: StepRecord, buffer: Any) -> None:
    """Set ``rec.eval_*`` to the newest eval in the actors' heartbeats (or the last one seen)."""
    try:
        results = [a["eval"] for a in buffer.actors().values() if isinstance(a.get("eval"), dict)]
    except Exception as e:  # tracking must never stop training; the next step tries again
        log.warning("reading eval results: %s", e)
        results = []
    for r in results:
        if int(r.get("version", -1)) > int(_last_eval.get("version", -1)):
            _last_eval.clear()
            _last_eval.update(r)
    if _last_eval:
        for field, key in EVAL_FIELDS.items():
            setattr(rec, field, type(getattr(rec, field))(_last_eval[key]))


def _scalars(rec: StepRecord) -> dict[str, float]:
    out = {}
    for k, v in rec.to_dict().items():
        if (
            isinstance(v, bool)
            or not isinstance(v, int | float)
            or k in ("step", "step_time")
            or k in EVAL_FIELDS
        ):
            continue
        out[f"totals/{k}" if k.endswith("_total") else f"train/{k}"] = float(v)
    return out


def _summary(scalars: dict[str, float]) -> Any:
    """One TensorBoard ``Summary`` with a simple (float32) value per tag, as ``add_scalar`` writes each."""
    from tensorboard.compat.proto.summary_pb2 import Summary

    return Summary(value=[Summary.Value(tag=tag, simple_value=v) for tag, v in scalars.items()])


def _purge_marker(step: int) -> Any:
    """The event at which TensorBoard drops every earlier-written event of ``step`` or later (all tags
    of the run): a ``SessionLog.START``, as ``SummaryWriter(purge_step=step)`` writes it."""
    from tensorboard.compat.proto.event_pb2 import Event, SessionLog

    return Event(step=step, session_log=SessionLog(status=SessionLog.START))


class Tracker:
    """TensorBoard and/or W&B logging of step records (see the module doc)."""

    def __init__(self, cfg: Any, run_dir: str | os.PathLike) -> None:
        self.run_dir = Path(run_dir)
        self.tb: Any = None
        self.tb_by_version: Any = None
        self._purged = False  # the purge marker is written before this process's first step
        self.wandb: Any = None
        self._eval_version = -1
        self.errors = 0  # writes that failed (logged; tracking never stops training)
        t = cfg.tracking
        if t.tensorboard:
            from torch.utils.tensorboard.writer import FileWriter

            self.tb = FileWriter(str(self.run_dir / TENSORBOARD_DIR), flush_secs=5)
            self.tb_by_version = FileWriter(
                str(self.run_dir / TENSORBOARD_DIR / BY_VERSION_DIR), flush_secs=5
            )
        if t.wandb:
            self.wandb = self._init_wandb(cfg)

    def _init_wandb(self, cfg: Any) -> Any:
        import wandb

        from asyncrl.config import to_yaml

        t = cfg.tracking
        mode = t.wandb_mode
        if mode == "auto":
            mode = "online" if os.environ.get("WANDB_API_KEY") else "offline"
        run_id = f"{cfg.run.name}-{hashlib.sha1(str(self.run_dir.resolve()).encode()).hexdigest()[:8]}"
        import yaml

        return wandb.init(project=t.wandb_project, entity=t.wandb_entity or None, name=cfg.run.name, id=run_id,
                          resume="allow", dir=str(self.run_dir), mode=mode,
                          config=yaml.safe_load(to_yaml(cfg)))  # fmt: skip

    def __call__(self, rec: StepRecord) -> None:
        scalars = _scalars(rec)
        new_eval = rec.eval_version >= 0 and rec.eval_version != self._eval_version
        if new_eval:
            self._eval_version = rec.eval_version
            for field, key in EVAL_FIELDS.items():
                if field != "eval_version":
                    scalars[f"eval/{key}"] = float(getattr(rec, field))
        if self.tb is not None:
            try:
                if not self._purged:
                    self.tb.add_event(_purge_marker(rec.step), walltime=rec.step_time or None)
                    self._purged = True
                self.tb.add_summary(_summary(scalars), rec.step, rec.step_time or None)
                if new_eval:  # x axis: the evaluated version
                    by_version = {f"eval/by_version/{key}": float(getattr(rec, field))
                                  for field, key in EVAL_FIELDS.items() if field != "eval_version"}  # fmt: skip
                    self.tb_by_version.add_summary(
                        _summary(by_version), rec.eval_version, rec.step_time or None
                    )
            except Exception as e:
                self._failed("TensorBoard", rec.step, e)
        if self.wandb is not None:
            try:
                self.wandb.log(scalars, step=rec.step)
            except Exception as e:
                self._failed("W&B", rec.step, e)

    def _failed(self, sink: str, step: int, e: Exception) -> None:
        """A tracking write failed (a full disk under the TensorBoard dir, a W&B service gone): the step
        record is in metrics.jsonl already and training goes on. A crash here would restart the learner
        from its last checkpoint, fail again one step later, and use up run.max_restarts and the
        pending groups' deliveries (learner.max_deliveries) on a logging problem. Logged (the first
        three, then every 100th), counted in ``errors``."""
        self.errors += 1
        if self.errors <= 3 or self.errors % 100 == 0:
            log.error("%s write of step %d failed (%d tracking write(s) failed so far): %r",
                      sink, step, self.errors, e)  # fmt: skip

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
            self.tb_by_version.close()
            self.tb = self.tb_by_version = None
        if self.wandb is not None:
            self.wandb.finish()
            self.wandb = None
