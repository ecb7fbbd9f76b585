"""The learner's bf16 path at a real model shape: is the fp32 gradient path right, and how fast is it.

``python -m asyncrl.bench.gpu_learner --shape qwen2.5-0.5b --out gpu.json`` on a CUDA machine (the
shape ``tiny`` runs the same checks on the CPU in a minute; the test suite does that). A random-init
model of the shape is built and every engine starts from its bf16-representable weights, so the fp32
reference and the bf16 engine compute from identical values. What it measures, on one rank:

* **precision path**: the bf16 engine's token logprobs (asyncrl.learner.logprobs) against the fp32
  model's at equal weights (what a user sees as ``mismatch_kl``), and the fp32 log-softmax of the bf16
  logits against a float64 one of the same logits;
* **gradient path**: the full fp32 gradient that DeepSpeed hands the optimizer (``safe_get_full_grad``,
  just before ``engine.step``) after one ``Trainer.train`` step of the bf16 ZeRO-1 engine, against the
  fp32 ZeRO-0 engine's on the same batch, with the step cut into 1 and into many micro-batches (the
  bf16 forward's own rounding); and, for the many-micro-batch step, against the float64 sum of the
  bf16 micro-batch gradients autograd handed DeepSpeed (hooks): DeepSpeed must accumulate them in
  fp32 (asyncrl.learner.engine.ds_config). The same gradients summed in bf16 (what ZeRO-0 bf16 does)
  are the control that shows the check can fail;
* **reference model**: learn()'s ``ReferenceModel`` on the policy's device, its logprobs bitwise the
  policy's at equal weights (one precision path), and a step with the reference-KL term finite;
* **non-finite guard**: a NaN loss (NaN behaviour logprobs) and an inf gradient under a finite loss
  (a hook on one parameter) each skip the step, leaving the fp32 master weights and the bf16 module
  weights bitwise unchanged; the next clean step applies;
* **throughput**: step time of ``Trainer.train`` (bf16 ZeRO-1, entropy metric on and off) beside bare
  DeepSpeed with the same DeepSpeed config and a bare torch bf16-autocast loop, on the same batch and
  micro-batches, in alternating blocks; tokens/s and the model FLOP utilisation 6 N T / t / peak;
* **ZeRO-1 / 2 / 3**: step time, and the full-weight gather + publish (file and shm transports,
  bf16) against the device-to-host and host-copy floors; the gather as a publish makes it (a CUDA
  policy's host stage, :mod:`asyncrl.learner.host_stage`) beside a pageable ``.to("cpu")`` per
  tensor, and each published file checked bitwise against the policy's weights; what the NCCL
  transport broadcasts from (``named_weights(None)``): on the policy's device, bitwise those weights,
  the live parameters at ZeRO 1-2 and a gathered copy at ZeRO-3, and how long iterating it takes.

The models, engines and checks live in :mod:`asyncrl.bench.gpu_checks`, the timings in
:mod:`asyncrl.bench.gpu_timings`; this module runs the sections. Every check's verdict is in the JSON
(``checks``); the process exits 1 when one fails.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from asyncrl.bench.gpu_checks import (
    BATCHES,
    LIMITS,
    PEAK_BF16_TFLOPS,
    SHAPES,
    Engine,
    build_model,
    compare,
    config,
    fill_behaviour_logprobs,
    free,
    guard_checks,
    logprob_precision,
    make_groups,
    reference_checks,
)
from asyncrl.bench.gpu_timings import floors, throughput, zero_row

__all__ = ["run", "main"]


def run(
    shape: str, steps: int, out: Path, seed: int = 0, skip: frozenset[str] = frozenset()
) -> dict[str, Any]:
    """Every section in turn; the JSON is rewritten after each, and a section that raises is recorded in
    ``errors`` (its checks then fail) while the independent ones still run: device time is scarce."""
    import traceback

    import deepspeed
    import torch
    import transformers

    batch = BATCHES["tiny" if shape == "tiny" else "real"]
    seq = batch["prompt"] + batch["completion"]
    whole = seq * batch["groups"] * batch["group_size"]
    cuda = torch.cuda.is_available()
    res: dict[str, Any] = {"shape": shape, "batch": batch, "limits": LIMITS, "errors": {},
                           "device": torch.cuda.get_device_name(0) if cuda else "cpu",
                           "versions": {"torch": torch.__version__, "deepspeed": deepspeed.__version__,
                                        "transformers": transformers.__version__}}  # fmt: skip
    marks: dict[str, float] = res.setdefault("marks_s", {})
    t0 = time.perf_counter()

    def section(name: str, fn: Any) -> Any:
        if name in skip:
            return None
        try:
            return fn()
        except Exception:  # recorded, the run goes on: the JSON says which section failed and why
            res["errors"][name] = traceback.format_exc()[-4000:]
            print(res["errors"][name], file=sys.stderr)
            free()
            return None
        finally:
            free()
            marks[name] = time.perf_counter() - t0
            out.write_text(json.dumps(res, indent=1) + "\n")

    with tempfile.TemporaryDirectory(prefix="asyncrl-gpu-bench-") as d:
        root = Path(d)
        model_path = root / "model"
        res["params"] = build_model(model_path, shape, seed)
        res["params_no_input_embedding"] = (
            res["params"] - SHAPES[shape]["vocab_size"] * SHAPES[shape]["hidden_size"]
        )
        marks["model_built"] = time.perf_counter() - t0
        groups = make_groups(shape, batch, seed)
        tp_batch = {**batch, "groups": batch["tp_groups"]}
        tp_groups = make_groups(shape, tp_batch, seed + 1)
        engines: dict[str, Engine] = {}

        def gradient() -> None:
            fp32 = Engine(config("float32", 0, batch["micro_tokens"], batch), model_path)
            fill_behaviour_logprobs(fp32, groups, batch["micro_tokens"])
            res["behaviour_filled"] = "fp32"
            ref_one = fp32.step_grads_lr0(groups, whole)
            ref_many = fp32.step_grads_lr0(groups, batch["micro_tokens"])
            bf16 = engines["bf16"] = Engine(config("bfloat16", 1, batch["micro_tokens"], batch), model_path)
            res["precision"] = logprob_precision(bf16, fp32, groups, batch["micro_tokens"])
            fp32.close()
            g_one = bf16.step_grads_lr0(groups, whole)
            sums: dict[str, dict] = {}
            g_many = bf16.step_grads_lr0(groups, batch["micro_tokens"], sums)
            grad = {"fp32_many_vs_one": compare(ref_many, ref_one), "bf16_one": compare(g_one, ref_one),
                    "bf16_many": compare(g_many, ref_many), "accumulated": compare(g_many, sums["exact"]),
                    "summed_in_bf16": compare(sums["bf16"], sums["exact"]),
                    "micro_batches": {"one": 1, "many": -(-whole // max(batch["micro_tokens"] // seq * seq, seq))}}  # fmt: skip
            grad["many_over_one"] = grad["bf16_many"]["rel_err"] / max(grad["bf16_one"]["rel_err"], 1e-300)
            res["gradient"] = grad

        def bf16_engine() -> Engine:
            if "bf16" not in engines:
                engines["bf16"] = Engine(config("bfloat16", 1, batch["micro_tokens"], batch), model_path)
            return engines["bf16"]

        section("gradient", gradient)
        free()
        if "behaviour_filled" not in res:  # the gradient section fills them; without it, from the bf16 engine
            section(
                "behaviour", lambda: fill_behaviour_logprobs(bf16_engine(), groups, batch["micro_tokens"])
            )
            res["behaviour_filled"] = "bf16"
        res["reference"] = section(
            "reference", lambda: reference_checks(bf16_engine(), model_path, groups, batch["micro_tokens"])
        )
        res["guard"] = section("guard", lambda: guard_checks(bf16_engine(), groups))

        def tp() -> dict:
            fill_behaviour_logprobs(bf16_engine(), tp_groups, batch["tp_micro_tokens"])
            return throughput(
                bf16_engine(), model_path, tp_groups, batch["tp_micro_tokens"], steps, small_tokens=seq
            )

        res["throughput"] = section("throughput", tp)
        if "bf16" in engines:
            section("close", engines.pop("bf16").close)
        res["zero"] = {}
        for stage in (1, 2, 3):
            cfg = config("bfloat16", stage, batch["tp_micro_tokens"], tp_batch)
            res["zero"][str(stage)] = section(f"zero{stage}", lambda cfg=cfg: zero_row(
                cfg, model_path, tp_groups, max(2, steps // 3), root))  # fmt: skip
        nbytes = next((z["bytes"] for z in res["zero"].values() if z), 2 * res["params"])
        res["floors"] = section("floors", lambda: floors(nbytes))
    tp = res["throughput"]
    if tp:
        flops = 6.0 * res["params_no_input_embedding"] * tp["tokens"]
        peak = next((v for k, v in PEAK_BF16_TFLOPS.items() if k in res["device"]), None)
        tp["tokens_per_s"] = tp["tokens"] / tp["alone_s"]
        tp["model_tflops"] = flops / tp["alone_s"] / 1e12
        tp["mfu"] = tp["model_tflops"] / peak if peak else None
    p, g, guard = res.get("precision"), res.get("gradient"), res.get("guard")
    res["checks"] = {
        "logp_fp32_softmax": bool(p) and p["logp_fp32_vs_fp64_max_abs"] <= LIMITS["logp_fp32_vs_fp64"],
        "fp32_cut_invariant": bool(g) and g["fp32_many_vs_one"]["rel_err"] <= LIMITS["fp32_cut_rel_err"],
        "bf16_grad_close": bool(g)
        and max(g["bf16_one"]["rel_err"], g["bf16_many"]["rel_err"]) <= LIMITS["bf16_grad_rel_err"]
        and min(g["bf16_one"]["cosine"], g["bf16_many"]["cosine"]) >= LIMITS["bf16_grad_cosine"],
        "fp32_accumulation": bool(g) and g["accumulated"]["rel_err"] <= LIMITS["accumulation_rel_err"],
        "accumulation_check_sensitive": bool(g)
        and g["summed_in_bf16"]["rel_err"] >= 10 * LIMITS["accumulation_rel_err"],
        "nonfinite_guard": bool(guard) and guard["ok"],
        "zero_stages_finite": all(z and z["finite"] for z in res["zero"].values()),
        "publish_bitwise": all(
            z and z["publish_file_bitwise"] and z["publish_shm_bitwise"] for z in res["zero"].values()
        ),
        "reference_same_path": bool(res["reference"]) and res["reference"]["ok"],
        "nccl_source": all(z and z["nccl_source_ok"] for z in res["zero"].values()),
        "no_errors": not res["errors"],
    }
    out.write_text(json.dumps(res, indent=1) + "\n")
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m asyncrl.bench.gpu_learner", description=__doc__.splitlines()[0]
    )
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen2.5-0.5b")
    ap.add_argument("--steps", type=int, default=9, help="timed steps per throughput variant (3 rounds)")
    ap.add_argument("--out", required=True, help="JSON results")
    ap.add_argument("--skip", default="", help="comma-separated sections to leave out (gradient, reference, "
                    "guard, throughput, zero1, zero2, zero3, floors): the checks of a skipped section read failed")  # fmt: skip
    args = ap.parse_args(argv)
    from asyncrl.learner.engine import shutdown_distributed

    try:  # the engines' process group is this process's own: destroyed before exit (see the helper)
        res = run(args.shape, args.steps, Path(args.out), skip=frozenset(filter(None, args.skip.split(","))))
    finally:
        shutdown_distributed()
    keys = ("device", "params", "precision", "gradient", "guard", "checks", "marks_s")
    print(json.dumps({k: res.get(k) for k in keys}, indent=1))
    tp = res["throughput"] or {}
    if tp:
        print(f"step: alone {tp['alone_s'] * 1e3:.1f} ms (entropy metric {tp['alone_entropy_metric_s'] * 1e3:.1f}), "
          f"bare DeepSpeed {tp['bare_deepspeed_s'] * 1e3:.1f}, bare torch autocast {tp['bare_torch_autocast_s'] * 1e3:.1f}; "
          f"alone/DS {tp['ratio_alone_vs_deepspeed']:.3f}; {tp['tokens_per_s']:.0f} tok/s, {tp['model_tflops']:.1f} TFLOP/s, "
          f"MFU {tp['mfu']}")  # fmt: skip
    if tp.get("small_micro_batches"):
        print(f"one-sequence micro-batches ({tp['small_micro_batches']} vs {tp['micro_batches']}): Trainer "
              f"{tp['alone_small_micro_s'] * 1e3:.1f} ms, bare DeepSpeed {tp['bare_deepspeed_small_micro_s'] * 1e3:.1f}, "
              f"bare torch {tp['bare_torch_autocast_small_micro_s'] * 1e3:.1f}; per extra micro-batch "
              f"{tp['alone_per_extra_micro_batch_s'] * 1e3:.1f} / {tp['bare_deepspeed_per_extra_micro_batch_s'] * 1e3:.1f} / "
              f"{tp['bare_torch_autocast_per_extra_micro_batch_s'] * 1e3:.1f} ms")  # fmt: skip
    for st, z in res["zero"].items():
        if z:
            print(
                f"ZeRO-{st}: step {z['step_s'] * 1e3:.1f} ms, publish file {z['publish_file_s'] * 1e3:.1f} ms, "
                f"shm {z['publish_shm_s'] * 1e3:.1f} ms, gather {z['gather_s'] * 1e3:.1f} ms (pageable "
                f"{z['gather_pageable_s'] * 1e3:.1f}), write {z['write_s'] * 1e3:.1f}, sha256 {z['sha256_s'] * 1e3:.1f}, "
                f"fsync {z['fsync_s'] * 1e3:.1f} ms, {z['bytes'] / 1e6:.0f} MB, bitwise {z['publish_file_bitwise']}/{z['publish_shm_bitwise']}"
            )
    print("floors", res["floors"])
    return 0 if all(res["checks"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
