"""Plots of a staleness sweep, with the spread over seeds drawn as bands and error bars.

reward_vs_step.png      reward (trailing mean over SMOOTH steps) vs learner step: one panel per
                        max_staleness, one line per objective, band = 95% bootstrap over seeds
reward_vs_time.png      the same vs seconds after start-up (see asyncrl.sweep_report)
final_reward_vs_staleness.png   final reward, mean reward over steps and time-averaged reward vs
                        max_staleness, error bars = 95% bootstrap over seeds
throughput_vs_staleness.png     trained samples/s and learner idle fraction vs max_staleness
paired_diff.png         objective - baseline per staleness level (paired by seed), with intervals
staleness_dist.png      fraction of trained tokens at each staleness, per cell
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from asyncrl.sweep_report import CellSpec, SeedRun
from asyncrl.sweep_runs import load_metrics, startup_s
from asyncrl.sweep_stats import band, moving_average

#: Trailing window (steps) of the reward curves: single steps of 4 groups are noisy.
SMOOTH = 5
PNGS = ("reward_vs_step", "reward_vs_time", "final_reward_vs_staleness", "throughput_vs_staleness",
        "paired_diff", "staleness_dist")  # fmt: skip
_DASH = ["-", "--", ":", "-."]
_MARK = "os^Dv<>p"


def _objectives(cells: Sequence[CellSpec]) -> list[str]:
    return list(dict.fromkeys(c.objective for c in cells))


def _curves(cells, seeds, statuses, clock: str) -> dict[str, list[tuple[np.ndarray, np.ndarray]]]:
    out: dict[str, list] = {}
    for c in cells:
        for s in seeds:
            run = SeedRun(c, s)
            if statuses.get(run.name, ("missing",))[0] != "ok":
                continue
            recs = load_metrics(run.dir / "metrics.jsonl")
            t0 = startup_s(recs)  # of the run, before any step is left out below
            # A "nan" reward (written as a string) would poison the moving average from there on.
            recs = [r for r in recs if math.isfinite(float(r["reward_mean"]))]
            if not recs:
                continue
            if clock == "step":
                recs = sorted(recs, key=lambda r: r["step"])
                x = np.array([r["step"] for r in recs], dtype=float)
            else:
                x = np.array([r["time"] - t0 for r in recs], dtype=float)
            y = moving_average([r["reward_mean"] for r in recs], SMOOTH)
            out.setdefault(c.name, []).append((x, y))
    return out


def _reward_panels(cells, seeds, statuses, clock: str, xlabel: str, path: Path) -> None:
    import matplotlib.pyplot as plt

    curves = _curves(cells, seeds, statuses, clock)
    stale = sorted({c.max_staleness for c in cells})
    objs = _objectives(cells)
    ncol = min(3, len(stale))
    nrow = -(-len(stale) // ncol)
    fig, axes = plt.subplots(nrow, ncol, figsize=(max(5 * ncol, 7), 3.6 * nrow), squeeze=False, sharey=True)
    for ax, s in zip(axes.flat, stale, strict=False):
        for c in (c for c in cells if c.max_staleness == s and c.name in curves):
            cs = curves[c.name]
            hi_x = max(x[-1] for x, _ in cs)
            grid = np.arange(1, hi_x + 1) if clock == "step" else np.linspace(0, hi_x, 120)
            mean, lo, hi = band(cs, grid)
            j = objs.index(c.objective)
            (line,) = ax.plot(grid, mean, linestyle=_DASH[j % 4], label=f"{c.objective} (n={len(cs)})")
            ax.fill_between(grid, lo, hi, color=line.get_color(), alpha=0.2, linewidth=0)
        ax.set(title=f"max_staleness={s}", xlabel=xlabel)
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=7)
        else:
            ax.text(0.5, 0.5, "no finished seed", ha="center", transform=ax.transAxes)
    for ax in axes.flat[len(stale) :]:
        ax.axis("off")
    for ax in axes[:, 0]:
        ax.set_ylabel(f"reward (trailing mean of {SMOOTH} steps)")
    fig.suptitle(f"reward vs {xlabel} (mean over seeds, band: 95% bootstrap)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


#: What the plots say where fewer than 2 seeds give no interval.
NO_INTERVAL = "no interval can be estimated; run more seeds"


def _err(pts: Sequence[tuple]) -> np.ndarray:
    """Error bar lengths below and above of (x, y, lo, hi) points; 0 where there is no interval (1 seed)."""
    return np.array([[0.0 if p[2] is None else p[1] - p[2] for p in pts],
                     [0.0 if p[3] is None else p[3] - p[1] for p in pts]])  # fmt: skip


def paired_note(comps: Sequence[dict]) -> str | None:
    """Why paired_diff.png shows no interval, or nothing: no objective-minus-baseline pair on the grid
    (one objective, or no baseline), or only single seeds. None when it shows intervals."""
    if not comps:
        return ("no objective - baseline pair on this grid (one objective, or no baseline);\n"
                "comparison.csv has the other comparisons")  # fmt: skip
    if not any(c["n"] for c in comps):
        return "no seed finished in both cells of any pair"
    if all(c["n"] < 2 for c in comps):
        return f"1 paired seed: {NO_INTERVAL}"
    return None


def _errorbars(rows: Sequence[dict], keys: Sequence[tuple[str, str]], title: str, path: Path) -> None:
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(keys), figsize=(5.2 * len(keys), 3.8), squeeze=False)
    objs = list(dict.fromkeys(r["objective"] for r in rows))
    if rows and all(r["seeds_ok"] < 2 for r in rows):
        title += f" (fewer than 2 finished seeds per cell: {NO_INTERVAL})"
    stale = sorted({r["max_staleness"] for r in rows})
    for ax, (key, label) in zip(axes[0], keys, strict=True):
        for j, obj in enumerate(objs):
            pts = sorted((r["max_staleness"], r[key], r[key + "_lo"], r[key + "_hi"]) for r in rows
                         if r["objective"] == obj and r.get(key) is not None)  # fmt: skip
            if not pts:
                continue
            # Objectives side by side around each grid point, so equal values do not hide each other.
            xs = np.array([stale.index(p[0]) for p in pts]) + (j - (len(objs) - 1) / 2) * 0.08
            y = np.array([p[1] for p in pts])
            err = _err(pts)
            ax.errorbar(xs, y, yerr=err, marker=_MARK[j % 8], linestyle=_DASH[j % 4], capsize=3, label=obj)
        ax.set_xticks(range(len(stale)), [str(s) for s in stale])
        ax.set_xlim(-0.5, len(stale) - 0.5)  # categorical: 0,1,2,4,8,16 evenly
        ax.set(xlabel="max_staleness", ylabel=label)
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _paired(comps: Sequence[dict], path: Path) -> None:
    import matplotlib.pyplot as plt

    # Objective minus baseline only (the rows against a fixed bound or staleness 0 have their own x axis).
    comps = [
        c
        for c in comps
        if "fixed bound" not in c["baseline"] and not c["baseline"].endswith(" at staleness 0")
    ]
    note = paired_note(comps)
    metrics = list(dict.fromkeys(c["metric"] for c in comps)) or ["final_reward"]
    fig, axes = plt.subplots(1, len(metrics), figsize=(4.6 * len(metrics), 3.8), squeeze=False)
    objs = list(dict.fromkeys(c["objective"] for c in comps))
    stale = sorted({c["max_staleness"] for c in comps})
    for ax, m in zip(axes[0], metrics, strict=True):
        ax.axhline(0, color="k", linewidth=0.8)
        for j, obj in enumerate(objs):
            pts = sorted((c["max_staleness"], c["diff"], c["diff_lo"], c["diff_hi"]) for c in comps
                         if c["metric"] == m and c["objective"] == obj and c["n"])  # fmt: skip
            if pts:
                xs = np.array([stale.index(p[0]) for p in pts]) + (j - (len(objs) - 1) / 2) * 0.1
                err = _err(pts)
                ax.errorbar(xs, [p[1] for p in pts], yerr=err, marker=_MARK[j % 8], linestyle="", capsize=3,
                            label=f"{obj} - {next(c['baseline'] for c in comps if c['objective'] == obj)}")  # fmt: skip
        ax.set_xticks(range(len(stale)), [str(s) for s in stale])
        ax.set_xlim(-0.5, max(len(stale), 1) - 0.5)
        ax.set(xlabel="max_staleness", ylabel=f"paired diff of {m}")
        ax.grid(alpha=0.3)
        if len(ax.lines) > 1:
            ax.legend(fontsize=7)
        if note:
            ax.text(0.5, 0.95, note.replace("; ", ";\n"), ha="center", va="top", fontsize=8, transform=ax.transAxes,
                    bbox={"facecolor": "white", "alpha": 0.85, "edgecolor": "none"})  # fmt: skip
    # Two lines: one panel (one metric) is too narrow for the title on one line.
    fig.suptitle("objective minus baseline, paired by seed\n(95% bootstrap interval)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _dist(dist: Sequence[dict], cells: Sequence[CellSpec], path: Path) -> None:
    import matplotlib.pyplot as plt

    objs = _objectives(cells)
    fig, axes = plt.subplots(1, len(objs), figsize=(4.8 * len(objs), 3.6), squeeze=False, sharey=True)
    for ax, obj in zip(axes[0], objs, strict=True):
        for c in (c for c in cells if c.objective == obj):
            pts = [(d["staleness"], d["fraction"]) for d in dist if d["cell"] == c.name]
            if pts:
                ax.plot(
                    [p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"bound {c.max_staleness}"
                )
        ax.set(title=obj, xlabel="token staleness V - v_t at train time")
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=7)
    axes[0, 0].set_ylabel("fraction of trained tokens")
    fig.suptitle("measured staleness of trained tokens (pooled over seeds)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_all(cells, seeds, statuses, rows, comps, dist, out_dir: Path) -> list[Path]:
    """Write every PNG of the module doc into ``out_dir``; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")  # no display on CI or over ssh; must precede pyplot
    p = {n: out_dir / f"{n}.png" for n in PNGS}
    _reward_panels(cells, seeds, statuses, "step", "learner step", p["reward_vs_step"])
    _reward_panels(cells, seeds, statuses, "time", "seconds after start-up", p["reward_vs_time"])
    _errorbars(rows, [("final_reward", "final reward (last 3 steps)"), ("reward_mean_steps", "mean reward over steps"),
                      ("reward_auc_time", "time-averaged reward")], "reward vs max_staleness", p["final_reward_vs_staleness"])  # fmt: skip
    _errorbars(rows, [("samples_per_s", "trained samples/s"), ("learner_wait_frac", "learner idle fraction"),
                      ("staleness_mean", "mean token staleness")], "throughput vs max_staleness", p["throughput_vs_staleness"])  # fmt: skip
    _paired(comps, p["paired_diff"])
    _dist(dist, cells, p["staleness_dist"])
    return list(p.values())
