"""``asyncrl bench``: one invocation, one table of ratios (target beside each row), one JSON file.

Rows, each family in its own module, measured side by side in one sitting so machine speed cancels
out of each ratio:

* weights (asyncrl.bench.weights): publish-to-serving vs the copy floor and the pause per swap at
  three model sizes for both transports; the engine wrapper vs raw vLLM AsyncLLM; one demo step's
  generation alone;
* learner (asyncrl.bench.learner): the Trainer step alone vs bare DeepSpeed vs bare torch on the same
  batch and micro-batches (fp32 CPU, the learner's thread count);
* pipeline (asyncrl.bench.pipeline; on by default, off with ``--quick`` unless ``--pipeline``): short
  real ``asyncrl run``s of the demo at max_staleness 0, 1, 4: steps/s and samples/s against the
  back-to-back limit, async/sync against the overlap bound, the learner step inside the pipeline vs
  alone, and start-up to the first learner step by phase;
* buffer (``benchmarks/bench_buffer.py``, when run from a checkout): codec, put+read+ack, admission.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from .pipeline import STALENESS
from .report import buffer_rows, table
from .weights import SIZES, copy_bandwidth, weight_path

__all__ = ["main", "SIZES", "table"]


def _default_config() -> str | None:
    """The demo config of this checkout (``asyncrl run``'s default), or None (the schema's defaults)."""
    p = Path(__file__).resolve().parents[2] / "configs" / "default.yaml"
    return str(p) if p.exists() else None


def _commit() -> str:
    try:
        root = Path(__file__).resolve().parents[2]
        out = subprocess.run(["git", "-C", str(root), "describe", "--always", "--dirty"], capture_output=True,
                             text=True, timeout=10)  # fmt: skip
        return out.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="asyncrl bench", description=__doc__.splitlines()[0])
    ap.add_argument(
        "--quick", action="store_true", help="tiny model only, few iterations, no pipeline runs (CI)"
    )
    ap.add_argument("--sizes", default=None, help=f"comma-separated subset of {','.join(SIZES)}")
    ap.add_argument("--iters", type=int, default=None, help="swaps per size and transport")
    ap.add_argument("--config", default=None, help="demo config for the learner and pipeline rows "
                    "(default: configs/default.yaml)")  # fmt: skip
    ap.add_argument("--learner-steps", type=int, default=None, help="timed steps per learner variant")
    ap.add_argument("--pipeline", action=argparse.BooleanOptionalAction, default=None,
                    help="run the demo at each --staleness (default: on, off with --quick)")  # fmt: skip
    ap.add_argument("--staleness", default=",".join(map(str, STALENESS)), help="max_staleness values to run")
    # 400: a 150-step run's steady window was ~7 s of this VM's time, shorter than its slow spells.
    ap.add_argument("--pipeline-steps", type=int, default=400, help="learner steps per pipeline run")
    ap.add_argument("--out", default="bench.json", help="where the JSON result goes")
    ap.add_argument("--weights-only", action="store_true",
                    help="only the weight-path rows (both swap paths at --sizes); no generation, learner, "
                    "pipeline or buffer rows")  # fmt: skip
    ap.add_argument("--startup-only", type=int, default=None, metavar="N",
                    help="only start-up to the first learner step, by phase: N short demo runs, median "
                    "and spread per phase")  # fmt: skip
    args = ap.parse_args(argv)
    if args.startup_only is not None:
        if args.weights_only or args.pipeline or args.quick:
            ap.error("--startup-only runs only the start-up samples; drop --weights-only/--pipeline/--quick")
        if args.startup_only < 1:
            ap.error(f"--startup-only: at least 1 run expected, got {args.startup_only}")
        return _startup_only(args.config or _default_config(), args.startup_only, args.out)
    sizes = (args.sizes or ("tiny" if args.quick else ",".join(SIZES))).split(",")
    bad = [s for s in sizes if s not in SIZES]
    if bad:
        ap.error(f"--sizes: unknown {bad}; expected a subset of {list(SIZES)}")
    try:
        staleness = tuple(int(x) for x in args.staleness.split(","))
    except ValueError:
        ap.error(f"--staleness: comma-separated integers expected, got {args.staleness!r}")
    pipeline = (not args.quick) if args.pipeline is None else args.pipeline
    if args.weights_only and args.pipeline:
        ap.error("--weights-only leaves the pipeline runs out; drop --pipeline")
    pipeline = pipeline and not args.weights_only
    config = args.config or _default_config()
    iters = args.iters or (2 if args.quick else 5)

    from asyncrl.config import load_config

    cfg = load_config(config)
    bw = copy_bandwidth(32 << 20 if args.quick else 256 << 20)
    gen = dict(groups=8 if args.quick else 32, concurrency=4, n=4, max_tokens=16 if args.quick else 48)
    demo = dict(cfg=cfg, steps=5 if args.quick else 20)
    result: dict[str, Any] = {**_header(), "copy_bandwidth_GBps": bw / 1e9}
    only = args.weights_only
    with tempfile.TemporaryDirectory(prefix="asyncrl-bench-") as d:
        g, dm = (None, None) if only else (gen, demo)
        result["weights"] = weight_path(
            sizes, Path(d), iters, bw, g, dm, cfg.actors.swap_staging, cfg.actors.cpu_keep_freed_memory
        )
        if not only:
            result["generation"] = gen if "ratio" in gen else None
            result["demo_generation"] = (
                {k: v for k, v in demo.items() if k != "cfg"} if "gen_step_s" in demo else None
            )
            steps = args.learner_steps or (10 if args.quick else 30)
            result["learner"] = lrn = _learner(config, steps)
        if pipeline:
            from .pipeline import back_to_back, pipeline_rows

            b2b = _b2b(result, cfg, back_to_back)
            result["pipeline"] = pipeline_rows(
                config,
                staleness,
                args.pipeline_steps,
                Path(d),
                b2b,
                lrn["alone_s"],
                lrn.get("alone_idle_gap_s"),
            )
    if not only:
        result["buffer"] = buffer_rows(args.quick)
    lines = table(result)
    print("\n".join(lines))
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


def _header() -> dict[str, Any]:
    return {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": f"{platform.node()} {platform.machine()} {platform.processor() or ''}".strip(),
        "commit": _commit(),
    }


def _startup_only(config: str | None, runs: int, out: str) -> int:
    from .startup import startup_rows

    result: dict[str, Any] = _header()
    with tempfile.TemporaryDirectory(prefix="asyncrl-bench-") as d:
        result["startup"] = startup_rows(config, runs, Path(d))
    print("\n".join(table(result)))
    Path(out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


def _learner(config: str | None, steps: int) -> dict:
    from .learner import learner_rows

    return learner_rows(config, steps)


def _b2b(result: dict, cfg: Any, back_to_back: Any) -> dict | None:
    """The back-to-back limit from this invocation's alone numbers (None without the tiny rows)."""
    transport = "file" if cfg.learner.weight_transport == "file" else "shm"  # auto: Redis is local here
    w = next((w for w in result["weights"] if w["size"] == "tiny" and w["transport"] == transport), None)
    if w is None or result["demo_generation"] is None:
        return None
    return back_to_back(result["demo_generation"]["gen_step_s"], result["learner"]["alone_s"], w["publish_s"],
                        w["publish_to_serving_s"] - w["publish_s"])  # fmt: skip
