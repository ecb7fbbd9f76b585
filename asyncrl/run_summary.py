"""``summary.json`` of a run dir: written at every end of `asyncrl run` (and of `asyncrl learn`), read by
a re-run (a finished run is not overwritten), ``asyncrl status`` and the sweeps. Stdlib only: the
readers import it without Ray, torch or vLLM. Moved out of asyncrl.orchestrator (still importable there).
"""

from __future__ import annotations

import json
import os
from collections import deque
from collections.abc import Iterable
from pathlib import Path


def write_summary(rdir: Path, records: Iterable[dict], start: float, end: float, extra: dict) -> dict:
    """``summary.json`` of the run dir from its metrics.jsonl records and this start's [start, end].

    After a resume metrics.jsonl holds the earlier starts' steps too: ``steps`` and ``trained_tokens``
    are the run's, but ``wall_s`` and the rate are this start's, so the rate counts only the tokens of
    steps that ended since ``start`` (before: every start's tokens over the last one's wall seconds).
    ``records`` is consumed once, in order (:func:`iter_jsonl`: a run of days is not held in memory)."""
    first: list[dict] = []
    last: deque[dict] = deque(maxlen=3)
    tokens = tokens_this_start = 0
    staleness_max = 0
    for r in records:
        if len(first) < 3:
            first.append(r)
        last.append(r)
        tokens += r.get("tokens", 0)
        if float(r.get("step_time", start)) >= start:
            tokens_this_start += r.get("tokens", 0)
        staleness_max = max(staleness_max, r["staleness_max"])
    summary = {
        "steps": last[-1]["step"] if last else 0,
        "final_version": last[-1]["version"] if last else 0,
        "start_reward": sum(r["reward_mean"] for r in first) / len(first) if first else None,
        "end_reward": sum(r["reward_mean"] for r in last) / len(last) if last else None,
        "wall_s": end - start,
        "trained_tokens": tokens,
        "trained_tokens_per_s": tokens_this_start / max(end - start, 1e-9),
        "staleness_max": staleness_max,
        **extra,
    }
    # Atomic: status and a re-run read it at any time, and the Ray-loss path writes it twice in a process
    # Ray may abort; a torn file read as {} made a finished run look unfinished.
    tmp = rdir / f".summary.json.tmp-{os.getpid()}"
    tmp.write_text(json.dumps(summary, indent=2))
    os.replace(tmp, rdir / "summary.json")
    return summary


def read_summary(rdir: Path) -> dict:
    try:
        return json.loads((rdir / "summary.json").read_text())
    except (OSError, ValueError):
        return {}
