"""The CUDA path (vllm + NCCL + bf16 DeepSpeed): runs only where a GPU is present (marked `gpu`)."""

from __future__ import annotations

import json
import subprocess

import pytest

from tests.e2e.procs import ROOT, asyncrl_cmd, read_jsonl

pytestmark = [pytest.mark.gpu, pytest.mark.slow]


def test_bf16_run_on_cuda_stays_finite_and_advances(tmp_path):
    rdir = tmp_path / "run"
    cmd = asyncrl_cmd("run", "--config", str(ROOT / "configs" / "default.yaml"), f"run.dir={rdir}",
                      "run.max_steps=8", "run.progress=false", "model.dtype=bfloat16", "actors.num_gpus_per_actor=1",
                      "actors.gpu_memory_utilization=0.3", "learner.loss.ref_kl_coef=0.01")  # fmt: skip
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=1200)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    recs = read_jsonl(rdir / "metrics.jsonl")
    assert len(recs) == 8 and recs[-1]["version"] > recs[0]["version"]
    assert all(r["skipped_nonfinite"] == 0 for r in recs), "bf16 policy + reference must stay finite"
    assert json.loads((rdir / "summary.json").read_text())["steps"] == 8
