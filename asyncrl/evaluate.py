"""Evaluation on a task's held-out split with vLLM: mean reward, pass@k, mean completion length.

Two entry points share :func:`evaluate_llm` (so a score means the same thing in both):

* ``asyncrl eval MODEL_DIR | RUN_DIR [--version N]``: a fresh vLLM engine on an exported model
  directory (a run's version is exported to a temporary directory first);
* periodic evaluation during a run (``eval.every = N``): :class:`PeriodicEval`, run by actor 0.

Which process runs the periodic eval, and why (decision): actor 0, on its own engine, right after it
swapped to the first version ``v`` of a new block of ``eval.every`` versions (v0, then the first
version >= N, >= 2N, ...; an actor can skip versions when the learner publishes fast). Its version watcher awaits the eval before it
looks at newer manifests, so every eval token is sampled by exactly version ``v`` (the engine serves
no other weights meanwhile), while its group workers keep generating training data in the same
continuous batch and the other actors and the learner carry on: training never stops. The cost is that
actor 0 defers its next swap by the eval's duration (tiny demo: 64 prompts x 4 samples, well under a
second), which the staleness bound already accounts for (admission refuses groups that would be too
stale). A dedicated eval engine would avoid even that, but costs a whole engine (memory, a GPU on a
cluster, ~30 s of start-up and half the cores of a 2-core CPU box); the learner has no fast sampler.

Determinism: prompt ``i`` is sampled with vLLM seed ``eval.seed + i * eval.samples`` (completion
``j`` of a seeded request uses ``seed + j``), so a seeded request's tokens depend only on its own
logits: ``asyncrl eval`` on the exported weights of version ``v`` reproduces the run's score for ``v``.

The results ride in actor 0's heartbeat (``eval``); the learner copies the newest into its step
records (metrics.jsonl ``eval_*`` fields, TensorBoard, W&B, Prometheus ``asyncrl_learner_eval_*``).

Console: a prompt whose reward fails or that the engine refuses is a warning, rate-limited like
training's per-group ones (asyncrl.log_throttle: a reward failing on every prompt printed one line per
prompt), and counted in the result and in one closing line. ``asyncrl eval`` says how many prompts it
scores out of how many (``task.eval_size`` caps a data eval split; 64 by default) and keeps vLLM's INFO
lines off the console (:func:`quiet_engine_console`; ``asyncrl eval -v`` shows them), its result alone on
stdout.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

from asyncrl.console import quiet_engine_console  # its home was here
from asyncrl.log_throttle import throttle
from asyncrl.tasks import Prompt, Task, prompt_token_ids
from asyncrl.tasks.registry import TINY_TASKS, require_eval_prompts
from asyncrl.tasks.render_check import check_prompt_rendering, load_tokenizer, render_failure

__all__ = ["EvalResult", "evaluate_llm", "PeriodicEval", "eval_model_dir", "eval_set_line",
           "quiet_engine_console", "require_eval_prompts"]  # fmt: skip

# Repeats rate-limited like training's per-group warnings: one line per failing prompt is a flood when the
# reward fails on every call (asyncrl.log_throttle); the closing line of evaluate_llm has the counts.
log = throttle(logging.getLogger(__name__))


@dataclass
class EvalResult:
    version: int  # policy version evaluated (-1: a model directory of unknown version)
    prompts: int  # eval prompts scored
    samples: int  # completions per prompt (k)
    reward_mean: float  # mean reward over all prompts x samples
    pass_at_k: float  # share of prompts with at least one completion scoring >= pass_threshold
    length_mean: float  # mean completion length, tokens
    seconds: float  # wall time of the evaluation
    # Prompts whose reward failed (raised, non-finite, past task.reward_timeout_s): left out of
    # reward_mean and pass_at_k (NaN when none scored), logged; the eval itself goes on.
    reward_failures: int = 0
    # Prompts the engine refused (vLLM's client errors: a prompt longer than model.max_model_len, ...)
    # or the chat template could not render (asyncrl.tasks.render_check):
    # left out of every mean (length_mean included, NaN when nothing was generated), logged with the
    # engine's reason; the eval goes on, as training dead-letters such a prompt's group.
    prompts_refused: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


async def evaluate_llm(llm: Any, tokenizer: Any, task: Task, cfg: Any, version: int = -1,
                       request_prefix: str = "eval") -> EvalResult:  # fmt: skip
    """Score ``task.eval_prompts`` with the vLLM ``AsyncLLM`` ``llm`` (see the module doc)."""
    prompts = require_eval_prompts(task)
    from vllm import SamplingParams
    from vllm.exceptions import VLLMClientError
    from vllm.inputs import tokens_input
    from vllm.sampling_params import RequestOutputKind

    e = cfg.eval
    k = e.samples
    t0 = time.perf_counter()

    # The training path's reward runner (asyncrl.actors.rewards): the user's reward runs off the event
    # loop, which on actor 0 also drives training generation, swaps and heartbeats, within
    # task.reward_timeout_s, and a failure costs that prompt's score, not the eval (nor actor 0's loop).
    from asyncrl.actors.rewards import RewardFailure, RewardRunner

    runner = RewardRunner(task, cfg.task.reward_timeout_s)

    async def one(i: int, p: Prompt) -> tuple[list[float] | None, list[int]] | None:
        """The prompt's rewards (None: its reward failed) and completion lengths; None if refused."""
        try:
            ids = prompt_token_ids(tokenizer, p.text, cfg.model.chat_template, cfg.task.system_prompt)
        except Exception as exc:  # the chat template refuses this prompt: as a refused prompt (below)
            log.warning("eval of v%d: %s", version, render_failure(cfg, p.prompt_id, exc))
            return None
        params = SamplingParams(n=k, temperature=e.temperature, top_p=1.0, seed=e.seed + i * k,
                                max_tokens=e.max_tokens or cfg.actors.max_tokens,
                                output_kind=RequestOutputKind.FINAL_ONLY)  # fmt: skip
        final = None
        # A rendered prompt: built and sent on this thread (asyncrl.actors.engine.generate_group).
        try:
            async for out in llm.generate(tokens_input(ids), params, f"{request_prefix}-{version}-{i}"):
                final = out
        except VLLMClientError as exc:
            # Before: raised out of the gather, failing the whole eval, and on actor 0 its loop.
            log.warning("eval of v%d: prompt %s (%d tokens) refused by the engine: %s",
                        version, p.prompt_id, len(ids), exc)  # fmt: skip
            return None
        assert final is not None
        outs = sorted(final.outputs, key=lambda c: c.index)
        lengths = [len(c.token_ids) for c in outs]
        try:
            return await runner.score(p, [c.text for c in outs]), lengths
        except RewardFailure as exc:
            log.warning("eval of v%d: prompt %s not scored: %s", version, p.prompt_id, exc)
            return None, lengths

    answered = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    results = [r for r in answered if r is not None]
    scored = [rs for rs, _ in results if rs is not None]
    if len(scored) < len(prompts):  # the exact counts, whatever the rate limit let through above
        log.warning("eval of v%d: %d of %d prompts not scored (%d rewards failed, %d prompts refused): "
                    "left out of the means", version, len(prompts) - len(scored), len(prompts),
                    len(results) - len(scored), len(answered) - len(results))  # fmt: skip
    rewards = [r for rs in scored for r in rs]
    lengths = [n for _, ns in results for n in ns]
    passed = sum(any(r >= e.pass_threshold for r in rs) for rs in scored)
    nan = float("nan")
    return EvalResult(version=version, prompts=len(prompts), samples=k,
                      reward_mean=sum(rewards) / len(rewards) if rewards else nan,
                      pass_at_k=passed / len(scored) if scored else nan,
                      length_mean=sum(lengths) / len(lengths) if lengths else nan,
                      seconds=time.perf_counter() - t0, reward_failures=len(results) - len(scored),
                      prompts_refused=len(answered) - len(results))  # fmt: skip


class PeriodicEval:
    """Actor 0's periodic evaluation (see the module doc for why actor 0)."""

    def __init__(self, cfg: Any, task: Task) -> None:
        self.cfg = cfg
        self.task = task
        self.last: EvalResult | None = None
        self._bucket = -1  # version // eval.every of the last evaluated version

    @classmethod
    def for_actor(cls, cfg: Any, task: Task, actor_index: int) -> PeriodicEval | None:
        if actor_index != 0 or not cfg.eval.every:
            return None
        # A ConfigError, as the CLI's start-up check (asyncrl.tasks.registry.check_task) says it before
        # any role starts; a warning here ran the whole run without the evaluation it was asked for.
        require_eval_prompts(task, cfg.eval.every)
        return cls(cfg, task)

    def due(self, version: int | None) -> bool:
        """True for the first version served in each block of ``eval.every`` versions (v0, then the first
        >= every, >= 2 * every, ...): the actor may skip versions when the learner publishes fast."""
        return version is not None and version // self.cfg.eval.every > self._bucket

    async def run(self, llm: Any, tokenizer: Any, version: int) -> EvalResult:
        """Evaluate the served ``version``; the caller must not swap weights until this returns."""
        self._bucket = version // self.cfg.eval.every
        res = await evaluate_llm(llm, tokenizer, self.task, self.cfg, version, "periodic-eval")
        self.last = res
        log.info("eval v%d: reward %.3f  pass@%d %.3f  length %.2f  (%d prompts, %.1fs)", version,
                    res.reward_mean, res.samples, res.pass_at_k, res.length_mean, res.prompts, res.seconds)  # fmt: skip
        return res


def eval_set_line(cfg: Any, task: Task) -> str:
    """How many eval prompts ``asyncrl eval`` scores, out of how many, and the key that sets it: the
    default cap (task.eval_size=64) was applied silently to an eval split of thousands."""
    n, k, cap = len(task.eval_prompts), cfg.eval.samples, cfg.task.eval_size
    what = f"asyncrl eval: {n} eval prompts x {k} samples (eval.samples)"
    if cfg.task.name in TINY_TASKS:  # there task.eval_size is how many it draws, not a cap
        return f"{what}; the tiny task draws task.eval_size={cap} of them"
    total = n
    if cap and n == cap:  # perhaps capped: the task without the cap says out of how many
        from asyncrl.tasks import make_task

        try:
            total = len(make_task(dataclasses.replace(cfg.task, eval_size=0), cfg.run.seed).eval_prompts)
        except Exception:  # a plug-in task that will not build uncapped: the count without the total
            return f"{what}; task.eval_size={cap} may cap them (task.eval_size=0: all)"
    if total > n:
        return (f"asyncrl eval: {n} of {total} eval prompts x {k} samples (eval.samples): task.eval_size={cap} "
                f"caps the eval set; task.eval_size=0 scores all {total}")  # fmt: skip
    return what


def eval_model_dir(cfg: Any, model_dir: str, version: int = -1) -> EvalResult:
    """``asyncrl eval`` on a Hugging Face model directory: a fresh engine, the task's eval split."""
    from asyncrl.tasks import make_task

    task = make_task(cfg.task, cfg.run.seed)
    # Before the tokenizer and the engine: a vLLM start costs from ~30 s (tiny model, CPU) to minutes,
    # all of it wasted when there is nothing to score (gsm8k's defaults hold no eval split).
    require_eval_prompts(task)
    print(eval_set_line(cfg, task), file=sys.stderr, flush=True)
    from asyncrl.actors.engine import Engine

    tokenizer = load_tokenizer(cfg, str(model_dir))  # a ConfigError naming the dir when it cannot load
    # Before the engine too: a chat template that refuses the config (a Gemma template and
    # task.system_prompt) is a one-line ConfigError, not a Jinja traceback after the engine started.
    check_prompt_rendering(cfg, task.eval_prompts[0], tokenizer, str(model_dir))

    async def main() -> EvalResult:
        engine = await asyncio.to_thread(Engine.from_config, cfg, model_dir)
        try:
            return await evaluate_llm(engine.llm, tokenizer, task, cfg, version)
        finally:
            engine.shutdown()

    return asyncio.run(main())
