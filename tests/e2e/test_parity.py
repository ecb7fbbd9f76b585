"""Parity: `asyncrl run` at max_staleness=0 ends with the same parameters as the synchronous loop.

The asynchronous pipeline (Redis buffer, admission, Ray actor with in-flight workers, learner in its
own process, weight swaps) and the plain synchronous loop of asyncrl.reference (same vLLM engine
class, same Trainer, no Redis, no admission, no Ray) run K steps from the same seed, at the same time
on the same 2 cores (so their timings differ as much as they can). On CPU fp32 everything that decides
what is computed is deterministic (prompt order, per-group sampling seeds, batch order, micro-batches,
one learner thread), so the comparison is bitwise: every tensor of weights v_K, every step's reward
and loss. A difference means the asynchronous machinery changed what was trained.
"""

from __future__ import annotations

import subprocess
import uuid

import pytest

from tests.e2e.procs import ROOT, asyncrl_cmd, marked_env, read_jsonl, wait_no_orphans

pytestmark = pytest.mark.slow

K = 4
COMMON = [
    "run.seed=3",
    f"run.max_steps={K}",
    "buffer.max_staleness=0",
    "actors.num_actors=1",
    "learner.torch_threads=1",
    "run.progress=false",
]


@pytest.mark.timeout(600)
def test_async_run_at_staleness_0_matches_the_synchronous_loop(tmp_path):
    import sys

    from safetensors.torch import load_file

    marker = uuid.uuid4().hex
    cfg = str(ROOT / "configs" / "default.yaml")
    run_dir, ref_dir = tmp_path / "run", tmp_path / "ref"
    run_cmd = asyncrl_cmd("run", "--config", cfg, *COMMON, f"run.dir={run_dir}", f"run.name=parity-{marker[:8]}",
                          "run.max_wall_s=400")  # fmt: skip
    ref_cmd = [sys.executable, "-m", "asyncrl.reference", "--config", cfg, *COMMON, f"run.dir={ref_dir}"]
    env = marked_env(marker)
    with (tmp_path / "run.log").open("wb") as rl, (tmp_path / "ref.log").open("wb") as fl:
        procs = [subprocess.Popen(c, cwd=tmp_path, env=env, stdout=out, stderr=subprocess.STDOUT)
                 for c, out in ((run_cmd, rl), (ref_cmd, fl))]  # fmt: skip
        try:
            codes = [p.wait(timeout=500) for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
    assert codes == [0, 0], (tmp_path / "run.log").read_text()[-3000:] + (tmp_path / "ref.log").read_text()[
        -3000:
    ]
    assert wait_no_orphans(marker) == []

    run_recs, ref_recs = read_jsonl(run_dir / "metrics.jsonl"), read_jsonl(ref_dir / "metrics.jsonl")
    assert [r["step"] for r in run_recs] == [r["step"] for r in ref_recs] == list(range(1, K + 1))
    # Every trained token was sampled by the weights being trained (on-policy), in both.
    assert all(r["staleness_max"] == 0 for r in run_recs)
    for a, b in zip(run_recs, ref_recs, strict=True):
        assert (a["reward_mean"], a["loss"], a["tokens"]) == (b["reward_mean"], b["loss"], b["tokens"]), (
            a,
            b,
        )

    w_run = load_file(run_dir / "weights" / f"v{K}" / "model.safetensors")
    w_ref = load_file(ref_dir / "weights" / f"v{K}" / "model.safetensors")
    w_0 = load_file(ref_dir / "weights" / "v0" / "model.safetensors")
    assert w_run.keys() == w_ref.keys()
    differ = sorted(n for n in w_run if not w_run[n].equal(w_ref[n]))
    assert differ == [], {n: float((w_run[n] - w_ref[n]).abs().max()) for n in differ}
    # ... and training moved them (a comparison of two untouched models would prove nothing).
    assert sum(not w_ref[n].equal(w_0[n]) for n in w_0) >= len(w_0) // 2
