"""The idle-gap penalty of a CPU: how much slower one training step runs after the core idled.

    .venv/bin/python benchmarks/idle_gap.py [--cpu 1] [--rounds 2] [--steps 40]

Why it exists: on the 2-core VMs the learner's step inside the synchronous pipeline (max_staleness 0)
is 1.0-1.1x the same step alone *after the same idle gap* but up to 1.4x the step run back to back,
and the gap, not the engine beside it, is the difference (README, "Current figures"). This measures
the gap alone, with nothing else running: a one-thread torch step (8 x Linear(256, 256), AdamW, a
440-row batch: about the tiny demo learner's step) pinned to ``--cpu``, timed after a gap of G ms
that the core spends sleeping or in a busy spin, and after a 50 ms gap filled with warm work (every
5 ms: an in-place touch of the parameters, grads and optimizer state; or a forward+backward on the
step's batch). Prints the median step (ms) per case and round, and its ratio to back to back.

Reading it: if a busy spin costs what a sleep costs, the vCPU's halt and the core's frequency are not
the cause; if re-touching the model's tensors during the gap does not recover the step, it is not
only their cache lines either. Measured 2026-11-29 (docs/benchmarks.md, "The idle-gap penalty").
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

GAPS_MS = (0, 3, 10, 30, 50, 100)
WARM_GAP_MS = 50
WARM_EVERY_S = 0.005


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cpu", type=int, default=os.cpu_count() - 1, help="core to pin to (default: the last)")
    ap.add_argument(
        "--rounds", type=int, default=2, help="passes over every case (their spread is the noise)"
    )
    ap.add_argument("--steps", type=int, default=40, help="timed steps per case (median reported)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    os.sched_setaffinity(0, {args.cpu})
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(8)])
    opt = torch.optim.AdamW(model.parameters())
    x = torch.randn(440, 256)

    def step() -> float:
        t = time.perf_counter()
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
        return time.perf_counter() - t

    for _ in range(20):  # warm-up: allocator, oneDNN primitives, optimizer state
        step()
    state = [p for p in model.parameters()] + [p.grad for p in model.parameters()]
    state += [v for s in opt.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0]

    def gap(mode: str, seconds: float) -> None:
        if mode == "sleep":
            time.sleep(seconds)
            return
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            if mode == "touch":
                with torch.no_grad():
                    for t in state:
                        t.add_(0)
                time.sleep(WARM_EVERY_S)
            elif mode == "fwd+bwd":
                model(x).square().mean().backward()
                opt.zero_grad(set_to_none=False)  # the timed step's grads start from zero as always
                time.sleep(WARM_EVERY_S)

    cases = [(mode, g) for g in GAPS_MS for mode in ("sleep", "spin")]
    cases += [("touch", WARM_GAP_MS), ("fwd+bwd", WARM_GAP_MS)]
    results: dict[str, list[float]] = {}
    for _ in range(args.rounds):
        for mode, g in cases:
            times = []
            for _ in range(args.steps):
                gap(mode, g / 1e3)
                times.append(step())
            results.setdefault(f"{mode} {g} ms", []).append(1e3 * statistics.median(times))
    hot = statistics.fmean(statistics.fmean(results[f"{m} 0 ms"]) for m in ("sleep", "spin"))
    print(f"| gap before the step (cpu {args.cpu}) | median step, ms (per round) | / back to back |")
    print("|---|---|---|")
    for name, ms in results.items():
        print(f"| {name} | {' / '.join(f'{v:.1f}' for v in ms)} | {statistics.fmean(ms) / hot:.2f}x |")


if __name__ == "__main__":
    main()
