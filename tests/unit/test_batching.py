"""Batching: samples, mini-batch split, rank assignment, token-budget packing, collate, padding."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from asyncrl.buffer import Completion, Group
from asyncrl.learner.batching import (
    LOSS_MASK,
    assign_ranks,
    build_samples,
    collate,
    micro_batch_tokens,
    pack_micro_batches,
    padding_like,
    plan_mini_batch,
    split_mini_batches,
)


def _group(gid: str, prompt: list[int], comps: list[tuple[list[int], str]], temp: float = 0.7) -> Group:
    cs = [
        Completion(
            np.array(t, np.uint32),
            -np.linspace(0.1, 1.0, len(t), dtype=np.float32),
            np.arange(len(t), dtype=np.uint32),
            float(i),
            fin,
        )  # fmt: skip
        for i, (t, fin) in enumerate(comps)
    ]
    return Group(gid, "p", np.array(prompt, np.uint32), cs, meta={"temperature": temp})


def test_build_samples_layout_overlong_and_empty() -> None:
    g = _group("a", [5, 6, 7], [([8, 9], "stop"), ([], "stop"), ([10, 11, 12], "length")])
    advs = [[1.0, 0.0, -1.0]]
    samples, overlong = build_samples([g], advs, overlong_mask=True, default_temperature=1.0)
    assert overlong == 1
    assert [(s.completion_index, s.length, s.prompt_len) for s in samples] == [(0, 5, 3), (2, 6, 3)]
    assert samples[0].loss_mask.all() and not samples[1].loss_mask.any()
    assert samples[1].advantage == -1.0 and samples[0].temperature == pytest.approx(0.7)
    samples, overlong = build_samples([g], advs, overlong_mask=False, default_temperature=1.0)
    assert overlong == 0 and samples[1].loss_mask.all()


def test_collate_aligns_token_fields_with_token_positions() -> None:
    g = _group("a", [5, 6, 7], [([8, 9], "stop"), ([10, 11, 12], "stop")])
    samples, _ = build_samples([g], [[0.5, -0.5]], False, 1.0)
    mb = collate(samples, [0, 1], pad_id=0)
    assert mb["input_ids"].tolist() == [[5, 6, 7, 8, 9, 0], [5, 6, 7, 10, 11, 12]]
    assert mb["attention_mask"].tolist() == [[1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1]]
    assert mb[LOSS_MASK].tolist() == [[False] * 3 + [True, True, False], [False] * 3 + [True] * 3]
    np.testing.assert_array_equal(mb["logp_behav"][1, 3:].numpy(), g.completions[1].logprobs)
    assert mb["token_versions"][1].tolist() == [0, 0, 0, 0, 1, 2]
    assert mb["advantages"].tolist() == [0.5, -0.5]
    assert mb["temperature"].dtype == torch.float32 and mb["temperature"][0].item() == pytest.approx(0.7)


def test_split_assign_pack() -> None:
    assert split_mini_batches(5, 2) == [[0, 1, 2], [3, 4]]
    assert split_mini_batches(2, 4) == [[0], [1]]
    assert split_mini_batches(0, 3) == []
    lengths = [10, 9, 3, 3, 2, 1]
    ranks = assign_ranks(lengths, range(6), 2)
    assert sorted(sum(ranks, [])) == list(range(6))
    assert [sum(lengths[i] for i in r) for r in ranks] == [14, 14]
    bins = pack_micro_batches(lengths, range(6), budget=12)
    for b in bins:
        assert micro_batch_tokens(b, lengths) <= 12 or len(b) == 1
    assert sorted(sum(bins, [])) == list(range(6))
    # A sequence longer than the budget still gets a micro-batch of its own.
    assert pack_micro_batches([50, 1], [0, 1], budget=8) == [[0], [1]]


def test_plan_pads_ranks_to_equal_micro_batch_counts() -> None:
    lengths = [40, 5, 5, 5, 5]
    plan = plan_mini_batch(lengths, range(5), world_size=2, budget=10)
    assert len(plan[0]) == len(plan[1])
    flat = [i for rp in plan for mb in rp for i in mb]
    assert sorted(flat) == list(range(5))
    assert any(mb == [] for rp in plan for mb in rp)  # someone runs a padding micro-batch


def test_padding_like_copies_every_key_and_masks_all() -> None:
    g = _group("a", [5, 6, 7], [([8, 9], "stop"), ([10, 11, 12], "stop")])
    samples, _ = build_samples([g], [[0.5, -0.5]], False, 1.0)
    mb = collate(samples, [0, 1], pad_id=0)
    mb["logp_prox"] = torch.randn(mb["input_ids"].shape)  # a key added later must be carried too
    pad = padding_like(mb)
    assert set(pad) == set(mb)
    for k in mb:
        assert pad[k].shape == mb[k].shape and pad[k].dtype == mb[k].dtype
    assert not pad[LOSS_MASK].any() and mb[LOSS_MASK].any()
    assert torch.equal(pad["temperature"], mb["temperature"])  # a valid divisor, never 0
    pad["logp_prox"].add_(1.0)
    assert not torch.equal(pad["logp_prox"], mb["logp_prox"])  # a copy, not a view
