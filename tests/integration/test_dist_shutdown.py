"""The learner's entry points tear the process group down themselves (pytorch/pytorch#190489).

A gloo rank that exits with its process group still alive can die in interpreter finalisation with
``terminate called without an active exception`` (SIGABRT): seen once in CI on a 2-rank ZeRO-3 learner
after its last step. :func:`asyncrl.learner.engine.shutdown_distributed` is what they call last.
"""

from __future__ import annotations

import subprocess
import sys

from tests.integration.learner_helpers import ROOT, child_env, free_port

SCRIPT = """
import torch
import torch.distributed as dist
from asyncrl.learner.engine import init_distributed, shutdown_distributed

rank, world = init_distributed()
out = [torch.zeros(1) for _ in range(world)]
dist.all_gather(out, torch.tensor([float(rank)]))
assert [t.item() for t in out] == [float(r) for r in range(world)], out
shutdown_distributed()
assert not dist.is_initialized()
shutdown_distributed()  # a second call is a no-op
print(f"rank {rank} of {world} shut down", flush=True)
"""


def test_two_ranks_destroy_their_process_group(tmp_path) -> None:
    script = tmp_path / "ranks.py"
    script.write_text(SCRIPT)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", "2",
           "--master_addr", "127.0.0.1", "--master_port", str(free_port()), str(script)]  # fmt: skip
    p = subprocess.run(cmd, env=child_env(), cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "rank 0 of 2 shut down" in p.stdout and "rank 1 of 2 shut down" in p.stdout, p.stdout
