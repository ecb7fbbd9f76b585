"""``asyncrl bench --startup-only``: start-up to the first learner step, by phase, over several runs.

The full bench reads the start-up phases off one of its pipeline runs; a start-up change needs more
than one sample (a cold run differs from a warm one by the page cache, and Ray's and vLLM's start
times spread by seconds on a shared box) and none of the steady-state rows. Each sample here is a
real ``asyncrl run`` of the demo stopped after a few steps (max_staleness 1, the demo's own), and
each phase is reported as the median over the samples with its spread, so one slow start is visible
as spread instead of moving the row.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from .pipeline import run_demo, startup_phases

__all__ = ["STARTUP_STEPS", "startup_rows", "summarize"]

#: Learner steps per sample: enough that the first step has finished and been written, no more.
STARTUP_STEPS = 3


def summarize(samples: list[dict[str, float | None]]) -> dict[str, Any]:
    """Per phase: median, min and max over the samples that reached it (a phase none reached is None)."""
    keys = list(dict.fromkeys(k for s in samples for k in s))
    out: dict[str, Any] = {}
    for k in keys:
        vals = [s[k] for s in samples if s.get(k) is not None]
        out[k] = (
            {"median": statistics.median(vals), "min": min(vals), "max": max(vals), "n": len(vals)}
            if vals
            else None
        )
    return out


def startup_rows(config: str | None, runs: int, root: Path) -> dict[str, Any]:
    """``runs`` short demo runs, one after the other; their phases and the per-phase summary."""
    if runs < 1:
        raise ValueError(f"--startup-only: at least 1 run expected, got {runs}")
    samples = []
    for i in range(runs):
        d = root / f"startup-{i}"
        d.mkdir(parents=True, exist_ok=True)
        samples.append(startup_phases(run_demo(config, 1, STARTUP_STEPS, d)))
    return {"runs": samples, "summary": summarize(samples), "steps_per_run": STARTUP_STEPS}
