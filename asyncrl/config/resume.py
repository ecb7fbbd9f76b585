"""Resuming a run dir with a changed config: which keys define the run, and the check made before the run
dir is touched.

A run dir keeps the config it was started with (``config.yaml``, password redacted). Its checkpoints,
weights, buffer (embedded Redis) and ``model/`` only mean something under the keys that made them: a
resume under another ``actors.group_size`` mixes groups of two sizes in one curve, another ``run.seed``
rebuilds ``model/`` (the reference model and version 0) with other weights, another model shape dies in
the checkpoint's state_dict load. :func:`check_resume` compares the new config with the saved one before
anything in the run dir changes (before ``config.yaml`` is rewritten and before the model is resolved),
refuses identity changes in one line naming each key with both values, and returns the accepted changes
(one line per key) for the caller to log. Every role that resumes calls it: ``asyncrl run``
(asyncrl.orchestrator), ``asyncrl learn`` and ``asyncrl serve-actors`` (asyncrl.cli).

Part of :mod:`asyncrl.config` (imports neither torch, vllm nor ray).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from .data_identity import DATA_KEYS, data_identity, read_identity, write_identity
from .fields import ConfigError
from .loading import Config
from .paths import absolute_path_value

SAVED_CONFIG = "config.yaml"

#: A change refused even with ``--allow-config-change``: the run's state cannot follow it.
FIXED = "fixed"
#: A change refused unless the key is named in ``--allow-config-change``: the state survives it, but the
#: run would no longer be one experiment (its curve mixes two setups).
IDENTITY = "identity"
#: A change accepted and logged: budgets, throughput, placement, transport, observability.
FREE = "free"

#: Key prefix -> kind; the longest matching prefix decides (``model`` is fixed, ``model.max_model_len``
#: free). A key no prefix matches counts as identity (a new schema key is refused until classified here;
#: tests/unit/test_config_resume.py checks that every key of the schema is).
RULES: dict[str, str] = {
    "run": FREE,  # budgets (max_steps, max_wall_s), restarts, progress, core placement
    "run.name": FIXED,  # namespaces every Redis key: another name is another buffer and consumer group
    "run.seed": FIXED,  # builds model/ (the reference model, `export --version 0`), prompt order, sampling
    "redis": FREE,  # where the buffer is reached (a Redis moved to another host), secrets, timeouts
    "ray": FREE,
    "model": FIXED,  # path, tiny.* shape and dtype: the weights and optimizer state the checkpoint holds
    "model.tiny_cache_dir": FREE,  # a cache keyed by the spec: it changes no byte of model/
    "model.max_model_len": FREE,  # the engines' length limit, not the weights
    "model.chat_template": IDENTITY,  # how prompts are rendered: the tokens the policy is trained on
    "task": IDENTITY,  # the prompt set, its order and the reward
    "task.eval_data_path": FREE,  # eval only (eval_fraction, by contrast, removes training rows)
    "task.eval_split": FREE,
    "task.eval_size": FREE,
    "task.reward_timeout_s": FREE,
    "task.reward_failure_limit": FREE,  # when an actor gives up on a reward failing group after group
    "task.reward_failure_window_s": FREE,  # how long a reward that worked must fail before the actor gives up
    "task.reward_fault": FREE,  # fault injection of tests and chaos runs
    "task.reward_fault_every": FREE,
    "task.reward_fault_hang_s": FREE,
    "actors": FREE,  # pool size, engine, swap, admission and supervision knobs
    "actors.group_size": IDENTITY,  # G: the unit of the advantages and of the admission window
    "actors.temperature": IDENTITY,  # the sampling law mu, and the learner divides its logits by it
    "actors.top_p": IDENTITY,  # truncates mu: buffered logprobs would come from another law
    "actors.max_tokens": IDENTITY,  # the completions' length limit (and Dr.GRPO's denominator)
    "buffer": FREE,  # max_staleness and the adaptive bound: what a resume is for (tuning the overlap)
    "buffer.groups_per_step": IDENTITY,  # the batch, and the admission credits per version
    "learner": FREE,  # lr, AdamW, clipping, warm-up, micro-batches, transport, checkpoint cadence
    "learner.zero_stage": FIXED,  # the checkpoint's layout (DeepSpeed shards) follows the stage
    "learner.consumer": FIXED,  # the Redis consumer whose pending groups the checkpoint acknowledges
    "learner.mini_batches": IDENTITY,  # updates per batch: the objective, and A-3PO's steps per version
    "learner.epochs": IDENTITY,
    "learner.exact_prox": IDENTITY,
    "learner.dynamic_sampling": IDENTITY,
    "learner.overlong_mask": IDENTITY,
    "learner.publish_every": IDENTITY,  # what a version (and so staleness) is, in steps
    "learner.publish_policy": IDENTITY,
    "learner.loss": IDENTITY,  # the objective: the choice a run (and a sweep cell) stands for
    "metrics": FREE,
    "eval": FREE,
    "tracking": FREE,
    "console": FREE,
}

#: Never compared nor logged: the saved config.yaml holds it redacted (asyncrl.launch.redacted).
SECRETS = ("redis.password",)


def kind_of(key: str) -> str:
    """FIXED, IDENTITY or FREE for a dotted ``key``: the rule of its longest matching prefix."""
    parts = key.split(".")
    for n in range(len(parts), 0, -1):
        rule = RULES.get(".".join(parts[:n]))
        if rule is not None:
            return rule
    return IDENTITY  # unclassified: refusing is the safe side, --allow-config-change the way out


def has_run_state(rdir: Path) -> bool:
    """The run dir holds state of an earlier start: checkpoints, weights, a buffer or step records."""
    from asyncrl.learner.records import CHECKPOINT_DIR, METRICS_FILE  # stdlib only

    dirs = (CHECKPOINT_DIR, "weights", "redis")
    metrics = rdir / METRICS_FILE
    return any((rdir / d).is_dir() and any((rdir / d).iterdir()) for d in dirs) or (
        metrics.is_file() and metrics.stat().st_size > 0
    )


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    """``{"a.b": leaf}`` of a nested mapping; dict-valued fields (task.params, actors.resources) are
    leaves, compared whole (their keys are the user's, not the schema's)."""
    out: dict[str, Any] = {}
    for k, v in tree.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and _is_section(key):
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


def _is_section(key: str) -> bool:
    """``key`` names a config section (a dataclass), not a dict-valued field."""
    node: Any = Config()
    for part in key.split("."):
        node = getattr(node, part, None)
    return dataclasses.is_dataclass(node)


@functools.cache
def _defaults() -> dict[str, Any]:
    """Every key of the schema with its default (flattened); read, never modified."""
    return flatten(OmegaConf.to_container(OmegaConf.structured(Config())))


def _comparable(cfg: Config) -> dict[str, Any]:
    """``cfg`` flattened as its saved config.yaml would hold it: secrets out, the URL's password out."""
    from asyncrl.launch import redact_url  # torch-free; asyncrl.config is fully imported by now

    flat = flatten(OmegaConf.to_container(OmegaConf.structured(cfg)))
    flat["redis.url"] = redact_url(flat["redis.url"])
    return {k: v for k, v in flat.items() if k not in SECRETS}


def config_changes(saved: dict[str, Any], new: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """``(key, saved value, new value)`` for each key of ``new`` whose value differs from ``saved``.

    A key the saved file lacks (the schema gained it since) is compared with today's default, which
    the run has been following since the upgrade; a key only the saved file has (renamed, removed) is
    left out: nothing can set it any more. ``model.tiny.*`` is not compared while ``model.path`` is set
    on both sides: the tiny spec is then unused. Paths (asyncrl.config.paths.PATH_KEYS) are compared
    absolute, against the working directory: a saved config.yaml holds them absolute, one from before
    that as typed (relative to where the run was started), and ``model.path=./m`` started there names
    the same model as ``model.path=/abs/m``."""
    default = _defaults()
    both_paths = bool(saved.get("model.path")) and bool(new.get("model.path"))
    out = []
    for key, value in new.items():
        old = absolute_path_value(key, saved.get(key, default.get(key)), compare=True)
        value = absolute_path_value(key, value, compare=True)
        if key in SECRETS or (both_paths and key.startswith("model.tiny.")):
            continue
        # 30 and 30.0 are one value (a float field written by hand as an int); True is not 1.
        if not (old == value and isinstance(old, bool) == isinstance(value, bool)):
            out.append((key, old, value))
    return out


def check_resume(cfg: Config, rdir: Path, allow: Iterable[str] = (), data: bool = True) -> list[str]:
    """Compare ``cfg`` with the config saved in ``rdir`` when ``rdir`` holds a run to resume.

    Returns one line per accepted change (for the caller to log; nothing when there is no saved config,
    no state of an earlier start, or no change). Raises ConfigError, in one line naming each refused key
    with its saved and new value, when a FIXED key changed, or an IDENTITY key not named (or under a
    prefix named) in ``allow``, or when a data file's contents changed since the run's start
    (:mod:`asyncrl.config.data_identity`). Writes only the data digests (``task_data.json``: at the
    first start, or once a resume is accepted); the caller rewrites config.yaml once this returned.
    ``data``: the caller's role reads the task's data (not the learner: its machine may have none)."""
    allow = tuple(allow)
    for a in allow:
        if not any(k == a or k.startswith(a + ".") for k in _defaults()):
            raise ConfigError(f"--allow-config-change {a!r}: not a config key or section")
    path = Path(rdir) / SAVED_CONFIG
    identity = data_identity(cfg) if data else {}
    if not path.is_file() or not has_run_state(Path(rdir)):
        if identity:  # the first start: what a resume compares the data files' contents with
            write_identity(Path(rdir), identity)
        return []
    loaded = OmegaConf.to_container(OmegaConf.load(path))
    saved = flatten(loaded) if isinstance(loaded, dict) else {}
    accepted, refused, overridable = [], [], False
    for key, old, new in config_changes(saved, _comparable(cfg)):
        kind = kind_of(key)
        allowed = any(key == a or key.startswith(a + ".") for a in allow)
        if kind == FREE or (kind == IDENTITY and allowed):
            why = "" if kind == FREE else " (allowed by --allow-config-change)"
            accepted.append(f"config change on resume: {key}: {old!r} -> {new!r}{why}")
        else:
            overridable = overridable or kind == IDENTITY
            refused.append(f"{key} {old!r} -> {new!r}{' (cannot change)' if kind == FIXED else ''}")
    recorded = read_identity(Path(rdir)) if data else None
    for key in DATA_KEYS if recorded is not None else ():
        if recorded.get(key) == identity.get(key):
            continue
        if any(key == a or key.startswith(a + ".") for a in allow):
            accepted.append(
                f"config change on resume: {key}: its contents changed (allowed by --allow-config-change)"
            )
        else:
            overridable = True
            refused.append(
                f"{key}'s contents (the eval hold-out and the prompt order depend on them: "
                f"{'not found' if key not in identity else 'digest ' + identity[key][:12]} against "
                f"{'none' if key not in recorded else recorded[key][:12]} at the run's start)"
            )
    if refused:
        hatch = "; --allow-config-change KEY accepts an identity change on purpose" if overridable else ""
        raise ConfigError(
            f"run dir {rdir} holds an unfinished run started with another config; keys that define the run "
            f"changed: {', '.join(refused)}. Put them back to resume it, or pass run.name=NEW for a new run"
            f"{hatch}"
        )
    if data and identity != recorded and (identity or recorded is not None):
        write_identity(Path(rdir), identity)  # recorded for a run from before the digests, or accepted
    return accepted
