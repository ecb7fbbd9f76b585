"""A sweep run dir's state, and the checks made on it before the sweep (re-)runs it.

What :mod:`asyncrl.sweep` reads back from a run dir: its marker (``sweep_cell.json``: what the sweep
recorded of the run, its status, pid and resolved config), whether the run is finished (reached
run.max_steps, no failure recorded, metrics.jsonl one run's record) or else its status on disk. And the
two refusals a sweep makes before running anything: a run dir whose recorded ``asyncrl run`` is still
alive (:class:`RunInUse`), and finished runs made with other overrides or another resolved config than
the sweep gives them now (:func:`check_finished_runs`). Split out of :mod:`asyncrl.sweep`, which
re-exports these names.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from asyncrl.config import Config, ConfigError, LearnerConfig, load_config
from asyncrl.proc_identity import start_time as _proc_start  # None for a zombie: it no longer runs
from asyncrl.run_summary import read_summary
from asyncrl.sweep_report import SeedRun
from asyncrl.sweep_runs import config_value, step_problem
from asyncrl.sweep_spec import SweepSpec, changed_config, config_hash, flat_config

# The sweep's log: its warnings keep the logger they had in asyncrl.sweep (log filters and tests name it).
log = logging.getLogger("asyncrl.sweep")

MARKER = "sweep_cell.json"


class RunInUse(ConfigError):
    """A run dir's recorded `asyncrl run` process is still alive: the sweep must not write into it."""


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


def bad_steps(run: SeedRun) -> str | None:
    """Why the run's metrics.jsonl is not the record of one run to run.max_steps (None: it is); e.g. an
    orphaned run of an earlier sweep wrote into it. run.max_steps from the marker, else the run's config."""
    limit = read_marker(run).get("max_steps", config_value(run.dir, "run.max_steps"))
    return step_problem(run.dir / "metrics.jsonl", limit)


def is_finished(run: SeedRun) -> bool:
    """Reached run.max_steps (summary.json), the sweep did not record a failure or interruption, and its
    metrics.jsonl is one run's record (:func:`bad_steps`)."""
    return (
        _reached_max_steps(read_summary(run.dir))
        and read_marker(run).get("status", "ok") == "ok"
        and bad_steps(run) is None
    )


def live_child(run: SeedRun) -> int | None:
    """The pid of the run's recorded `asyncrl run` process if it is still alive (same pid, same start)."""
    marker = read_marker(run)
    pid, start = marker.get("pid"), marker.get("pid_start")
    return pid if pid is not None and start is not None and _proc_start(pid) == start else None


def check_no_live_runs(runs: list[SeedRun]) -> None:
    """Refuse to start while a run's recorded process is still alive: a re-run would move its dir aside
    and start a second run in a new one, into which the live one keeps writing (its metrics.jsonl and
    summary.json are opened by path): two runs' steps in one record, reported as one run."""
    for run in runs:
        if (pid := live_child(run)) is not None:
            raise RunInUse(
                f"sweep run {run.dir} is still being run by process {pid} (started by an earlier sweep that "
                "was killed, or by another sweep on the same dir); a re-run would mix its steps into the new "
                f"run. Let it end, or stop it (kill -TERM -- -{pid}, its process group), then run the sweep again"
            )


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
    overrides match. Then the same for the run's fully resolved config (its marker's hash of it): another
    ``sweep.base_config``, or the same file edited, changes it under the same overrides. Keys only one
    side has (added or removed by another asyncrl version, with their defaults) are no change. Markers
    from before the overrides (or the config) were recorded cannot be checked: accepted as before, with
    one warning.
    """
    new_dir = (f"Run the changed sweep in a new dir (e.g. sweep.dir={spec.dir}-v2, or a new sweep.name where "
               "the file sets no sweep.dir), or put")  # fmt: skip
    unchecked = no_config = 0
    for run in runs:
        if not is_finished(run):
            continue
        marker = read_marker(run)
        recorded = marker.get("overrides")
        if recorded is None:
            unchecked += 1
            continue
        if diff := changed_overrides(recorded, spec.run_overrides(run)):
            raise ConfigError(
                f"sweep run {run.dir} finished with other overrides than this sweep gives it now ({diff}); "
                f"it would be skipped and reported under the new settings. {new_dir} the overrides back as "
                "they were"
            )
        if "config" not in marker:
            no_config += 1
        elif diff := _changed_run_config(spec, run, marker):
            raise ConfigError(
                f"sweep run {run.dir} finished with another run config than this sweep gives it now, under the "
                f"same overrides ({diff}): the base config {spec.base_config or 'configs/default.yaml'} is "
                f"another file or was edited; the run would be skipped and reported under the new settings. "
                f"{new_dir} the base config back as it was"
            )
    if unchecked:
        log.warning("sweep %s: %d finished runs have no recorded overrides (made by an older asyncrl); "
                    "reused without checking them against the sweep file", spec.name, unchecked)  # fmt: skip
    if no_config:
        log.warning("sweep %s: %d finished runs have no recorded run config (made by an older asyncrl); "
                    "reused without checking them against the base config", spec.name, no_config)  # fmt: skip


def _changed_run_config(spec: SweepSpec, run: SeedRun, marker: dict[str, Any]) -> str | None:
    """How the run's resolved config now differs from the one its marker recorded (None: the same, or it
    no longer loads: the run is then re-run only if unfinished, as before)."""
    cfg = _run_config(spec, run)
    if cfg is None or config_hash(now := flat_config(cfg)) == marker.get("config_hash"):
        return None
    # Paths compared absolute, as the run dir's resume check does: markers written before config.yaml
    # held absolute paths (asyncrl.config.paths.absolute_paths) recorded them as typed.
    old, now = _paths_compared(marker["config"]), _paths_compared(now)
    return changed_config(
        {k: v for k, v in old.items() if k in now}, {k: v for k, v in now.items() if k in old}
    )


def _paths_compared(flat: dict[str, Any]) -> dict[str, Any]:
    from asyncrl.config.paths import PATH_KEYS, absolute_path_value

    return {k: absolute_path_value(k, v, compare=True) if k in PATH_KEYS else v for k, v in flat.items()}


def disk_status(run: SeedRun) -> str:
    """The status of a run the sweep did not run this time, from its dir: ok, incomplete (exited 0 but
    stopped before run.max_steps; a marker written before "incomplete" existed says ok), failed (also: a
    metrics.jsonl that is not one run's record, :func:`bad_steps`), interrupted, running (the sweep died
    during it) or missing."""
    if is_finished(run):
        return "ok"
    marker = read_marker(run).get("status")
    if marker in (None, "ok") and _reached_max_steps(read_summary(run.dir)):
        return "failed"  # finished, but bad_steps
    if marker in (None, "ok") and (run.dir / "summary.json").exists():
        return "incomplete"
    return marker or "missing"


#: Seconds a stopped run gets beyond its learner's own stop grace (learner.stop_grace_s), for the rest of
#: its tear-down (actors, Ray, Redis's final save).
STOP_MARGIN_S = 60.0
#: learner.stop_grace_s's default, for a run whose config no longer loads.
DEFAULT_STOP_GRACE_S = LearnerConfig().stop_grace_s


def _run_config(spec: SweepSpec, run: SeedRun) -> Config | None:
    """The run's config, or None (logged) if it no longer loads (edited or removed mid-sweep)."""
    try:
        return load_config(spec.base_config, spec.run_overrides(run))
    except (ConfigError, OSError) as e:
        log.warning("sweep run %s: its config does not load (%s); stop grace %.0f s", run.name, e,
                    DEFAULT_STOP_GRACE_S + STOP_MARGIN_S)  # fmt: skip
        return None
