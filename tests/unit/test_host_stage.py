"""HostStage: one reusable host buffer with a slot per tensor (a CUDA policy's published weights)."""

from __future__ import annotations

import logging

import pytest
import torch

from asyncrl.learner.host_stage import HostStage


def _spec(tensors: dict[str, torch.Tensor]) -> list[tuple[str, torch.Size, torch.dtype]]:
    return [(k, v.shape, v.dtype) for k, v in tensors.items()]


def _weights(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(7, 5, generator=g).to(torch.bfloat16),
        "norm.weight": torch.randn(5, generator=g),  # fp32, odd byte count before the next slot
        "lm_head.weight": torch.randn(5, 7, generator=g).to(torch.bfloat16).t(),  # not contiguous
        "empty": torch.empty(0, 3),
        "scalar": torch.tensor(3.25, dtype=torch.float64),
        "steps": torch.arange(3, dtype=torch.int64),
        "mask": torch.tensor([True, False, True]),
    }


def test_staged_views_hold_every_tensor_bitwise_in_its_own_aligned_slot() -> None:
    src = _weights(0)
    stage = HostStage(pin=False)
    views = stage.views(_spec(src))
    assert list(views) == list(src)
    for k, v in src.items():
        views[k].copy_(v)
    base = stage._buf.data_ptr()
    for k, v in src.items():
        t = views[k]
        assert t.shape == v.shape and t.dtype == v.dtype and t.is_contiguous()
        assert torch.equal(t, v), k
        assert (t.data_ptr() - base) % 64 == 0
    # Slots do not overlap: rewriting one leaves every other byte as it was.
    before = {k: t.clone() for k, t in views.items()}
    views["norm.weight"].fill_(float("nan"))
    for k in src:
        if k != "norm.weight":
            assert torch.equal(views[k], before[k]), k
    # 7x5 bf16 (70 B) -> 128, 5 fp32 (20) -> 192, 35 bf16 (70) -> 320, 0 -> 320, 8 -> 384, 24 -> 448, 3
    assert stage.nbytes == 451 and not stage.pinned


def test_the_same_layout_reuses_the_buffer_and_a_new_one_reallocates() -> None:
    stage = HostStage(pin=False)
    first = stage.views(_spec(_weights(0)))
    ptrs = {k: t.data_ptr() for k, t in first.items()}
    again = stage.views(_spec(_weights(1)))  # same names, shapes, dtypes: the same memory
    assert {k: t.data_ptr() for k, t in again.items()} == ptrs
    bigger = {**_weights(0), "extra": torch.zeros(1000)}
    grown = stage.views(_spec(bigger))
    assert stage.nbytes >= 4000 + 451 and list(grown) == list(bigger)
    for k, v in bigger.items():
        grown[k].copy_(v)
        assert torch.equal(grown[k], v)


def test_a_name_twice_is_refused() -> None:
    with pytest.raises(ValueError, match="twice"):
        HostStage(pin=False).views([("a", (2,), torch.float32), ("a", (3,), torch.float32)])


def test_a_buffer_that_cannot_be_pinned_is_pageable_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    if torch.cuda.is_available():
        pytest.skip("pinning works here; the fallback is for hosts without a CUDA host allocator")
    stage = HostStage(pin=True)
    with caplog.at_level(logging.WARNING, logger="asyncrl.learner.host_stage"):
        views = stage.views([("w", (4,), torch.float32)])
    views["w"].copy_(torch.arange(4.0))
    assert torch.equal(views["w"], torch.arange(4.0)) and not stage.pinned and stage.pin is False
    assert "cannot be pinned" in caplog.text
    stage.release()
    assert stage.nbytes == 0
