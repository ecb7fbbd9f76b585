"""The report of a staleness sweep: per-seed numbers from run dirs, per-cell means with bootstrap
intervals, paired comparisons against the baseline objective, csv/markdown tables and plots.

Pure functions over ``metrics.jsonl`` (one JSON record per learner step, ``time`` = seconds since the
run's command started) and ``summary.json``; nothing here starts a process, so it is unit-tested on
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
  finished by m seconds of that clock; ``reward_auc_time`` = time-averaged reward over the clock.

Rates (trained samples/s, learner idle fraction) are over the training window from the end of the
first step to the end of the last one. The staleness distribution of trained tokens is summed from
the steps' ``staleness_hist``.
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from asyncrl.sweep_stats import Interval, bootstrap_ci, paired_ci

#: Number of last steps averaged into "final reward" and into the reward-at-mark columns.
LAST_K = 3

#: Identity columns of a run row (runs.csv) and of a cell row (results.csv).
RUN_HEAD = ("cell", "max_staleness", "objective", "seed", "status", "exit_code")
CELL_HEAD = ("cell", "max_staleness", "objective", "seeds", "seeds_ok")
#: Numeric per-run columns around the mark columns (in this order).
METRICS_HEAD = ("steps", "final_reward", "reward_mean_steps")
METRICS_TAIL = (
    "reward_auc_time",
    "startup_s",
    "samples_per_s",
    "trained_tokens_per_s",
    "gen_tokens_per_s",
    "learner_wait_frac",
    "staleness_mean",
    "staleness_max",
    "mismatch_kl_mean",
    "rollout_kl_mean",
    "ess_mean",
    "dropped_groups",
    "wall_s",
)


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


@dataclass(frozen=True)
class Marks:
    """Where the two budget views are read: wall-clock seconds after start-up and learner steps."""

    seconds: tuple[float, ...] = ()
    steps: tuple[int, ...] = ()


def mark_column(mark_s: float) -> str:
    """Column of a wall-clock mark (seconds after start-up): 60 -> reward_at_60s."""
    return f"reward_at_{mark_s:g}s"


def step_column(step: int) -> str:
    return f"reward_at_step_{step}"


def metric_columns(marks: Marks) -> list[str]:
    """The numeric columns of a run, in report order."""
    return [
        *METRICS_HEAD,
        *(step_column(n) for n in marks.steps),
        *(mark_column(m) for m in marks.seconds),
        *METRICS_TAIL,
    ]


def columns(marks: Marks) -> list[str]:
    """The results.csv header: per metric its mean over seeds and the 95% interval bounds."""
    return [*CELL_HEAD, *(c + sfx for c in metric_columns(marks) for sfx in ("", "_lo", "_hi"))]


def run_columns(marks: Marks) -> list[str]:
    """The runs.csv header (one row per seed run)."""
    return [*RUN_HEAD, *metric_columns(marks)]


# ----------------------------------------------------------------------------------- per-run numbers


def load_metrics(path: Path) -> list[dict[str, Any]]:
    """Step records of a metrics.jsonl, sorted by time; a missing file is no steps.

    A torn last line (the run was killed mid-write) is skipped rather than failing the whole report.
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


def startup_s(records: Sequence[dict]) -> float | None:
    """Seconds from the command start until the first batch was ready (see the module doc)."""
    if not records:
        return None
    r = records[0]
    return max(0.0, r["time"] - r.get("train_s", 0.0) - r.get("publish_s", 0.0))


def reward_at(records: Sequence[dict], mark_s: float) -> float | None:
    """Mean reward of the last LAST_K steps finished by ``mark_s`` seconds after start-up."""
    t0 = startup_s(records)
    return final_reward([r for r in records if r["time"] - t0 <= mark_s]) if records else None


def reward_at_step(records: Sequence[dict], step: int) -> float | None:
    """Mean reward of the last LAST_K steps up to learner step ``step``; None if the run stopped before."""
    done = sorted((r for r in records if r["step"] <= step), key=lambda r: r["step"])
    if not done or done[-1]["step"] < step:
        return None
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


def staleness_hist(records: Sequence[dict]) -> dict[int, int]:
    """Trained tokens per token staleness, summed over the steps."""
    out: dict[int, int] = {}
    for r in records:
        for k, v in (r.get("staleness_hist") or {}).items():
            out[int(k)] = out.get(int(k), 0) + int(v)
    return dict(sorted(out.items()))


def _group_size(run_dir: Path) -> int:
    """G of the run from the config.yaml it wrote (completions per group); 0 if unknown.

    Read as plain YAML, not through the schema: a sweep dir must stay reportable after the schema
    gains or renames a key.
    """
    from omegaconf import OmegaConf

    path = run_dir / "config.yaml"
    if not path.exists():
        return 0
    return int(OmegaConf.select(OmegaConf.load(path), "actors.group_size", default=0) or 0)


def _generated_tokens(summary: dict) -> int | None:
    """Sum of the actors' ``generated_tokens`` heartbeat counters, or None when none reported one."""
    vals = [a["generated_tokens"] for a in (summary.get("actors") or {}).values() if "generated_tokens" in a]
    return int(sum(vals)) if vals else None


def run_metrics(run_dir: Path, marks: Marks) -> dict[str, Any]:
    """Every numeric column of one run (None = no value: no steps, no window, not reached)."""
    recs = load_metrics(run_dir / "metrics.jsonl")
    summary_path = run_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    row: dict[str, Any] = dict.fromkeys(metric_columns(marks))
    row.update(steps=len(recs), wall_s=summary.get("wall_s"))
    if not recs:
        return row
    row["final_reward"] = final_reward(recs)
    row["reward_mean_steps"] = _mean([r["reward_mean"] for r in recs])
    for n in marks.steps:
        row[step_column(n)] = reward_at_step(recs, n)
    for m in marks.seconds:
        row[mark_column(m)] = reward_at(recs, m)
    row["reward_auc_time"] = reward_auc(recs)
    row["startup_s"] = startup_s(recs)
    window = recs[-1]["time"] - recs[0]["time"]
    later = recs[1:]
    if window > 0:
        g = _group_size(run_dir)
        row["samples_per_s"] = sum(r["groups"] for r in later) * g / window if g else None
        row["trained_tokens_per_s"] = sum(r["tokens"] for r in later) / window
        row["learner_wait_frac"] = sum(r["wait_s"] for r in later) / window
    gen = _generated_tokens(summary)
    if gen is not None and summary.get("wall_s"):
        # Actors have no step clock: this rate is over the whole command, start-up included.
        row["gen_tokens_per_s"] = gen / summary["wall_s"]
    hist = staleness_hist(recs)
    n_tok = sum(hist.values())
    if n_tok:  # token-weighted, from the distribution itself
        row["staleness_mean"] = sum(k * v for k, v in hist.items()) / n_tok
        row["staleness_max"] = max(hist)
    else:
        row["staleness_mean"] = _mean([r["staleness_mean"] for r in recs])
        row["staleness_max"] = max(r["staleness_max"] for r in recs)
    row["mismatch_kl_mean"] = _mean([r["mismatch_kl"] for r in recs])
    row["rollout_kl_mean"] = _mean([r["rollout_kl"] for r in recs])
    row["ess_mean"] = _mean([r["ess"] for r in recs if "ess" in r])
    row["dropped_groups"] = sum(r["dropped_stale"] for r in recs)
    return row


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
        row[col], row[col + "_lo"], row[col + "_hi"] = (None, None, None) if ci.n == 0 else ci[:3]
    return row


#: Columns the paired naive-vs-corrected comparison is made on (those present in a report).
COMPARE = ("final_reward", "reward_mean_steps", "reward_auc_time")
#: What "the best fixed bound" of an objective is ranked by (see :func:`comparisons`).
BEST_BY = "reward_mean_steps"


def comparisons(
    cells: Sequence[CellSpec], runs: dict[str, list[dict[str, Any]]], marks: Marks, baseline: str | None
) -> list[dict[str, Any]]:
    """Paired (by seed) differences of the compared columns, with their mean and bootstrap interval:

    * per staleness level, every objective other than ``baseline`` minus ``baseline``;
    * every ``<X>-adaptive`` cell (the adaptive controller on objective X, ``max_staleness`` its
      ceiling) minus the X cell at its ceiling (does the controller beat the fixed bound it may go up
      to?) and minus the X cell at the best fixed bound: highest mean over seeds of
      ``reward_mean_steps``, the whole equal-steps curve (final reward saturates near the task's
      maximum at most bounds, so ranking by it would pick among ties by noise); ties go to the lower
      bound. When the best fixed bound is the ceiling, the pair is listed once, as the best.
    """
    metrics = [*COMPARE[:2], *(step_column(n) for n in marks.steps[-1:]), *COMPARE[2:],
               *(mark_column(m) for m in marks.seconds[-1:])]  # fmt: skip
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
        for m in metrics:
            ci: Interval = paired_ci(per_seed(c.name, m), per_seed(base.name, m))
            out.append({"max_staleness": c.max_staleness, "objective": c.objective, "baseline": label,
                        "metric": m, "diff": ci.mean, "diff_lo": ci.lo, "diff_hi": ci.hi, "n": ci.n,
                        "excludes_zero": ci.excludes_zero()})  # fmt: skip
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
              "learner_wait_frac", "staleness_mean", "rollout_kl_mean", "dropped_groups")  # fmt: skip


def write_markdown(rows: Sequence[dict], marks: Marks, comps: Sequence[dict], path: Path) -> Path:
    """results.md: 'mean [lo, hi]' of the main columns per cell, then the paired comparisons."""
    cols = [c for c in (*MD_COLUMNS[:3], *(step_column(n) for n in marks.steps), *MD_COLUMNS[3:])]
    lines = ["| cell | seeds ok | " + " | ".join(cols) + " |", "|" + "---|" * (len(cols) + 2)]
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
        lines += ["", "Paired difference (objective - baseline, same seeds), mean [95% bootstrap interval]:", "",
                  "| max_staleness | objective | metric | diff | seeds | interval excludes 0 |", "|---|---|---|---|---|---|"]  # fmt: skip
        for c in comps:
            d = "-" if not c["n"] else f"{_num(c['diff'])} [{_num(c['diff_lo'])}, {_num(c['diff_hi'])}]"
            sig = "yes" if c["excludes_zero"] else "no"
            lines.append(
                f"| {c['max_staleness']} | {c['objective']} - {c['baseline']} | {c['metric']} | {d} | {c['n']} | {sig} |"
            )
    path.write_text("\n".join(lines) + "\n")
    return path


def write_report(
    cells: Sequence[CellSpec],
    seeds: Sequence[int],
    statuses: dict[str, tuple[str, int | None]],
    marks: Marks,
    out_dir: Path,
    baseline: str | None = None,
) -> list[dict[str, Any]]:
    """runs.csv, results.csv, results.md, comparison.csv, staleness.csv and the plots; returns the cell rows.

    ``statuses``: SeedRun.name -> (status, exit code); a run not in it is reported as "missing".
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
    write_markdown(rows, marks, comps, out_dir / "results.md")
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
