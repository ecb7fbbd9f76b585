"""``asyncrl learn``: the DeepSpeed learner as a role of its own (split roles: ``asyncrl serve-actors``
elsewhere, the user's Redis between them), and the learner process of ``asyncrl run``.

Its lines (every step, its resume, its stop) go to the console and to ``<run_dir>/learner.log``
(:func:`asyncrl.console.role_logging`); a fresh start over a run that has weights or a checkpoint is
refused before DeepSpeed loads and before the run dir changes (:func:`check_fresh_start`, called once,
by asyncrl.cli before it writes the run's config.yaml: `asyncrl run`'s learner is started through it too);
on its own (not `asyncrl run`'s learner) it writes the run dir's ``summary.json`` when it ends, finished,
interrupted or failed, as `asyncrl run` does. Imported by asyncrl.cli only for ``asyncrl learn`` (it imports torch).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

__all__ = ["run_learn", "check_fresh_start"]

log = logging.getLogger("asyncrl.learn")


def check_fresh_start(cfg: Any, rdir: Path) -> None:
    """`asyncrl learn` without --resume on a run that has published weights or a checkpoint: refused here,
    in a second, as one `asyncrl: error:` line. The learner refuses it too (the backstop), but only after
    DeepSpeed and the model had loaded, with a traceback. A Redis that does not answer yet: the learner's
    own check decides once it reaches it."""
    from asyncrl.learner.records import CHECKPOINT_DIR, POINTER  # stdlib only

    found = (rdir / CHECKPOINT_DIR / POINTER).exists()
    if not found:
        from asyncrl.buffer import ReplayBuffer

        try:
            with ReplayBuffer.from_config(cfg, socket_timeout=5.0, retry_budget_s=2.0) as buf:
                found = buf.latest_manifest() is not None or buf.version() != 0  # Rank0.published_max
        except Exception:
            return
    if found:
        raise FileExistsError(
            f"run {cfg.run.name!r} already has published weights or a checkpoint in {rdir}; resume it "
            "(asyncrl learn --resume) or use a new run name and directory"
        )


def run_learn(cfg: Any, rdir: Path, resume: bool) -> int:
    """`asyncrl learn`: its lines on the console (and in <run_dir>/learner.log), the learner, and on its
    own (not as `asyncrl run`'s learner, whose run writes it) the run dir's summary.json when it ends."""
    from asyncrl.console import role_logging
    from asyncrl.launch import ENV_REDIS_URL

    rank0 = int(os.environ.get("RANK", "0")) == 0
    role_logging(rdir / "learner.log" if rank0 else None)
    if cfg.learner.torch_threads:  # before torch is imported: it reads OMP_NUM_THREADS once
        os.environ["OMP_NUM_THREADS"] = str(cfg.learner.torch_threads)
    from asyncrl.learner.engine import shutdown_distributed
    from asyncrl.learner.loop import learn

    start = float(os.environ.get("ASYNCRL_START_TIME", time.time()))
    exporter, stop_metrics = _learner_metrics(cfg)
    tracker = _tracker(cfg, rdir)
    status, error = "interrupted", ""
    try:
        state = learn(cfg, rdir, resume=resume, start_time=start, on_step=[exporter, *tracker],
                      on_wait=[exporter.waiting])  # fmt: skip
        if cfg.run.max_steps and state.step >= cfg.run.max_steps:
            status = "finished"
            log.info("reached run.max_steps=%d: done (checkpoint at step %d)", cfg.run.max_steps, state.step)
        else:
            log.info("stopping: checkpoint at step %d (asyncrl learn --resume continues the run)", state.step)
    except Exception as e:
        status, error = "failed", f"{type(e).__name__}: {e}"
        raise
    finally:
        for t in tracker:
            t.close()
        stop_metrics()
        shutdown_distributed()  # this process owns its rank (see the function)
        if rank0 and not os.environ.get(ENV_REDIS_URL):  # not `asyncrl run`'s learner: that run writes it
            if status == "finished" or not _finished_before(rdir, start):
                _learn_summary(cfg, rdir, start, status, error)
    return 0


def _finished_before(rdir: Path, start: float) -> bool:
    """Did an earlier start finish the run, and has this one trained no step (a --resume that failed
    before its first step, e.g. Redis unreachable)? Its summary is then kept: replaced by "failed", the
    finished run would look unfinished and `asyncrl run` would no longer refuse to start over it."""
    from asyncrl.learner.records import METRICS_FILE, lines_from_end
    from asyncrl.run_summary import read_summary

    if not read_summary(rdir).get("finished"):
        return False
    for _, line in lines_from_end(rdir / METRICS_FILE):
        try:
            return float(json.loads(line)["step_time"]) < start  # the newest record: before this start
        except (ValueError, KeyError, TypeError):
            continue
    return True


def _learn_summary(cfg: Any, rdir: Path, start: float, status: str, error: str) -> None:
    """summary.json of a run whose learner ran on its own (split roles), as `asyncrl run` writes it
    (asyncrl.run_summary.write_summary), marked ``"started_by": "asyncrl learn"``: asyncrl status shows
    it once the run is not up, and `asyncrl run` refuses to start over a finished one."""
    from asyncrl.buffer import ReplayBuffer
    from asyncrl.learner.records import METRICS_FILE, iter_jsonl
    from asyncrl.run_summary import write_summary

    extra: dict = {"finished": status == "finished", "status": status, "error": error,
                   "started_by": "asyncrl learn"}  # fmt: skip
    try:
        with ReplayBuffer.from_config(cfg, socket_timeout=5.0, retry_budget_s=2.0) as buf:
            extra["buffer"] = buf.stats()
    except Exception as e:  # Redis gone: the summary is written without the buffer's state
        extra["buffer_error"] = f"{type(e).__name__}: {e}"
    try:
        write_summary(rdir, iter_jsonl(rdir / METRICS_FILE), start, time.time(), extra)
    except Exception as e:  # the learner's own outcome (its exception) must not be masked
        print(f"asyncrl learn: summary.json not written: {type(e).__name__}: {e}", file=sys.stderr)


def _learner_metrics(cfg: Any) -> tuple[Any, Any]:
    """Rank 0 serves the learner's and the buffer's metrics; its address goes to the learner status."""
    from asyncrl.metrics_export import (
        LearnerExporter,
        learner_collectors,
        metrics_endpoint,
        scrape_buffer,
        serve,
    )

    exporter = LearnerExporter(cfg.buffer.max_staleness)
    if not cfg.metrics.enabled or int(os.environ.get("RANK", "0")) != 0:
        return exporter, lambda: None
    from asyncrl.buffer import ReplayBuffer

    buf = ReplayBuffer.from_config(cfg)
    # The scrape's own client (short timeouts, no retry): a Redis outage costs the buffer's series, never
    # the learner's (the patient client above rides out a restart for redis.retry_budget_s).
    scrape_buf = scrape_buffer(cfg)
    bind, advertised = metrics_endpoint(cfg.metrics.host)
    port, stop = serve(learner_collectors(exporter, scrape_buf.stats), bind, cfg.metrics.port)
    buf.set_learner_status({"metrics_addr": f"{advertised}:{port}"})

    def close() -> None:
        stop()
        scrape_buf.close()
        buf.close()

    return exporter, close


def _tracker(cfg: Any, rdir: Path) -> list:
    """TensorBoard / W&B step logging on rank 0 (none when both are off)."""
    if int(os.environ.get("RANK", "0")) != 0 or not (cfg.tracking.tensorboard or cfg.tracking.wandb):
        return []
    from asyncrl.learner.tracking import Tracker

    return [Tracker(cfg, rdir)]
