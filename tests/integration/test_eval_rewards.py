"""Evaluation scores with the training path's reward runner (asyncrl.evaluate -> asyncrl.actors.rewards):
on actor 0 the eval shares the event loop that drives training generation, swaps and heartbeats, so a
user's reward must run off it, within task.reward_timeout_s, and a failing one must cost only its
prompt's score. Before: ``task.score`` ran on the loop (a 3 s reward stalled it 3 s per call, the
timeout ignored) and one raising reward aborted the whole eval (and actor 0's loop with it).
A prompt the engine refuses (longer than model.max_model_len) likewise costs only its own score.
Their warnings are rate-limited like training's (asyncrl.log_throttle), and the engine, quieted as
``asyncrl eval`` quiets it, keeps its INFO lines off the console.
A real vLLM engine (tiny model, CPU); the rewards are the test's own functions."""

from __future__ import annotations

import asyncio
import logging
import math
import time

import pytest

from asyncrl.config import load_config
from asyncrl.tasks import FunctionTask, Prompt

pytest.importorskip("vllm")


def _reward(prompt: str, completion: str, meta: dict) -> float:
    if meta["kind"] == "raise":
        raise KeyError("judge failed")
    if meta["kind"] == "hang":
        time.sleep(3.0)  # past task.reward_timeout_s=1
    time.sleep(0.05)  # a blocking (synchronous) reward
    return 1.0


def test_eval_rewards_run_off_the_loop_with_the_timeout_and_failures_cost_their_prompt(
    tmp_path, monkeypatch, capfd, caplog
) -> None:
    from transformers import AutoTokenizer

    from asyncrl.actors.engine import Engine
    from asyncrl.evaluate import evaluate_llm, log, quiet_engine_console
    from asyncrl.tinymodel import resolve_model_path

    for var in ("VLLM_LOGGING_LEVEL", "VLLM_LOGGING_STREAM", "HF_HUB_DISABLE_PROGRESS_BARS"):
        monkeypatch.setenv(var, "")  # restored after the test, with what was there (or nothing)
        monkeypatch.delenv(var)
    quiet_engine_console()  # what `asyncrl eval` does before its engine starts
    for f in log.filters:
        f.reset()  # type: ignore[attr-defined]  # another test's warnings in the last 10 s count too

    cfg = load_config(overrides=[
        f"run.dir={tmp_path / 'run'}", "actors.kv_cache_mib=64", "eval.samples=2", "eval.max_tokens=4",
        "task.reward_timeout_s=1",
    ])  # fmt: skip
    model_dir = resolve_model_path(cfg, tmp_path / "run")
    kinds = ["ok", "raise", "ok", "hang", "ok", "ok", "long", *["raise"] * 7]
    # "long": a prompt longer than model.max_model_len, which vLLM refuses (VLLMValidationError).
    text = {"long": "copy: " + "ab" * cfg.model.max_model_len}
    prompts = [Prompt(f"p-{i}", text.get(k, f"copy: ab{i}"), "ab", {"kind": k}) for i, k in enumerate(kinds)]
    task = FunctionTask("eval-rewards", prompts, _reward, prompts)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    assert len(tokenizer(text["long"])["input_ids"]) > cfg.model.max_model_len

    async def main():
        engine = await asyncio.to_thread(Engine.from_config, cfg, str(model_dir))
        try:
            stalls: list[float] = []
            done = asyncio.Event()

            async def ticker() -> None:
                t = time.perf_counter()
                while not done.is_set():
                    await asyncio.sleep(0.01)
                    now = time.perf_counter()
                    stalls.append(now - t)
                    t = now

            tick = asyncio.create_task(ticker())
            t0 = time.perf_counter()
            caplog.clear()
            with caplog.at_level(logging.WARNING, logger="asyncrl.evaluate"):
                res = await evaluate_llm(engine.llm, tokenizer, task, cfg, version=0)
            wall = time.perf_counter() - t0
            done.set()
            await tick
            return res, wall, max(stalls)
        finally:
            engine.shutdown()

    res, wall, stall = asyncio.run(main())
    # The refused prompt costs its own score only (before: it failed the whole eval, and actor 0's loop).
    assert res.prompts_refused == 1 and res.reward_failures == 9 and res.prompts == 14 and res.samples == 2
    assert res.reward_mean == 1.0 and res.pass_at_k == 1.0  # over the 4 prompts that scored
    assert math.isfinite(res.length_mean) and res.length_mean > 0
    assert wall < 2.9, wall  # the hung reward was cut at 1 s, not waited for (3 s)
    assert stall < 1.0, stall  # the loop kept turning (before: >= 3 s at the hung reward)
    # 8 raising rewards, one warning each before: 5 pass (log_throttle's burst), then the counts in one line.
    warned = [r.getMessage() for r in caplog.records if r.name == "asyncrl.evaluate"]
    assert sum("judge failed" in m for m in warned) == 5, warned
    assert "eval of v0: 10 of 14 prompts not scored (9 rewards failed, 1 prompts refused)" in warned[-1], (
        warned
    )
    out, err = capfd.readouterr()
    assert ") INFO " not in out + err, (out + err)[-3000:]  # vLLM's INFO lines, engine core's included
    assert "(EngineCore" not in out and "(MainProcess" not in out  # vLLM's warnings: stderr, not stdout
