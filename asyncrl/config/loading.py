"""The root ``Config``, its validation, loading with overrides, YAML and ``--explain``.

Part of :mod:`asyncrl.config` (imports neither torch, vllm nor ray)."""

from __future__ import annotations

import dataclasses
import functools
import math
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException

from .actors import ActorsConfig, BufferConfig
from .checks import check_config, validate_task_name
from .fields import CONFIG_DIR, ConfigError, F
from .learner import LearnerConfig, LossConfig, _check_loss
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


def validate_config(cfg: Config) -> None:
    """The value and cross-field checks of :func:`load_config` on a loaded ``cfg`` (ConfigError)."""
    _validate(cfg, "")


def validate_loss(lc: LossConfig, prefix: str = "learner.loss.") -> None:
    """Validate a LossConfig exactly as load_config does (the objective's config uses it too)."""
    _validate(lc, prefix)


@dataclass
class Config:
    run: RunConfig = F(RunConfig(), "Run identity and budget.")
    redis: RedisConfig = F(RedisConfig(), "Where the replay buffer lives.")
    ray: RayConfig = F(RayConfig(), "Where the actors run.")
    model: ModelConfig = F(ModelConfig(), "Policy model.")
    task: TaskConfig = F(TaskConfig(), "Prompts and reward.")
    actors: ActorsConfig = F(ActorsConfig(), "vLLM actor pool.")
    buffer: BufferConfig = F(BufferConfig(), "Replay buffer and staleness bound.")
    learner: LearnerConfig = F(LearnerConfig(), "DeepSpeed learner.")
    metrics: MetricsConfig = F(MetricsConfig(), "Prometheus endpoints.")
    eval: EvalConfig = F(EvalConfig(), "Periodic evaluation on the task's eval split.")
    tracking: TrackingConfig = F(TrackingConfig(), "Experiment tracking (TensorBoard, Weights & Biases).")
    console: ConsoleConfig = F(ConsoleConfig(), "What `asyncrl run` shows on the terminal.")


_YAML_BOOL_WORDS = {"True": ("on", "yes", "true", "y"), "False": ("off", "no", "false", "n")}


def _validate(obj: Any, prefix: str) -> None:
    if isinstance(obj, LossConfig):
        _check_loss(obj, prefix)
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        key = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(value):
            _validate(value, key + ".")
            continue
        m = f.metadata
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{key}={value!r} must be a finite number")
        # YAML 1.1 reads a bare on/off/yes/no as a boolean, which a str field then holds as "True"/"False"
        # (a YAML file: appendfsync: no); map it back to the word among the allowed values.
        if m.get("choices") is not None and value in _YAML_BOOL_WORDS:
            word = next((w for w in _YAML_BOOL_WORDS[value] if w in m["choices"]), None)
            if word is not None:
                value = word
                setattr(obj, f.name, value)
        if m.get("choices") is not None and value not in m["choices"]:
            raise ConfigError(
                f"{key}={value!r} is not allowed; allowed values: {', '.join(map(repr, m['choices']))}"
            )
        for op, ok, word in (("ge", lambda a, b: a >= b, ">="), ("gt", lambda a, b: a > b, ">"),
                             ("le", lambda a, b: a <= b, "<="), ("lt", lambda a, b: a < b, "<")):  # fmt: skip
            bound = m.get(op)
            if bound is not None and not ok(value, bound):
                raise ConfigError(f"{key}={value!r} is out of range; must be {word} {bound}")
    if isinstance(obj, BufferConfig) and obj.adaptive.min_bound > obj.max_staleness:
        raise ConfigError(
            f"{prefix}adaptive.min_bound={obj.adaptive.min_bound} must be <= {prefix}max_staleness={obj.max_staleness}"
        )
    if isinstance(obj, BufferConfig) and obj.adaptive.enabled and obj.adaptive.start >= 0:
        a = obj.adaptive
        if not a.min_bound <= a.start <= obj.max_staleness:
            # The controller clamped it silently: the run started at another bound than configured.
            raise ConfigError(
                f"{prefix}adaptive.start={a.start} must be in [{prefix}adaptive.min_bound={a.min_bound}, "
                f"{prefix}max_staleness={obj.max_staleness}], or -1 (= max_staleness)"
            )
    if (
        isinstance(obj, Config)
        and obj.learner.weight_transport == "nccl"
        and not obj.actors.num_gpus_per_actor
    ):
        raise ConfigError(
            "learner.weight_transport='nccl' needs CUDA actors (actors.num_gpus_per_actor > 0); "
            "for CPU actors the allowed values are 'auto', 'file', 'shm'"
        )
    if isinstance(obj, Config) and obj.actors.swap_min_lag > 1:
        lag, eta = obj.actors.swap_min_lag, obj.buffer.max_staleness
        if lag > max(1, eta):
            raise ConfigError(
                f"actors.swap_min_lag={lag} must be <= max(1, buffer.max_staleness={eta}): weights that far "
                "behind could start no group the bound lets through"
            )
        if obj.learner.weight_transport == "nccl" or obj.learner.publish_policy == "taken":
            raise ConfigError(
                f"actors.swap_min_lag={lag} needs learner.publish_policy='steps' and learner.weight_transport "
                "in 'auto', 'file', 'shm' (with nccl or taken the learner drives the swaps); use 1"
            )
    if isinstance(obj, LearnerConfig) and obj.publish_policy == "taken":
        if obj.publish_every != 1:
            raise ConfigError(
                f"{prefix}publish_policy='taken' decides every step itself: {prefix}publish_every must be 1 "
                f"(got {obj.publish_every}); or use {prefix}publish_policy='steps'"
            )
        if obj.mini_batches * obj.epochs > 1 and not obj.exact_prox:
            raise ConfigError(
                f"{prefix}publish_policy='taken' with {prefix}mini_batches * {prefix}epochs > 1 needs "
                f"{prefix}exact_prox=true (A-3PO assumes a fixed number of steps per version)"
            )
    if isinstance(obj, TinyModelConfig):
        if obj.hidden_size % obj.num_heads or obj.hidden_size // obj.num_heads < 32:
            raise ConfigError(
                f"{prefix}hidden_size / {prefix}num_heads must be an integer >= 32 "
                f"(vLLM CPU attention); got {obj.hidden_size}/{obj.num_heads}"
            )
        if obj.num_heads % obj.num_kv_heads:
            raise ConfigError(f"{prefix}num_heads must be a multiple of {prefix}num_kv_heads")
    if isinstance(obj, TaskConfig):
        # asyncrl.tasks never imports asyncrl.config. One entry-point scan for both checks below.
        from asyncrl.tasks.registry import check_task_config, registered_entry_points

        registered = registered_entry_points()
        _validate_task_name(obj.name, f"{prefix}name", registered)
        # A built-in name shadowed by an installed plug-in, or data keys a tiny task would ignore: at
        # load, not at actor start (entry-point metadata only; no plug-in is imported here).
        check_task_config(obj, prefix, registered)
    if isinstance(obj, Config):
        check_config(obj)


_validate_task_name = validate_task_name  # its old name, re-exported by asyncrl.config


def load_config(
    path: str | Path | None = None, overrides: list[str] | None = None, validate: bool = True
) -> Config:
    """Load ``path`` (default ``configs/default.yaml``) merged with dotlist overrides.

    ``validate=False`` skips the value and cross-field checks (types and unknown keys still fail): for
    reading a finished run's saved config (asyncrl.export), which passed the checks of its day.

    Raises ``ConfigError`` naming the full key path for unknown keys, wrong types and out-of-range values.
    """
    if path is None:
        path = CONFIG_DIR / "default.yaml"
        if not path.exists():
            # configs/ lives in the source tree, not in an installed wheel: falling back to the schema
            # defaults silently would run a different demo from the one the README describes.
            raise ConfigError(
                f"no config given and the default config {path} is missing (a non-editable install does "
                "not ship configs/): pass --config FILE (e.g. the repository's configs/default.yaml)"
            )
    p = Path(path)
    if not p.exists():
        raise ConfigError(f"config file not found: {p}")
    for item in overrides or []:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like key.path=value")
    try:
        loaded = OmegaConf.load(p)
    except (yaml.YAMLError, UnicodeDecodeError) as e:  # a tab, a duplicate key, a binary file
        raise ConfigError(f"{p}: not a valid YAML file: {_yaml_problem(e)}") from None
    if not isinstance(loaded, DictConfig):
        raise ConfigError(
            f"{p}: the top level must be a mapping of sections (run:, actors:, ...), not a list"
        )
    try:
        merged = OmegaConf.merge(OmegaConf.structured(Config), _keep_str_text(loaded, p))
    except (ConfigKeyError, ConfigAttributeError) as e:
        raise _unknown_key(e) from None
    except OmegaConfBaseException as e:
        where = ": ".join(str(w) for w in (p, getattr(e, "full_key", None)) if w)
        raise ConfigError(f"{where}: {_first_line(e)}") from None
    for item in overrides or []:
        _apply_override(merged, item)
    cfg: Config = OmegaConf.to_object(merged)  # type: ignore[assignment]
    if validate:
        _validate(cfg, "")
    return cfg


def _omegaconf_yaml_loader() -> Any:
    """The YAML loader OmegaConf reads files with: it types more plain scalars than PyYAML's SafeLoader
    (``1e3`` is a float to it, a str to SafeLoader), and a scalar is re-typed exactly when OmegaConf's
    loader types it. Private in omegaconf (``omegaconf._yaml``, earlier ``omegaconf._utils``): SafeLoader
    when neither is there."""
    for module in ("omegaconf._yaml", "omegaconf._utils"):
        try:
            return __import__(module, fromlist=["get_yaml_loader"]).get_yaml_loader()
        except (ImportError, AttributeError):
            continue
    return yaml.SafeLoader


def _keep_str_text(loaded: Any, path: Path) -> Any:
    """``loaded`` (the file as OmegaConf read it) with each plain (unquoted) scalar of a ``str`` field
    set back to its text in the file. YAML types a bare ``007`` as 7, ``1e3`` as 1000.0 and ``yes`` as
    True, which a str field then holds as '7', '1000.0', 'True': a run named 007 would run as 7
    (another run dir, other Redis keys). The same rule as a ``key=value`` override (_apply_override);
    a quoted scalar is taken as YAML reads it, and a null stays null (the schema judges it)."""
    try:
        root = yaml.compose(path.read_text(), Loader=_omegaconf_yaml_loader())
    except yaml.YAMLError:
        return loaded  # OmegaConf read it; its own errors stand

    def walk(node: Any, prefix: str) -> None:
        if not isinstance(node, yaml.MappingNode):
            return
        for knode, vnode in node.value:
            if not isinstance(knode, yaml.ScalarNode):
                continue
            key = f"{prefix}{knode.value}"
            tp = _field_type(key)
            if dataclasses.is_dataclass(tp):
                walk(vnode, key + ".")
            # A plain scalar's style is None or '' (by loader); quoted ones are ' or ", blocks | or >.
            elif (tp is str and isinstance(vnode, yaml.ScalarNode) and not vnode.style
                  and vnode.tag not in ("tag:yaml.org,2002:str", "tag:yaml.org,2002:null")):  # fmt: skip
                OmegaConf.update(loaded, key, vnode.value, merge=True)

    walk(root, "")
    return loaded


def _apply_override(merged: DictConfig, item: str) -> None:
    """One ``key=value`` onto the merged config; the errors name the override's key."""
    key, _, raw = item.partition("=")
    tp = _field_type(key)
    try:
        if tp is str and not (len(raw) >= 2 and raw[0] == raw[-1] and raw[0] in "'\""):
            # The raw text: YAML would read 0123 as 83, 1e3 as 1000.0 and on/no/yes as booleans, which
            # a str field then holds as '83', '1000.0', 'True'. A quoted value still goes through YAML.
            OmegaConf.update(merged, key, raw, merge=True)
        else:
            merged.merge_with_dotlist([item])
    except (ConfigKeyError, ConfigAttributeError) as e:
        raise _unknown_key(e) from None
    except yaml.YAMLError as e:  # a value that is not YAML ('[0,,1]'): OmegaConf lets the parser's error out
        raise ConfigError(f"{key}={raw!r}: not a YAML value: {_first_line(e)}") from None
    except OmegaConfBaseException as e:
        if dataclasses.is_dataclass(tp):
            raise ConfigError(
                f"{key}={raw!r}: {key} is a section, not a value; set its keys ({key}.KEY=VALUE), "
                f"allowed keys: {', '.join(_allowed_keys(key))}"
            ) from None
        raise ConfigError(f"{getattr(e, 'full_key', None) or key}={raw!r}: {_first_line(e)}") from None


def _unknown_key(e: OmegaConfBaseException) -> ConfigError:
    key = getattr(e, "full_key", None) or str(e)
    parent = key.rsplit(".", 1)[0] if "." in key else ""
    allowed = _allowed_keys(parent)
    return ConfigError(f"unknown config key {key!r}; allowed keys here: {', '.join(allowed)}")


def _yaml_problem(e: Exception) -> str:
    """What is wrong and where (PyYAML's first message line is only its context, "while scanning...")."""
    mark = getattr(e, "problem_mark", None)
    problem = getattr(e, "problem", None)
    if problem and mark is not None:
        return f"{problem} (line {mark.line + 1}, column {mark.column + 1})"
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__


def _first_line(e: OmegaConfBaseException) -> str:
    # OmegaConf appends full_key/object_type lines to its messages; the key is named by the caller.
    msg = getattr(e, "msg", None) or str(e)
    return str(msg).splitlines()[0] if str(msg).strip() else type(e).__name__


@functools.cache
def _field_type(key: str) -> Any:
    """The schema type of ``key`` (``str``, ``int``, a section's class...), None when it names no field."""
    node: Any = Config
    for part in key.split("."):
        if not (isinstance(node, type) and dataclasses.is_dataclass(node)):
            return None  # inside a dict field (task.params) or past a leaf
        node = typing.get_type_hints(node).get(part)
        if node is None:
            return None
    return node


def _allowed_keys(parent: str) -> list[str]:
    node: Any = Config()
    for part in [p for p in parent.split(".") if p]:
        node = getattr(node, part, None)
        if not dataclasses.is_dataclass(node):
            node = Config()
            break
    return [f.name for f in dataclasses.fields(node)]


def to_yaml(cfg: Config) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def from_yaml(text: str) -> Config:
    merged = OmegaConf.merge(OmegaConf.structured(Config), OmegaConf.create(text))
    cfg: Config = OmegaConf.to_object(merged)  # type: ignore[assignment]
    _validate(cfg, "")
    return cfg


def run_dir(cfg: Config) -> Path:
    return Path(cfg.run.dir) if cfg.run.dir else Path("runs") / cfg.run.name


def explain(obj: Any = None, prefix: str = "") -> list[str]:
    """One line per field: key, default, allowed values and documentation."""
    obj = obj if obj is not None else Config()
    lines = []
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        key = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(value):
            lines.append(f"{key}: {f.metadata['doc']}")
            lines.extend(explain(value, key + "."))
            continue
        m = f.metadata
        rng = ""
        if m.get("choices"):
            rng = " {" + "|".join(map(str, m["choices"])) + "}"
        for op, word in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<")):
            if m.get(op) is not None:
                rng += f" {word}{m[op]}"
        lines.append(f"  {key} = {value!r}{rng}  # {m['doc']}")
    return lines
