"""The printed table of ``asyncrl bench``: one line per row, measured value, target and whether it is met.

A row without a target is context (an absolute number the ratios are built from). The buffer rows
come from ``benchmarks/bench_buffer.py`` when run from a checkout.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from .learner import ALONE_TARGET, IN_PIPELINE_TARGET
from .pipeline import B2B_TARGET, FIRST_STEP_TARGET_S, OVERLAP_TARGET
from .weights import GEN_TARGET, P2S_MIN_PARAMS, P2S_TARGET, PAUSE_TARGET_MS

__all__ = ["table", "buffer_rows"]

#: Start-up milestones in the order they are printed, with their row label.
PHASES = (
    ("redis_ready", "embedded Redis ready"),
    ("learner_started", "learner process up (torch/DeepSpeed imported)"),
    ("deepspeed_ready", "DeepSpeed engine initialised"),
    ("weights_published", "v0 weights published"),
    ("actor_started", "Ray up, actor process started"),
    ("engine_up", "vLLM engine(s) up"),
    ("actor_serving_v0", "actor(s) serving v0"),
    ("first_batch", "first batch in the learner's hands"),
)


def buffer_rows(quick: bool) -> list[dict]:
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_buffer.py"
    if not path.exists():
        return []
    spec = importlib.util.spec_from_file_location("asyncrl_bench_buffer", path)
    mod = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(mod)
    rows = mod.measure(groups=200 if quick else 2000)
    targets = {"codec": 1.5, "put+read+ack": 2.5, "admission": 2.0}
    out = []
    for what, a, b, desc in rows:
        t = next(v for k, v in targets.items() if what.startswith(k))
        out.append(
            {"what": what, "asyncrl_s": a, "baseline_s": b, "ratio": a / b, "target": t, "baseline": desc}
        )
    return out


def table(result: dict) -> list[str]:
    """The printed table: one line per row, its target beside it (``ok`` empty for context rows)."""
    lines = [f"{'row':<78} {'measured':>12} {'target':>11} {'ok':>3}"]

    def row(
        name: str, value: float, target: float | None = None, fmt: str = "{:.2f}x", op: str = "<="
    ) -> None:
        if target is None:
            lines.append(f"{name:<78} {fmt.format(value):>12}")
            return
        ok = "yes" if (value <= target if op == "<=" else value >= target) else "NO"
        lines.append(f"{name:<78} {fmt.format(value):>12} {(op + ' ' + fmt.format(target)):>11} {ok:>3}")

    for w in result.get("weights") or []:
        tag = f"{w['size']} ({w['params'] / 1e6:.1f}M params, {w['bytes'] / 2**20:.1f} MiB) {w['transport']}"
        p2s_target = P2S_TARGET if w["params"] >= P2S_MIN_PARAMS else None  # smaller: context
        row(f"weights {tag}: publish-to-serving / copy floor", w["ratio_to_floor"], p2s_target)
        path = "staged" if w.get("staging") else "in place"
        row(f"weights {tag}: pause per swap, {path} (ms)", w["pause_s"] * 1e3, PAUSE_TARGET_MS, "{:.1f}")
        for other, label in (("in_place", "in place"), ("staged", "staged")):
            if other in w and label != path:  # the other path, measured side by side (context)
                o = w[other]
                row(f"weights {tag}: {label}: pause per swap (ms)", o["pause_s"] * 1e3, fmt="{:.1f}")
                row(f"weights {tag}: {label}: publish-to-serving / copy floor", o["ratio_to_floor"])
        if w.get("staging"):
            row(
                f"weights {tag}: staged: stage built while generating (ms)",
                w["prepare_s"] * 1e3,
                fmt="{:.1f}",
            )
    g = result.get("generation")
    if g:
        how = (
            f" (medians of {g['rounds']} rounds each; per pair {g['ratio_min']:.2f}-{g['ratio_max']:.2f})"
            if "rounds" in g
            else ""
        )
        row(f"generation: raw AsyncLLM tok/s / asyncrl Engine tok/s{how}", g["ratio"], GEN_TARGET)
    d = result.get("demo_generation")
    if d:
        row("generation: one demo step's groups alone, idle engine (ms)", d["gen_step_s"] * 1e3, fmt="{:.1f}")
    lr = result.get("learner")
    if lr:
        cores = f" on cores {','.join(map(str, lr['cpus']))}" if lr.get("cpus") else ""
        shape = f"{lr['sequences']} seqs, {lr['tokens']} tok, {lr['micro_batches']} micro-batch, {lr['threads']} thr{cores}"
        row(f"learner: step alone (ms; {shape})", lr["alone_s"] * 1e3, fmt="{:.1f}")
        row("learner: bare DeepSpeed step (ms)", lr["bare_deepspeed_s"] * 1e3, fmt="{:.1f}")
        row("learner: bare torch step (ms)", lr["bare_torch_s"] * 1e3, fmt="{:.1f}")
        row("learner: step alone / bare DeepSpeed", lr["ratio_alone_vs_deepspeed"], ALONE_TARGET)
        if "ratio_alone_vs_deepspeed_same_kernels" in lr:
            row("learner: step alone / bare DeepSpeed with asyncrl's kernels (fused AdamW, no 1-rank all-reduce)",
                lr["ratio_alone_vs_deepspeed_same_kernels"])  # fmt: skip
        row("learner: bare DeepSpeed / bare torch", lr["ratio_deepspeed_vs_torch"])
        if lr.get("alone_idle_gap_s"):
            row(f"learner: step alone after {lr['idle_gap_s'] * 1e3:.0f} ms idle, as in a sync run (ms)",
                lr["alone_idle_gap_s"] * 1e3, fmt="{:.1f}")  # fmt: skip
    p = result.get("pipeline")
    if p:
        b2b = p.get("back_to_back")
        if b2b:
            parts = "+".join(f"{b2b[k] * 1e3:.0f}" for k in ("gen_s", "train_s", "publish_s", "reload_s"))
            row(f"pipeline: back-to-back limit, steps/s (gen+train+publish+reload = {parts} ms)",
                b2b["steps_per_s"], fmt="{:.2f}")  # fmt: skip
        for eta, r in p["runs"].items():
            row(f"pipeline eta={eta}: steps/s ({r['window_steps']} steps in {r['window_s']:.1f} s)",
                r["steps_per_s"], fmt="{:.2f}")  # fmt: skip
            row(f"pipeline eta={eta}: samples/s", r["samples_per_s"], fmt="{:.1f}")
            if "over_back_to_back" in r:
                row(f"pipeline eta={eta}: steps/s / back-to-back limit", r["over_back_to_back"], B2B_TARGET,
                    op=">=")  # fmt: skip
            if "train_in_pipeline_over_alone" in r:
                row(f"learner: step inside the pipeline (eta={eta}, median {r['train_s_median'] * 1e3:.1f} ms) / alone",
                    r["train_in_pipeline_over_alone"], IN_PIPELINE_TARGET)  # fmt: skip
            if "train_in_pipeline_over_alone_idle_gap" in r:
                row(f"learner: step inside the pipeline (eta={eta}) / alone after the same idle gap",
                    r["train_in_pipeline_over_alone_idle_gap"])  # fmt: skip
        same = p.get("same_placement_sync")
        if same:
            row(f"pipeline eta=0, front end on the {same['frontend']}'s cores as in the async runs: steps/s",
                same["steps_per_s"], fmt="{:.2f}")  # fmt: skip
        if "overlap_bound" in p:
            at = "eta=0, front end as async" if same else "eta=0"
            row(f"pipeline: overlap bound (T_gen {p['T_gen_s'] * 1e3:.0f} ms, T_train {p['T_train_s'] * 1e3:.0f} ms at {at})",
                p["overlap_bound"], fmt="{:.2f}x")  # fmt: skip
            for eta, r in p["runs"].items():
                if "speedup_over_bound" in r:
                    row(f"pipeline eta={eta}: async/sync {r['speedup_vs_sync']:.2f}x / overlap bound",
                        r["speedup_over_bound"], OVERLAP_TARGET, op=">=")  # fmt: skip
                if "speedup_vs_default_sync" in r:
                    row(
                        f"pipeline eta={eta}: steps/s / the default eta=0 run's", r["speedup_vs_default_sync"]
                    )
        lz = p.get("lazy_swaps")
        if lz:
            eta = lz["max_staleness"]
            row(f"pipeline eta={eta}, actors.swap_min_lag={lz['swap_min_lag']}: steps/s (context)", lz["steps_per_s"],
                fmt="{:.2f}")  # fmt: skip
            if "over_back_to_back" in lz:
                row(f"pipeline eta={eta}, actors.swap_min_lag={lz['swap_min_lag']}: steps/s / back-to-back limit",
                    lz["over_back_to_back"])  # fmt: skip
            if "speedup_vs_default" in lz:
                row(f"pipeline eta={eta}: swap_min_lag={lz['swap_min_lag']} / 1, steps/s (staleness "
                    f"{lz['staleness_mean']:.2f} / {lz['default_staleness_mean']:.2f})", lz["speedup_vs_default"])  # fmt: skip
        ref = p["runs"].get("1") or next(iter(p["runs"].values()))
        s = ref["startup"]
        for key, label in PHASES:
            if s.get(key) is not None:
                row(f"start-up (eta={ref['max_staleness']} demo): {label} at (s)", s[key], fmt="{:.1f}")
        row(f"start-up (eta={ref['max_staleness']} demo): first learner step at (s)", s["first_step"],
            FIRST_STEP_TARGET_S, fmt="{:.1f}")  # fmt: skip
    st = result.get("startup")
    if st:
        n = len(st["runs"])
        for key, label in (*PHASES, ("first_step", "first learner step")):
            v = st["summary"].get(key)
            if v is None:
                continue
            name = f"start-up (median of {n} demo runs, {v['min']:.1f}-{v['max']:.1f}): {label} at (s)"
            row(name, v["median"], FIRST_STEP_TARGET_S if key == "first_step" else None, fmt="{:.1f}")
    for b in result.get("buffer") or []:
        row(f"buffer: {b['what']} / {b['baseline'][:24]}", b["ratio"], b["target"])
    return lines
