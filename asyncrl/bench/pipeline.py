"""Pipeline rows of ``asyncrl bench``: short real ``asyncrl run``s of the demo at several max_staleness.

Each run is the demo config (``configs/default.yaml`` unless ``--config``) with only ``run.dir``,
``run.max_steps``, ``buffer.max_staleness`` and the console changed, started as the user would start
it (``python -m asyncrl.cli run``). From its ``metrics.jsonl`` (steady-state window: after the steps
asyncrl.plan.calibrate leaves out, the same window ``asyncrl plan --from`` measures):

* steps/s and samples/s;
* the learner step inside the pipeline (median ``train_s``, the same scope as the "alone" row);
* at max_staleness 0 (sync: the learner waits while the actors generate, the actors wait while the
  learner trains): T_train = mean ``step_s - wait_s`` (the learner's busy time per step: train +
  publish + records + checkpoint share) and T_gen = the sync step time minus the mean ``train_s +
  publish_s`` (everything on the step's serial path that is not the learner's train and publish: the
  hand-off to the actors, their swap and generation, the buffer write and read). The overlap bound
  T_sync / max(T_gen, T_train) is the best async/sync speed-up perfect overlap can give: async can go
  no faster than the busier role. (T_gen was the mean ``wait_s`` and T_sync = T_gen + T_train before the
  sync hand-off got fast enough for the learner's post-publish records and checkpoint share to run
  beside the actors' generation: ``wait_s`` then undercounts the actors' path. The old number is kept
  as ``T_gen_wait_s``.)

Placement: ``run.actor_frontend_cpus=auto`` puts the actor process on the learner's cores at max_staleness
0 (the roles take turns) and elsewhere otherwise (one actor: all cores; several: its engine's), so
the default sync run's T_gen is not what the async runs' engines can do. The overlap bound compares
the same pipeline with and without overlap, so when the placements differ it comes from one more sync
run with the async runs' placement (``same_placement_sync``); the eta=0 rows (steps/s, learner step)
stay the default's.

The back-to-back limit is 1 / (gen + train + publish + reload per step), each measured alone in the
same bench invocation: gen = one step's groups on an idle engine (asyncrl.bench.weights), train =
the Trainer step alone (asyncrl.bench.learner), publish and reload = the tiny model's weight path for
the run's transport.

Start-up by phase comes from timestamps the run writes anyway: the run's start (``time`` vs
``step_time`` of the first record), redis.log's "Ready to accept connections", the actor log's state
lines (starting / waiting_for_weights = engine up / running = v0 loaded), and the learner's
``learner_startup.json`` (asyncrl.learner.loop.STARTUP_FILE).
"""

from __future__ import annotations

import json
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

__all__ = ["STALENESS", "B2B_TARGET", "OVERLAP_TARGET", "FIRST_STEP_TARGET_S", "run_demo", "steady",
           "startup_phases", "pipeline_rows", "back_to_back", "lazy_swap_row"]  # fmt: skip

STALENESS = (0, 1, 4)
B2B_TARGET = 0.9  # steady-state steps/s >= 0.9x the back-to-back limit
OVERLAP_TARGET = 0.95  # async/sync >= 0.95x the overlap bound
FIRST_STEP_TARGET_S = 25.0

_REDIS_READY = re.compile(r"^\d+:M (\d+ \w{3} \d{4} \d\d:\d\d:\d\d\.\d{3}) \* Ready to accept connections")
_ACTOR_STATE = re.compile(
    r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) asyncrl\.actors\.\S+ INFO (actor-\d+): (starting|waiting_for_weights|running)$"
)


def run_demo(
    config: str | None,
    eta: int,
    steps: int,
    root: Path,
    timeout_s: float = 600.0,
    frontend: str | None = None,
    swap_min_lag: int | None = None,
) -> Path:
    """One real ``asyncrl run`` of the demo at ``buffer.max_staleness=eta`` (``frontend``: a
    ``run.actor_frontend_cpus`` other than the config's; ``swap_min_lag``: an ``actors.swap_min_lag``
    other than the config's); returns its run dir."""
    name = f"run-eta{eta}" + (f"-frontend-{frontend}" if frontend else "")
    name += f"-swap-min-lag{swap_min_lag}" if swap_min_lag else ""
    rdir = root / name
    cmd = [sys.executable, "-m", "asyncrl.cli", "run", *(["-c", config] if config else []),
           f"run.dir={rdir}", f"run.max_steps={steps}", f"buffer.max_staleness={eta}",
           f"run.max_wall_s={int(timeout_s)}", "console.mode='off'",
           *([f"run.actor_frontend_cpus={frontend}"] if frontend else []),
           *([f"actors.swap_min_lag={swap_min_lag}"] if swap_min_lag else [])]  # fmt: skip
    with open(root / f"{name}.out", "wb") as out:
        proc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, timeout=timeout_s + 120)
    summary = json.loads((rdir / "summary.json").read_text()) if (rdir / "summary.json").exists() else {}
    if proc.returncode != 0 or not summary.get("finished"):
        raise RuntimeError(f"demo run at max_staleness={eta} did not finish (exit {proc.returncode}, "
                           f"status {summary.get('status')!r}); see {root / f'{name}.out'}")  # fmt: skip
    return rdir


def steady(rdir: Path) -> dict:
    """Steady-state numbers of one run (window of asyncrl.plan.calibrate.measure)."""
    from asyncrl.learner.records import METRICS_FILE, read_jsonl
    from asyncrl.plan.calibrate import measure

    m = measure(rdir)
    win = read_jsonl(rdir / METRICS_FILE)[m.warmup :]
    n = len(win)
    return {
        "max_staleness": m.max_staleness,
        "steps": m.steps,
        "window_steps": n,
        "window_s": m.window_s,
        "steps_per_s": n / m.window_s,
        "samples_per_s": m.samples_per_s,
        "train_s_median": statistics.median(r["train_s"] for r in win),
        "wait_s_mean": sum(r["wait_s"] for r in win) / n,
        "learner_s_mean": sum(r["step_s"] - r["wait_s"] for r in win) / n,
        "train_publish_s_mean": sum(r["train_s"] + r["publish_s"] for r in win) / n,
        "publish_s_mean": m.publish_s,
        "staleness_mean": m.staleness_mean,
    }


def _local_ts(text: str, fmt: str) -> float:
    """Unix time of a log timestamp written in local time (redis-server and Python logging both are)."""
    whole, frac = re.split(r"[.,]", text)
    return time.mktime(time.strptime(whole, fmt)) + int(frac) / 1000


def startup_phases(rdir: Path) -> dict:
    """Seconds after the run's start at which each start-up milestone was reached (None: not found)."""
    from asyncrl.learner.loop import STARTUP_FILE
    from asyncrl.learner.records import METRICS_FILE, read_jsonl

    first = read_jsonl(rdir / METRICS_FILE)[0]
    t0 = first["step_time"] - first["time"]
    out: dict[str, Any] = dict.fromkeys(
        ("redis_ready", "learner_started", "deepspeed_ready", "weights_published", "actor_started",
         "engine_up", "actor_serving_v0", "first_batch", "first_step"))  # fmt: skip
    out["first_step"] = first["time"]
    log = rdir / "redis" / "redis.log"
    for line in log.read_text(errors="replace").splitlines() if log.exists() else []:
        m = _REDIS_READY.match(line)
        if m:
            out["redis_ready"] = _local_ts(m.group(1), "%d %b %Y %H:%M:%S") - t0
            break
    names = {"starting": "actor_started", "waiting_for_weights": "engine_up", "running": "actor_serving_v0"}
    for log in sorted((rdir / "logs").glob("actor-*.log")):  # the last actor to get there counts
        for line in log.read_text(errors="replace").splitlines():
            m = _ACTOR_STATE.match(line)
            if m and (key := names[m.group(3)]):
                t = _local_ts(m.group(1), "%Y-%m-%d %H:%M:%S") - t0
                out[key] = t if out[key] is None else max(out[key], t)
    marks = rdir / STARTUP_FILE
    if marks.exists():
        for k, v in json.loads(marks.read_text()).items():
            if k in out and k != "first_step":
                out[k] = v - t0
    return out


def back_to_back(gen_step_s: float, train_s: float, publish_s: float, reload_s: float) -> dict:
    """1 / (gen + train + publish + reload): steps/s with every phase run in turn at its alone speed."""
    per_step = gen_step_s + train_s + publish_s + reload_s
    return {"gen_s": gen_step_s, "train_s": train_s, "publish_s": publish_s, "reload_s": reload_s,
            "per_step_s": per_step, "steps_per_s": 1.0 / per_step}  # fmt: skip


def overlap_bound(t_gen: float, t_train: float, t_sync: float | None = None) -> float:
    """T_sync / max(T_gen, T_train): async/sync speed-up with perfect overlap (T_sync defaults to
    T_gen + T_train, the sync step when nothing of one role overlaps the other)."""
    return (t_gen + t_train if t_sync is None else t_sync) / max(t_gen, t_train)


def frontend_placements(config: str | None) -> tuple[str | None, str | None]:
    """(sync, async): the resolved ``run.actor_frontend_cpus`` of the demo's run at max_staleness 0
    and at >= 1 (None: no CPU plan on this machine, nothing is placed)."""
    from asyncrl.config import load_config
    from asyncrl.cpu_binding import frontend_placement, resolve_plan

    cfg = load_config(config)
    if resolve_plan(cfg) is None:
        return None, None
    at = lambda eta: frontend_placement(load_config(config, [f"buffer.max_staleness={eta}"]))  # noqa: E731
    return at(0), at(1)


def pipeline_rows(config: str | None, staleness: tuple[int, ...], steps: int, root: Path,
                  b2b: dict | None, train_alone_s: float | None,
                  train_alone_idle_gap_s: float | None = None) -> dict:  # fmt: skip
    """Run the demo at each max_staleness and derive the pipeline rows (see the module docstring)."""
    runs = {}
    for eta in staleness:
        rdir = run_demo(config, eta, steps, root)
        runs[eta] = {**steady(rdir), "startup": startup_phases(rdir)}
    res: dict[str, Any] = {"runs": {str(k): v for k, v in runs.items()}, "back_to_back": b2b}
    sync_place, async_place = frontend_placements(config)
    same = None
    if 0 in runs and any(e > 0 for e in runs) and sync_place != async_place:
        same = {**steady(run_demo(config, 0, steps, root, frontend=async_place)), "frontend": async_place}
        res["same_placement_sync"] = same
    if 0 in runs:
        sync = same or runs[0]
        t_sync, t_train = 1.0 / sync["steps_per_s"], sync["learner_s_mean"]
        t_gen = max(t_sync - sync["train_publish_s_mean"], 1e-9)
        bound = overlap_bound(t_gen, t_train, t_sync)
        res.update(T_gen_s=t_gen, T_train_s=t_train, T_sync_s=t_sync, T_gen_wait_s=sync["wait_s_mean"],
                   overlap_bound=bound)  # fmt: skip
        for eta, r in runs.items():
            if eta > 0:
                r["speedup_vs_sync"] = r["steps_per_s"] / sync["steps_per_s"]
                r["speedup_over_bound"] = r["speedup_vs_sync"] / bound
                if same is not None:  # against the default sync run (context)
                    r["speedup_vs_default_sync"] = r["steps_per_s"] / runs[0]["steps_per_s"]
    lazy_eta = max(staleness)
    if lazy_eta > 1:  # the lever for a slow swap: stage a version only every eta (see lazy_swap_row)
        lazy = steady(run_demo(config, lazy_eta, steps, root, swap_min_lag=lazy_eta))
        res["lazy_swaps"] = lazy_swap_row(lazy, runs.get(lazy_eta), lazy_eta, b2b)
    for r in runs.values():
        if b2b:
            r["over_back_to_back"] = r["steps_per_s"] / b2b["steps_per_s"]
        if train_alone_s:
            r["train_in_pipeline_over_alone"] = r["train_s_median"] / train_alone_s
    if 0 in runs and train_alone_idle_gap_s:  # context: the same step alone with the sync run's idle gaps
        runs[0]["train_in_pipeline_over_alone_idle_gap"] = runs[0]["train_s_median"] / train_alone_idle_gap_s
    return res


def lazy_swap_row(lazy: dict, default: dict | None, eta: int, b2b: dict | None) -> dict:
    """The largest eta once more with ``actors.swap_min_lag = eta``: an actor stages a new version only
    once it is eta ahead (or a group worker waits on admission), instead of every version. Context, not
    a target: it trades fresher rollouts (``staleness_mean``) for engine time, so the demo's default
    stays 1 and the eta rows above are the default's."""
    row = {**lazy, "swap_min_lag": eta}
    if b2b:
        row["over_back_to_back"] = lazy["steps_per_s"] / b2b["steps_per_s"]
    if default:
        row["speedup_vs_default"] = lazy["steps_per_s"] / default["steps_per_s"]
        row["default_staleness_mean"] = default["staleness_mean"]
    return row
