"""asyncrl.learner.validate: every kind of record that decodes but does not fit the run is named."""

from __future__ import annotations

import numpy as np
import pytest

from asyncrl.buffer import Completion, Group
from asyncrl.learner.validate import RunSpec, check_group

SPEC = RunSpec(vocab_size=100, max_model_len=32, group_size=3)


def group(n: int = 3, prompt=(1, 2, 3), tokens=(4, 5), version: int = 0, meta=None, **overrides) -> Group:
    comps = [
        Completion(
            token_ids=np.array(tokens, dtype=np.uint32),
            logprobs=np.full(len(tokens), -0.5, dtype=np.float32),
            versions=np.full(len(tokens), version, dtype=np.uint32),
            reward=1.0,
            finish_reason="stop",
        )
        for _ in range(n)
    ]
    g = Group(
        "g",
        "p",
        np.array(prompt, dtype=np.uint32),
        comps,
        meta={"temperature": 1.0} if meta is None else meta,
    )
    for k, v in overrides.items():
        setattr(g.completions[1], k, v)
    return g


def test_a_fitting_group_passes_at_the_edges() -> None:
    assert check_group(group(), SPEC, 0) is None
    # Highest token id, exactly max_model_len tokens, tokens sampled by the current version, no meta.
    edge = group(prompt=[99] * 2, tokens=[99] * 30, version=5, meta={})
    assert check_group(edge, SPEC, 5) is None
    assert check_group(group(tokens=()), SPEC, 0) is None  # a completion without tokens carries no loss


@pytest.mark.parametrize(
    ("g", "version", "field"),
    [
        (group(n=2), 0, "completions: 2 completions, the run's group size (actors.group_size) is 3"),
        (group(n=4), 0, "completions: 4 completions"),
        (group(prompt=()), 0, "prompt_token_ids: empty prompt"),
        (group(prompt=(1, 100)), 0, "prompt_token_ids: token id 100 at 1 is outside the vocabulary"),
        (group(tokens=(4, 2**31)), 0, "completions[0].token_ids: token id 2147483648 at 1"),
        (
            group(tokens=[1] * 30),
            0,
            "completions[0]: prompt + completion = 33 tokens > model.max_model_len=32",
        ),
        (
            group(version=3),
            2,
            "completions[0].versions: token sampled by v3, newer than the learner's current version v2",
        ),
        (group(meta={"temperature": 0.0}), 0, "meta['temperature']: 0.0"),
        (group(meta={"temperature": -1}), 0, "meta['temperature']: -1"),
        (group(meta={"temperature": float("nan")}), 0, "meta['temperature']: nan"),
        (group(meta={"temperature": "1.0"}), 0, "meta['temperature']: '1.0'"),
        (group(meta={"temperature": True}), 0, "meta['temperature']: True"),
        (group(meta={"top_p": 0.0}), 0, "meta['top_p']: 0.0"),
        (group(meta={"top_p": 1.5}), 0, "meta['top_p']: 1.5"),
        # The batch's sort keys (feed.batch_order_key): anything else raised inside gather.
        (group(meta={"actor_index": "x"}), 0, "meta['actor_index']: 'x' (orders the step's batch"),
        (group(meta={"prompt_seq": float("nan")}), 0, "meta['prompt_seq']: nan"),
        (group(meta={"prompt_seq": float("inf")}), 0, "meta['prompt_seq']: inf"),
        (group(meta={"prompt_seq": 3.0}), 0, "meta['prompt_seq']: 3.0"),
        (group(meta={"actor_index": True}), 0, "meta['actor_index']: True"),
        (
            group(logprobs=np.array([-0.5, np.inf], dtype=np.float32)),
            0,
            "completions[1].logprobs: non-finite",
        ),
        (group(logprobs=np.array([-0.5], dtype=np.float32)), 0, "completions[1]: 2 tokens but 1 logprobs"),
        (group(reward=float("inf")), 0, "completions[1].reward: inf is not a finite number"),
        # Finite in float64 but not trainable in fp32 (records from a producer without the codec's bounds).
        (group(reward=1e39), 0, "completions[1].reward: 1e+39 is beyond +-1e+09"),
        (group(reward=-2e9), 0, "completions[1].reward: -2e+09 is beyond"),
        (
            group(logprobs=np.array([-0.5, -1e30], dtype=np.float32)),
            0,
            "completions[1].logprobs: -1e+30 is below -10000",
        ),
        (
            group(meta={"temperature": 1e-6}),
            0,
            "meta['temperature']: 1e-06 (the learner divides logits by it: must be >= 1e-05)",
        ),
        (group(meta={"temperature": 1e-40}), 0, "meta['temperature']: 1e-40"),
    ],
)
def test_each_poison_kind_is_named(g: Group, version: int, field: str) -> None:
    reason = check_group(g, SPEC, version)
    assert reason is not None and reason.startswith(field), reason


def test_the_value_bounds_are_inclusive() -> None:
    """Rewards of +-1e9, a logprob of -1e4 and a temperature of 1e-5 are trainable (just inside)."""
    for reward in (1e9, -1e9):
        assert check_group(group(reward=reward), SPEC, 0) is None
    assert check_group(group(logprobs=np.array([-1e4, -0.5], dtype=np.float32)), SPEC, 0) is None
    assert check_group(group(meta={"temperature": 1e-5}), SPEC, 0) is None
    assert check_group(group(logprobs=np.array([-1.0001e4, -0.5], dtype=np.float32)), SPEC, 0) is not None


def test_every_group_that_passes_can_be_ordered() -> None:
    """batch_order_key is total on what check_group accepts (integer keys of any size, or none)."""
    from asyncrl.learner.feed import batch_order_key

    for meta in ({}, {"actor_index": 2, "prompt_seq": 2**62}, {"prompt_seq": -1}, {"actor_index": 0}):
        g = group(meta=meta)
        assert check_group(g, SPEC, 0) is None
        assert batch_order_key(g)[:2] == (meta.get("actor_index", -1), meta.get("prompt_seq", -1))


def test_random_groups_agree_with_a_slow_reference() -> None:
    """check_group accepts exactly the groups a plain per-token reference accepts (random inputs)."""
    rng = np.random.default_rng(0)

    def reference(g: Group, v: int) -> bool:
        if len(g.completions) != SPEC.group_size or len(g.prompt_token_ids) == 0:
            return False
        if any(int(t) >= SPEC.vocab_size for t in g.prompt_token_ids):
            return False
        for c in g.completions:
            if len(g.prompt_token_ids) + len(c.token_ids) > SPEC.max_model_len:
                return False
            if any(int(t) >= SPEC.vocab_size for t in c.token_ids) or any(int(x) > v for x in c.versions):
                return False
        return g.meta.get("temperature", 1.0) >= 1e-5

    seen = {True: 0, False: 0}
    for _ in range(400):
        n_prompt, n_tok = int(rng.integers(0, 12)), int(rng.integers(0, 24))
        g = group(
            n=int(rng.integers(2, 5)),
            prompt=rng.integers(0, 104, n_prompt),
            tokens=rng.integers(0, 104, n_tok),
            version=int(rng.integers(0, 4)),
            meta={"temperature": float(rng.choice([1.0, 0.5, 1e-5, 0.0, 9e-6, -0.1]))},
        )
        v = int(rng.integers(0, 4))
        ok = reference(g, v)
        seen[ok] += 1
        assert (check_group(g, SPEC, v) is None) == ok
    assert seen[True] > 10 and seen[False] > 10
