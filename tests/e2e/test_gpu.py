"""The CUDA path (vllm + NCCL + bf16 DeepSpeed): runs only where a GPU is present (marked `gpu`)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.e2e.procs import ROOT, asyncrl_cmd, read_jsonl

pytestmark = [pytest.mark.gpu, pytest.mark.slow]


def torch_cuda_devices(n: int) -> bool:
    """At least ``n`` CUDA devices (False without torch CUDA)."""
    try:
        import torch

        return torch.cuda.device_count() >= n
    except ImportError:
        return False


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


# ------------------------------------------------------------------ learner.weight_transport=nccl
# Never executed on the machine that wrote it (no GPU there); the CPU tests of the same control plane
# and learner-side handshake are tests/unit/test_weight_broadcast.py.


def _nccl_cfg(run_name: str, redis_url: str):
    from asyncrl.config import load_config

    return load_config(ROOT / "configs" / "default.yaml", [
        f"run.name={run_name}", f"redis.url={redis_url}", "learner.weight_transport=nccl",
        "actors.num_gpus_per_actor=1", "actors.gpu_memory_utilization=0.2", "model.dtype=float32",
    ])  # fmt: skip


async def _nccl_actor(run_dir: str, run_name: str, redis_url: str, out: str) -> None:
    """The actor side, in its own process on GPU 1: vLLM (backend nccl) + NcclReceiver until v1."""
    import asyncio

    from asyncrl.actors.engine import Engine
    from asyncrl.actors.nccl_receiver import NcclReceiver, expected_names
    from asyncrl.buffer import ReplayBuffer
    from asyncrl.buffer.broadcast import BroadcastSession
    from asyncrl.tinymodel import resolve_model_path

    cfg = _nccl_cfg(run_name, redis_url)
    model = resolve_model_path(cfg, run_dir)
    engine = Engine.from_config(cfg, model)
    buf = ReplayBuffer.connect(redis_url, run_name)
    recv = NcclReceiver(engine, BroadcastSession(buf.client, run_name), "actor-0", expected_names(model), 1)
    try:
        while engine.version != 1:
            await recv.poll("in_flight")
            await asyncio.sleep(0.005)
        seqs = await engine.generate_group(list(range(3, 11)), 2, 1.0, 1.0, 24, "g0", seed=7)
        Path(out).write_text(
            json.dumps([{"ids": s.token_ids, "lp": s.logprobs, "v": s.versions} for s in seqs])
        )
    finally:
        engine.shutdown()


@pytest.mark.skipif(not torch_cuda_devices(2), reason="NCCL broadcast needs 2 GPUs (learner + actor)")
def test_nccl_broadcast_swaps_a_cuda_actor_with_exact_versions(tmp_path, redis_url, run_name):
    """Learner (this process, GPU 0) -> actor (vLLM, GPU 1) over vLLM's NCCL engine: every token of a
    group sampled after v1 is labelled 1 and its logprob is v1's fp32 log-softmax (HF reference)."""
    import sys

    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from asyncrl.buffer import ReplayBuffer
    from asyncrl.buffer.broadcast import BroadcastSession
    from asyncrl.learner.nccl_transport import NcclTransport
    from asyncrl.learner.publisher import Publisher, checkpoint_tensor_names
    from asyncrl.tinymodel import resolve_model_path

    cfg = _nccl_cfg(run_name, redis_url)
    model = resolve_model_path(cfg, tmp_path)
    out = tmp_path / "actor.json"
    actor = subprocess.Popen(
        [sys.executable, "-m", "tests.e2e.test_gpu", str(tmp_path), run_name, redis_url, str(out)],
        cwd=ROOT, env={**__import__("os").environ, "CUDA_VISIBLE_DEVICES": "1"},
    )  # fmt: skip
    buf = ReplayBuffer.connect(redis_url, run_name)
    names = checkpoint_tensor_names(model)
    from vllm.utils.network_utils import get_open_port

    transport = NcclTransport(BroadcastSession(buf.client, run_name), names, master_address="127.0.0.1",
                              master_port=get_open_port(), world_size=2, timeout_s=120, join_timeout_s=600)  # fmt: skip
    pub = Publisher(buf, transport, keep_versions=2, dtype="float32")
    try:
        v0 = {k: t.to("cuda:0") for k, t in load_file(str(model / "model.safetensors")).items()}
        pub.publish(0, v0)
        g = torch.Generator(device="cuda:0").manual_seed(0)
        v1 = {k: t + 0.05 * torch.randn(t.shape, generator=g, device="cuda:0") for k, t in v0.items()}
        m = pub.publish(1, v1)
        assert buf.version() == 1 and m.path.startswith("nccl://") and m.digest == "none"
        assert actor.wait(timeout=600) == 0
        hf = AutoModelForCausalLM.from_pretrained(str(model), torch_dtype=torch.float32).to("cuda:0")
        hf.load_state_dict(v1, strict=False)
        for s in json.loads(out.read_text()):
            assert s["v"] == [1] * len(s["ids"])
            ids = torch.tensor([list(range(3, 11)) + s["ids"]], device="cuda:0")
            with torch.no_grad():
                logits = hf(ids).logits[0, 7:-1].float()
            ref = torch.log_softmax(logits, -1).gather(-1, ids[0, 8:, None])[:, 0]
            assert torch.allclose(ref.cpu(), torch.tensor(s["lp"]), atol=2e-3), (ref, s["lp"])
    finally:
        if actor.poll() is None:
            actor.kill()
            actor.wait()
        transport.close()
        buf.delete_run()


if __name__ == "__main__":  # the actor process of the NCCL test
    import asyncio
    import sys

    asyncio.run(_nccl_actor(*sys.argv[1:5]))
