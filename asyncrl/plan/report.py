"""`asyncrl plan`: simulate the pipeline over a range of staleness bounds and print what to expect.

    asyncrl plan --plan configs/plan_qwen2.5_7b_8x8.yaml                 # a fleet you do not have yet
    asyncrl plan --from runs/s0 --from runs/s4 --staleness 0,1,4         # calibrated on real runs
    asyncrl plan --from runs/s0 num_actors=8 learner_token_s=1e-5        # ... then changed

Inputs: defaults < ``--plan`` file < calibration from ``--from`` run dirs < ``key=value`` overrides.
Every row is the simulator's steady state. A row whose eta one of the runs had is predicted from that
run's own components (:func:`asyncrl.plan.calibrate.calibrate_run`: its learner costs, hand-offs and
engine step cost; nothing fitted to its throughput or staleness) and shows what the run measured
beside it; the other rows are projected from the inputs :func:`asyncrl.plan.calibrate.calibrate`
fits to all the runs. Why two: on this box the fitted inputs missed the very runs they were fitted
to by up to 36% in tok/s (eta 4, five sets of demo runs at eta 0 / 1 / 4: a pipeline whose learner and
engines slow each other is not one pair of slowdown factors), where each run's own components
predicted it within 5% (tok/s and staleness); a projection to an eta without a run (eta 1 from the
eta 0 and 4 runs: -11..+23% fitted, -37..+38% from the eta 4 run's components) is a projection.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import replace
from typing import Any

from asyncrl.config import ConfigError

from .calibrate import Measured, calibrate, calibrate_run, measure
from .inputs import PlanInputs, load_plan_inputs
from .simulate import PlanResult, simulate

__all__ = ["parse_staleness", "plan_table", "run_plan"]


def plan_table(p: PlanInputs, etas: list[int]) -> list[tuple[int, PlanResult]]:
    """The simulator's steady state for each staleness bound (everything else as in ``p``)."""
    return [(eta, simulate(replace(p, max_staleness=eta))) for eta in etas]


def parse_staleness(text: str) -> list[int]:
    """``--staleness 0,1,4`` -> [0, 1, 4] (sorted, unique); ConfigError unless every value is an integer >= 0.

    Checked here, not by PlanInputs (whose max_staleness >= 0 check these values bypass): a negative
    bound would have the simulator admit nothing, forever.
    """
    vals = [x.strip() for x in text.split(",") if x.strip()]
    if not vals:
        raise ConfigError(
            f"--staleness: {text!r} has no value; give comma-separated integers >= 0, e.g. 0,1,4"
        )
    out = set()
    for v in vals:
        try:
            eta = int(v)
        except ValueError:
            eta = -1
        if eta < 0:
            raise ConfigError(f"--staleness: {v!r} is not an integer >= 0 (comma-separated, e.g. 0,1,4)")
        out.add(eta)
    return sorted(out)


def _flat(p: Any, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for f in dataclasses.fields(p):
        v = getattr(p, f.name)
        if dataclasses.is_dataclass(v):
            out.update(_flat(v, f"{prefix}{f.name}."))
        else:
            out[f"{prefix}{f.name}"] = v
    return out


def run_plan(plan_file: str | None, run_dirs: list[str], staleness: str, overrides: list[str],
             as_json: bool = False) -> int:  # fmt: skip
    from rich.console import Console
    from rich.table import Table

    etas_given = parse_staleness(staleness) if staleness else None  # before any run dir is read
    p = load_plan_inputs(plan_file)
    sources: dict[str, str] = {k: "plan file" if plan_file else "default" for k in _flat(p)}
    measured: dict[int, Measured] = {}
    own: dict[int, PlanInputs] = {}  # eta -> the inputs of that eta's run, from its own components
    origin: dict[int, str] = {}
    if run_dirs:
        base_p = p
        p, cal = calibrate(run_dirs, p)
        sources.update(cal)
        for d in run_dirs:
            m = measure(d)
            measured[m.max_staleness] = m
            try:
                own[m.max_staleness], _ = calibrate_run(d, base_p)
                origin[m.max_staleness] = f"its run's own components ({d})"
            except ValueError as e:  # no actor timeline to measure the engine from: the fitted inputs
                origin[m.max_staleness] = f"fitted to all runs ({e})"
    if overrides:
        p = load_plan_inputs(None, overrides, base=p)
        own = {eta: load_plan_inputs(None, overrides, base=q) for eta, q in own.items()}
        for item in overrides:
            sources[item.split("=", 1)[0]] = "command line"
    etas = etas_given or [p.max_staleness]
    rows = [(eta, simulate(replace(own.get(eta, p), max_staleness=eta))) for eta in etas]
    for eta in etas:
        origin.setdefault(eta, "fitted to all runs" if run_dirs else "the inputs above")
    base = rows[0][1].tokens_per_s if rows and rows[0][0] == 0 else None
    if as_json:
        out = {"inputs": _flat(p), "sources": sources,
               "results": [{"max_staleness": eta, **r.as_dict(),
                            "speedup_vs_sync": r.tokens_per_s / base if base else None,
                            "inputs_from": origin[eta],
                            "own_inputs": _flat(own[eta]) if eta in own else None,
                            "measured": dataclasses.asdict(measured[eta]) if eta in measured else None}
                           for eta, r in rows]}  # fmt: skip
        print(json.dumps(out, indent=2))
        return 0
    console = Console(width=max(Console().width, 150))  # a pipe gets 80 columns: too narrow
    inputs = Table(title="simulator inputs (fitted to all runs: the rows without a run of their own)",
                   show_lines=False)  # fmt: skip
    for col in ("input", "value", "source"):
        inputs.add_column(col)
    for k, v in _flat(p).items():
        inputs.add_row(k, f"{v:.4g}" if isinstance(v, float) else str(v), sources.get(k, ""))
    console.print(inputs)
    t = Table(title="steady state (simulated; measured in brackets where a calibration run had that eta)")
    for col in ("eta", "samples/s", "trained tok/s", "vs sync", "learner idle", "actors blocked",
                "staleness mean", "staleness max", "dropped", "inputs"):  # fmt: skip
        t.add_column(col, justify="right")
    for eta, r in rows:
        m = measured.get(eta)

        def both(sim: float, real: float | None, fmt: str) -> str:
            return format(sim, fmt) + (f" [{format(real, fmt)}]" if real is not None else "")

        t.add_row(
            str(eta),
            both(r.samples_per_s, m.samples_per_s if m else None, ".1f"),
            both(r.tokens_per_s, m.tokens_per_s if m else None, ".1f"),
            f"{r.tokens_per_s / base:.2f}x" if base else "-",
            both(r.learner_idle_frac, m.learner_idle_frac if m else None, ".0%"),
            f"{r.actor_blocked_frac:.0%}",
            both(r.staleness_mean, m.staleness_mean if m else None, ".2f"),
            str(r.staleness_max),
            str(r.dropped_stale),
            "own run" if eta in own else ("fitted" if run_dirs else "-"),
        )
    console.print(t)
    return 0
