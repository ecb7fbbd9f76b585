"""The synchronous reference loop: generate at the current weights, train on it, repeat.

    python -m asyncrl.reference --config configs/default.yaml run.max_steps=4 run.dir=/tmp/ref

What a ``max_staleness=0`` run claims to be, written out as a plain loop with no Redis, no admission,
no Ray and no second process: one vLLM :class:`~asyncrl.actors.engine.Engine` samples
``groups_per_step`` groups (all of them at once, as the actor's in-flight workers do) with the weights
the learner just published, the same :class:`~asyncrl.learner.step.Trainer` trains one step on them,
the new weights are published through the same file transport and swapped into the engine, and so on.

It shares with ``asyncrl run`` every function that decides *what* is computed (prompt order, per-group
sampling seeds, group building and the wire round trip, batch order, micro-batching, the objective,
DeepSpeed and its optimizer) and none of the machinery that decides *when*. The parity test
(tests/e2e/test_parity.py) checks that both end with the same parameters: any difference is a bug in
the asynchronous machinery (a group trained twice or on other weights, an order that leaks timing),
which is exactly what a parity test is for (verl's fully-async mode fails this one, its issue 6780).

Scope: one actor (with several, which actor is admitted first is timing, so the prompt sets of a step
are not reproducible), ``max_staleness=0``, no ``fill_window``. Dynamic sampling is reproduced the
way admission credits work: a filtered group is replaced by the next prompt of the stream.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

from asyncrl.config import Config, ConfigError, load_config, run_dir

__all__ = ["run_reference", "check_reference_config", "main"]

log = logging.getLogger(__name__)


def check_reference_config(cfg: Config) -> None:
    """Raise ConfigError for settings whose asynchronous run has no synchronous equivalent."""
    if cfg.actors.num_actors != 1:
        raise ConfigError(
            f"actors.num_actors={cfg.actors.num_actors}: the reference loop models one actor (with several, "
            "which one is admitted first is timing, so a step's prompt set is not reproducible)"
        )
    if cfg.buffer.max_staleness != 0:
        raise ConfigError(
            f"buffer.max_staleness={cfg.buffer.max_staleness}: the reference loop is on-policy (0)"
        )
    if cfg.learner.fill_window:
        raise ConfigError("learner.fill_window=true has no meaning at max_staleness=0; turn it off")
    if not cfg.actors.seeded_sampling:
        raise ConfigError("actors.seeded_sampling=false: unseeded samples cannot be reproduced")
    if cfg.learner.publish_every != 1:
        raise ConfigError("learner.publish_every must be 1 (a step trains on the weights it published)")


async def _sample_group(
    engine: Any, task: Any, tokenizer: Any, cfg: Config, prompt: Any, seq: int, version: int
) -> Any:
    """One group exactly as RolloutActor._group_worker builds it (ids, seed, rewards, meta)."""
    from asyncrl.actors.groups import build_group
    from asyncrl.actors.seeding import request_seed
    from asyncrl.buffer import decode, encode
    from asyncrl.tasks import prompt_token_ids

    a = cfg.actors
    ids = prompt_token_ids(tokenizer, prompt.text, cfg.model.chat_template, cfg.task.system_prompt)
    group_id = f"reference-{seq}"
    seqs = await engine.generate_group(
        ids,
        a.group_size,
        a.temperature,
        a.top_p,
        a.max_tokens,
        group_id,
        seed=request_seed(cfg.run.seed, 0, seq),
    )
    rewards = [await task.score(prompt, s.text) for s in seqs]
    meta = {"temperature": float(a.temperature), "top_p": float(a.top_p), "max_tokens": int(a.max_tokens),
            "task": task.name, "actor_index": 0, "version_start": version, "version_end": version,
            "swaps": 0, "swap_mode": "in_flight", "prompt_seq": seq}  # fmt: skip
    # Through the wire codec, as the learner receives it from Redis (same dtypes, same validation).
    return decode(encode(build_group(group_id, rewards, prompt, ids, seqs, "reference", meta)))


async def _reference(cfg: Config, rdir: Path, steps: int) -> list[dict[str, Any]]:
    import numpy as np
    import torch
    from transformers import AutoTokenizer

    from asyncrl.actors.engine import Engine
    from asyncrl.actors.seeding import prompt_seq
    from asyncrl.launch import learner_threads
    from asyncrl.learner.engine import build_engine, init_distributed, pad_id
    from asyncrl.learner.feed import batch_order_key
    from asyncrl.learner.logprobs import ReferenceModel
    from asyncrl.learner.publisher import FilesystemTransport, checkpoint_tensor_names
    from asyncrl.learner.step import Trainer
    from asyncrl.tasks import make_task
    from asyncrl.tinymodel import resolve_model_path

    threads = learner_threads(cfg)  # what `asyncrl run` gives its learner process (float sums depend on it)
    if threads:
        torch.set_num_threads(threads)
    init_distributed()
    torch.manual_seed(cfg.run.seed)  # as learn() seeds rank 0
    np.random.seed(cfg.run.seed)
    model_path = resolve_model_path(cfg, rdir)
    le = build_engine(cfg, model_path)
    # On the engine's device (a CUDA learner's micro-batches are there; "cpu" was a device mismatch).
    ref = ReferenceModel(model_path, le.dtype, le.device) if cfg.learner.loss.ref_kl_coef > 0 else None
    trainer = Trainer(cfg, le, ref, pad_id(le.module.config))
    transport = FilesystemTransport(rdir / "weights", checkpoint_tensor_names(model_path))
    task = make_task(cfg.task, cfg.run.seed)
    source = task.source(cfg.run.seed, 0, 1)
    tokenizer = AutoTokenizer.from_pretrained(str(model_path))
    engine = await asyncio.to_thread(Engine.from_config, cfg, model_path)
    records: list[dict[str, Any]] = []
    t0 = time.time()
    try:
        version = 0
        m = transport.publish(version, le.named_weights, le.dtype_name)
        await engine.load_weights(m.path, version)
        for step in range(1, steps + 1):
            kept: list[Any] = []
            while len(kept) < cfg.buffer.groups_per_step:  # a filtered group's slot goes to the next prompt
                need = cfg.buffer.groups_per_step - len(kept)
                seqs = [prompt_seq(source.cursor, len(source)) + i for i in range(need)]
                prompts = source.take(need)
                groups = await asyncio.gather(
                    *(
                        _sample_group(engine, task, tokenizer, cfg, p, s, version)
                        for p, s in zip(prompts, seqs, strict=True)
                    )
                )
                for g in groups:
                    rewards = {float(c.reward) for c in g.completions}
                    if not (cfg.learner.dynamic_sampling and len(rewards) <= 1):
                        kept.append(g)
            kept.sort(key=batch_order_key)
            res = trainer.train(kept, version)
            version += 1
            m = transport.publish(version, le.named_weights, le.dtype_name)
            await engine.swap_weights(m.path, version, "in_flight")
            rewards = [float(c.reward) for g in kept for c in g.completions]
            rec = {"step": step, "version": version, "time": time.time() - t0,
                   "reward_mean": float(np.mean(rewards)), "loss": res.metrics.get("loss", 0.0),
                   "tokens": res.tokens, "prompt_seqs": [int(g.meta["prompt_seq"]) for g in kept]}  # fmt: skip
            records.append(rec)
            with (rdir / "metrics.jsonl").open("a") as f:
                f.write(json.dumps(rec) + "\n")
            log.info(
                "reference step %d v%d reward %.4f loss %.6f", step, version, rec["reward_mean"], rec["loss"]
            )
    finally:
        engine.shutdown()
    return records


def run_reference(cfg: Config, steps: int | None = None) -> list[dict[str, Any]]:
    """Run ``steps`` (default ``run.max_steps``) synchronous steps into ``run_dir(cfg)``.

    Leaves ``weights/v{N}/model.safetensors`` (the same layout ``asyncrl run`` publishes) and a
    ``metrics.jsonl`` with one line per step; returns those lines.
    """
    check_reference_config(cfg)
    steps = cfg.run.max_steps if steps is None else steps
    if steps < 1:
        raise ConfigError("run.max_steps must be >= 1 for the reference loop")
    rdir = run_dir(cfg).resolve()
    if (rdir / "metrics.jsonl").exists():
        raise ConfigError(f"{rdir} already holds a reference run (metrics.jsonl); choose another run.dir")
    rdir.mkdir(parents=True, exist_ok=True)
    return asyncio.run(_reference(cfg, rdir, steps))


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m asyncrl.reference", description=__doc__.splitlines()[0])
    ap.add_argument("--config", "-c", default=None)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    try:
        recs = run_reference(load_config(args.config, args.overrides))
    except ConfigError as e:
        print(f"asyncrl: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(recs[-1]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
