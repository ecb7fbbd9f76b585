"""Wire records: round trips, and every kind of malformed input rejected with a named field."""

from __future__ import annotations

import math

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from asyncrl.buffer import records as rec
from asyncrl.buffer.records import Completion, Group, RecordError, decode, encode

# --------------------------------------------------------------------------- strategies

u32 = st.integers(0, 2**32 - 1)
logprob = st.floats(min_value=-1e4, max_value=0.0, width=32)
meta_value = st.one_of(
    st.text(max_size=20),
    st.integers(-(2**63), 2**64 - 1),
    st.floats(allow_nan=False),
    st.booleans(),
)


@st.composite
def completions(draw: st.DrawFn) -> Completion:
    n = draw(st.integers(0, 24))
    start = draw(st.integers(0, 2**31))
    steps = draw(st.lists(st.integers(0, 3), min_size=n, max_size=n))
    return Completion(
        token_ids=draw(st.lists(u32, min_size=n, max_size=n)),
        logprobs=draw(st.lists(logprob, min_size=n, max_size=n)),
        versions=np.cumsum([start, *steps])[1:] if n else [],
        reward=draw(st.floats(-rec.REWARD_ABS_MAX, rec.REWARD_ABS_MAX)),
        finish_reason=draw(st.sampled_from(sorted(rec.FINISH_REASONS))),
    )


@st.composite
def groups(draw: st.DrawFn) -> Group:
    return Group(
        group_id=draw(st.text(min_size=1, max_size=30)),
        prompt_id=draw(st.text(max_size=30)),
        prompt_token_ids=draw(st.lists(u32, max_size=50)),
        completions=draw(st.lists(completions(), min_size=1, max_size=4)),
        actor_id=draw(st.text(max_size=10)),
        created_at=draw(st.floats(allow_nan=False, allow_infinity=False)),
        meta=draw(st.dictionaries(st.text(max_size=10), meta_value, max_size=8)),
    )


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(groups())
def test_round_trip(group: Group) -> None:
    data = encode(group)
    back = decode(data)
    assert back == group
    for a, b in zip(back.completions, group.completions, strict=True):
        assert a.token_ids.dtype == np.uint32 and a.versions.dtype == np.uint32
        assert a.logprobs.dtype == np.float32
        assert a.logprobs.tobytes() == b.logprobs.tobytes()  # bit-exact fp32
    assert encode(back) == data  # canonical


def _valid() -> Group:
    return Group(
        group_id="g1",
        prompt_id="p1",
        prompt_token_ids=[5, 6],
        completions=[
            Completion([1, 2, 3], [-0.1, -0.2, -0.3], [3, 3, 4], 1.0, "stop"),
            Completion([7, 8, 9, 10], [-1.0, -2.0, -3.0, -4.0], [3, 4, 4, 4], 0.0, "length"),
        ],
        actor_id="a0",
        created_at=12.5,
        meta={"temperature": 0.7, "task": "gsm8k", "n": 3, "greedy": False},
    )


def test_staleness_num_tokens_and_coercion() -> None:
    g = _valid()
    assert g.completions[0].num_tokens == 3 and g.num_tokens == 7
    assert g.staleness(4) == 1 and g.staleness(10) == 7
    assert g.prompt_token_ids.dtype == np.uint32 and g.completions[1].logprobs.dtype == np.float32
    c = Completion(np.array([1]), np.array([-0.5]), np.array([2]), np.float32(0.5), "abort")
    g2 = Group("g", "p", [], [c], meta={"temperature": np.float32(0.5), "n": np.int64(4)})
    assert decode(encode(g2)) == g2 and g2.meta == {"temperature": 0.5, "n": 4}
    assert type(g2.meta["n"]) is int and type(c.reward) is float
    with pytest.raises(RecordError, match="token_ids: value out of uint32 range"):
        Completion([-1], [-0.1], [0], 0.0, "stop")
    with pytest.raises(RecordError, match="versions: expected integers"):
        Completion([1], [-0.1], [0.5], 0.0, "stop")


def _doc() -> dict:
    return msgpack.unpackb(encode(_valid()), raw=False)


def _pack(doc: dict) -> bytes:
    return msgpack.packb(doc, use_bin_type=True)


def _mutate(path: str, value: object) -> bytes:
    doc = _doc()
    target = doc
    *parents, last = path.split("/")
    for p in parents:
        target = target[int(p)] if isinstance(target, list) else target[p]
    if isinstance(target, list):
        target[int(last)] = value
    elif value is _DELETE:
        del target[last]
    else:
        target[last] = value
    return _pack(doc)


_DELETE = object()
f32 = np.dtype("<f4")
u4 = np.dtype("<u4")

MALFORMED = [
    ("not msgpack", b"\xc1\xc1\xc1", "record: not valid msgpack"),
    ("truncated", encode(_valid())[:-7], "record: not valid msgpack"),
    ("trailing bytes", encode(_valid()) + b"\x00", "record: not valid msgpack"),
    ("not a map", _pack([1, 2, 3]), "record: expected a map"),
    ("missing field", _mutate("group_id", _DELETE), "group_id: missing field"),
    (
        "missing completion field",
        _mutate("completions/1/reward", _DELETE),
        r"completions\[1\].reward: missing field",
    ),
    ("unknown field", _mutate("extra", 1), "record: unknown field 'extra'"),
    ("schema version", _mutate("schema", 2), "schema: unsupported schema version 2"),
    ("schema type", _mutate("schema", "1"), "schema: unsupported"),
    ("group_id type", _mutate("group_id", 5), "group_id: expected str"),
    ("empty group_id", _mutate("group_id", ""), "group_id: must not be empty"),
    ("prompt type", _mutate("prompt", [1, 2]), "prompt_token_ids: expected bytes"),
    ("prompt bytes", _mutate("prompt", b"\x00" * 5), "prompt_token_ids: 5 bytes is not a multiple of 4"),
    ("no completions", _mutate("completions", []), "completions: must be a non-empty list"),
    ("completions type", _mutate("completions", {"a": 1}), "completions: must be a non-empty list"),
    ("completion type", _mutate("completions/0", [1]), r"completions\[0\]: expected a map"),
    (
        "NaN logprob",
        _mutate("completions/1/logprobs", np.array([-1, -2, -3, np.nan], f32).tobytes()),
        r"completions\[1\].logprobs: non-finite value at 3",
    ),
    (
        "-inf logprob",
        _mutate("completions/0/logprobs", np.array([-np.inf, -1, -1], f32).tobytes()),
        r"completions\[0\].logprobs: non-finite value at 0",
    ),
    (
        "positive logprob",
        _mutate("completions/0/logprobs", np.array([-1, 0.5, -1], f32).tobytes()),
        r"completions\[0\].logprobs: positive value 0.5 at 1",
    ),
    (
        "length mismatch",
        _mutate("completions/1/versions", np.array([4, 4, 4], u4).tobytes()),
        r"completions\[1\].versions: length 3 != 4 token_ids",
    ),
    (
        "decreasing versions",
        _mutate("completions/1/versions", np.array([3, 4, 2, 4], u4).tobytes()),
        r"completions\[1\].versions: decreases at 2",
    ),
    ("bad finish reason", _mutate("completions/0/finish", "eos"), r"completions\[0\].finish_reason: 'eos'"),
    ("reward type", _mutate("completions/0/reward", "1.0"), r"completions\[0\].reward: expected a number"),
    ("reward bool", _mutate("completions/0/reward", True), r"completions\[0\].reward: expected a number"),
    ("reward NaN", _mutate("completions/0/reward", math.nan), r"completions\[0\].reward: must be finite"),
    # Finite in float64, inf in the fp32 step: refused with the bound named.
    (
        "reward past 1e9",
        _mutate("completions/0/reward", 1e39),
        r"completions\[0\].reward: 1e\+39 is beyond \+-1e\+09",
    ),
    (
        "reward past -1e9",
        _mutate("completions/0/reward", -1.5e9),
        r"completions\[0\].reward: -1.5e\+09 is beyond",
    ),
    (
        "sentinel logprob",
        _mutate("completions/0/logprobs", np.array([-1, -1e30, -1], f32).tobytes()),
        r"completions\[0\].logprobs: -1e\+30 at 1 is below -10000",
    ),
    ("created_at type", _mutate("created_at", None), "created_at: expected a number"),
    ("meta type", _mutate("meta", [1]), "meta: expected a map"),
    ("meta value", _mutate("meta", {"x": [1, 2]}), r"meta\['x'\]: expected str/int/float/bool"),
    ("meta nested", _mutate("meta", {"x": {"y": 1}}), r"meta\['x'\]: expected"),
    (
        "meta too many",
        _mutate("meta", {str(i): i for i in range(rec.MAX_META_ENTRIES + 1)}),
        "meta: more than",
    ),
    ("meta key long", _mutate("meta", {"k" * (rec.MAX_STR_LEN + 1): 1}), "meta key: longer than"),
    ("int map key", _pack({1: 2}), "record: not valid msgpack"),
    ("bad utf-8", b"\x81\xa1\xff\x01", "record: not valid msgpack"),
]


@pytest.mark.parametrize(("case", "data", "reason"), MALFORMED, ids=[m[0] for m in MALFORMED])
def test_malformed_rejected_with_field(case: str, data: bytes, reason: str) -> None:
    with pytest.raises(RecordError, match=reason):
        decode(data)


def test_error_is_value_error() -> None:
    assert issubclass(RecordError, ValueError)


@pytest.mark.parametrize(
    ("limit", "value", "reason_decode", "reason_encode"),
    [
        (
            "MAX_COMPLETIONS",
            1,
            "completions: 2 exceed the limit of 1",
            "completions: 2 exceed the limit of 1",
        ),
        (
            "MAX_COMPLETION_TOKENS",
            3,
            r"completions\[1\].token_ids: 4 elements exceed the limit of 3",
            r"completions\[1\].token_ids: 4 tokens exceed the limit of 3",
        ),
        (
            "MAX_PROMPT_TOKENS",
            1,
            "prompt_token_ids: 2 elements exceed the limit of 1",
            "prompt_token_ids: 2 tokens exceed the limit of 1",
        ),
        (
            "MAX_ENCODED_BYTES",
            100,
            r"record: \d+ bytes exceed the limit of 100",
            r"record: \d+ bytes exceed the limit of 100",
        ),
        ("MAX_META_ENTRIES", 2, "meta: more than 2 entries", "meta: more than 2 entries"),
    ],
)
def test_size_limits(
    monkeypatch: pytest.MonkeyPatch, limit: str, value: int, reason_decode: str, reason_encode: str
) -> None:
    data = encode(_valid())  # valid under the default limits
    assert decode(data) == _valid()
    monkeypatch.setattr(rec, limit, value)
    with pytest.raises(RecordError, match=reason_decode):
        decode(data)
    with pytest.raises(RecordError, match=reason_encode):
        encode(_valid())


@pytest.mark.parametrize(
    ("mutate", "reason"),
    [
        (
            lambda g: setattr(g.completions[1], "logprobs", np.array([-1, -1, np.nan, -1], np.float32)),
            r"completions\[1\].logprobs: non-finite value at 2",
        ),
        (lambda g: setattr(g, "completions", []), "completions: must be a non-empty list"),
        (lambda g: setattr(g.completions[0], "finish_reason", "done"), r"completions\[0\].finish_reason"),
        (
            lambda g: setattr(g.completions[0], "versions", np.array([5, 4, 6], np.uint32)),
            r"completions\[0\].versions: decreases at 1",
        ),
        (
            lambda g: setattr(g.completions[0], "token_ids", np.array([1, 2], np.uint32)),
            r"completions\[0\].logprobs: length 3 != 2",
        ),
        (
            lambda g: setattr(g.completions[0], "token_ids", np.array([1, 2, 3], np.int64)),
            r"completions\[0\].token_ids: expected a 1-D uint32 array",
        ),
        (lambda g: g.meta.update(bad=None), r"meta\['bad'\]"),
        (lambda g: g.meta.update({3: 1}), "meta key: expected str"),
        (lambda g: g.meta.update(big=2**64), r"meta\['big'\]: integer out of 64-bit range"),
    ],
)
def test_encode_validates(mutate, reason: str) -> None:
    g = _valid()
    mutate(g)
    with pytest.raises(RecordError, match=reason):
        encode(g)


# --------------------------------------------------------------------------- vectorized value check


@st.composite
def value_cases(draw: st.DrawFn) -> list[Completion]:
    """Completions whose values are valid or broken in the ways _check_values names: NaN, +-inf,
    positive logprobs, logprobs below -1e4 (and -1e4 itself, valid), a decreasing version inside one completion; and versions that drop from one
    completion to the next (legal), empty completions among them."""
    out = []
    for _ in range(draw(st.integers(1, 5))):
        n = draw(st.integers(0, 6))
        lp = draw(st.lists(st.sampled_from([-1.0, -0.0, 0.0, -1e-30, -80.0, 1e-30, 2.0, np.nan, np.inf,
                                            -np.inf, -1e4, -10001.0, -1e30]), min_size=n, max_size=n))  # fmt: skip
        v = draw(st.lists(st.integers(0, 5), min_size=n, max_size=n))
        if draw(st.booleans()):
            v = sorted(v)  # mostly monotone, so that the boundary masking is exercised
        out.append(Completion(token_ids=np.zeros(n, np.uint32), logprobs=np.array(lp, np.float32),
                              versions=np.array(v, np.uint32), reward=0.0, finish_reason="stop"))  # fmt: skip
    return out


def _reference_ok(completions: list[Completion]) -> bool:
    """The definition, one completion and one token at a time."""
    for c in completions:
        for i, x in enumerate(c.logprobs.tolist()):
            if not math.isfinite(x) or x > 0 or x < -1e4:
                return False
            if i and int(c.versions[i]) < int(c.versions[i - 1]):
                return False
    return True


@settings(max_examples=400, deadline=None)
@given(value_cases())
def test_group_value_check_matches_the_per_completion_definition(cs: list[Completion]) -> None:
    ok = _reference_ok(cs)
    assert rec._values_ok(cs) == ok
    g = _valid()
    g.completions = cs
    if ok:
        rec.validate(g)
    else:  # the slow path names the first offending completion and index
        with pytest.raises(RecordError, match=r"completions\[\d+\]\.(logprobs|versions): "):
            rec.validate(g)


def test_versions_may_drop_between_completions_but_not_inside_one() -> None:
    def comp(v: list[int]) -> Completion:
        n = len(v)
        return Completion(token_ids=np.zeros(n, np.uint32), logprobs=np.full(n, -1.0, np.float32),
                          versions=np.array(v, np.uint32), reward=0.0, finish_reason="stop")  # fmt: skip

    assert rec._values_ok([comp([5, 6]), comp([]), comp([1, 2]), comp([0])])
    assert not rec._values_ok([comp([5, 6]), comp([1, 0])])
    g = _valid()
    g.completions = [comp([5, 6]), comp([]), comp([2, 1])]
    with pytest.raises(RecordError, match=r"completions\[2\]\.versions: decreases at 1"):
        rec.validate(g)
