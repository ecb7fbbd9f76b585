"""The report of a staleness sweep: per-cell numbers from run dirs, results.csv/.md and PNG plots.

Pure functions over ``metrics.jsonl`` (one JSON record per learner step, ``time`` = seconds since the
cell's command started) and ``summary.json``; nothing here starts a process, so it is unit-tested on
synthetic run dirs. ``asyncrl.sweep`` runs the cells and calls :func:`write_report`.

Time windows, and why: every cell pays about a minute of engine and learner start-up before its first
step. Rates (trained samples/s, learner wait fraction) are measured over the *training window*, from
the end of the first step to the end of the last one, so that start-up, which is the same for every
cell, does not drown the effect of ``max_staleness`` on short budgets. Reward-at-mark and the
reward curve use the raw time axis, start-up included, because that is the wall clock a user pays.
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: Number of last steps averaged into "final reward" and into reward-at-mark.
LAST_K = 3

#: results.csv columns before and after the per-mark ``reward_at_<m>s`` columns (in this order).
HEAD_COLUMNS = ("cell", "max_staleness", "objective", "status", "exit_code", "steps", "final_reward")
TAIL_COLUMNS = (
    "reward_auc",
    "samples_per_s",
    "trained_tokens_per_s",
    "gen_tokens_per_s",
    "learner_wait_frac",
    "staleness_mean",
    "staleness_max",
    "mismatch_kl_mean",
    "rollout_kl_mean",
    "dropped_groups",
    "wall_s",
)


@dataclass(frozen=True)
class CellSpec:
    """One grid point: its name, its coordinates and where it runs."""

    name: str
    max_staleness: int
    objective: str
    dir: Path


def mark_column(mark_s: float) -> str:
    """Column name of a wall-clock mark: 60 -> reward_at_60s, 90.5 -> reward_at_90.5s."""
    return f"reward_at_{mark_s:g}s"


def columns(marks_s: Sequence[float]) -> list[str]:
    """The results.csv header for these marks."""
    return [*HEAD_COLUMNS, *(mark_column(m) for m in marks_s), *TAIL_COLUMNS]


def load_metrics(path: Path) -> list[dict[str, Any]]:
    """Step records of a metrics.jsonl, sorted by time; a missing file is no steps.

    A torn last line (the cell was killed mid-write) is skipped rather than failing the whole report.
    """
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return sorted(out, key=lambda r: r["time"])


def _mean(xs: Sequence[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def final_reward(records: Sequence[dict]) -> float | None:
    """Mean reward of the last LAST_K steps (None without steps)."""
    return _mean([r["reward_mean"] for r in records[-LAST_K:]])


def reward_at(records: Sequence[dict], mark_s: float) -> float | None:
    """Mean reward of the last LAST_K steps finished by ``mark_s`` (None if no step had finished)."""
    done = [r for r in records if r["time"] <= mark_s]
    return final_reward(done)


def reward_auc(records: Sequence[dict]) -> float | None:
    """Trapezoid area under reward(time) divided by its duration: the time-averaged reward.

    Over [first step, last step]; a single step has no duration, its reward is the average.
    """
    if not records:
        return None
    t = [r["time"] for r in records]
    y = [r["reward_mean"] for r in records]
    duration = t[-1] - t[0]
    if duration <= 0:
        return _mean(y)
    area = sum((t[i + 1] - t[i]) * (y[i] + y[i + 1]) / 2 for i in range(len(t) - 1))
    return area / duration


def _group_size(cell_dir: Path) -> int:
    """G of the cell from the config.yaml the run wrote (completions per group); 0 if unknown.

    Read as plain YAML, not through the schema: a sweep dir must stay reportable after the schema
    gains or renames a key.
    """
    from omegaconf import OmegaConf

    path = cell_dir / "config.yaml"
    if not path.exists():
        return 0
    return int(OmegaConf.select(OmegaConf.load(path), "actors.group_size", default=0) or 0)


def _generated_tokens(summary: dict) -> int | None:
    """Sum of the actors' ``generated_tokens`` heartbeat counters, or None when none reported one."""
    vals = [a["generated_tokens"] for a in (summary.get("actors") or {}).values() if "generated_tokens" in a]
    return int(sum(vals)) if vals else None


def cell_row(cell: CellSpec, marks_s: Sequence[float], status: str, exit_code: int | None) -> dict[str, Any]:
    """All results.csv values of one cell (None = empty cell in the csv)."""
    recs = load_metrics(cell.dir / "metrics.jsonl")
    summary_path = cell.dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    row: dict[str, Any] = {c: None for c in columns(marks_s)}
    row.update(
        cell=cell.name,
        max_staleness=cell.max_staleness,
        objective=cell.objective,
        status=status,
        exit_code=exit_code,
        steps=len(recs),
        wall_s=summary.get("wall_s"),
    )
    if not recs:
        return row
    row["final_reward"] = final_reward(recs)
    for m in marks_s:
        row[mark_column(m)] = reward_at(recs, m)
    row["reward_auc"] = reward_auc(recs)
    # Training window: steps after the first, over the time between the first and last step ends.
    window = recs[-1]["time"] - recs[0]["time"]
    later = recs[1:]
    if window > 0:
        g = _group_size(cell.dir)
        row["samples_per_s"] = sum(r["groups"] for r in later) * g / window if g else None
        row["trained_tokens_per_s"] = sum(r["tokens"] for r in later) / window
        row["learner_wait_frac"] = sum(r["wait_s"] for r in later) / window
    gen = _generated_tokens(summary)
    if gen is not None and summary.get("wall_s"):
        # Actors have no step clock: this rate is over the whole command, start-up included.
        row["gen_tokens_per_s"] = gen / summary["wall_s"]
    row["staleness_mean"] = _mean([r["staleness_mean"] for r in recs])
    row["staleness_max"] = max(r["staleness_max"] for r in recs)
    row["mismatch_kl_mean"] = _mean([r["mismatch_kl"] for r in recs])
    row["rollout_kl_mean"] = _mean([r["rollout_kl"] for r in recs])
    row["dropped_groups"] = sum(r["dropped_stale"] for r in recs)
    return row


def _fmt(v: Any) -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return ""
    if isinstance(v, float):
        return f"{v:.6g}"
    return str(v)


def write_csv(rows: Sequence[dict], marks_s: Sequence[float], path: Path) -> Path:
    """results.csv: one row per cell, empty fields for values a cell does not have."""
    cols = columns(marks_s)
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(cols)
        for row in rows:
            w.writerow([_fmt(row.get(c)) for c in cols])
    return path


def write_markdown(rows: Sequence[dict], marks_s: Sequence[float], path: Path) -> Path:
    """results.md: the same table for reading (fewer digits, '-' for empty)."""
    cols = columns(marks_s)

    def cell(v: Any) -> str:
        if isinstance(v, float) and math.isfinite(v):
            return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"
        return _fmt(v) or "-"

    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(cell(r.get(c)) for c in cols) + " |" for r in rows]
    path.write_text("\n".join(lines) + "\n")
    return path


def write_report(
    cells: Sequence[CellSpec],
    statuses: dict[str, tuple[str, int | None]],
    marks_s: Sequence[float],
    out_dir: Path,
) -> list[dict[str, Any]]:
    """Rows for every cell, results.csv, results.md and the four PNGs in ``out_dir``; returns the rows."""
    rows = [cell_row(c, marks_s, *statuses.get(c.name, ("missing", None))) for c in cells]
    write_csv(rows, marks_s, out_dir / "results.csv")
    write_markdown(rows, marks_s, out_dir / "results.md")
    plot_all(cells, rows, out_dir)
    return rows


# ---------------------------------------------------------------------------------------------- plots


def _styles(cells: Sequence[CellSpec]) -> dict[str, dict[str, Any]]:
    """Colour by max_staleness (viridis, ordered), line style by objective, so both axes read at once."""
    import matplotlib

    stale = sorted({c.max_staleness for c in cells})
    objs = list(dict.fromkeys(c.objective for c in cells))
    cmap = matplotlib.colormaps["viridis"]
    dashes = ["-", "--", ":", "-."]
    return {
        c.name: {
            "color": cmap(stale.index(c.max_staleness) / max(len(stale) - 1, 1) * 0.9),
            "linestyle": dashes[objs.index(c.objective) % len(dashes)],
        }
        for c in cells
    }


def _curves(cells: Sequence[CellSpec], x_key: str, xlabel: str, path: Path) -> None:
    import matplotlib.pyplot as plt

    styles = _styles(cells)
    fig, ax = plt.subplots(figsize=(8, 4.5))
    drawn = 0
    for c in cells:
        recs = load_metrics(c.dir / "metrics.jsonl")
        if recs:
            ax.plot(
                [r[x_key] for r in recs],
                [r["reward_mean"] for r in recs],
                marker=".",
                label=c.name,
                **styles[c.name],
            )
            drawn += 1
    if drawn:
        ax.legend(fontsize=8, ncol=2)
    else:
        ax.text(0.5, 0.5, "no cell has steps yet", ha="center", transform=ax.transAxes)
    ax.set(xlabel=xlabel, ylabel="mean reward", title=f"reward vs {xlabel}")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _by_staleness(rows: Sequence[dict], keys: Sequence[tuple[str, str]], title: str, path: Path) -> None:
    """One panel per (column, label): that column vs max_staleness, one line per objective."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(keys), figsize=(5.5 * len(keys), 4), squeeze=False)
    objs = list(dict.fromkeys(r["objective"] for r in rows))
    for ax, (key, label) in zip(axes[0], keys, strict=True):
        for j, obj in enumerate(objs):
            pts = sorted(
                (r["max_staleness"], r[key]) for r in rows if r["objective"] == obj and r[key] is not None
            )
            if pts:
                # Distinct marker and dash per objective: equal values must not hide one another.
                ax.plot(
                    [p[0] for p in pts],
                    [p[1] for p in pts],
                    marker="os^D"[j % 4],
                    markersize=8 - 2 * (j % 2),
                    linestyle=["-", "--", ":", "-."][j % 4],
                    label=obj,
                )
        if ax.lines:
            ax.legend()
        else:
            ax.text(0.5, 0.5, "no data", ha="center", transform=ax.transAxes)
        ax.set_xticks(sorted({r["max_staleness"] for r in rows}))  # the grid values, not 0.25 steps
        ax.set(xlabel="max_staleness", ylabel=label)
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_all(cells: Sequence[CellSpec], rows: Sequence[dict], out_dir: Path) -> list[Path]:
    """reward_vs_step.png, reward_vs_time.png, final_reward_vs_staleness.png, throughput_vs_staleness.png."""
    import matplotlib

    matplotlib.use("Agg")  # no display on CI or over ssh; must precede pyplot
    paths = [
        out_dir / n
        for n in (
            "reward_vs_step.png",
            "reward_vs_time.png",
            "final_reward_vs_staleness.png",
            "throughput_vs_staleness.png",
        )
    ]
    _curves(cells, "step", "learner step", paths[0])
    _curves(cells, "time", "wall time since cell start (s)", paths[1])
    _by_staleness(
        rows,
        [
            ("final_reward", f"final reward (mean of last {LAST_K} steps)"),
            ("reward_auc", "time-averaged reward (AUC / duration)"),
        ],
        "reward vs max_staleness",
        paths[2],
    )
    _by_staleness(
        rows,
        [
            ("samples_per_s", "trained samples/s"),
            ("gen_tokens_per_s", "generated tokens/s"),
            ("learner_wait_frac", "learner wait fraction"),
        ],
        "throughput vs max_staleness",
        paths[3],
    )
    return paths
