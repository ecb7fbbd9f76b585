"""A group's meta names the versions its tokens were sampled with (asyncrl.actors.groups.version_span)."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")  # asyncrl.actors.engine imports vLLM's types

from asyncrl.actors.engine import SampledCompletion  # noqa: E402
from asyncrl.actors.groups import swaps_seen, version_span  # noqa: E402


def _seq(versions: list[int]) -> SampledCompletion:
    return SampledCompletion(
        token_ids=list(range(len(versions))), logprobs=[0.0] * len(versions), versions=versions
    )


def test_a_swap_between_the_engine_read_and_the_first_token_is_not_the_start_version() -> None:
    # The worker read v3, a between-groups drain swapped to v4 before the group reached the engine: every
    # token is v4 (before: version_start 3, a version no token had).
    assert version_span([_seq([4, 4]), _seq([4, 4, 4])], 3, 4) == (4, 4)
    # A swap in flight: the tokens span 3..5 whatever the engine says after the group.
    assert version_span([_seq([3, 3, 5]), _seq([3])], 3, 6) == (3, 5)
    # No tokens at all (every completion empty): the engine's versions.
    assert version_span([_seq([]), _seq([])], 2, 3) == (2, 3)
    assert version_span([], 2, 2) == (2, 2)


def test_swaps_seen_counts_the_swaps_inside_the_tokens_only() -> None:
    # A swap before the group reached the engine (all tokens v4) is none the group saw (before: 1).
    assert swaps_seen([_seq([4, 4]), _seq([4, 4, 4])]) == 0
    # A lagged swap 0 -> 2 is one swap; two swaps in flight, seen by different completions, are two.
    assert swaps_seen([_seq([0, 0, 2]), _seq([0])]) == 1
    assert swaps_seen([_seq([3, 4]), _seq([3, 4, 5])]) == 2
    assert swaps_seen([_seq([]), _seq([])]) == 0 and swaps_seen([]) == 0
