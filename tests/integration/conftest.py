"""Session fixtures for the actor tests: local Ray, the tiny model and its weight versions, and ONE
actor pool (one Ray actor, one real vLLM CPU engine) shared by the tests that need it.

``actor_run`` gives tests a :class:`ActorRun`: the pool, a session buffer on the real redis-server
of ``tests/conftest.py``, a publisher of weight versions (perturbed copies of the tiny model,
optionally tampered) and an HF fp32 reference for logprob recomputation. The pool is created on
first use and stopped at the end of the session (or by the test that checks the stop itself).
"""

from __future__ import annotations

import logging
import shutil
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from asyncrl.buffer import Group, ReplayBuffer, WeightManifest, build_manifest, decode
from asyncrl.buffer.layout import ROLLOUT_FIELD
from asyncrl.config import load_config

TEMPERATURE = 0.8
GROUP_SIZE = 4
GROUPS_PER_STEP = 2
MAX_STALENESS = 1


@pytest.fixture(scope="session")
def ray_local():
    ray = pytest.importorskip("ray")
    from asyncrl.actors.pool import actor_runtime_env

    started = False
    if not ray.is_initialized():
        ray.init(
            num_cpus=4,
            include_dashboard=False,
            runtime_env=actor_runtime_env() or None,
            logging_level=logging.WARNING,
        )
        started = True
    yield ray
    if started:
        ray.shutdown()


class ActorRun:
    """The shared pool and everything the tests need around it."""

    def __init__(self, cfg: Any, run_dir: Path, buffer: ReplayBuffer, model_dir: Path) -> None:
        self.cfg, self.run_dir, self.buffer, self.model_dir = cfg, run_dir, buffer, model_dir
        self.pool: Any = None
        self._hf: dict[int, Any] = {}
        self._state: dict[int, Any] = {}

    # -------------------------------------------------------------- weights

    def _perturbed_state(self, version: int) -> dict:
        """v0 = the initial weights; vN = initial + N(0, 0.05^2) noise drawn from seed N."""
        import torch
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=torch.float32)
        if version:
            g = torch.Generator().manual_seed(version)
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(torch.randn(p.shape, generator=g) * 0.05)
        self._hf[version] = model.eval()
        return {k: v.detach().contiguous().clone() for k, v in model.state_dict().items()}

    def prepare(self, version: int, tamper: bool = False) -> WeightManifest:
        """Write weights v``version`` like the learner does; returns the manifest (unpublished).

        ``tamper`` flips bytes of the file after the manifest was computed (sha mismatch).
        """
        from safetensors.torch import save_file

        path = self.run_dir / "weights" / f"v{version}" / "model.safetensors"
        path.parent.mkdir(parents=True, exist_ok=True)
        save_file(self._perturbed_state(version), str(path))
        manifest = build_manifest(version, path, "float32")
        if tamper:
            data = bytearray(path.read_bytes())
            data[-16:] = bytes(b ^ 0xFF for b in data[-16:])
            path.write_bytes(bytes(data))
        return manifest

    def publish(self, version: int, tamper: bool = False) -> WeightManifest:
        manifest = self.prepare(version, tamper)
        self.buffer.publish_weights(manifest)
        return manifest

    def hf(self, version: int) -> Any:
        if version not in self._hf:
            self._perturbed_state(version)
        return self._hf[version]

    def hf_logprobs(self, version: int, prompt_ids, token_ids) -> Any:
        """fp32 log_softmax(logits / T) at the sampled tokens, as the learner computes it."""
        import torch

        ids = torch.tensor([list(prompt_ids) + list(token_ids)], dtype=torch.long)
        with torch.no_grad():
            logits = self.hf(version)(ids).logits[0, len(prompt_ids) - 1 : -1].float()
        lp = torch.log_softmax(logits / TEMPERATURE, dim=-1)
        return lp.gather(1, torch.tensor(list(token_ids), dtype=torch.long)[:, None])[:, 0].numpy()

    # -------------------------------------------------------------- buffer views

    def groups(self) -> list[Group]:
        """Every group written so far, in stream order (read-only XRANGE; nothing is consumed)."""
        entries = self.buffer.client.xrange(self.buffer.keys.rollouts)
        return [decode(fields[ROLLOUT_FIELD]) for _, fields in entries]

    def wait_groups(self, n: int, timeout: float = 240.0) -> list[Group]:
        deadline = time.monotonic() + timeout
        while True:
            self.pool.check()
            gs = self.groups()
            if len(gs) >= n:
                return gs
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(gs)} of {n} groups written within {timeout}s")
            time.sleep(0.2)

    def stats(self) -> dict:
        return self.pool.stats()[0]

    def wait_stats(self, pred, timeout: float = 120.0, what: str = "condition", poll_s: float = 0.05) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            self.pool.check()
            s = self.stats()
            if pred(s):
                return s
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what} not reached within {timeout}s; actor stats {s}")
            time.sleep(poll_s)


@pytest.fixture(scope="session")
def actor_run(ray_local, redis_server, tmp_path_factory):
    """One Ray actor with one vLLM engine, writing to a fresh run on the session redis-server."""
    from asyncrl.actors.pool import ActorPool
    from asyncrl.tinymodel import resolve_model_path

    run_dir = tmp_path_factory.mktemp("actors-run")
    name = f"actors-{uuid.uuid4().hex[:8]}"
    cfg = load_config(
        None,
        [
            f"run.name={name}",
            f"run.dir={run_dir}",
            "run.seed=0",
            "task.name=copy",
            "task.num_prompts=64",
            f"actors.group_size={GROUP_SIZE}",
            "actors.groups_in_flight=2",
            f"actors.temperature={TEMPERATURE}",
            "actors.top_p=1.0",
            # Long completions (a random model rarely says EOS) so a swap lands mid-generation.
            "actors.max_tokens=160",
            "actors.kv_cache_mib=64",
            "actors.num_cpus_per_actor=1",
            "actors.max_restarts=2",
            "actors.heartbeat_s=0.3",
            "actors.swap_mode=in_flight",
            # The tests time swaps and stops by the tokens in flight, which only a streaming engine
            # counts while they are sampled (the default hands each group over once it ends; both give
            # the same rollouts: test_weight_swap.test_streamed_and_final_only_groups_are_identical).
            "actors.stream_tokens=true",
            f"buffer.max_staleness={MAX_STALENESS}",
            # The tests move V without publishing weights to count admissions exactly; the
            # stale-weights refusal is covered by test_buffer and the on-policy e2e test.
            "actors.refuse_stale_weights=false",
            f"buffer.groups_per_step={GROUPS_PER_STEP}",
            "model.max_model_len=256",
        ],
    )
    model_dir = resolve_model_path(cfg, run_dir)
    buffer = ReplayBuffer(
        redis_server.client(socket_timeout=30.0),
        name,
        max_staleness=MAX_STALENESS,
        groups_per_step=GROUPS_PER_STEP,
        owns_client=True,
    )
    run = ActorRun(cfg, run_dir, buffer, model_dir)
    run.publish(0)
    run.pool = ActorPool(cfg, run_dir, redis_url=redis_server.url).start()
    try:
        yield run
    finally:
        if not run.pool._stopped:
            run.pool.stop(abort=True)
        buffer.delete_run()
        buffer.close()
        shutil.rmtree(run_dir / "weights", ignore_errors=True)
