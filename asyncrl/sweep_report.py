"""The report of a staleness sweep: per-seed numbers from run dirs, per-cell means with bootstrap
intervals, paired comparisons against the baseline objective, csv/markdown tables and plots.

Pure functions over the per-run numbers of :mod:`asyncrl.sweep_runs` (read from ``metrics.jsonl``,
one JSON record per learner step, ``time`` = seconds since the run's command started, and
``summary.json``); nothing here starts a process, so it is unit-tested on
synthetic run dirs. ``asyncrl.sweep`` runs the seeds of every cell and calls :func:`write_report`.

Two budget views, because they answer different questions:

* **steps** (sample efficiency): ``reward_at_step_<n>`` = mean reward of the last LAST_K steps up to
  step n, and ``reward_mean_steps`` = the mean reward over all steps. Cells are compared at equal
  numbers of learner steps, i.e. equal amounts of trained data; a run that did not reach step n has
  no value there (it is not compared at a budget it did not get).
* **wall clock after start-up** (what asynchrony buys): the clock starts when the first batch was
  ready (``startup_s`` = end of the first step minus its train and publish time), so that engine and
  learner start-up, identical work for every cell and a large share of a short CPU cell, does not
  drown the effect of ``max_staleness``. ``reward_at_<m>s`` = mean reward of the last LAST_K steps
  finished by m seconds of that clock (none for a run whose last step ended before m, as for a step
  mark it did not reach); ``reward_auc_time`` = time-averaged reward over the clock.

Rates (trained samples/s, learner idle fraction) are over the training window from the end of the
first step to the end of the last one. The staleness distribution of trained tokens is summed from
the steps' ``staleness_hist``.
"""

from __future__ import annotations

import csv
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from asyncrl.sweep_runs import (
    Marks,
    load_metrics,
    mark_column,
    metric_columns,
    run_metrics,
    staleness_hist,
    step_column,
)
from asyncrl.sweep_stats import Interval, bootstrap_ci, paired_ci

#: Identity columns of a run row (runs.csv) and of a cell row (results.csv).
RUN_HEAD = ("cell", "max_staleness", "objective", "seed", "status", "exit_code")
CELL_HEAD = ("cell", "max_staleness", "objective", "seeds", "seeds_ok")


@dataclass(frozen=True)
class CellSpec:
    """One grid point: its name, its coordinates and its directory (one sub-dir per seed)."""

    name: str
    max_staleness: int
    objective: str
    dir: Path


@dataclass(frozen=True)
class SeedRun:
    """One seed of a cell: one ``asyncrl run`` in ``<cell dir>/seed<k>``."""

    cell: CellSpec
    seed: int

    @property
    def name(self) -> str:
        return f"{self.cell.name}/seed{self.seed}"

    @property
    def dir(self) -> Path:
        return self.cell.dir / f"seed{self.seed}"


def columns(marks: Marks) -> list[str]:
    """The results.csv header: per metric its mean over seeds and the 95% interval bounds."""
    return [*CELL_HEAD, *(c + sfx for c in metric_columns(marks) for sfx in ("", "_lo", "_hi"))]


def run_columns(marks: Marks) -> list[str]:
    """The runs.csv header (one row per seed run)."""
    return [*RUN_HEAD, *metric_columns(marks)]


# ------------------------------------------------------------------------------------ aggregation


def run_row(run: SeedRun, marks: Marks, status: str, exit_code: int | None) -> dict[str, Any]:
    """One runs.csv row: the run's identity and :func:`run_metrics`."""
    c = run.cell
    row = {"cell": c.name, "max_staleness": c.max_staleness, "objective": c.objective, "seed": run.seed,
           "status": status, "exit_code": exit_code}  # fmt: skip
    row.update(run_metrics(run.dir, marks))
    return row


def cell_row(cell: CellSpec, runs: Sequence[dict[str, Any]], marks: Marks) -> dict[str, Any]:
    """One results.csv row: per metric the mean over the cell's ok seeds and its bootstrap interval."""
    ok = [r for r in runs if r["status"] == "ok"]
    row: dict[str, Any] = {"cell": cell.name, "max_staleness": cell.max_staleness, "objective": cell.objective,
                           "seeds": len(runs), "seeds_ok": len(ok)}  # fmt: skip
    for col in metric_columns(marks):
        ci = bootstrap_ci([r[col] for r in ok])
        # One seed: a mean but no interval (empty _lo/_hi: no spread can be estimated from one value).
        row[col], row[col + "_lo"], row[col + "_hi"] = (
            (None, None, None) if ci.n == 0 else (ci.mean, None, None) if ci.n < 2 else ci[:3]
        )
    return row


def few_seeds_warning(rows: Sequence[dict[str, Any]]) -> str | None:
    """The warning of a report whose cells have fewer than 2 finished seeds (None when every cell with
    a finished seed has two or more): their intervals, and those of their comparisons, are n/a."""
    few = [r["cell"] for r in rows if r["seeds_ok"] == 1]
    if not few:
        return None
    which = (
        "every cell has"
        if len(few) == len(rows)
        else f"{', '.join(few)} {'has' if len(few) == 1 else 'have'}"
    )
    return (
        f"Warning: {which} only 1 finished seed: no uncertainty can be estimated (intervals n/a), so a "
        f"difference cannot be told from seed-to-seed noise; run more seeds (e.g. sweep.seeds=[0,1,2])."
    )


#: Columns the paired naive-vs-corrected comparison is made on (those present in a report).
COMPARE = ("final_reward", "reward_mean_steps", "reward_auc_time")
#: What "the best fixed bound" of an objective is ranked by (see :func:`comparisons`).
BEST_BY = "reward_mean_steps"
#: Compared between a staleness level and staleness 0 of the same objective besides the reward columns:
#: what asynchrony buys (trained samples/s over the training window).
THROUGHPUT = "samples_per_s"


def on_policy_label(objective: str) -> str:
    """The ``baseline`` of a "staleness N vs 0, same objective" comparison row."""
    return f"{objective} at staleness 0"


def comparisons(
    cells: Sequence[CellSpec], runs: dict[str, list[dict[str, Any]]], marks: Marks, baseline: str | None
) -> list[dict[str, Any]]:
    """Paired (by seed) differences of the compared columns, with their mean and bootstrap interval:

    Compared: :data:`COMPARE`, every step mark some finished run reached, and the last wall-clock mark
    some finished run reached.

    * per staleness level, every objective other than ``baseline`` minus ``baseline``;
    * every cell at a staleness level > 0 minus the same objective at staleness 0 (what the staleness
      costs in reward, and buys in :data:`THROUGHPUT`, which these rows compare too);
    * every ``<X>-adaptive`` cell (the adaptive controller on objective X, ``max_staleness`` its
      ceiling) minus the X cell at its ceiling (does the controller beat the fixed bound it may go up
      to?) and minus the X cell at the best fixed bound: highest mean over seeds of
      ``reward_mean_steps``, the whole equal-steps curve (final reward saturates near the task's
      maximum at most bounds, so ranking by it would pick among ties by noise); ties go to the lower
      bound. When the best fixed bound is the ceiling, the pair is listed once, as the best.
    """
    ok = [r for rs in runs.values() for r in rs if r["status"] == "ok"]
    reached = [n for n in marks.steps if any(r[step_column(n)] is not None for r in ok)]
    reached_s = [m for m in marks.seconds if any(r[mark_column(m)] is not None for r in ok)]
    metrics = [*COMPARE[:2], *(step_column(n) for n in reached), *COMPARE[2:],
               *(mark_column(m) for m in reached_s[-1:])]  # fmt: skip
    by_key = {(c.max_staleness, c.objective): c for c in cells}

    def per_seed(name: str, m: str) -> dict[int, float | None]:
        return {r["seed"]: r[m] for r in runs.get(name, []) if r["status"] == "ok"}

    def best_fixed(obj: str) -> CellSpec | None:
        scored = [(bootstrap_ci(list(per_seed(c.name, BEST_BY).values())).mean, -c.max_staleness, c)
                  for c in cells if c.objective == obj]  # fmt: skip
        scored = [t for t in scored if math.isfinite(t[0])]
        return max(scored, key=lambda t: t[:2])[2] if scored else None

    pairs: list[tuple[CellSpec, CellSpec, str]] = []
    for c in cells:
        base = by_key.get((c.max_staleness, baseline)) if baseline else None
        if base is not None and c.objective != baseline:
            pairs.append((c, base, baseline))
        on_policy = by_key.get((0, c.objective))
        if on_policy is not None and c.max_staleness > 0:
            pairs.append((c, on_policy, on_policy_label(c.objective)))
        fixed = c.objective.removesuffix("-adaptive")
        if not c.objective.endswith("-adaptive"):
            continue
        ref = best_fixed(fixed)
        same = by_key.get((c.max_staleness, fixed))
        if same is not None and same is not ref:
            pairs.append((c, same, f"{fixed} at fixed bound {same.max_staleness}"))
        if ref is not None:
            pairs.append((c, ref, f"{fixed} at best fixed bound {ref.max_staleness}"))
    out = []
    for c, base, label in pairs:
        for m in [*metrics, THROUGHPUT] if label == on_policy_label(c.objective) else metrics:
            ci: Interval = paired_ci(per_seed(c.name, m), per_seed(base.name, m))
            one = ci.n < 2  # no interval from fewer than 2 pairs: empty bounds, excludes_zero n/a
            out.append({"max_staleness": c.max_staleness, "objective": c.objective, "baseline": label,
                        "metric": m, "diff": ci.mean, "diff_lo": None if one else ci.lo,
                        "diff_hi": None if one else ci.hi, "n": ci.n,
                        "excludes_zero": None if one else ci.excludes_zero()})  # fmt: skip
    return out


# ----------------------------------------------------------------------------------------- writing


def _fmt(v: Any) -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return ""
    if isinstance(v, float):
        return f"{v:.6g}"
    return str(v)


def _write_csv(rows: Sequence[dict], cols: Sequence[str], path: Path) -> Path:
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(cols)
        for row in rows:
            w.writerow([_fmt(row.get(c)) for c in cols])
    return path


def _num(v: Any) -> str:
    if isinstance(v, float) and math.isfinite(v):
        return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"
    return _fmt(v) or "-"


#: Columns of the markdown table (the csv has all of them).
MD_COLUMNS = ("steps", "final_reward", "reward_mean_steps", "reward_auc_time", "samples_per_s",
              "learner_wait_frac", "staleness_mean", "rollout_kl_mean", "dropped_groups", "wall_s")  # fmt: skip


#: What a run status other than ok means, for the report's list of left-out runs.
STATUS_NOTES = {
    "incomplete": "stopped before run.max_steps, e.g. by run.max_wall_s",
    "failed": "non-zero exit or cell_timeout_s",
    "interrupted": "the sweep was stopped during it",
    "running": "the sweep died during it",
    "missing": "not run yet",
}


def header(
    cells: Sequence[CellSpec], seeds: Sequence[int], runs: Sequence[dict], sweep_wall_s: float | None
) -> list[str]:
    """results.md's first lines: the grid, the seeds and the wall time (the sum of the runs' wall_s, any
    status: what the sweep cost, over every invocation that ran them)."""

    def values(xs: Sequence) -> str:
        return ", ".join(map(str, dict.fromkeys(xs)))

    walls = [r["wall_s"] for r in runs if isinstance(r.get("wall_s"), int | float)]
    total = (
        f"{sum(walls):.0f} s over {len(walls)} runs (sum of their wall_s)"
        if walls
        else "no run has a wall_s yet"
    )
    lines = [f"Grid: max_staleness {{{values(c.max_staleness for c in cells)}}} x objective "
             f"{{{values(c.objective for c in cells)}}}: {len(cells)} cells ({', '.join(c.name for c in cells)}), "
             f"seeds {{{values(seeds)}}}.", "", f"Wall time: {total}"]  # fmt: skip
    if sweep_wall_s is not None:
        lines[-1] += f"; this sweep command {sweep_wall_s:.0f} s"
    return [*lines, ""]


def write_markdown(rows: Sequence[dict], marks: Marks, comps: Sequence[dict], path: Path,
                   left_out: Sequence[tuple[str, str]] = (), head: Sequence[str] = ()) -> Path:  # fmt: skip
    """results.md: the ``head`` lines (:func:`header`), 'mean [lo, hi]' of the main columns per cell, then the
    paired comparisons, then the ``left_out`` runs ((name, status), status not ok) none of the numbers include."""
    cols = [c for c in (*MD_COLUMNS[:3], *(step_column(n) for n in marks.steps), *MD_COLUMNS[3:])]
    warn = few_seeds_warning(rows)
    lines = [*head, *([f"**{warn}**", ""] if warn else []),
             "| cell | seeds ok | " + " | ".join(cols) + " |", "|" + "---|" * (len(cols) + 2)]  # fmt: skip
    for r in rows:
        vals = []
        for c in cols:
            if r.get(c) is None:
                vals.append("-")
            elif r[c + "_lo"] == r[c + "_hi"]:
                vals.append(_num(r[c]))
            else:
                vals.append(f"{_num(r[c])} [{_num(r[c + '_lo'])}, {_num(r[c + '_hi'])}]")
        lines.append(f"| {r['cell']} | {r['seeds_ok']}/{r['seeds']} | " + " | ".join(vals) + " |")
    if comps:
        lines += ["", "Paired difference (cell - baseline, same seeds), mean [95% bootstrap interval]:", "",
                  "| max_staleness | objective | metric | diff | seeds | interval excludes 0 |", "|---|---|---|---|---|---|"]  # fmt: skip
        for c in comps:
            if c["n"] < 2:
                d = f"{_num(c['diff'])} [n/a (1 seed)]" if c["n"] else "-"
                sig = "n/a"
            else:
                d = f"{_num(c['diff'])} [{_num(c['diff_lo'])}, {_num(c['diff_hi'])}]"
                sig = "yes" if c["excludes_zero"] else "no"
            lines.append(
                f"| {c['max_staleness']} | {c['objective']} - {c['baseline']} | {c['metric']} | {d} | {c['n']} | {sig} |"
            )
    if left_out:
        # Named, not only counted in "seeds ok": results.md read alone must say which runs its numbers lack, and why.
        lines += ["", "Left out of every mean, interval and comparison above (only finished runs count):", ""]
        lines += [
            f"- {name}: {st}" + (f" ({STATUS_NOTES[st]})" if st in STATUS_NOTES else "")
            for name, st in left_out
        ]
    path.write_text("\n".join(lines) + "\n")
    return path


def write_report(
    cells: Sequence[CellSpec],
    seeds: Sequence[int],
    statuses: dict[str, tuple[str, int | None]],
    marks: Marks,
    out_dir: Path,
    baseline: str | None = None,
    sweep_wall_s: float | None = None,
) -> list[dict[str, Any]]:
    """runs.csv, results.csv, results.md, comparison.csv, staleness.csv and the plots; returns the cell rows.

    ``statuses``: SeedRun.name -> (status, exit code); a run not in it is reported as "missing". Only
    "ok" runs (finished: reached run.max_steps) enter the statistics and plots; runs.csv lists them all
    with their status, results.md names the others.
    """
    from asyncrl.sweep_plots import plot_all

    runs: dict[str, list[dict[str, Any]]] = {}
    for c in cells:
        runs[c.name] = [run_row(SeedRun(c, s), marks, *statuses.get(SeedRun(c, s).name, ("missing", None)))
                        for s in seeds]  # fmt: skip
    _write_csv([r for c in cells for r in runs[c.name]], run_columns(marks), out_dir / "runs.csv")
    rows = [cell_row(c, runs[c.name], marks) for c in cells]
    _write_csv(rows, columns(marks), out_dir / "results.csv")
    comps = comparisons(cells, runs, marks, baseline)
    comp_cols = [
        "max_staleness",
        "objective",
        "baseline",
        "metric",
        "diff",
        "diff_lo",
        "diff_hi",
        "n",
        "excludes_zero",
    ]
    _write_csv(comps, comp_cols, out_dir / "comparison.csv")
    left_out = [(r.name, st) for c in cells for r in (SeedRun(c, s) for s in seeds)
                if (st := statuses.get(r.name, ("missing", None))[0]) != "ok"]  # fmt: skip
    head = header(cells, seeds, [r for c in cells for r in runs[c.name]], sweep_wall_s)
    write_markdown(rows, marks, comps, out_dir / "results.md", left_out, head)
    dist = []
    for c in cells:  # pooled over the ok seeds
        hist: dict[int, int] = {}
        for s in seeds:
            if statuses.get(SeedRun(c, s).name, ("missing",))[0] == "ok":
                for k, v in staleness_hist(load_metrics(SeedRun(c, s).dir / "metrics.jsonl")).items():
                    hist[k] = hist.get(k, 0) + v
        total = sum(hist.values())
        dist += [{"cell": c.name, "max_staleness": c.max_staleness, "objective": c.objective, "staleness": k,
                  "tokens": v, "fraction": v / total} for k, v in sorted(hist.items())]  # fmt: skip
    _write_csv(
        dist,
        ["cell", "max_staleness", "objective", "staleness", "tokens", "fraction"],
        out_dir / "staleness.csv",
    )
    plot_all(cells, seeds, statuses, rows, comps, dist, out_dir)
    return rows
