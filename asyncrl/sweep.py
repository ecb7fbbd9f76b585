"""`asyncrl sweep`: run the pipeline over a max_staleness x objective grid, several seeds per cell.

Each (cell, seed) is a separate ``python -m asyncrl.cli run`` subprocess in ``<cell>/seed<k>/``, so
every run gets fresh Ray, Redis and vLLM processes and a crash in one cannot poison the next. Runs
share the budget and task (the sweep's common overrides) and differ only in ``run.seed``,
``buffer.max_staleness`` and the objective's overrides; the same seed in two cells means the same
initial weights, prompt order and sampling seeds, which is what makes the paired comparison of
objectives at one staleness level meaningful. Seeds are the outer loop, so an interrupted sweep has
complete grids for its first seeds. The sweep is resumable: a finished run (its ``summary.json`` says
``"finished": true``, i.e. it reached ``run.max_steps``, and the sweep recorded no failure) is not
re-run (if the sweep now gives it other overrides than its marker recorded, e.g. after an edit of the
sweep file, the sweep refuses to start rather than report it under settings it did not run with); a
failed, interrupted or incomplete one (stopped early, e.g. by ``run.max_wall_s``: ``asyncrl
run`` exits 0 then) is re-run from scratch. Only finished runs enter the report's statistics, and a
run dir is one run's: its ``asyncrl run`` dies with the sweep (die_with_parent; a stop signal stops it in
order), a dir whose recorded run process is still alive is refused, and a finished run whose
metrics.jsonl is not one run's record (steps repeated, decreasing or past run.max_steps) is failed. The
sweep file format is documented in ``configs/sweep_staleness.yaml`` and validated by
:mod:`asyncrl.sweep_spec`; the report (statistics, csv, markdown, plots) is :mod:`asyncrl.sweep_report`; a run
dir's state (marker, status) and the checks before a run (live process, changed settings) are
:mod:`asyncrl.sweep_state`.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from asyncrl.config import Config, ConfigError
from asyncrl.launch import stop_process
from asyncrl.lifetime import die_with_parent
from asyncrl.run_summary import read_summary
from asyncrl.sweep_report import SeedRun, few_seeds_warning, write_report
from asyncrl.sweep_runs import step_problem
from asyncrl.sweep_spec import SweepSpec, config_hash, flat_config, load_spec

# A run dir's state and the checks before a run: asyncrl/sweep_state.py; its names stay importable here.
from asyncrl.sweep_state import (
    DEFAULT_STOP_GRACE_S,
    MARKER,
    STOP_MARGIN_S,
    RunInUse,
    _proc_start,
    _reached_max_steps,
    _run_config,
    _write_marker,
    bad_steps,
    changed_overrides,
    check_finished_runs,
    check_no_live_runs,
    disk_status,
    is_finished,
    live_child,
    read_marker,
)

__all__ = [
    "DEFAULT_STOP_GRACE_S",
    "MARKER",
    "STOP_MARGIN_S",
    "STOP_SIGNALS",
    "RunInUse",
    "bad_steps",
    "changed_overrides",
    "check_finished_runs",
    "check_no_live_runs",
    "disk_status",
    "is_finished",
    "live_child",
    "load_spec",
    "main",
    "read_marker",
    "run_one",
    "run_sweep",
    "stop_grace_s",
]


# ------------------------------------------------------------------------------------------ running


class _Interrupted(Exception):
    """SIGINT/SIGTERM/SIGHUP reached the sweep; the running seed run is stopped and marked for a re-run."""


#: What stops the sweep in order (the run is stopped and marked for a re-run): Ctrl-C, kill, a closed
#: terminal or ssh session. Ignored while the run is being stopped, so that a second one cannot leave it
#: running; a SIGKILL of the sweep kills the run too (die_with_parent).
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def _raise_interrupt(*_: Any) -> None:
    raise _Interrupted


def stop_grace_s(spec: SweepSpec, run: SeedRun, cfg: Config | None = None) -> float:
    """How long a stopped run may take before its process group is killed: its learner's
    ``learner.stop_grace_s`` (the final checkpoint) plus :data:`STOP_MARGIN_S`. A fixed 120 s killed a
    run whose learner was given more, mid-checkpoint (the learner dies with its parent). A config that
    no longer loads (edited or removed mid-sweep) gets the default's grace: the run itself then fails
    on it and is marked failed, as any failed run, and the sweep goes on."""
    cfg = cfg or _run_config(spec, run)
    return (cfg.learner.stop_grace_s if cfg else DEFAULT_STOP_GRACE_S) + STOP_MARGIN_S


def _stop(proc: subprocess.Popen, grace_s: float) -> None:
    """SIGTERM lets the run tear down its Ray/Redis/vLLM processes; SIGKILL the group if it hangs."""
    stop_process(proc, grace_s)


def run_one(spec: SweepSpec, run: SeedRun) -> tuple[str, int | None]:
    """Run one seed of a cell to completion; returns (status, exit code). Output in <run dir>/run.log."""
    check_no_live_runs([run])  # checked at the sweep's start too; here again: another sweep on the dir
    if run.dir.exists():
        # A failed or interrupted attempt: keep it for forensics, start clean (the run would otherwise
        # resume its checkpoints and append to metrics.jsonl with a second clock).
        aside = run.dir.with_name(run.dir.name + ".failed")
        shutil.rmtree(aside, ignore_errors=True)
        run.dir.rename(aside)
    run.dir.mkdir(parents=True)
    cmd = spec.command(run)
    overrides = spec.run_overrides(run)  # what a resume checks this run against (check_finished_runs)
    cfg = _run_config(spec, run)
    grace_s = stop_grace_s(spec, run, cfg)
    # What every marker of this run records: bad_steps checks the steps against max_steps, a resume the
    # resolved config against the sweep's (check_finished_runs).
    info: dict[str, Any] = {
        "cmd": cmd,
        "overrides": overrides,
        "max_steps": cfg.run.max_steps if cfg else None,
    }
    if cfg is not None:
        flat = flat_config(cfg)
        info.update(config_hash=config_hash(flat), config=flat)
    started = time.time()
    _write_marker(run, status="running", started=started, **info)
    proc: subprocess.Popen | None = None
    timed_out = False
    try:
        with (run.dir / "run.log").open("ab") as log:
            # Own session: a terminal Ctrl-C reaches the sweep only, which then stops the run in order.
            # die_with_parent: a SIGKILL of the sweep kills the run too (its own processes die with it,
            # asyncrl.lifetime); an orphan would write on into the dir the next sweep re-runs it in.
            proc = subprocess.Popen(
                die_with_parent(cmd), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        # The pid (and its start, against pid reuse): a later sweep refuses the dir while it lives.
        info.update(pid=proc.pid, pid_start=_proc_start(proc.pid))
        _write_marker(run, status="running", started=started, **info)
        while proc.poll() is None:
            if spec.cell_timeout_s and time.time() - started > spec.cell_timeout_s:
                timed_out = True
                _stop(proc, grace_s)
                break
            time.sleep(0.5)
    except _Interrupted:
        for s in STOP_SIGNALS:  # a second Ctrl-C, a kill or a hang-up must not abandon the tear-down
            signal.signal(s, signal.SIG_IGN)
        code = None
        if proc is not None:
            _stop(proc, grace_s)
            code = proc.returncode
        _write_marker(run, status="interrupted", started=started, ended=time.time(), exit_code=code, **info)
        raise
    summary = read_summary(run.dir)
    reason = None
    if proc.returncode != 0 or timed_out:
        status = "failed"
    elif not _reached_max_steps(summary):
        # `asyncrl run` exits 0 on a wall-budget stop too (a normal stop for a plain run, resumable), but a
        # truncated run would enter the paired statistics with fewer steps than its pair: not ok here.
        status = "incomplete"
    else:
        reason = step_problem(run.dir / "metrics.jsonl", info["max_steps"])
        status = "failed" if reason else "ok"
    _write_marker(run, status=status, started=started, ended=time.time(), exit_code=proc.returncode,
                  timed_out=timed_out, run_status=summary.get("status"), steps=summary.get("steps"),
                  reason=reason, **info)  # fmt: skip
    return status, proc.returncode


def _status_line(run: SeedRun, status: str, code: int | None, elapsed: float | None) -> str:
    if status == "incomplete":
        summary = read_summary(run.dir)
        stopped = summary.get("status", "?")
        hint = "; raise run.max_wall_s" if stopped == "wall_budget" else ""
        return (
            f"INCOMPLETE (stopped at step {summary.get('steps', '?')}, status {stopped}{hint}; "
            f"left out of the statistics, re-run next time)  log: {run.dir / 'run.log'}"
        )
    if status != "ok":
        marker = read_marker(run)
        why = marker.get("reason") or ("timed out" if marker.get("timed_out") else f"exit {code}")
        return f"FAILED ({why})  log: {run.dir / 'run.log'}"
    summary = json.loads((run.dir / "summary.json").read_text())
    from asyncrl.sweep_runs import finite_mean, load_metrics

    recs = load_metrics(run.dir / "metrics.jsonl")
    smean = finite_mean(r["staleness_mean"] for r in recs) or 0.0
    smax = max((r["staleness_max"] for r in recs), default=0)
    dropped = sum(r["dropped_stale"] for r in recs)
    r0, r1 = summary.get("start_reward"), summary.get("end_reward")
    rew = f"{r0:.3f}->{r1:.3f}" if r0 is not None and r1 is not None else "-"
    took = f"{elapsed:.0f}s" if elapsed is not None else "skipped (done)"
    return (
        f"ok  {took}  steps {len(recs)}  reward {rew}  staleness {smean:.2f}/{smax:g} "
        f"(bound {run.cell.max_staleness})  dropped {dropped}"
    )


def run_sweep(config_path: str | Path | None, overrides: list[str] | None = None) -> int:
    """`asyncrl sweep`: run every unfinished seed of every cell, then write the report.

    Returns 0 iff every run succeeded (130 when interrupted).
    """
    t_start = time.time()
    spec = load_spec(config_path, overrides)
    spec.dir.mkdir(parents=True, exist_ok=True)
    spec.out_dir.mkdir(parents=True, exist_ok=True)
    runs = spec.runs()
    check_finished_runs(spec, runs)  # before any run: an edited sweep must not mix old and new settings
    check_no_live_runs(runs)
    print(f"sweep {spec.name}: {len(spec.cells())} cells x {len(spec.seeds)} seeds in {spec.dir}", flush=True)
    statuses: dict[str, tuple[str, int | None]] = {}
    prev = {s: signal.signal(s, _raise_interrupt) for s in STOP_SIGNALS}
    interrupted = False
    try:
        for i, run in enumerate(runs, 1):
            print(f"[{i}/{len(runs)}] {run.name:<26} ", end="", flush=True)
            if is_finished(run):
                statuses[run.name] = ("ok", read_marker(run).get("exit_code", 0))
                print(_status_line(run, "ok", None, None), flush=True)
                continue
            t0 = time.time()
            statuses[run.name] = run_one(spec, run)
            print(_status_line(run, *statuses[run.name], time.time() - t0), flush=True)
    except _Interrupted:
        interrupted = True
        print("interrupted; the run is marked for a re-run", flush=True)
    finally:
        for s, h in prev.items():
            signal.signal(s, h)
    for run in runs:  # runs not reached (interrupt) still get a row, with whatever is on disk
        if run.name not in statuses:
            statuses[run.name] = (disk_status(run), read_marker(run).get("exit_code"))
    rows = write_report(
        spec.cells(), spec.seeds, statuses, spec.marks, spec.out_dir, spec.baseline, time.time() - t_start
    )
    warn = few_seeds_warning(rows)
    if warn:
        print(warn, file=sys.stderr)
    failed = [n for n, (st, _) in statuses.items() if st != "ok"]
    print(
        f"results: {spec.out_dir / 'results.md'}  {spec.out_dir / 'results.csv'}  (+ runs.csv, comparison.csv, PNGs)"
    )
    if failed:
        print(f"not ok: {', '.join(failed)}; re-run the same command to retry them", file=sys.stderr)
    return 130 if interrupted else (1 if failed else 0)


def main(argv: list[str] | None = None) -> int:
    """`python -m asyncrl.sweep --config SWEEP_YAML [overrides...]` (same as `asyncrl sweep`)."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m asyncrl.sweep", description=__doc__.splitlines()[0])
    ap.add_argument("--config", "-c", required=True)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args(argv)
    try:
        return run_sweep(args.config, args.overrides)
    except (ConfigError, FileNotFoundError) as e:
        print(f"asyncrl: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
