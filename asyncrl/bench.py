"""``asyncrl bench``: one invocation, one table of ratios (target beside each row), one JSON file.

Rows measured here, side by side in one process so machine speed cancels out of each ratio:

* weight path at three model sizes (random-init Qwen2-style models: tiny, ~50M, ~300M params), for
  each transport (``file``: streamed write + sha256 + one fsync, actor-side sha256 verify; ``shm``:
  /dev/shm, no hash): publish-to-serving (publish + verify + swap into a live vLLM engine) against
  the copy floor (model bytes / measured memcpy bandwidth), and the generation pause per swap;
* generation: asyncrl's engine wrapper (``Engine.generate_group``) vs raw vLLM ``AsyncLLM.generate``
  on the same engine, sampling and concurrency;
* the buffer path (``benchmarks/bench_buffer.py``: codec, put+read+ack, admission), when run from a
  checkout.

Not measured by this command (see the README's Benchmarks section): the learner step vs bare
DeepSpeed / torch, pipeline steps/s at max_staleness 0/1/4 against the overlap bound, and start-up
by phase.

Swaps are timed with generation idle, so a pause is the swap itself (a swap during generation also
waits for the engine step in progress, which is not a pause of sampling).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import importlib.util
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

__all__ = ["main", "SIZES"]

#: name -> tiny-model spec overrides (hidden, intermediate, layers, heads, kv heads).
SIZES = {
    "tiny": {},
    "50M": dict(hidden_size=512, intermediate_size=2048, num_layers=12, num_heads=8, num_kv_heads=8),
    "300M": dict(hidden_size=1024, intermediate_size=4096, num_layers=18, num_heads=16, num_kv_heads=16),
}
PAUSE_TARGET_MS = 5.0
P2S_TARGET = 3.0  # publish-to-serving <= 3x the copy floor (at >= 300M params)
GEN_TARGET = 1.05  # the engine wrapper costs (almost) nothing


def copy_bandwidth(nbytes: int = 256 << 20, reps: int = 5) -> float:
    """Bytes/s of a memcpy into already-touched memory (the floor any transport pays once)."""
    import torch

    src = torch.ones(nbytes // 4)
    dst = torch.zeros_like(src)
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t)
    return nbytes / best


async def _weight_path(size: str, root: Path, iters: int, bw: float, gen: dict | None) -> list[dict]:
    from safetensors.torch import load_file

    from asyncrl.actors.engine import Engine
    from asyncrl.buffer import verify
    from asyncrl.config import Config
    from asyncrl.learner.publisher import FilesystemTransport, ShmTransport, shm_root
    from asyncrl.tinymodel import build_tiny_model

    spec = dataclasses.replace(Config().model.tiny, **SIZES[size])
    model_dir = build_tiny_model(root / f"model-{size}", spec, 0)
    base = load_file(str(model_dir / "model.safetensors"))
    nparams = sum(t.numel() for t in base.values())
    engine = Engine(model_dir, dtype="float32", kv_cache_bytes=64 << 20, max_model_len=128)
    rows = []
    try:
        version = 0
        for kind in ("file", "shm"):
            tr = (
                FilesystemTransport(root / f"w-{size}")
                if kind == "file"
                else ShmTransport(shm_root(root, f"bench-{size}"))
            )
            pub, ver, pause, total = [], [], [], []
            for i in range(iters + 1):  # the first swap of each transport is a warm-up
                state = {k: v + 1e-3 * (version + 1) for k, v in base.items()}
                t0 = time.perf_counter()
                m = tr.publish(version, state, "float32")
                t1 = time.perf_counter()
                verify(m)  # what the actor does before it swaps
                t2 = time.perf_counter()
                res = await engine.swap_weights(m.path, version, "in_flight")
                t3 = time.perf_counter()
                tr.delete(version - 1)
                version += 1
                if i:
                    pub.append(t1 - t0)
                    ver.append(t2 - t1)
                    pause.append(res.pause_s)
                    total.append(t3 - t0)
            tr.delete(version - 1)
            if isinstance(tr, ShmTransport):
                tr.cleanup()
            nbytes = m.size
            floor = nbytes / bw
            med = statistics.median
            rows.append(
                {
                    "size": size,
                    "params": nparams,
                    "bytes": nbytes,
                    "transport": kind,
                    "publish_s": med(pub),
                    "verify_s": med(ver),
                    "pause_s": med(pause),
                    "publish_to_serving_s": med(total),
                    "copy_floor_s": floor,
                    "ratio_to_floor": med(total) / floor,
                }
            )
        if gen is not None:
            gen.update(await _generation(engine, **gen))
    finally:
        engine.shutdown()
    return rows


async def _generation(engine: Any, groups: int, concurrency: int, n: int, max_tokens: int) -> dict:
    """Wrapper vs raw AsyncLLM: ``groups`` groups of ``n``, ``concurrency`` at a time, same params."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    prompt = [5, 17, 29, 41, 53, 7, 11]
    params = dict(temperature=1.0, top_p=1.0, max_tokens=max_tokens)  # exactly what Engine sends

    async def raw(i: int) -> int:
        sp = SamplingParams(n=n, logprobs=0, output_kind=RequestOutputKind.DELTA, **params)
        toks = 0
        async for out in engine.llm.generate({"prompt_token_ids": prompt}, sp, f"raw-{i}"):
            toks += sum(len(c.token_ids) for c in out.outputs)
        return toks

    async def ours(i: int) -> int:
        seqs = await engine.generate_group(prompt, n, 1.0, 1.0, max_tokens, f"ours-{i}")
        return sum(len(s.token_ids) for s in seqs)

    async def run(fn) -> float:
        sem = asyncio.Semaphore(concurrency)

        async def one(i: int) -> int:
            async with sem:
                return await fn(i)

        t = time.perf_counter()
        toks = sum(await asyncio.gather(*(one(i) for i in range(groups))))
        return toks / (time.perf_counter() - t)

    await run(raw)  # warm-up
    r, o = [], []
    for _ in range(2):  # interleaved, so drift of the shared box hits both
        r.append(await run(raw))
        o.append(await run(ours))
    return {"raw_tok_s": max(r), "ours_tok_s": max(o), "ratio": max(r) / max(o)}


def _buffer_rows(quick: bool) -> list[dict]:
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_buffer.py"
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
    """The printed table: one line per ratio, its target beside it."""
    lines = [f"{'row':<74} {'measured':>12} {'target':>10} {'ok':>3}"]

    def row(name: str, value: float, target: float, fmt: str = "{:.2f}x") -> None:
        ok = "yes" if value <= target else "NO"
        lines.append(f"{name:<74} {fmt.format(value):>12} {('<= ' + fmt.format(target)):>10} {ok:>3}")

    for w in result["weights"]:
        tag = f"{w['size']} ({w['params'] / 1e6:.1f}M params, {w['bytes'] / 2**20:.1f} MiB) {w['transport']}"
        row(f"weights {tag}: publish-to-serving / copy floor", w["ratio_to_floor"], P2S_TARGET)
        row(f"weights {tag}: pause per swap (ms)", w["pause_s"] * 1e3, PAUSE_TARGET_MS, "{:.1f}")
    g = result.get("generation")
    if g:
        row("generation: raw AsyncLLM tok/s / asyncrl Engine tok/s", g["ratio"], GEN_TARGET)
    for b in result["buffer"]:
        row(f"buffer: {b['what']} / {b['baseline'][:24]}", b["ratio"], b["target"])
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="asyncrl bench", description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny model only, few iterations (CI smoke)")
    ap.add_argument("--sizes", default=None, help=f"comma-separated subset of {','.join(SIZES)}")
    ap.add_argument("--iters", type=int, default=None, help="swaps per size and transport")
    ap.add_argument("--out", default="bench.json", help="where the JSON result goes")
    args = ap.parse_args(argv)
    sizes = (args.sizes or ("tiny" if args.quick else ",".join(SIZES))).split(",")
    bad = [s for s in sizes if s not in SIZES]
    if bad:
        ap.error(f"--sizes: unknown {bad}; expected a subset of {list(SIZES)}")
    iters = args.iters or (2 if args.quick else 5)
    bw = copy_bandwidth(32 << 20 if args.quick else 256 << 20)
    gen = dict(groups=8 if args.quick else 32, concurrency=4, n=4, max_tokens=16 if args.quick else 48)
    result: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": f"{platform.node()} {platform.machine()} {platform.processor() or ''}".strip(),
        "copy_bandwidth_GBps": bw / 1e9,
        "weights": [],
        "generation": None,
    }
    with tempfile.TemporaryDirectory(prefix="asyncrl-bench-") as d:
        for size in sizes:
            g = dict(gen) if size == sizes[0] else None
            result["weights"] += asyncio.run(_weight_path(size, Path(d), iters, bw, g))
            if g is not None:
                result["generation"] = g
    result["buffer"] = _buffer_rows(args.quick)
    lines = table(result)
    print("\n".join(lines))
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0
