"""The one configuration schema of asyncrl.

Typed dataclasses turned into an OmegaConf structured config. Every field carries its documentation
and its allowed range in ``field(metadata=...)`` so that ``asyncrl config --explain`` can print it and
``load_config`` can reject a bad value at start-up with the full key path and what is allowed.

Modules: ``fields`` (the ``F`` helper, ``ConfigError``), ``sections`` (run, redis, ray, model, task,
eval, tracking, console, metrics), ``actors`` (actors, buffer, adaptive staleness), ``learner`` (loss,
learner), ``checks`` (checks across fields at load; model and data files before a role starts),
``loading`` (the root ``Config``, validation, ``load_config``, YAML, ``explain``); every name is
re-exported here, so ``from asyncrl.config import X`` is the one way to import them.

Invariant: this package imports neither torch, vllm nor ray (the CLI and the buffer read it in
processes that must start fast and that may not have those installed).
"""

from __future__ import annotations

from .actors import ActorsConfig, AdaptiveStalenessConfig, BufferConfig
from .checks import REDIS_SCHEMES, check_config, check_data_paths, check_model_dir
from .fields import CONFIG_DIR, ConfigError, F, _copy
from .learner import KL_LOSS_KINDS, OBJECTIVE_AT_DEFAULTS, LearnerConfig, LossConfig, _check_loss
from .loading import (
    Config,
    _allowed_keys,
    _validate,
    _validate_task_name,
    explain,
    from_yaml,
    load_config,
    run_dir,
    to_yaml,
    validate_loss,
)
from .sections import (
    ConsoleConfig,
    EvalConfig,
    MetricsConfig,
    ModelConfig,
    RayConfig,
    RedisConfig,
    RunConfig,
    TaskConfig,
    TinyModelConfig,
    TrackingConfig,
)

__all__ = [
    "CONFIG_DIR",
    "REDIS_SCHEMES",
    "check_config",
    "check_data_paths",
    "check_model_dir",
    "ConfigError",
    "F",
    "_copy",
    "RunConfig",
    "RedisConfig",
    "RayConfig",
    "TinyModelConfig",
    "ModelConfig",
    "TaskConfig",
    "EvalConfig",
    "TrackingConfig",
    "ConsoleConfig",
    "MetricsConfig",
    "ActorsConfig",
    "AdaptiveStalenessConfig",
    "BufferConfig",
    "KL_LOSS_KINDS",
    "OBJECTIVE_AT_DEFAULTS",
    "LossConfig",
    "_check_loss",
    "LearnerConfig",
    "validate_loss",
    "Config",
    "_validate",
    "_validate_task_name",
    "load_config",
    "_allowed_keys",
    "to_yaml",
    "from_yaml",
    "run_dir",
    "explain",
]
