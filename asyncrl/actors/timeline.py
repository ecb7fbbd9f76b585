"""The rollout actor's timeline: one JSON line per group and per weight swap, in the run dir.

``asyncrl plan --from RUN_DIR`` calibrates the pipeline's hand-off costs from it (how long a swap
pauses the engine and how long after a publish it starts, how long a finished group takes to reach
the buffer, how long a refused worker waits after the event that admits it); see
:mod:`asyncrl.plan.calibrate`. Records (unix seconds, ``time.time()``, comparable with the learner's
``step_time`` in metrics.jsonl on the same machine or NTP-synced nodes)::

    {"kind": "group", "t_try": .., "t_admit": .., "t_gen0": .., "t_gen1": .., "t_written": ..,
     "blocked": bool, "tokens": int, "v_start": int, "v_end": int}
    {"kind": "swap", "t_start": .., "pause_s": .., "version": int}

``t_try``: the worker asked for admission; ``t_admit``: it got it; ``t_gen0``/``t_gen1``: its
completions were submitted / all done; ``t_written``: the buffer write returned. Cost: one buffered
line per group and per swap, from the event loop (no thread, no fsync: a lost tail only shortens the
calibration sample). Invariant: a failure to write the timeline never stops the actor.

Bounded for runs of days: past :data:`TIMELINE_MAX_BYTES` the file becomes
``<actor_id>.prev.timeline.jsonl`` (replacing the one before) and a new one starts, so an actor keeps
at most about twice that (~500k groups). The calibration reads both (the same glob, the same actor)
and only needs a recent window.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, TextIO

__all__ = ["Timeline", "TIMELINE_SUFFIX"]

log = logging.getLogger(__name__)

TIMELINE_SUFFIX = ".timeline.jsonl"
#: Size at which the timeline starts a new file (the previous one is kept, the one before it dropped).
#: ~250 bytes a group: 64 MiB is ~250k groups, days of a large run and ~3 h of the CPU demo.
TIMELINE_MAX_BYTES = 64 << 20


class Timeline:
    """Appends timeline records to ``<run_dir>/logs/<actor_id>.timeline.jsonl``."""

    def __init__(self, run_dir: str | Path, actor_id: str, max_bytes: int = TIMELINE_MAX_BYTES) -> None:
        self.path = Path(run_dir) / "logs" / f"{actor_id}{TIMELINE_SUFFIX}"
        self.prev_path = self.path.with_name(f"{actor_id}.prev{TIMELINE_SUFFIX}")
        self.max_bytes = max_bytes
        self._f: TextIO | None = None
        self._size = 0  # bytes in the current file (what was there at open, plus what this wrote)
        self._failed = False

    def record(self, kind: str, **fields: Any) -> None:
        if self._failed:
            return
        try:
            if self._f is not None and self._size >= self.max_bytes:
                self._f.close()
                self._f = None
                self.path.replace(self.prev_path)  # atomic: a reader sees the old file or the new one
            if self._f is None:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self._f = self.path.open("a", buffering=1)  # line-buffered: whole lines reach the file
                self._size = self._f.tell()
            line = json.dumps({"kind": kind, **fields}) + "\n"
            self._f.write(line)
            self._size += len(line)
        except OSError as e:  # a full or read-only disk must not stop generation
            self._failed = True
            log.warning("timeline %s disabled: %s", self.path, e)

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None
