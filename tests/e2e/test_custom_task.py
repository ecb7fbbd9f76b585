"""Bring your own task, get a trained model out, see what happens: one `asyncrl run`, shared.

The run trains a task defined outside the package (``tests/e2e/custom_task/echo_task.py``, given to
``task.name`` as an import path, with an async reward and a JSONL data file), evaluates every few
versions on its held-out split, and is then checked for:

* a reward gain (the custom task was learned);
* its console (stdout + stderr, not a terminal): asyncrl's plain status lines, no vLLM/Ray INFO line,
  while the actor's log file in the run dir does hold vLLM's lines and no per-swap RotaryEmbedding
  warning;
* TensorBoard event files holding the reward curve of metrics.jsonl, and the eval results;
* ``asyncrl export`` of the final version: loadable by transformers with logprobs equal to the learner's
  checkpoint of that version, and of the last evaluated version: loadable by vLLM with the same logprobs
  as transformers, and ``asyncrl eval`` on it reproduces the run's last eval score.
"""

from __future__ import annotations

import json
import re
import subprocess
import uuid

import pytest

from tests.e2e.procs import ROOT, asyncrl_cmd, marked_env, read_jsonl, wait_no_orphans

pytestmark = pytest.mark.slow

STEPS = 80
EVAL_EVERY = 15
TASK = "tests.e2e.custom_task.echo_task:make_task"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("custom-task")
    rdir = tmp / "run"
    marker = uuid.uuid4().hex
    cmd = asyncrl_cmd(
        "run", f"run.dir={rdir}", f"run.name=custom-{marker[:8]}", f"run.max_steps={STEPS}", "run.max_wall_s=400",
        f"task.name={TASK}", f"task.data_path={ROOT / 'tests/e2e/custom_task/echo.jsonl'}",
        "task.eval_fraction=0.1", f"eval.every={EVAL_EVERY}", "eval.samples=4",
        "learner.weight_transport=file", f"learner.keep_versions={STEPS + 1}",
    )  # fmt: skip
    env = marked_env(
        marker, PYTHONPATH=str(ROOT)
    )  # the task module is found on PYTHONPATH, as a user's would be
    proc = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=600)
    console = proc.stdout + proc.stderr
    assert proc.returncode == 0, console[-4000:]
    left = wait_no_orphans(marker)
    assert not left, left
    return {"dir": rdir, "console": console, "tmp": tmp, "records": read_jsonl(rdir / "metrics.jsonl")}


def test_custom_task_trains_to_a_reward_gain(run):
    recs = run["records"]
    assert len(recs) == STEPS
    first = sum(r["reward_mean"] for r in recs[:5]) / 5
    last = sum(r["reward_mean"] for r in recs[-5:]) / 5
    assert last > first + 0.2, (first, last)
    evals = {r["eval_version"]: r["eval_reward_mean"] for r in recs if r["eval_version"] >= 0}
    assert min(evals) == 0 and len(evals) >= 2, evals  # v0 baseline + at least one later eval
    assert evals[max(evals)] > evals[0] + 0.2, evals  # the held-out split improved too


def test_console_holds_asyncrl_lines_only(run):
    console, rdir = run["console"], run["dir"]
    assert re.search(rf"^step \d+/{STEPS}  steps/s ", console, re.M), console[-2000:]
    noise = [ln for ln in console.splitlines() if re.search(r"\bINFO\b|^\(\w+ pid=\d+", ln)]
    assert not noise, noise[:10]
    actor_log = (rdir / "logs" / "actor-0.log").read_text()
    assert re.search(
        r"\bINFO \d\d-\d\d [\d:]+ \[\w+\.py:\d+\]", actor_log
    )  # vLLM's INFO lines went to the file
    swaps = json.loads((rdir / "summary.json").read_text())["actors"]
    assert sum(a.get("swaps", 0) for a in swaps.values()) > 10
    assert "Failed to load weights" not in actor_log  # the per-swap RotaryEmbedding warning is gone


def test_tensorboard_holds_the_reward_curve(run):
    from tests.unit.test_tracking import read_scalars

    s = read_scalars(run["dir"] / "tensorboard")
    want = [(r["step"], r["reward_mean"]) for r in run["records"]]
    got = s["train/reward_mean"]
    assert [st for st, _ in got] == [st for st, _ in want]
    assert all(abs(a - b) < 1e-6 for (_, a), (_, b) in zip(got, want, strict=True))
    by_version = read_scalars(run["dir"] / "tensorboard" / "by_version")
    assert by_version["eval/by_version/reward_mean"][0][0] == 0


def _logprobs_hf(model, seqs):
    import torch

    out = []
    with torch.no_grad():
        for ids in seqs:
            logits = model(torch.tensor([ids])).logits[0].float()
            lp = torch.log_softmax(logits[:-1], -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
            out.append(lp)
    return out


def _sequences(model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    return [tok(f"say:{w}={w}")["input_ids"] + [tok.eos_token_id] for w in ("ab", "bba", "abab", "b")]


def test_export_loads_in_transformers_with_the_learners_logprobs(run):
    import torch
    from transformers import AutoModelForCausalLM

    from asyncrl.learner.checkpoint import read_latest

    out = run["tmp"] / "export-final"
    res = subprocess.run(asyncrl_cmd("export", str(run["dir"]), str(out)), capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    info = json.loads((out / "asyncrl_export.json").read_text())
    assert info["version"] == STEPS and {"config.json", "generation_config.json", "model.safetensors"} <= {
        p.name for p in out.iterdir()
    }
    tag_dir, state = read_latest(run["dir"])
    assert state.version == STEPS
    learner_sd = torch.load(tag_dir / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False)[
        "module"
    ]
    exported = AutoModelForCausalLM.from_pretrained(out).eval()
    learner = AutoModelForCausalLM.from_pretrained(run["dir"] / "model").eval()
    learner.load_state_dict(learner_sd)
    base = AutoModelForCausalLM.from_pretrained(run["dir"] / "model").eval()
    seqs = _sequences(out)
    got, want, v0 = _logprobs_hf(exported, seqs), _logprobs_hf(learner, seqs), _logprobs_hf(base, seqs)
    for g, w, b in zip(got, want, v0, strict=True):
        assert torch.equal(g, w)
        assert (g - b).abs().max() > 1e-3  # trained weights, not the initial ones


def test_eval_of_export_reproduces_the_runs_last_eval_and_vllm_matches(run):
    from transformers import AutoModelForCausalLM

    last = run["records"][-1]
    v = last["eval_version"]
    out = run["tmp"] / f"export-v{v}"
    res = subprocess.run(asyncrl_cmd("export", str(run["dir"]), str(out), "--version", str(v)),
                         capture_output=True, text=True)  # fmt: skip
    assert res.returncode == 0, res.stderr
    res = subprocess.run(asyncrl_cmd("eval", str(out)), capture_output=True, text=True, cwd=run["tmp"],
                         env=marked_env("x", PYTHONPATH=str(ROOT)))  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    score = json.loads(res.stdout.strip().splitlines()[-1])
    assert score["version"] == v and score["prompts"] == 20 and score["samples"] == 4
    assert abs(score["reward_mean"] - last["eval_reward_mean"]) < 1e-6, (score, last)
    assert abs(score["pass_at_k"] - last["eval_pass_at_k"]) < 1e-6
    assert abs(score["length_mean"] - last["eval_length_mean"]) < 1e-6

    from vllm import LLM, SamplingParams

    seqs = _sequences(out)
    hf = _logprobs_hf(AutoModelForCausalLM.from_pretrained(out).eval(), seqs)
    llm = LLM(
        model=str(out), dtype="float32", enforce_eager=True, max_model_len=64, kv_cache_memory_bytes=32 << 20
    )
    try:
        outs = llm.generate(
            [{"prompt_token_ids": s} for s in seqs], SamplingParams(max_tokens=1, prompt_logprobs=0)
        )
    finally:
        llm.llm_engine.engine_core.shutdown()
    for o, ids, ref in zip(outs, seqs, hf, strict=True):
        lp = [pl[t].logprob for pl, t in zip(o.prompt_logprobs[1:], ids[1:], strict=True)]
        assert max(abs(a - float(b)) for a, b in zip(lp, ref, strict=True)) < 1e-4
