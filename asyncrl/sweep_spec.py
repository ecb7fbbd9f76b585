"""The sweep file of `asyncrl sweep`: its keys, their validation, and the :class:`SweepSpec` they make.

A spec knows its grid (max_staleness x objective, plus extra cells), its seeds, and each run's
command line and overrides; :func:`load_spec` also resolves every cell's full run config, so a bad
override fails before any cell starts. The file format is documented in ``configs/sweep_staleness.yaml``;
running the spec is :mod:`asyncrl.sweep`.
"""

from __future__ import annotations

import hashlib
import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from asyncrl.config import Config, ConfigError, load_config
from asyncrl.config.loading import _yaml_problem
from asyncrl.sweep_report import CellSpec, SeedRun
from asyncrl.sweep_runs import Marks
from asyncrl.tasks.base import TaskDataError
from asyncrl.tasks.registry import TaskNotFound

SWEEP_KEYS = ("name", "dir", "base_config", "grid", "objectives", "overrides", "seeds", "baseline", "marks_s",
              "step_marks", "cell_timeout_s", "report_dir", "extra_cells")  # fmt: skip
GRID_KEYS = ("max_staleness", "objective")
#: Keys the sweep sets per run; a common or objective override may not fight over them.
RESERVED = ("run.name", "run.dir", "run.progress", "run.seed", "buffer.max_staleness")
DEFAULT_SEEDS = (0, 1, 2)
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


# ------------------------------------------------------------------------------- a run's resolved config

#: Keys of a resolved run config that change no result: where the run dir is (a sweep dir moved or
#: reached by another path) and the progress display.
LOCATION_KEYS = ("run.dir", "run.progress")


def flat_config(cfg: Config) -> dict[str, Any]:
    """A run's fully resolved config as {dotted key: value} (JSON types), less :data:`LOCATION_KEYS` and
    the Redis password: what a finished run's marker records, so that a resume sees a changed base config
    (another ``sweep.base_config`` file, or the same file edited) and names the keys that changed."""
    from asyncrl.launch import redacted

    tree = OmegaConf.to_container(OmegaConf.structured(redacted(cfg)), enum_to_str=True)
    out: dict[str, Any] = {}

    def walk(node: Any, prefix: str) -> None:
        for k, v in node.items():
            if isinstance(v, dict) and v:
                walk(v, f"{prefix}{k}.")
            elif f"{prefix}{k}" not in LOCATION_KEYS:
                out[f"{prefix}{k}"] = v

    walk(tree, "")
    return out


def config_hash(flat: dict[str, Any]) -> str:
    """sha256 of a :func:`flat_config` (key order does not count)."""
    return hashlib.sha256(json.dumps(flat, sort_keys=True, default=str).encode()).hexdigest()


def changed_config(recorded: dict[str, Any], current: dict[str, Any], most: int = 6) -> str | None:
    """The keys whose values differ between two :func:`flat_config` s, as 'key: old -> new' (None: same)."""
    # Through JSON both ways: a recorded (JSON) 1e-3 and a current float 0.001 compare equal, a tuple a list.
    current = json.loads(json.dumps(current, default=str))
    keys = [
        k
        for k in dict.fromkeys([*recorded, *current])
        if recorded.get(k, "<absent>") != current.get(k, "<absent>")
    ]
    if not keys:
        return None
    shown = [f"{k}: {json.dumps(recorded.get(k, '<absent>'))} -> {json.dumps(current.get(k, '<absent>'))}"
             for k in keys[:most]]  # fmt: skip
    return ", ".join(shown) + (f" and {len(keys) - most} more" if len(keys) > most else "")


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
        merged = OmegaConf.create(raw)
        for ov in cli_sweep_overrides:  # one at a time, so that the error names the bad one
            try:
                merged = OmegaConf.merge(merged, OmegaConf.from_dotlist([ov]))
            except (OmegaConfBaseException, yaml.YAMLError) as e:
                # from_dotlist parses the value as YAML: a malformed one ('sweep.seeds=[0,,1]') raises
                # yaml's own error (a traceback before), which names neither the override nor the key.
                raise _fail("overrides", f"{ov!r}: {' '.join(str(e).split())}") from None
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
    if baseline is not None and not isinstance(baseline, str):  # a list/dict is unhashable below
        raise _fail("sweep.baseline", f"{baseline!r} is not an objective name ({', '.join(objectives)})")
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
        raise _fail("sweep.base_config", f"file not found: {base} (relative paths are from the current dir; "
                    "unset or empty = the built-in default config, as `asyncrl run` without -c)")  # fmt: skip
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
    except (yaml.YAMLError, UnicodeDecodeError) as e:  # a tab, a duplicate key (a traceback before)
        raise ConfigError(f"sweep config {path}: not a valid YAML file: {_yaml_problem(e)}") from None
    except OmegaConfBaseException as e:
        raise ConfigError(f"sweep config {path}: {e}") from None
    overrides = list(overrides or [])
    spec = parse_spec(raw, [o for o in overrides if o.startswith("sweep.")])
    spec.overrides += _dotlist([o for o in overrides if not o.startswith("sweep.")], "command-line overrides")
    from asyncrl.cli import _check_model_path  # what `asyncrl run` checks, before any cell pays start-up

    for cell in spec.cells():  # the seed changes nothing a config check looks at: one run per cell
        try:
            cfg = load_config(spec.base_config, spec.run_overrides(SeedRun(cell, spec.seeds[0])))
            _check_model_path(cfg)
        except (ConfigError, TaskDataError, TaskNotFound) as e:  # every user error names its cell
            raise ConfigError(f"sweep cell {cell.name}: {e}") from None
        limit = cfg.run.max_steps  # 0: no limit
        if limit and (past := [m for m in spec.step_marks if m > limit]):
            # No run of the cell reaches it: an empty column, and (before) the only mark compared.
            raise _fail("sweep.step_marks", f"{past[0]} is past run.max_steps={limit} of cell {cell.name}: "
                        "no run of it reaches that step")  # fmt: skip
    return spec
