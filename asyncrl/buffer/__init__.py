"""Where actors and the learner meet: wire records, Redis layout, replay buffer, admission,
weight manifests, and an embedded redis-server. Imports neither torch, vllm nor ray."""

from asyncrl.buffer.admission import admission_bound_formula
from asyncrl.buffer.embedded import EmbeddedRedis, EmbeddedRedisError, find_redis_server
from asyncrl.buffer.layout import Keys, validate_run_name
from asyncrl.buffer.records import (
    FINISH_REASONS,
    MAX_COMPLETION_TOKENS,
    MAX_COMPLETIONS,
    MAX_ENCODED_BYTES,
    MAX_META_ENTRIES,
    MAX_PROMPT_TOKENS,
    SCHEMA_VERSION,
    Completion,
    Group,
    RecordError,
    decode,
    encode,
    validate,
)
from asyncrl.buffer.replay import Entry, ReplayBuffer
from asyncrl.buffer.subscription import VersionSubscription
from asyncrl.buffer.weights import (
    FileDigest,
    WeightIntegrityError,
    WeightManifest,
    WeightTransport,
    build_manifest,
    sha256_dir,
    sha256_file,
    verify,
)

__all__ = [
    "FINISH_REASONS",
    "MAX_COMPLETIONS",
    "MAX_COMPLETION_TOKENS",
    "MAX_ENCODED_BYTES",
    "MAX_META_ENTRIES",
    "MAX_PROMPT_TOKENS",
    "SCHEMA_VERSION",
    "Completion",
    "EmbeddedRedis",
    "EmbeddedRedisError",
    "Entry",
    "FileDigest",
    "Group",
    "Keys",
    "RecordError",
    "ReplayBuffer",
    "VersionSubscription",
    "WeightIntegrityError",
    "WeightManifest",
    "WeightTransport",
    "admission_bound_formula",
    "build_manifest",
    "decode",
    "encode",
    "find_redis_server",
    "sha256_dir",
    "sha256_file",
    "validate",
    "validate_run_name",
    "verify",
]
