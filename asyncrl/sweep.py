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
run`` exits 0 then) is re-run from scratch. Only finished runs enter the report's statistics. The
sweep file format is documented in ``configs/sweep_staleness.yaml`` and validated by
:mod:`asyncrl.sweep_spec`; the report (statistics, csv, markdown, plots) is :mod:`asyncrl.sweep_report`.
"""

from __future__ import annotations

import json
import logging
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from asyncrl.config import ConfigError, LearnerConfig, load_config
from asyncrl.launch import stop_process
from asyncrl.orchestrator import read_summary
from asyncrl.sweep_report import SeedRun, write_report
from asyncrl.sweep_spec import SweepSpec, load_spec

log = logging.getLogger(__name__)

MARKER = "sweep_cell.json"


# ------------------------------------------------------------------------------------------ running


class _Interrupted(Exception):
    """SIGINT/SIGTERM reached the sweep; the running seed run is stopped and marked for a re-run."""


def _raise_interrupt(*_: Any) -> None:
    raise _Interrupted


def read_marker(run: SeedRun) -> dict[str, Any]:
    p = run.dir / MARKER
    return json.loads(p.read_text()) if p.exists() else {}


def _write_marker(run: SeedRun, **info: Any) -> None:
    (run.dir / MARKER).write_text(json.dumps(info, indent=2))


def _reached_max_steps(summary: dict[str, Any]) -> bool:
    """A run's summary.json says ``finished`` (the orchestrator sets it when the learner reached
    ``run.max_steps`` and exited 0). A run writes its summary at every end, a wall-budget stop and a
    crash included, so the file's presence alone says nothing."""
    return summary.get("finished") is True


def is_finished(run: SeedRun) -> bool:
    """Reached run.max_steps (summary.json) and the sweep did not record a failure or interruption."""
    return _reached_max_steps(read_summary(run.dir)) and read_marker(run).get("status", "ok") == "ok"


#: Overrides left out when a finished run's recorded overrides are compared with the current ones: where
#: the run dir is (a sweep dir moved or reached by another path) and the progress display change no result.
_LOCATION_KEYS = ("run.dir=", "run.progress=")


def _compared(overrides: list[str]) -> list[str]:
    return [o for o in overrides if not o.startswith(_LOCATION_KEYS)]


def changed_overrides(recorded: list[str], current: list[str]) -> str | None:
    """How a finished run's recorded overrides differ from what the sweep would run now (None: same).

    Compared as lists, location keys aside: a reordering can change the config too (the last one wins).
    """
    old, new = _compared(recorded), _compared(current)
    if old == new:
        return None
    gone, added = [o for o in old if o not in new], [o for o in new if o not in old]
    if not gone and not added:
        return f"the same overrides in another order (was: {' '.join(old)})"
    parts = [f"ran with {' '.join(gone)}"] if gone else []
    parts += [f"now {' '.join(added)}"] if added else []
    return "; ".join(parts)


def check_finished_runs(spec: SweepSpec, runs: list[SeedRun]) -> None:
    """Refuse to resume onto finished runs made with other overrides than the sweep gives them now.

    A finished run is skipped, and reported as a run of the current sweep file; after an edit of, e.g.,
    a common ``learner.lr`` it was silently reported under settings it never ran with. A run dir may be
    shared by a second sweep file (configs/sweep_staleness_ladder.yaml): that is fine as long as the
    overrides match. Markers from before the overrides were recorded cannot be checked: accepted as
    before, with one warning.
    """
    unchecked = 0
    for run in runs:
        if not is_finished(run):
            continue
        recorded = read_marker(run).get("overrides")
        if recorded is None:
            unchecked += 1
            continue
        if diff := changed_overrides(recorded, spec.run_overrides(run)):
            raise ConfigError(
                f"sweep run {run.dir} finished with other overrides than this sweep gives it now ({diff}); "
                f"it would be skipped and reported under the new settings. Run the changed sweep in a new dir "
                f"(e.g. sweep.dir={spec.dir}-v2, or a new sweep.name where the file sets no sweep.dir), or put "
                "the overrides back as they were"
            )
    if unchecked:
        log.warning("sweep %s: %d finished runs have no recorded overrides (made by an older asyncrl); "
                    "reused without checking them against the sweep file", spec.name, unchecked)  # fmt: skip


def disk_status(run: SeedRun) -> str:
    """The status of a run the sweep did not run this time, from its dir: ok, incomplete (exited 0 but
    stopped before run.max_steps; a marker written before "incomplete" existed says ok), failed,
    interrupted, running (the sweep died during it) or missing."""
    if is_finished(run):
        return "ok"
    marker = read_marker(run).get("status")
    if marker in (None, "ok") and (run.dir / "summary.json").exists():
        return "incomplete"
    return marker or "missing"


#: Seconds a stopped run gets beyond its learner's own stop grace (learner.stop_grace_s), for the rest of
#: its tear-down (actors, Ray, Redis's final save).
STOP_MARGIN_S = 60.0
#: learner.stop_grace_s's default, for a run whose config no longer loads.
DEFAULT_STOP_GRACE_S = LearnerConfig().stop_grace_s


def stop_grace_s(spec: SweepSpec, run: SeedRun) -> float:
    """How long a stopped run may take before its process group is killed: its learner's
    ``learner.stop_grace_s`` (the final checkpoint) plus :data:`STOP_MARGIN_S`. A fixed 120 s killed a
    run whose learner was given more, mid-checkpoint (the learner dies with its parent). A config that
    no longer loads (edited or removed mid-sweep) gets the default's grace: the run itself then fails
    on it and is marked failed, as any failed run, and the sweep goes on."""
    try:
        cfg = load_config(spec.base_config, spec.run_overrides(run))
    except (ConfigError, OSError) as e:
        log.warning("sweep run %s: its config does not load (%s); stop grace %.0f s", run.name, e,
                    DEFAULT_STOP_GRACE_S + STOP_MARGIN_S)  # fmt: skip
        return DEFAULT_STOP_GRACE_S + STOP_MARGIN_S
    return cfg.learner.stop_grace_s + STOP_MARGIN_S


def _stop(proc: subprocess.Popen, grace_s: float) -> None:
    """SIGTERM lets the run tear down its Ray/Redis/vLLM processes; SIGKILL the group if it hangs."""
    stop_process(proc, grace_s)


def run_one(spec: SweepSpec, run: SeedRun) -> tuple[str, int | None]:
    """Run one seed of a cell to completion; returns (status, exit code). Output in <run dir>/run.log."""
    if run.dir.exists():
        # A failed or interrupted attempt: keep it for forensics, start clean (the run would otherwise
        # resume its checkpoints and append to metrics.jsonl with a second clock).
        aside = run.dir.with_name(run.dir.name + ".failed")
        shutil.rmtree(aside, ignore_errors=True)
        run.dir.rename(aside)
    run.dir.mkdir(parents=True)
    cmd = spec.command(run)
    overrides = spec.run_overrides(run)  # what a resume checks this run against (check_finished_runs)
    grace_s = stop_grace_s(spec, run)
    started = time.time()
    _write_marker(run, status="running", started=started, cmd=cmd, overrides=overrides)
    proc: subprocess.Popen | None = None
    timed_out = False
    try:
        with (run.dir / "run.log").open("ab") as log:
            # Own session: a terminal Ctrl-C reaches the sweep only, which then stops the run in order.
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        while proc.poll() is None:
            if spec.cell_timeout_s and time.time() - started > spec.cell_timeout_s:
                timed_out = True
                _stop(proc, grace_s)
                break
            time.sleep(0.5)
    except _Interrupted:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not abandon the tear-down
        code = None
        if proc is not None:
            _stop(proc, grace_s)
            code = proc.returncode
        _write_marker(run, status="interrupted", started=started, ended=time.time(), exit_code=code, cmd=cmd,
                      overrides=overrides)  # fmt: skip
        raise
    summary = read_summary(run.dir)
    if proc.returncode != 0 or timed_out:
        status = "failed"
    else:
        # `asyncrl run` exits 0 on a wall-budget stop too (a normal stop for a plain run, resumable), but a
        # truncated run would enter the paired statistics with fewer steps than its pair: not ok here.
        status = "ok" if _reached_max_steps(summary) else "incomplete"
    _write_marker(run, status=status, started=started, ended=time.time(), exit_code=proc.returncode,
                  timed_out=timed_out, run_status=summary.get("status"), steps=summary.get("steps"),
                  cmd=cmd, overrides=overrides)  # fmt: skip
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
        why = "timed out" if read_marker(run).get("timed_out") else f"exit {code}"
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
    spec = load_spec(config_path, overrides)
    spec.dir.mkdir(parents=True, exist_ok=True)
    spec.out_dir.mkdir(parents=True, exist_ok=True)
    runs = spec.runs()
    check_finished_runs(spec, runs)  # before any run: an edited sweep must not mix old and new settings
    print(f"sweep {spec.name}: {len(spec.cells())} cells x {len(spec.seeds)} seeds in {spec.dir}", flush=True)
    statuses: dict[str, tuple[str, int | None]] = {}
    prev = {s: signal.signal(s, _raise_interrupt) for s in (signal.SIGINT, signal.SIGTERM)}
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
    write_report(spec.cells(), spec.seeds, statuses, spec.marks, spec.out_dir, spec.baseline)
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
