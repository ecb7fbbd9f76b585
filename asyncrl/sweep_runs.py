"""The numbers of one sweep run, read from its run dir: reward at step and wall-clock marks, rates,
staleness and KL columns (what :mod:`asyncrl.sweep_report` aggregates over seeds).

Pure functions over ``metrics.jsonl`` (one JSON record per learner step, ``time`` = seconds since the
run's command started), ``summary.json`` and ``config.yaml``; see :mod:`asyncrl.sweep_report` for the
two budget views (steps, wall clock after start-up) these columns serve.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: Number of last steps averaged into "final reward" and into the reward-at-mark columns.
LAST_K = 3

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


def finite_mean(xs: Iterable[Any]) -> float | None:
    """Mean of the finite values of ``xs`` (None if there are none).

    metrics.jsonl writes a non-finite float as a string ("nan", "inf": StepRecord.to_dict), e.g. the KL of
    a step the learner skipped as non-finite; ``float`` reads those back, and they are left out rather
    than poisoning (or, as strings, crashing) the mean of the run.
    """
    return _mean([v for v in (float(x) for x in xs) if math.isfinite(v)])


def token_weighted_kl(records: Sequence[dict]) -> float | None:
    """The run's engine-vs-learner mismatch KL: sum(mismatch_kl * mismatch_tokens) / sum(mismatch_tokens).

    A step with no staleness-0 token under the loss (or one published since its batch was sampled)
    measured nothing and writes mismatch_kl=0.0, mismatch_tokens=0 (learner/step.py _drift_split);
    a plain mean over steps would count those zeros, and more of them at higher staleness, which
    confounds the staleness axis. Non-finite values are left out too. None when no step measured it.
    """
    num = den = 0.0
    for r in records:
        n, kl = float(r.get("mismatch_tokens", 0) or 0), float(r.get("mismatch_kl", "nan"))
        if n > 0 and math.isfinite(kl):
            num, den = num + kl * n, den + n
    return num / den if den > 0 else None


def final_reward(records: Sequence[dict]) -> float | None:
    """Mean finite reward of the last LAST_K steps (None without one)."""
    return finite_mean(r["reward_mean"] for r in records[-LAST_K:])


def startup_s(records: Sequence[dict]) -> float | None:
    """Seconds from the command start until the first batch was ready (see the module doc)."""
    if not records:
        return None
    r = records[0]
    return max(0.0, r["time"] - r.get("train_s", 0.0) - r.get("publish_s", 0.0))


def reward_at(records: Sequence[dict], mark_s: float) -> float | None:
    """Mean reward of the last LAST_K steps finished by ``mark_s`` seconds after start-up; None if the
    run's last step ended before the mark (as :func:`reward_at_step` past a run's last step: the run
    was not measured there, and its final reward is not what it would have had by then)."""
    if not records:
        return None
    t0 = startup_s(records)
    if max(r["time"] for r in records) - t0 < mark_s:
        return None
    return final_reward([r for r in records if r["time"] - t0 <= mark_s])


def reward_at_step(records: Sequence[dict], step: int) -> float | None:
    """Mean reward of the last LAST_K steps up to learner step ``step``; None if the run stopped before."""
    done = sorted((r for r in records if r["step"] <= step), key=lambda r: r["step"])
    if not done or done[-1]["step"] < step:
        return None
    return final_reward(done)


def reward_auc(records: Sequence[dict]) -> float | None:
    """Trapezoid area under reward(time) divided by its duration: the time-averaged reward.

    Over [first step, last step]; a single step has no duration, its reward is the average. A step
    with a non-finite reward is left out (the trapezoid bridges it) rather than making the area NaN.
    """
    pts = [(r["time"], float(r["reward_mean"])) for r in records]
    pts = [(t, y) for t, y in pts if math.isfinite(y)]
    if not pts:
        return None
    t, y = [p[0] for p in pts], [p[1] for p in pts]
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


def config_value(run_dir: Path, key: str) -> Any:
    """``key`` of the config.yaml the run wrote; None if unknown.

    Read as plain YAML, not through the schema: a sweep dir must stay reportable after the schema
    gains or renames a key.
    """
    from omegaconf import OmegaConf

    path = run_dir / "config.yaml"
    return OmegaConf.select(OmegaConf.load(path), key, default=None) if path.exists() else None


def _group_size(run_dir: Path) -> int:
    """G of the run (completions per group); 0 if unknown."""
    return int(config_value(run_dir, "actors.group_size") or 0)


def step_problem(path: Path, max_steps: int | None) -> str | None:
    """Why a metrics.jsonl is not the record of one run (None: it can be): its steps must increase line
    by line (a learner restart rewrites the file from its checkpoint's step on, it never repeats one)
    and number at most ``max_steps`` (0 or None: no limit). A second process writing into the run dir
    (an orphaned run of a killed sweep, beside the re-run) breaks both. A torn line is skipped."""
    if not path.exists():
        return None
    prev, n = None, 0
    with path.open() as f:
        for line in f:
            try:
                step = json.loads(line)["step"]
            except (ValueError, KeyError, TypeError):
                continue
            n += 1
            if prev is not None and step <= prev:
                return (f"metrics.jsonl has step {step} after step {prev} (record {n}): steps of two runs "
                        "in one dir")  # fmt: skip
            prev = step
    if max_steps and n > max_steps:
        return f"metrics.jsonl has {n} steps, more than run.max_steps={max_steps}"
    return None


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
    row["reward_mean_steps"] = finite_mean(r["reward_mean"] for r in recs)
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
        row["staleness_mean"] = finite_mean(r["staleness_mean"] for r in recs)
        row["staleness_max"] = max(r["staleness_max"] for r in recs)
    row["mismatch_kl_mean"] = token_weighted_kl(recs)
    row["rollout_kl_mean"] = finite_mean(r["rollout_kl"] for r in recs)
    # "nan" ess: a step that measured no ESS.
    row["ess_mean"] = finite_mean(r["ess"] for r in recs if "ess" in r)
    row["dropped_groups"] = sum(r["dropped_stale"] for r in recs)
    return row
