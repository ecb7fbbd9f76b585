"""`asyncrl sweep`: run the pipeline over a max_staleness x objective grid, several seeds per cell.

Each (cell, seed) is a separate ``python -m asyncrl.cli run`` subprocess in ``<cell>/seed<k>/``, so
every run gets fresh Ray, Redis and vLLM processes and a crash in one cannot poison the next. Runs
share the budget and task (the sweep's common overrides) and differ only in ``run.seed``,
``buffer.max_staleness`` and the objective's overrides; the same seed in two cells means the same
initial weights, prompt order and sampling seeds, which is what makes the paired comparison of
objectives at one staleness level meaningful. Seeds are the outer loop, so an interrupted sweep has
complete grids for its first seeds. The sweep is resumable: a finished run (its ``summary.json`` says
``"finished": true``, i.e. it reached ``run.max_steps``, and the sweep recorded no failure) is not
re-run; a failed, interrupted or incomplete one (stopped early, e.g. by ``run.max_wall_s``: ``asyncrl
run`` exits 0 then) is re-run from scratch. Only finished runs enter the report's statistics. The
sweep file format is documented in ``configs/sweep_staleness.yaml``; the report (statistics, csv, markdown, plots) is
:mod:`asyncrl.sweep_report`.
"""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from asyncrl.config import ConfigError, load_config
from asyncrl.launch import stop_process
from asyncrl.orchestrator import read_summary
from asyncrl.sweep_report import CellSpec, SeedRun, write_report
from asyncrl.sweep_runs import Marks

SWEEP_KEYS = ("name", "dir", "base_config", "grid", "objectives", "overrides", "seeds", "baseline", "marks_s",
              "step_marks", "cell_timeout_s", "report_dir", "extra_cells")  # fmt: skip
GRID_KEYS = ("max_staleness", "objective")
#: Keys the sweep sets per run; a common or objective override may not fight over them.
RESERVED = ("run.name", "run.dir", "run.progress", "run.seed", "buffer.max_staleness")
DEFAULT_SEEDS = (0, 1, 2)
MARKER = "sweep_cell.json"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$")


@dataclass
class SweepSpec:
    """A validated sweep: the grid, what each objective means, and the settings every cell shares."""

    name: str
    dir: Path
    base_config: Path | None
    max_staleness: list[int]
    objectives: dict[str, list[str]]  # only the objectives of some cell: grid order, then extra_cells'
    overrides: list[str] = field(default_factory=list)
    marks_s: list[float] = field(default_factory=list)
    cell_timeout_s: float = 0.0
    seeds: list[int] = field(default_factory=lambda: list(DEFAULT_SEEDS))
    step_marks: list[int] = field(default_factory=list)
    baseline: str | None = None  # objective the others are compared with (paired by seed)
    # Where the report goes (default: dir). A second sweep file can share another's run dirs (its
    # finished runs are skipped) and report on a different grid without overwriting the first report.
    report_dir: Path | None = None
    # (max_staleness, objective) points run besides the cross product, e.g. an adaptive row at one
    # ceiling only; never a grid point (validated). Their objectives are in ``objectives`` too.
    extra_cells: list[tuple[int, str]] = field(default_factory=list)
    grid_objectives: list[str] = field(default_factory=list)  # the grid's axis (empty = all objectives)

    @property
    def out_dir(self) -> Path:
        return self.report_dir or self.dir

    @property
    def marks(self) -> Marks:
        return Marks(tuple(self.marks_s), tuple(self.step_marks))

    def runs(self) -> list[SeedRun]:
        """Every (cell, seed) in run order: seed outer, then staleness, then objective."""
        return [SeedRun(c, s) for s in self.seeds for c in self.cells()]

    def cells(self) -> list[CellSpec]:
        """Grid points and extra cells in run order: staleness outer (the grid's bounds, then the extra
        cells' new ones), then the grid's objectives, then the extra cells at that bound."""
        grid_objs = self.grid_objectives or list(self.objectives)
        points: list[tuple[int, str]] = []
        for s in dict.fromkeys([*self.max_staleness, *(s for s, _ in self.extra_cells)]):
            points += [(s, o) for o in grid_objs] if s in self.max_staleness else []
            points += [(t, o) for t, o in self.extra_cells if t == s]
        return [CellSpec(f"s{s}-{o}", s, o, self.dir / f"s{s}-{o}") for s, o in points]

    def run_overrides(self, run: SeedRun) -> list[str]:
        """Dotlist of a run: common, then objective, then what the sweep owns (last wins)."""
        cell = run.cell
        return [
            *self.overrides,
            *self.objectives[cell.objective],
            f"buffer.max_staleness={cell.max_staleness}",
            f"run.seed={run.seed}",
            f"run.name={cell.name}-seed{run.seed}",
            f"run.dir={run.dir}",
            "run.progress=false",
        ]

    def command(self, run: SeedRun) -> list[str]:
        cmd = [sys.executable, "-m", "asyncrl.cli", "run"]
        if self.base_config is not None:
            cmd += ["--config", str(self.base_config)]
        return cmd + self.run_overrides(run)


# ---------------------------------------------------------------------------------------- validation


def _fail(key: str, msg: str) -> ConfigError:
    return ConfigError(f"sweep config: {key}: {msg}")


def _dotlist(value: Any, key: str) -> list[str]:
    """A list of 'key.path=value' strings that does not touch what the sweep sets per cell."""
    if value is None:
        return []
    if not isinstance(value, list):
        raise _fail(key, f"must be a list of 'key.path=value' strings, got {type(value).__name__}")
    for i, item in enumerate(value):
        if not isinstance(item, str) or "=" not in item:
            raise _fail(f"{key}[{i}]", f"{item!r} must be a 'key.path=value' string")
        if item.split("=", 1)[0].strip() in RESERVED:
            raise _fail(f"{key}[{i}]", f"{item!r}: the sweep sets {', '.join(RESERVED)} itself")
    return list(value)


def _unique_list(value: Any, key: str) -> list:
    if not isinstance(value, list) or not value:
        raise _fail(key, f"must be a non-empty list, got {value!r}")
    if len(set(map(str, value))) != len(value):
        raise _fail(key, f"has duplicate values: {value!r}")
    return value


def _extra_cells(value: Any, stale: list, objs: list, defined: dict) -> list[tuple[int, str]]:
    """``sweep.extra_cells``: [max_staleness, objective] pairs off the grid, each defined and new."""
    key = "sweep.extra_cells"
    if value is None:
        return []
    if not isinstance(value, list):
        raise _fail(key, f"must be a list of [max_staleness, objective] pairs, got {value!r}")
    out: list[tuple[int, str]] = []
    for i, item in enumerate(value):
        if not isinstance(item, list) or len(item) != 2:
            raise _fail(f"{key}[{i}]", f"{item!r} must be a pair [max_staleness, objective]")
        bound, obj = item
        if isinstance(bound, bool) or not isinstance(bound, int) or bound < 0:
            raise _fail(f"{key}[{i}]", f"max_staleness {bound!r} is not an integer >= 0")
        if not isinstance(obj, str) or not _NAME.match(obj) or obj not in defined:
            raise _fail(
                f"{key}[{i}]", f"objective {obj!r} not defined (defined: {', '.join(defined) or 'none'})"
            )
        if bound in stale and obj in objs:
            raise _fail(f"{key}[{i}]", f"{item!r} is already a grid point")
        if (bound, obj) in out:
            raise _fail(f"{key}[{i}]", f"{item!r} is listed twice")
        out.append((bound, obj))
    return out


def parse_spec(raw: Any, cli_sweep_overrides: list[str] | None = None) -> SweepSpec:
    """Validate a loaded sweep file (plus ``sweep.*`` dotlist overrides) into a SweepSpec.

    Raises ConfigError naming the offending key for unknown keys, empty or duplicate grid values,
    undefined objectives, malformed overrides and bad marks.
    """
    if not isinstance(raw, dict) or "sweep" not in raw:
        raise _fail("sweep", "missing: a sweep file is a mapping with one top-level key 'sweep'")
    if extra := sorted(set(raw) - {"sweep"}):
        raise _fail(extra[0], "unknown top-level key; the only one allowed is 'sweep'")
    if cli_sweep_overrides:
        try:
            merged = OmegaConf.merge(OmegaConf.create(raw), OmegaConf.from_dotlist(cli_sweep_overrides))
        except OmegaConfBaseException as e:
            raise _fail("overrides", str(e)) from None
        raw = OmegaConf.to_container(merged, resolve=True)
    s = raw["sweep"]
    if not isinstance(s, dict):
        raise _fail("sweep", "must be a mapping")
    if extra := sorted(set(s) - set(SWEEP_KEYS)):
        raise _fail(f"sweep.{extra[0]}", f"unknown key; allowed keys: {', '.join(SWEEP_KEYS)}")
    name = s.get("name", "sweep")
    if not isinstance(name, str) or not _NAME.match(name):
        raise _fail("sweep.name", f"{name!r}: use 1-64 characters from [A-Za-z0-9_-]")
    grid = s.get("grid")
    if not isinstance(grid, dict) or not grid:
        raise _fail("sweep.grid", f"must be a mapping with keys {', '.join(GRID_KEYS)}")
    if extra := sorted(set(grid) - set(GRID_KEYS)):
        raise _fail(f"sweep.grid.{extra[0]}", f"unknown grid axis; allowed axes: {', '.join(GRID_KEYS)}")
    for axis in GRID_KEYS:
        if axis not in grid:
            raise _fail(f"sweep.grid.{axis}", "missing (every grid axis needs a non-empty list)")
    stale = _unique_list(grid["max_staleness"], "sweep.grid.max_staleness")
    for v in stale:
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise _fail("sweep.grid.max_staleness", f"{v!r} is not an integer >= 0")
    objs = _unique_list(grid["objective"], "sweep.grid.objective")
    defined = s.get("objectives") or {}
    if not isinstance(defined, dict):
        raise _fail("sweep.objectives", "must be a mapping objective name -> list of overrides")
    objectives = {}
    for obj in objs:
        if not isinstance(obj, str) or not _NAME.match(obj):
            raise _fail("sweep.grid.objective", f"{obj!r}: use 1-64 characters from [A-Za-z0-9_-]")
        if obj not in defined:
            raise _fail(f"sweep.objectives.{obj}", f"not defined (defined: {', '.join(defined) or 'none'})")
        objectives[obj] = _dotlist(defined[obj], f"sweep.objectives.{obj}")
    extra = _extra_cells(s.get("extra_cells"), stale, objs, defined)
    for _, obj in extra:
        objectives.setdefault(obj, _dotlist(defined[obj], f"sweep.objectives.{obj}"))
    marks = s.get("marks_s") or []
    if not isinstance(marks, list):
        raise _fail("sweep.marks_s", f"must be a list of seconds, got {marks!r}")
    for m in marks:
        if isinstance(m, bool) or not isinstance(m, int | float) or m <= 0:
            raise _fail("sweep.marks_s", f"{m!r} is not a number of seconds > 0")
    seeds = _unique_list(s.get("seeds", list(DEFAULT_SEEDS)), "sweep.seeds")
    for v in seeds:
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise _fail("sweep.seeds", f"{v!r} is not an integer >= 0")
    step_marks = s.get("step_marks") or []
    if not isinstance(step_marks, list):
        raise _fail("sweep.step_marks", f"must be a list of learner steps, got {step_marks!r}")
    for m in step_marks:
        if isinstance(m, bool) or not isinstance(m, int) or m < 1:
            raise _fail("sweep.step_marks", f"{m!r} is not a learner step (integer >= 1)")
    baseline = s.get("baseline", "naive" if "naive" in objectives else None)
    if baseline is not None and baseline not in objectives:
        raise _fail(
            "sweep.baseline", f"{baseline!r} is not an objective of the grid ({', '.join(objectives)})"
        )
    timeout = s.get("cell_timeout_s", 0)
    if isinstance(timeout, bool) or not isinstance(timeout, int | float) or timeout < 0:
        raise _fail("sweep.cell_timeout_s", f"{timeout!r} is not a number of seconds >= 0")
    for key in ("dir", "base_config", "report_dir"):
        if not isinstance(s.get(key, ""), str):
            raise _fail(f"sweep.{key}", f"must be a path string, got {s[key]!r}")
    base = Path(s["base_config"]).resolve() if s.get("base_config") else None
    if base is not None and not base.exists():
        raise _fail("sweep.base_config", f"file not found: {base} (relative paths are from the current dir)")
    return SweepSpec(
        name=name,
        dir=Path(s.get("dir") or f"runs/sweep-{name}").resolve(),
        base_config=base,
        max_staleness=stale,
        objectives=objectives,
        overrides=_dotlist(s.get("overrides"), "sweep.overrides"),
        marks_s=sorted({float(m) for m in marks}),
        cell_timeout_s=float(timeout),
        seeds=list(seeds),
        step_marks=sorted(set(step_marks)),
        baseline=baseline,
        report_dir=Path(s["report_dir"]).resolve() if s.get("report_dir") else None,
        extra_cells=extra,
        grid_objectives=list(objs),
    )


def load_spec(path: str | Path | None, overrides: list[str] | None = None) -> SweepSpec:
    """Load and validate a sweep file; ``sweep.*`` overrides edit the sweep, the others join every cell.

    Every cell's full run config is resolved here too, so a bad override fails before any cell starts.
    """
    if path is None:
        raise ConfigError("asyncrl sweep needs --config SWEEP_YAML (e.g. configs/sweep_staleness.yaml)")
    if not Path(path).exists():
        raise ConfigError(f"sweep config file not found: {path}")
    try:
        raw = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    except OmegaConfBaseException as e:
        raise ConfigError(f"sweep config {path}: {e}") from None
    overrides = list(overrides or [])
    spec = parse_spec(raw, [o for o in overrides if o.startswith("sweep.")])
    spec.overrides += _dotlist([o for o in overrides if not o.startswith("sweep.")], "command-line overrides")
    from asyncrl.cli import _check_model_path  # what `asyncrl run` checks, before any cell pays start-up

    for cell in spec.cells():  # the seed changes nothing a config check looks at: one run per cell
        try:
            _check_model_path(load_config(spec.base_config, spec.run_overrides(SeedRun(cell, spec.seeds[0]))))
        except ConfigError as e:
            raise ConfigError(f"sweep cell {cell.name}: {e}") from None
    return spec


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


def _stop(proc: subprocess.Popen, grace_s: float = 120.0) -> None:
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
    started = time.time()
    _write_marker(run, status="running", started=started, cmd=cmd)
    proc: subprocess.Popen | None = None
    timed_out = False
    try:
        with (run.dir / "run.log").open("ab") as log:
            # Own session: a terminal Ctrl-C reaches the sweep only, which then stops the run in order.
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        while proc.poll() is None:
            if spec.cell_timeout_s and time.time() - started > spec.cell_timeout_s:
                timed_out = True
                _stop(proc)
                break
            time.sleep(0.5)
    except _Interrupted:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not abandon the tear-down
        code = None
        if proc is not None:
            _stop(proc)
            code = proc.returncode
        _write_marker(run, status="interrupted", started=started, ended=time.time(), exit_code=code, cmd=cmd)
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
                  cmd=cmd)  # fmt: skip
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
    from asyncrl.sweep_runs import load_metrics

    recs = load_metrics(run.dir / "metrics.jsonl")
    smean = sum(r["staleness_mean"] for r in recs) / len(recs) if recs else 0.0
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
