"""Shared fixtures: one real redis-server per test session, a fresh run name per test.

Fixtures:
  redis_server  (session)   EmbeddedRedis on a free loopback port, data in a tmp dir
  redis_url     (session)   its redis:// url
  redis_client  (function)  redis.Redis (bytes responses) on that server
  run_name      (function)  unique run name, so tests never share keys
  buffer        (function)  ReplayBuffer on run_name; its keys are deleted afterwards
  make_group    (function)  factory for small valid Group records

Only tests that request these fixtures need redis-server; nothing here imports torch.
"""

from __future__ import annotations

import itertools
import uuid
from collections.abc import Callable, Iterator

import numpy as np
import pytest
import redis

from asyncrl.buffer import Completion, EmbeddedRedis, Group, ReplayBuffer


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedRedis]:
    server = EmbeddedRedis(tmp_path_factory.mktemp("redis"))
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def redis_url(redis_server: EmbeddedRedis) -> str:
    return redis_server.url


@pytest.fixture
def redis_client(redis_server: EmbeddedRedis) -> Iterator[redis.Redis]:
    client = redis_server.client(socket_timeout=30.0)
    try:
        yield client
    finally:
        client.close()


@pytest.fixture
def run_name(request: pytest.FixtureRequest) -> str:
    # Readable prefix for debugging + uuid so reruns and xdist workers never collide.
    base = "".join(ch if ch.isalnum() else "-" for ch in request.node.name)[:40].strip("-") or "t"
    return f"{base}-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def buffer(redis_client: redis.Redis, run_name: str) -> Iterator[ReplayBuffer]:
    buf = ReplayBuffer(redis_client, run_name)
    try:
        yield buf
    finally:
        buf.delete_run()
        buf.close()


_counter = itertools.count()


def small_group(
    group_id: str | None = None,
    n_completions: int = 2,
    n_tokens: int = 4,
    version: int = 0,
    reward: float = 1.0,
) -> Group:
    """A valid group with deterministic contents (token ids encode the group counter)."""
    k = next(_counter)
    completions = [
        Completion(
            token_ids=np.arange(n_tokens, dtype=np.uint32) + 10 * i,
            logprobs=np.full(n_tokens, -0.5, dtype=np.float32),
            versions=np.full(n_tokens, version, dtype=np.uint32),
            reward=reward,
            finish_reason="stop",
        )
        for i in range(n_completions)
    ]
    return Group(
        group_id=group_id or f"g{k}",
        prompt_id=f"p{k}",
        prompt_token_ids=np.array([1, 2, 3], dtype=np.uint32),
        completions=completions,
        actor_id="actor-0",
        created_at=1000.0 + k,
        meta={"temperature": 1.0},
    )


@pytest.fixture
def make_group() -> Callable[..., Group]:
    return small_group


def _has_cuda() -> bool:
    import shutil
    import subprocess

    smi = shutil.which("nvidia-smi")
    return bool(smi) and subprocess.run([smi, "-L"], capture_output=True).returncode == 0


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """`gpu` tests need CUDA (vllm + NCCL); on CPU-only machines they are skipped, not faked."""
    if any("gpu" in item.keywords for item in items) and not _has_cuda():
        skip = pytest.mark.skip(reason="needs a CUDA GPU (nvidia-smi -L failed or missing)")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)
