"""``asyncrl run`` with GPU actors gives the learner a GPU of its own (asyncrl.launch.learner_gpu_split).

The learner took cuda:0 of every GPU while the local Ray handed GPU 0 to actor 0's bundle (vLLM then
refused to start or the learner ran out of memory; NCCL refuses two ranks on one device). The split
itself is pure and checked here; the CUDA run is the `gpu`-marked e2e test's."""

from __future__ import annotations

import pytest

from asyncrl.config import load_config
from asyncrl.launch import learner_gpu_split, visible_gpus


@pytest.mark.parametrize(
    ("overrides", "gpus", "want"),
    [
        (
            ["actors.num_actors=2", "actors.num_gpus_per_actor=1"],
            ["0", "1", "2", "3"],
            ("3", ["0", "1", "2"]),
        ),
        (["actors.num_actors=2", "actors.num_gpus_per_actor=1"], ["4", "5", "6"], ("6", ["4", "5"])),
        # TP 2 x 2 actors need 4 GPUs besides the learner's.
        (
            ["actors.num_actors=2", "actors.num_gpus_per_actor=1", "actors.tensor_parallel_size=2"],
            [str(i) for i in range(5)],
            ("4", ["0", "1", "2", "3"]),
        ),  # fmt: skip
        (
            ["actors.num_actors=2", "actors.num_gpus_per_actor=1", "actors.tensor_parallel_size=2"],
            [str(i) for i in range(4)],
            None,
        ),  # fmt: skip  (no room: shared as configured)
        (["actors.num_actors=1", "actors.num_gpus_per_actor=1"], ["0"], None),  # one GPU: shared
        (["actors.num_gpus_per_actor=0"], ["0", "1"], None),  # CPU actors
        (
            ["actors.num_actors=1", "actors.num_gpus_per_actor=1", "ray.address=10.0.0.1:6379"],
            ["0", "1"],
            None,
        ),
        (["actors.num_actors=1", "actors.num_gpus_per_actor=1"], [], None),
    ],
)
def test_the_learner_gets_the_last_gpu_when_the_actors_fit_on_the_others(overrides, gpus, want) -> None:
    assert learner_gpu_split(load_config(overrides=overrides), gpus) == want


def test_visible_gpus_honours_cuda_visible_devices(monkeypatch) -> None:
    for value, want in (("4,5", ["4", "5"]), ("GPU-a1b2, GPU-c3d4", ["GPU-a1b2", "GPU-c3d4"]), ("", []),
                        ("-1", [])):  # fmt: skip
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", value)
        assert visible_gpus() == want
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    monkeypatch.setenv("PATH", "/nonexistent")  # no nvidia-smi: no GPUs, no error
    assert visible_gpus() == []
