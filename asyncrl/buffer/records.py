"""Wire records: the groups of completions that actors send to the learner.

This is the public format for anyone writing a custom actor. A :class:`Group` holds all
completions sampled for one prompt; each :class:`Completion` carries, per generated token,
the token id, the behaviour logprob ``mu_t`` (fp32, exactly as the engine produced it) and
the policy version ``v_t`` of the weights that sampled it.

On the wire a group is one msgpack map (never pickle: anything that can write to Redis must
not be able to run code in the learner). Numeric arrays travel as little-endian raw bytes.
:func:`encode` and :func:`decode` run the same strict validation, so a record that encodes
always decodes, and a record a buggy or hostile producer wrote is rejected with a
:class:`RecordError` whose message starts with the offending field.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np

__all__ = [
    "SCHEMA_VERSION",
    "FINISH_REASONS",
    "MAX_COMPLETIONS",
    "MAX_COMPLETION_TOKENS",
    "MAX_PROMPT_TOKENS",
    "MAX_META_ENTRIES",
    "MAX_STR_LEN",
    "MAX_ENCODED_BYTES",
    "LOGPROB_MIN",
    "REWARD_ABS_MAX",
    "RecordError",
    "Completion",
    "Group",
    "MetaValue",
    "encode",
    "decode",
    "validate",
]

#: Bumped on any incompatible change of the wire layout; decode rejects other versions.
SCHEMA_VERSION = 1
FINISH_REASONS = frozenset({"stop", "length", "abort"})

# Size limits. They bound the memory one record can make the learner allocate; the byte
# limit is checked before unpacking, the others before any array is built.
MAX_COMPLETIONS = 1024
MAX_COMPLETION_TOKENS = 262_144
MAX_PROMPT_TOKENS = 262_144
MAX_META_ENTRIES = 64
MAX_STR_LEN = 4096  # ids, meta keys and meta string values
MAX_ENCODED_BYTES = 128 * 1024 * 1024

# Value bounds: numbers finite in float64 that still break an fp32 step. A sampled token's logprob
# from fp32 logits is >= ~-104 (a probability below fp32's smallest subnormal is never sampled);
# -1e4 leaves room for raw (untempered) logprobs and rejects an engine's "masked" sentinel (-1e30,
# finfo.min), whose k2 rollout-KL is inf. A reward past 1e9 overflows fp32 in the advantages
# (1e39 is finite in float64, inf in fp32) or in the loss; it is a producer bug, not a scale.
LOGPROB_MIN = -1e4
REWARD_ABS_MAX = 1e9

MetaValue = str | int | float | bool

# In-memory arrays are native; the wire is little-endian whatever the host is.
_U32 = np.dtype(np.uint32)
_F32 = np.dtype(np.float32)
_WIRE_U32 = np.dtype("<u4")
_WIRE_F32 = np.dtype("<f4")
_GROUP_FIELDS = frozenset(
    {"schema", "group_id", "prompt_id", "prompt", "completions", "actor_id", "created_at", "meta"}
)
_COMPLETION_FIELDS = frozenset({"tokens", "logprobs", "versions", "reward", "finish"})


class RecordError(ValueError):
    """A record violates the wire schema. The message starts with the field path."""


def _as_array(value: Any, dtype: np.dtype, name: str) -> np.ndarray:
    """Coerce a list/array to a 1-D native array of ``dtype`` without silent wrap-around."""
    if isinstance(value, np.ndarray) and value.dtype == dtype and value.ndim == 1:
        return value
    arr = np.asarray(value)
    if arr.ndim != 1:
        raise RecordError(f"{name}: expected a 1-D sequence, got shape {arr.shape}")
    if arr.size == 0:
        return np.zeros(0, dtype=dtype)
    if dtype.kind == "u":
        if arr.dtype.kind not in "iu":
            raise RecordError(f"{name}: expected integers, got dtype {arr.dtype}")
        if int(arr.min()) < 0 or int(arr.max()) > np.iinfo(np.uint32).max:
            raise RecordError(f"{name}: value out of uint32 range")
    elif arr.dtype.kind not in "fiu":
        raise RecordError(f"{name}: expected numbers, got dtype {arr.dtype}")
    return arr.astype(dtype)


@dataclass(eq=False)
class Completion:
    """One sampled completion. Arrays are aligned: index t describes generated token t."""

    token_ids: np.ndarray  # uint32, generated tokens only (no prompt)
    logprobs: np.ndarray  # float32 behaviour logprobs mu_t, in [LOGPROB_MIN, 0]
    versions: np.ndarray  # uint32 policy version v_t per token, non-decreasing
    reward: float
    finish_reason: str  # one of FINISH_REASONS

    def __post_init__(self) -> None:
        if isinstance(self.reward, np.generic):  # numpy scalars from reward functions
            self.reward = self.reward.item()
        self.token_ids = _as_array(self.token_ids, _U32, "token_ids")
        self.logprobs = _as_array(self.logprobs, _F32, "logprobs")
        self.versions = _as_array(self.versions, _U32, "versions")

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Completion):
            return NotImplemented
        return (
            np.array_equal(self.token_ids, other.token_ids)
            and np.array_equal(self.logprobs, other.logprobs)
            and np.array_equal(self.versions, other.versions)
            and self.reward == other.reward
            and self.finish_reason == other.finish_reason
        )


@dataclass(eq=False)
class Group:
    """All completions sampled for one prompt: the unit of the buffer and of GRPO advantages."""

    group_id: str
    prompt_id: str
    prompt_token_ids: np.ndarray  # uint32
    completions: list[Completion]
    actor_id: str = ""
    created_at: float = field(default_factory=time.time)
    meta: dict[str, MetaValue] = field(default_factory=dict)  # small str -> scalar map

    def __post_init__(self) -> None:
        self.prompt_token_ids = _as_array(self.prompt_token_ids, _U32, "prompt_token_ids")
        self.completions = list(self.completions)
        if isinstance(self.meta, dict):  # numpy scalars -> Python scalars msgpack can carry
            self.meta = {k: v.item() if isinstance(v, np.generic) else v for k, v in self.meta.items()}

    @property
    def num_tokens(self) -> int:
        """Generated tokens over all completions."""
        return sum(c.num_tokens for c in self.completions)

    def min_version(self) -> int | None:
        """Oldest policy version that sampled any token, or None if there are no tokens."""
        mins = [int(c.versions.min()) for c in self.completions if c.num_tokens]
        return min(mins) if mins else None

    def staleness(self, version: int) -> int:
        """max over tokens of ``version - v_t``; 0 for a group without tokens."""
        oldest = self.min_version()
        return 0 if oldest is None else int(version) - oldest

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Group):
            return NotImplemented
        return (
            self.group_id == other.group_id
            and self.prompt_id == other.prompt_id
            and np.array_equal(self.prompt_token_ids, other.prompt_token_ids)
            and self.completions == other.completions
            and self.actor_id == other.actor_id
            and self.created_at == other.created_at
            and self.meta == other.meta
        )


# --------------------------------------------------------------------------- validation


def _check_str(value: Any, name: str, *, nonempty: bool = False) -> str:
    if not isinstance(value, str):
        raise RecordError(f"{name}: expected str, got {type(value).__name__}")
    if len(value) > MAX_STR_LEN:
        raise RecordError(f"{name}: longer than {MAX_STR_LEN} characters")
    if nonempty and not value:
        raise RecordError(f"{name}: must not be empty")
    return value


def _check_float(value: Any, name: str) -> float:
    # bool is an int subclass; a bool where a number belongs is a producer bug.
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise RecordError(f"{name}: expected a number, got {type(value).__name__}")
    value = float(value)
    if not math.isfinite(value):
        raise RecordError(f"{name}: must be finite, got {value}")
    return value


def _check_reward(value: Any, name: str) -> float:
    value = _check_float(value, name)
    if abs(value) > REWARD_ABS_MAX:
        raise RecordError(f"{name}: {value:g} is beyond +-{REWARD_ABS_MAX:g} (overflows the fp32 step)")
    return value


def _check_meta(meta: Any) -> None:
    if not isinstance(meta, dict):
        raise RecordError(f"meta: expected a map, got {type(meta).__name__}")
    if len(meta) > MAX_META_ENTRIES:
        raise RecordError(f"meta: more than {MAX_META_ENTRIES} entries ({len(meta)})")
    for key, value in meta.items():
        _check_str(key, "meta key")
        name = f"meta[{key!r}]"
        if isinstance(value, str):
            _check_str(value, name)
        elif isinstance(value, int):  # includes bool
            if not -(2**63) <= value < 2**64:
                raise RecordError(f"{name}: integer out of 64-bit range")
        elif not isinstance(value, float):
            raise RecordError(f"{name}: expected str/int/float/bool, got {type(value).__name__}")


def _check_completion(c: Any, name: str) -> None:
    """Types, shapes, reward and finish reason of one completion; its values: :func:`_check_values`."""
    if not isinstance(c, Completion):
        raise RecordError(f"{name}: expected Completion, got {type(c).__name__}")
    arrays = (
        ("token_ids", c.token_ids, _U32),
        ("logprobs", c.logprobs, _F32),
        ("versions", c.versions, _U32),
    )
    for attr, arr, dtype in arrays:
        if not isinstance(arr, np.ndarray) or arr.ndim != 1 or arr.dtype != dtype:
            raise RecordError(f"{name}.{attr}: expected a 1-D {dtype.name} array")
    n = c.token_ids.shape[0]
    if n > MAX_COMPLETION_TOKENS:
        raise RecordError(f"{name}.token_ids: {n} tokens exceed the limit of {MAX_COMPLETION_TOKENS}")
    for attr, arr, _ in arrays[1:]:
        if arr.shape[0] != n:
            raise RecordError(f"{name}.{attr}: length {arr.shape[0]} != {n} token_ids")
    _check_reward(c.reward, f"{name}.reward")
    if not isinstance(c.finish_reason, str) or c.finish_reason not in FINISH_REASONS:
        raise RecordError(f"{name}.finish_reason: {c.finish_reason!r} not in {sorted(FINISH_REASONS)}")


def _check_values(c: Completion, name: str) -> None:
    """Finite, non-positive logprobs; versions that never decrease (weights only move forward while
    a request is in flight). Raises with the first offending index."""
    bad = np.flatnonzero(~np.isfinite(c.logprobs))
    if bad.size:
        raise RecordError(f"{name}.logprobs: non-finite value at {int(bad[0])}")
    bad = np.flatnonzero(c.logprobs > 0)
    if bad.size:
        raise RecordError(f"{name}.logprobs: positive value {float(c.logprobs[bad[0]])} at {int(bad[0])}")
    bad = np.flatnonzero(c.logprobs < LOGPROB_MIN)
    if bad.size:
        raise RecordError(
            f"{name}.logprobs: {float(c.logprobs[bad[0]]):g} at {int(bad[0])} is below {LOGPROB_MIN:g} (no sampled "
            "token is that unlikely: a sentinel, not a logprob)"
        )
    bad = np.flatnonzero(c.versions[1:] < c.versions[:-1])
    if bad.size:
        raise RecordError(f"{name}.versions: decreases at {int(bad[0]) + 1}")


def _values_ok(completions: list[Completion]) -> bool:
    """:func:`_check_values` of every completion at once, without the indices: a few reductions over
    the group's concatenated arrays (every record is validated twice, at put and at read, and the
    per-completion index searches were most of the codec's time). NaN and -inf fail the range test."""
    lp = np.concatenate([c.logprobs for c in completions])
    if not ((lp >= LOGPROB_MIN) & (lp <= 0)).all():  # NaN compares False: refused too
        return False
    v = np.concatenate([c.versions for c in completions])
    if v.size < 2:
        return True
    up = v[1:] >= v[:-1]
    # A completion may start below the previous one's last version: its first pair is not compared.
    starts = np.cumsum([c.versions.shape[0] for c in completions])[:-1]
    up[starts[(starts > 0) & (starts < v.size)] - 1] = True
    return bool(up.all())


def validate(group: Group) -> None:
    """Raise :class:`RecordError` unless ``group`` satisfies every wire invariant."""
    if not isinstance(group, Group):
        raise RecordError(f"group: expected Group, got {type(group).__name__}")
    _check_str(group.group_id, "group_id", nonempty=True)
    _check_str(group.prompt_id, "prompt_id")
    _check_str(group.actor_id, "actor_id")
    _check_float(group.created_at, "created_at")
    p = group.prompt_token_ids
    if not isinstance(p, np.ndarray) or p.ndim != 1 or p.dtype != _U32:
        raise RecordError("prompt_token_ids: expected a 1-D uint32 array")
    if p.shape[0] > MAX_PROMPT_TOKENS:
        raise RecordError(f"prompt_token_ids: {p.shape[0]} tokens exceed the limit of {MAX_PROMPT_TOKENS}")
    if not isinstance(group.completions, list) or not group.completions:
        raise RecordError("completions: must be a non-empty list")
    if len(group.completions) > MAX_COMPLETIONS:
        raise RecordError(f"completions: {len(group.completions)} exceed the limit of {MAX_COMPLETIONS}")
    for i, c in enumerate(group.completions):
        _check_completion(c, f"completions[{i}]")
    if not _values_ok(group.completions):
        for i, c in enumerate(group.completions):
            _check_values(c, f"completions[{i}]")
        raise AssertionError("_values_ok and _check_values disagree")  # unreachable by construction
    _check_meta(group.meta)


# --------------------------------------------------------------------------- codec


def encode(group: Group) -> bytes:
    """Validate and serialise ``group`` to msgpack bytes."""
    validate(group)
    doc = {
        "schema": SCHEMA_VERSION,
        "group_id": group.group_id,
        "prompt_id": group.prompt_id,
        "prompt": group.prompt_token_ids.astype(_WIRE_U32, copy=False).tobytes(),
        "completions": [
            {
                "tokens": c.token_ids.astype(_WIRE_U32, copy=False).tobytes(),
                "logprobs": c.logprobs.astype(_WIRE_F32, copy=False).tobytes(),
                "versions": c.versions.astype(_WIRE_U32, copy=False).tobytes(),
                "reward": float(c.reward),
                "finish": c.finish_reason,
            }
            for c in group.completions
        ],
        "actor_id": group.actor_id,
        "created_at": float(group.created_at),
        "meta": dict(group.meta),
    }
    data = msgpack.packb(doc, use_bin_type=True)
    if len(data) > MAX_ENCODED_BYTES:
        raise RecordError(f"record: {len(data)} bytes exceed the limit of {MAX_ENCODED_BYTES}")
    return data


def _fields(doc: Any, name: str, expected: frozenset[str]) -> dict[str, Any]:
    if not isinstance(doc, dict):
        raise RecordError(f"{name}: expected a map, got {type(doc).__name__}")
    missing = sorted(expected - doc.keys())
    if missing:
        raise RecordError(f"{name + '.' if name != 'record' else ''}{missing[0]}: missing field")
    unknown = sorted(str(k) for k in doc.keys() - expected)
    if unknown:
        raise RecordError(f"{name}: unknown field {unknown[0]!r}")
    return doc


def _array(raw: Any, wire: np.dtype, native: np.dtype, name: str, limit: int) -> np.ndarray:
    if not isinstance(raw, bytes):
        raise RecordError(f"{name}: expected bytes, got {type(raw).__name__}")
    if len(raw) % wire.itemsize:
        raise RecordError(f"{name}: {len(raw)} bytes is not a multiple of {wire.itemsize}")
    if len(raw) // wire.itemsize > limit:
        raise RecordError(f"{name}: {len(raw) // wire.itemsize} elements exceed the limit of {limit}")
    # Copy into a native, writable array that does not pin the msgpack buffer.
    return np.frombuffer(raw, dtype=wire).astype(native)


def decode(data: bytes) -> Group:
    """Parse and validate msgpack bytes produced by :func:`encode` (or a foreign producer)."""
    if not isinstance(data, bytes | bytearray | memoryview):
        raise RecordError(f"record: expected bytes, got {type(data).__name__}")
    if len(data) > MAX_ENCODED_BYTES:
        raise RecordError(f"record: {len(data)} bytes exceed the limit of {MAX_ENCODED_BYTES}")
    try:
        doc = msgpack.unpackb(data, raw=False, strict_map_key=True, use_list=True)
    except Exception as exc:  # msgpack raises several unrelated types for bad input
        raise RecordError(f"record: not valid msgpack ({type(exc).__name__}: {exc})") from None
    doc = _fields(doc, "record", _GROUP_FIELDS)
    schema = doc["schema"]
    if schema != SCHEMA_VERSION or isinstance(schema, bool):
        raise RecordError(f"schema: unsupported schema version {schema!r} (expected {SCHEMA_VERSION})")
    raw_completions = doc["completions"]
    if not isinstance(raw_completions, list) or not raw_completions:
        raise RecordError("completions: must be a non-empty list")
    if len(raw_completions) > MAX_COMPLETIONS:
        raise RecordError(f"completions: {len(raw_completions)} exceed the limit of {MAX_COMPLETIONS}")
    completions = []
    for i, rc in enumerate(raw_completions):
        name = f"completions[{i}]"
        rc = _fields(rc, name, _COMPLETION_FIELDS)
        lim = MAX_COMPLETION_TOKENS
        completions.append(
            Completion(
                token_ids=_array(rc["tokens"], _WIRE_U32, _U32, f"{name}.token_ids", lim),
                logprobs=_array(rc["logprobs"], _WIRE_F32, _F32, f"{name}.logprobs", lim),
                versions=_array(rc["versions"], _WIRE_U32, _U32, f"{name}.versions", lim),
                reward=_check_reward(rc["reward"], f"{name}.reward"),
                finish_reason=rc["finish"],
            )
        )
    group = Group(
        group_id=doc["group_id"],
        prompt_id=doc["prompt_id"],
        prompt_token_ids=_array(doc["prompt"], _WIRE_U32, _U32, "prompt_token_ids", MAX_PROMPT_TOKENS),
        completions=completions,
        actor_id=doc["actor_id"],
        created_at=_check_float(doc["created_at"], "created_at"),
        meta=doc["meta"],
    )
    validate(group)
    return group
