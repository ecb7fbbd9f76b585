"""Learner rows of ``asyncrl bench``: asyncrl's learner step alone vs bare DeepSpeed vs bare torch.

All three train the same tiny model (the demo's, built from the same spec and seed) on the same
batch (one step of the demo: ``groups_per_step`` groups of ``group_size``, the demo's prompts,
completions of ``max_tokens`` tokens ending in EOS) cut into the same micro-batches (the Trainer's
own plan), fp32 on the CPU, with the same optimizer settings:

* ``alone``: :meth:`asyncrl.learner.step.Trainer.train` on a :func:`build_engine` engine, i.e. exactly
  the learner's step (advantages, plan, objective, metrics, guarded optimizer step) without Redis,
  publishing or checkpoints; this is what ``train_s`` in metrics.jsonl times inside a run;
* ``alone_no_entropy``: the same Trainer step with ``learner.entropy_metric`` off (the demo keeps
  the metric on; the bare variants compute no entropy), on the same engine;
* ``bare DeepSpeed``: ``deepspeed.initialize`` with a plain ``torch.optim.AdamW`` and DeepSpeed's own
  gradient clipping; per micro-batch forward, fp32 log-softmax at the sampled tokens, a token-mean
  ratio * advantage loss, ``engine.backward``, ``engine.step``;
* ``bare DeepSpeed, same kernels``: the same, with the two settings asyncrl's learner makes and a bare
  script need not (torch's fused AdamW; no backward all-reduce with one rank): alone over it is the
  cost of asyncrl's own step machinery (objective terms, metrics, guard), with no kernel choice in it;
* ``bare torch``: the same loss on a plain module, ``clip_grad_norm_``, ``AdamW.step``;
* ``alone after an idle gap``: the ``alone`` step with the process idle for ``IDLE_GAP_S`` before each
  one (not timed), as in a synchronous run (max_staleness 0), where the learner waits ~50 ms for the
  actors between steps. On the 2-core VM a step after such a gap measured ~1.3x one right after the
  previous step, with nothing else running (a sleep and a busy spin of the gap both did it): a
  context row, the reference for the learner inside the synchronous pipeline.

It runs in its own process (``python -m asyncrl.bench.learner``) placed as ``asyncrl run`` places its
learner (the same cores and ``OMP_NUM_THREADS``), so the caller's torch threads and process group are
untouched and "alone" differs from the in-pipeline learner only in having no engine beside it. Steps of the
variants run in blocks, A B C D in at least three rounds (``steps / 10`` rounds when more steps are
asked for), so drift of a shared machine hits all of them; each number is the median step time, leaving
out the first steps of every block (warm-up), and the JSON also holds the ratio within each round.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

__all__ = ["ALONE_TARGET", "IN_PIPELINE_TARGET", "learner_rows", "demo_groups"]

ALONE_TARGET = 1.05  # Trainer step alone <= 1.05x bare DeepSpeed
IN_PIPELINE_TARGET = 1.3  # learner step inside the pipeline <= 1.3x alone
#: Variants run in blocks (A B C D, at least ROUNDS times; more rounds of ~BLOCK steps when more steps
#: are asked for), not step by step: stepping three models in turn evicts each one's weights and
#: optimizer state from the caches and doubled every step time.
ROUNDS = 3
BLOCK = 10
#: Idle time before each step of the ``alone_idle_gap`` variant: about a synchronous demo step's
#: generation (the learner's wait for data there).
IDLE_GAP_S = 0.05


def demo_groups(cfg: Any, tokenizer: Any, vocab: int, seed: int = 0) -> list:
    """One learner step of demo-shaped groups (real prompts, random tokens, rewards in {0, 1})."""
    import numpy as np

    from asyncrl.buffer import Completion, Group
    from asyncrl.tasks import make_task, prompt_token_ids

    rng = np.random.default_rng(seed)
    a = cfg.actors
    eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0
    prompts = make_task(cfg.task, seed).prompts
    groups = []
    for g in range(cfg.buffer.groups_per_step):
        p = prompts[g % len(prompts)]
        ids = prompt_token_ids(tokenizer, p.text, cfg.model.chat_template, cfg.task.system_prompt)
        comps = []
        for _ in range(a.group_size):
            toks = rng.integers(0, vocab, a.max_tokens).astype(np.uint32)
            toks[-1] = eos  # "stop": not overlong-masked, every token carries loss
            comps.append(Completion(token_ids=toks, logprobs=np.full(a.max_tokens, -np.log(vocab), np.float32),
                                    versions=np.zeros(a.max_tokens, np.uint32), reward=float(rng.integers(0, 2)),
                                    finish_reason="stop"))  # fmt: skip
        groups.append(Group(group_id=f"bench-{g}", prompt_id=p.prompt_id, completions=comps,
                            prompt_token_ids=np.asarray(ids, np.uint32), meta={"temperature": a.temperature}))  # fmt: skip
    return groups


def _bare_loss(model: Any, mb: dict) -> Any:
    """Token-mean ratio * advantage over the loss mask: the minimum a policy-gradient step computes."""
    import torch

    out = model(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"], use_cache=False)
    logits = out.logits[:, :-1].float() / mb["temperature"][:, None, None]
    logp = torch.log_softmax(logits, -1).gather(-1, mb["input_ids"][:, 1:, None]).squeeze(-1)
    mask = mb["loss_mask"][:, 1:]
    ratio = torch.exp(torch.where(mask, logp - mb["logp_behav"][:, 1:], 0.0))
    return -torch.where(mask, ratio * mb["advantages"][:, None], 0.0).sum() / mask.sum().clamp(min=1)


def _param_groups(model: Any, weight_decay: float) -> list[dict]:
    decay = [p for p in model.parameters() if p.ndim >= 2]
    rest = [p for p in model.parameters() if p.ndim < 2]
    return [{"params": decay, "weight_decay": weight_decay}] + (
        [{"params": rest, "weight_decay": 0.0}] if rest else []
    )


def _measure(config: str | None, steps: int, warmup: int) -> dict:
    import deepspeed
    import torch
    from transformers import AutoTokenizer

    from asyncrl.config import load_config
    from asyncrl.learner.batching import collate, plan_mini_batch, split_mini_batches
    from asyncrl.learner.engine import build_engine, pad_id
    from asyncrl.learner.logprobs import load_hf_model
    from asyncrl.learner.step import Trainer
    from asyncrl.tinymodel import build_tiny_model

    cfg = load_config(config)
    lc = cfg.learner
    with tempfile.TemporaryDirectory(prefix="asyncrl-bench-learner-") as d:
        model_path = build_tiny_model(Path(d) / "model", cfg.model.tiny, cfg.run.seed)
        tok = AutoTokenizer.from_pretrained(str(model_path), local_files_only=True)
        le = build_engine(cfg, model_path)
        mc = le.module.config
        pad = pad_id(mc)
        trainer = Trainer(cfg, le, None, pad)
        no_ent = dataclasses.replace(cfg, learner=dataclasses.replace(lc, entropy_metric=False))
        trainer_no_ent = Trainer(no_ent, le, None, pad)
        groups = demo_groups(cfg, tok, int(mc.vocab_size), cfg.run.seed)
        samples, _ = trainer.samples(groups)
        lengths = [s.length for s in samples]
        minis = [[collate(samples, ix, int(pad)) for ix in plan_mini_batch(lengths, idx, 1, lc.micro_batch_tokens)[0]]
                 for idx in split_mini_batches(len(samples), lc.mini_batches)]  # fmt: skip
        adam = dict(lr=lc.lr, betas=(lc.adam_beta1, lc.adam_beta2), eps=lc.adam_eps)

        ds_model = load_hf_model(model_path, torch.float32).train()
        ds_opt = torch.optim.AdamW(_param_groups(ds_model, lc.weight_decay), **adam)
        ds_conf = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
                   "gradient_clipping": float(lc.grad_clip), "zero_optimization": {"stage": 0},
                   "steps_per_print": 2**31 - 1}  # fmt: skip
        ds_engine, _, _, _ = deepspeed.initialize(model=ds_model, optimizer=ds_opt, config=ds_conf)
        same_model = load_hf_model(model_path, torch.float32).train()
        same_opt = torch.optim.AdamW(_param_groups(same_model, lc.weight_decay), fused=True, **adam)
        same_engine, _, _, _ = deepspeed.initialize(model=same_model, optimizer=same_opt, config=ds_conf)
        same_engine.enable_backward_allreduce = False  # one rank (as asyncrl.learner.engine.build_engine)
        pt_model = load_hf_model(model_path, torch.float32).train()
        pt_opt = torch.optim.AdamW(_param_groups(pt_model, lc.weight_decay), **adam)

        def alone() -> None:
            trainer.train(groups, 0)

        def alone_no_entropy() -> None:
            trainer_no_ent.train(groups, 0)

        def alone_idle_gap() -> None:
            trainer.train(groups, 0)

        def ds_step(engine: Any) -> None:
            for _ in range(lc.epochs):
                for mbs in minis:
                    for k, mb in enumerate(mbs):
                        engine.set_gradient_accumulation_boundary(k == len(mbs) - 1)
                        engine.backward(_bare_loss(engine, mb), scale_wrt_gas=False)
                    engine.step()

        def bare_ds() -> None:
            ds_step(ds_engine)

        def bare_ds_same_kernels() -> None:
            ds_step(same_engine)

        def bare_torch() -> None:
            for _ in range(lc.epochs):
                for mbs in minis:
                    for mb in mbs:
                        _bare_loss(pt_model, mb).backward()
                    if lc.grad_clip > 0:
                        torch.nn.utils.clip_grad_norm_(pt_model.parameters(), lc.grad_clip)
                    pt_opt.step()
                    pt_opt.zero_grad(set_to_none=True)

        fns = {"alone": alone, "alone_no_entropy": alone_no_entropy, "bare_deepspeed": bare_ds,
               "bare_deepspeed_same_kernels": bare_ds_same_kernels, "bare_torch": bare_torch,
               "alone_idle_gap": alone_idle_gap}  # fmt: skip
        times: dict[str, list[float]] = {k: [] for k in fns}
        rounds = max(ROUNDS, steps // BLOCK)
        block = max(1, -(-steps // rounds))
        for _ in range(rounds):
            for k, fn in fns.items():
                for i in range(warmup + block):
                    if k == "alone_idle_gap":
                        time.sleep(IDLE_GAP_S)
                    t = time.perf_counter()
                    fn()
                    if i >= warmup:
                        times[k].append(time.perf_counter() - t)
    med = {f"{k}_s": statistics.median(v) for k, v in times.items()}
    # The ratio within each round (adjacent blocks): drift of a shared machine between rounds cancels.
    per_round = {
        k: [statistics.median(times[k][r * block : (r + 1) * block])
            / statistics.median(times["bare_deepspeed"][r * block : (r + 1) * block]) for r in range(rounds)]
        for k in ("alone", "alone_no_entropy")
    }  # fmt: skip
    same = [statistics.median(times["alone"][r * block : (r + 1) * block])
            / statistics.median(times["bare_deepspeed_same_kernels"][r * block : (r + 1) * block])
            for r in range(rounds)]  # fmt: skip
    return {**med, "rounds": rounds, "ratio_alone_vs_deepspeed_per_round": per_round["alone"],
            "ratio_alone_vs_deepspeed_same_kernels_per_round": same,
            "ratio_alone_no_entropy_vs_deepspeed_per_round": per_round["alone_no_entropy"], "idle_gap_s": IDLE_GAP_S, "steps": steps, "threads": torch.get_num_threads(), "sequences": len(samples),
            "tokens": int(sum(lengths)), "micro_batches": sum(len(m) for m in minis) * lc.epochs}  # fmt: skip


def learner_rows(config: str | None, steps: int, timeout_s: float = 600.0) -> dict:
    """Run :func:`_measure` in a fresh process placed as ``asyncrl run`` places its learner: the cores
    of the run's CPU plan (asyncrl.cpu_binding) and the thread count of
    :func:`asyncrl.launch.learner_threads`."""
    from asyncrl.config import load_config
    from asyncrl.cpu_binding import resolve_plan
    from asyncrl.launch import learner_threads

    cfg = load_config(config)
    plan = resolve_plan(cfg)
    cpus = plan.learner if plan is not None else None
    threads = learner_threads(cfg, cpus)
    env = dict(os.environ)
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    with tempfile.TemporaryDirectory(prefix="asyncrl-bench-") as d:
        out = Path(d) / "learner.json"
        cmd = [sys.executable, "-m", "asyncrl.bench.learner", "--steps", str(steps), "--out", str(out)]
        if config:
            cmd += ["--config", config]
        with subprocess.Popen(
            cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        ) as proc:
            if cpus:  # as the orchestrator does: before the child starts any thread
                os.sched_setaffinity(proc.pid, cpus)
            try:
                _, err = proc.communicate(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                raise
        if proc.returncode != 0:
            raise RuntimeError(f"learner bench failed (exit {proc.returncode}):\n{err[-3000:]}")
        res = json.loads(out.read_text())
    res["cpus"] = list(cpus) if cpus else None
    res["ratio_alone_vs_deepspeed"] = res["alone_s"] / res["bare_deepspeed_s"]
    res["ratio_alone_no_entropy_vs_deepspeed"] = res["alone_no_entropy_s"] / res["bare_deepspeed_s"]
    res["ratio_deepspeed_vs_torch"] = res["bare_deepspeed_s"] / res["bare_torch_s"]
    res["ratio_alone_vs_deepspeed_same_kernels"] = res["alone_s"] / res["bare_deepspeed_same_kernels_s"]
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m asyncrl.bench.learner", description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=None, help="YAML config (default: configs/default.yaml)")
    ap.add_argument(
        "--steps",
        type=int,
        default=30,
        help=f"timed steps per variant, in rounds of ~{BLOCK} (>= {ROUNDS} rounds)",
    )
    ap.add_argument("--warmup", type=int, default=2, help="steps left out at the start of every block")
    ap.add_argument("--out", required=True)
    ap.add_argument("--placed", action="store_true", help="only the learner rows of `asyncrl bench`: run the "
                    "measurement in a child placed as `asyncrl run` places its learner, print the ratios")  # fmt: skip
    args = ap.parse_args(argv)
    if args.placed:
        res = learner_rows(args.config, args.steps)
        Path(args.out).write_text(json.dumps(res, indent=1) + "\n")
        rr = res["ratio_alone_vs_deepspeed_per_round"]
        print(f"alone {res['alone_s'] * 1e3:.2f} ms (no entropy metric {res['alone_no_entropy_s'] * 1e3:.2f}), "
              f"bare DeepSpeed {res['bare_deepspeed_s'] * 1e3:.2f} (same kernels {res['bare_deepspeed_same_kernels_s'] * 1e3:.2f}, "
              f"alone / it {res['ratio_alone_vs_deepspeed_same_kernels']:.3f}), bare torch {res['bare_torch_s'] * 1e3:.2f}; "
              f"alone / DeepSpeed {res['ratio_alone_vs_deepspeed']:.3f} "
              f"(no entropy {res['ratio_alone_no_entropy_vs_deepspeed']:.3f}; per round: median "
              f"{statistics.median(rr):.3f}, {min(rr):.3f}-{max(rr):.3f} over {len(rr)}), cpus {res['cpus']}")  # fmt: skip
        return 0
    Path(args.out).write_text(json.dumps(_measure(args.config, args.steps, args.warmup)) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
