"""checkpoint._all_ranks_ok on a NCCL-only group: the flag must be a device tensor.

A CUDA learner's process group has only an NCCL backend (engine.init_distributed), which reduces device
tensors; the CPU flag the resume path all-reduced raised "No backend type associated with device type
cpu" there, so every multi-GPU resume crashed. Without CUDA the failure is emulated with a group whose
only backend is registered for cuda (gloo standing in for nccl).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from asyncrl.learner import checkpoint

#: In a fresh interpreter: an earlier test of the same process may have left a default process group
#: initialized ("trying to initialize the default process group twice" in the full suite).
_CHECK = """
import sys
from types import SimpleNamespace

import torch
import torch.distributed as dist

from asyncrl.learner import checkpoint

dist.init_process_group("cuda:gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
try:
    # The emulation is faithful: a CPU tensor has no backend in this group.
    try:
        dist.all_reduce(torch.zeros(1, dtype=torch.int64))
        raise SystemExit("a CPU tensor was reduced on the cuda-only group")
    except RuntimeError as e:
        assert "No backend type associated with device type cpu" in str(e), e

    class Reached(Exception):
        pass

    seen = []

    def spy(t, *a, **kw):  # no CUDA here: record where the flag lives, stop before the reduce
        seen.append(t.device)
        raise Reached

    dist.all_reduce = spy
    le = SimpleNamespace(world_size=2, device=torch.device("meta"))  # stands in for cuda:N
    try:
        checkpoint._all_ranks_ok(le, True)
        raise SystemExit("the flag was never reduced")
    except Reached:
        pass
    assert seen == [torch.device("meta")], seen
    print("ok")
finally:
    dist.destroy_process_group()
"""


def test_flag_is_reduced_on_the_engine_device(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", _CHECK, str(tmp_path / "pg")], capture_output=True, text=True,
                         timeout=300, cwd=root)  # fmt: skip
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stdout + out.stderr


@pytest.mark.gpu
def test_flag_reduces_on_a_nccl_group(tmp_path):
    dist.init_process_group("nccl", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        le = SimpleNamespace(world_size=2, device=torch.device("cuda", 0))  # 2: take the collective path
        assert checkpoint._all_ranks_ok(le, True) is True
        assert checkpoint._all_ranks_ok(le, False) is False
    finally:
        dist.destroy_process_group()
