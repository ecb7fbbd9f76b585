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


@pytest.fixture
def cuda_only_group(tmp_path):
    dist.init_process_group("cuda:gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


class _Reached(Exception):
    pass


def test_flag_is_reduced_on_the_engine_device(cuda_only_group, monkeypatch):
    # The emulation is faithful: a CPU tensor has no backend in this group.
    with pytest.raises(RuntimeError, match="No backend type associated with device type cpu"):
        dist.all_reduce(torch.zeros(1, dtype=torch.int64))
    seen: list[torch.device] = []

    def spy(t, *a, **kw):  # no CUDA here: record where the flag lives, stop before the reduce
        seen.append(t.device)
        raise _Reached

    monkeypatch.setattr(dist, "all_reduce", spy)
    le = SimpleNamespace(world_size=2, device=torch.device("meta"))  # stands in for cuda:N
    with pytest.raises(_Reached):
        checkpoint._all_ranks_ok(le, True)
    assert seen == [torch.device("meta")]


@pytest.mark.gpu
def test_flag_reduces_on_a_nccl_group(tmp_path):
    dist.init_process_group("nccl", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        le = SimpleNamespace(world_size=2, device=torch.device("cuda", 0))  # 2: take the collective path
        assert checkpoint._all_ranks_ok(le, True) is True
        assert checkpoint._all_ranks_ok(le, False) is False
    finally:
        dist.destroy_process_group()
