"""What the second core's work costs the first: the demo's learner step and the engine's decode, each
alone on its own core and both at once on disjoint cores.

    .venv/bin/python benchmarks/core_interference.py [--rounds 3] [--seconds 4]

Why it exists: the async rows of `asyncrl bench` compare async/sync with the overlap bound
(T_gen + T_train) / max(T_gen, T_train), which assumes that generation on one core and training on the
other do not slow each other. Inside the pipeline the learner's step is 1.08-1.38x its step alone at
eta 1 and 4 (where it trains while the engine generates) and the async runs generate ~9% slower per
step than the sync run. This measures that coupling with nothing of asyncrl in between: two
one-thread torch loops pinned to cores 0 and 1 (a training step of about the tiny demo learner's size
on one, a decode-like loop of small matmuls on the other), each timed alone and then while the other
runs. A ratio near 1.00 says the cores are independent and the gap to the bound is asyncrl's; a ratio
well above it says the two vCPUs share a physical core or its caches, which no placement removes.

Prints the median ms per iteration of each loop, alone and together, and the ratios; run it alone.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import time


def _timed(step, warmup: int, per: int, seconds: float, start: mp.Event) -> float:
    """Median ms of ``step`` (timed ``per`` calls at a time) for ``seconds`` after ``start`` is set."""
    for _ in range(warmup):
        step()
    start.wait()
    times, end = [], time.monotonic() + seconds
    while time.monotonic() < end:
        t = time.perf_counter()
        for _ in range(per):
            step()
        times.append((time.perf_counter() - t) / per)
    return statistics.median(times) * 1e3


def _train_loop(cpu: int, seconds: float, start: mp.Event, out: mp.Queue) -> None:
    """About the demo learner's step: 8 x Linear(256, 256) on a 440-row batch, backward, AdamW."""
    os.sched_setaffinity(0, {cpu})
    import torch

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(8)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(440, 256)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        model(x).square().mean().backward()
        opt.step()

    out.put(("train", _timed(step, 20, 1, seconds, start)))


def _decode_loop(cpu: int, seconds: float, start: mp.Event, out: mp.Queue) -> None:
    """Decode-like: 4 layers of (32 x 256) @ (256 x 768) and (32 x 768) @ (768 x 256), no grad."""
    os.sched_setaffinity(0, {cpu})
    import torch

    torch.set_num_threads(1)
    torch.manual_seed(0)
    ws = [(torch.randn(256, 768), torch.randn(768, 256)) for _ in range(4)]
    h0 = torch.randn(32, 256)

    def step() -> None:
        with torch.no_grad():
            h = h0
            for a, b in ws:
                h = torch.relu(h @ a) @ b

    out.put(("decode", _timed(step, 50, 10, seconds, start)))


def measure(loops: dict[str, int], seconds: float) -> dict[str, float]:
    """Run the named loops (name -> cpu) at once; their median ms per iteration."""
    ctx = mp.get_context("spawn")
    start, out = ctx.Event(), ctx.Queue()
    fns = {"train": _train_loop, "decode": _decode_loop}
    procs = [ctx.Process(target=fns[n], args=(cpu, seconds, start, out)) for n, cpu in loops.items()]
    for p in procs:
        p.start()
    time.sleep(3.0)  # both warmed up (imports, 20-50 iterations) before either is timed
    start.set()
    got = dict(out.get(timeout=seconds + 60) for _ in procs)
    for p in procs:
        p.join()
    return got


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--train-cpu", type=int, default=1, help="the learner's core in asyncrl's placement")
    ap.add_argument("--decode-cpu", type=int, default=0, help="the engine's core")
    args = ap.parse_args()
    print(f"{'round':>5} {'train alone':>12} {'decode alone':>13} {'train both':>11} {'decode both':>12} "
          f"{'train x':>8} {'decode x':>9}")  # fmt: skip
    ratios: dict[str, list[float]] = {"train": [], "decode": []}
    for r in range(args.rounds):
        alone_t = measure({"train": args.train_cpu}, args.seconds)["train"]
        alone_d = measure({"decode": args.decode_cpu}, args.seconds)["decode"]
        both = measure({"train": args.train_cpu, "decode": args.decode_cpu}, args.seconds)
        ratios["train"].append(both["train"] / alone_t)
        ratios["decode"].append(both["decode"] / alone_d)
        print(f"{r:>5} {alone_t:>12.2f} {alone_d:>13.3f} {both['train']:>11.2f} {both['decode']:>12.3f} "
              f"{ratios['train'][-1]:>7.2f}x {ratios['decode'][-1]:>8.2f}x")  # fmt: skip
    print(f"median: train {statistics.median(ratios['train']):.2f}x, "
          f"decode {statistics.median(ratios['decode']):.2f}x of alone while the other core works")  # fmt: skip


if __name__ == "__main__":
    main()
