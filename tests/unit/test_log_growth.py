"""The actor's log does not grow with the steps: no line per weight swap once an engine serves.

``actor-<i>.log`` (fds 1 and 2 of the actor and its engine processes, asyncrl.console.redirect_output)
is never rotated. A 100- and a 400-step demo showed two lines per published version in it, 217 bytes
per step: asyncrl's ``serving vN`` and the engine core's ``Successfully reset prefix cache`` (vLLM).
Both are checked through what writes the file: the actor's logging at INFO into a file, and a real
vLLM ``BlockPool`` reset in a fresh process (an engine core's) whose output is captured."""

from __future__ import annotations

import asyncio
import logging
import subprocess
import sys
from pathlib import Path

import pytest

from tests.unit.test_actor_metrics import _actor

ROOT = Path(__file__).resolve().parents[2]
SWAPS = 200


def test_routine_weight_swaps_add_no_line_to_the_actor_log(tmp_path: Path) -> None:
    """The first version an engine serves is logged at INFO (the actor's level); the next SWAPS are not."""
    path = tmp_path / "actor-0.log"
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))  # ray_actor's
    logger = logging.getLogger("asyncrl.actors.version_watch")
    old_level = logger.level
    logger.setLevel(logging.INFO)  # as under the actor's logging.basicConfig(level=INFO)
    logger.addHandler(handler)
    try:
        a = _actor()

        async def swaps() -> int:
            assert await a._maybe_swap(first=True)
            handler.flush()
            first = path.stat().st_size
            for _ in range(SWAPS):
                assert await a._maybe_swap()
            return first

        first = asyncio.run(swaps())
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)
        handler.close()
    lines = path.read_text().splitlines()
    assert len(lines) == 1 and "serving v1" in lines[0], lines[:5]
    assert a.counters["swaps"] == SWAPS
    assert path.stat().st_size == first  # 0 bytes per routine swap (was ~100)


# A fresh interpreter, as an engine core: vLLM's logging configured (its handler writes to stdout), a
# real BlockPool's reset as a swap's KV reset runs it (the control: vLLM's line is there), then the
# asyncrl module the engine core loads is imported and vLLM's logging configured again, as the engine
# core's entry (EngineCoreProc.run_engine_core) does after the actor's standby preloaded its modules
# (asyncrl.actors.engine_start.PRELOAD): dictConfig resets every vllm.* logger's level. Then SWAPS resets.
# Output: what the actor's log receives.
_ENGINE_CORE = """
import importlib, sys
from vllm.config.logging import LoggingConfig
from vllm.logger import configure_logging
from vllm.v1.core.block_pool import BlockPool
configure_logging(LoggingConfig())
pool = BlockPool(num_gpu_blocks=4, enable_caching=True, hash_block_size=16)
for _ in range(3):
    assert pool.reset_prefix_cache()
print("=== import", sys.argv[1], flush=True)
importlib.import_module(sys.argv[1])
configure_logging(LoggingConfig())
for _ in range({swaps}):
    assert pool.reset_prefix_cache()
print("=== done", flush=True)
"""


@pytest.mark.parametrize("module", ["asyncrl.actors.worker_ext", "asyncrl.actors.quiet_executor"])
def test_the_engine_core_logs_no_line_per_kv_reset(module: str) -> None:
    """vLLM logs one INFO line per prefix-cache reset (the control, before the import); once the module
    that asyncrl runs in the engine core is loaded, SWAPS resets write nothing."""
    out = subprocess.run(
        [sys.executable, "-c", _ENGINE_CORE.format(swaps=SWAPS), module],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=300,
    )  # one stream for both fds, as the actor's log
    text = out.stdout
    assert out.returncode == 0, text[-3000:]
    before, _, after = text.partition(f"=== import {module}")
    assert "=== done" in after, text[-3000:]
    assert before.count("Successfully reset prefix cache") == 3, before[-3000:]  # the line this is about
    assert after.count("Successfully reset prefix cache") == 0, after[-3000:]
