"""Cross-field checks of a loaded ``Config``, and the file checks a role runs before it starts.

Part of :mod:`asyncrl.config` (imports neither torch, vllm nor ray).

Why these exist: each mistake below passes the per-field checks and used to fail minutes later inside
an actor (after Ray and vLLM had started), then again on each of ``run.max_restarts`` restarts.
:func:`check_config` runs in every ``load_config``; :func:`check_model_dir` and
:func:`check_data_paths` read the disk, so only the roles that use those files call them (``asyncrl status`` or a sweep report on a machine without the
data must still load the config).
"""

from __future__ import annotations

import importlib.util
import json
import os
import string
from pathlib import Path
from typing import Any

from .fields import ConfigError

#: URL schemes the buffer's connection code handles (asyncrl/buffer/connection.py, cluster.py).
#: unix:// is not among them: redis-py's socket connection rejects the TCP options every role sets.
REDIS_SCHEMES = ("redis://", "rediss://", "redis+cluster://", "rediss+cluster://")

#: Characters a tiny task's alphabet may not hold: the prompt's separators. The same rule as
#: TinyTask.__init__ (asyncrl/tasks/tiny.py), which only runs in the actor; besides these, only
#: printable ASCII is allowed.
TINY_RESERVED = ":=+\n"


def check_config(cfg: Any) -> None:
    """Checks across fields of one loaded config; raises ``ConfigError`` naming the keys."""
    _check_run(cfg.run)
    _check_task(cfg.task)
    _check_tiny_model(cfg.model)
    _check_redis(cfg.redis)
    _check_lengths(cfg)
    if not cfg.learner.consumer.strip():
        # The learner's name in the Redis consumer group; empty failed only at its first read.
        raise ConfigError(
            f"learner.consumer={cfg.learner.consumer!r} is not allowed: a non-empty consumer name (default "
            "'learner-0')"
        )


def _check_run(r: Any) -> None:
    # The name is a directory under runs/ and part of every Redis key: empty made the run dir runs/
    # itself; a slash nests it, whitespace and '.'/'..' are paths nobody means.
    n = r.name
    if not n or n in (".", "..") or "/" in n or "\\" in n or any(c.isspace() for c in n):
        raise ConfigError(
            f"run.name={n!r} is not allowed: a non-empty name without '/', '\\' or whitespace "
            "(it names the run directory and every Redis key of the run)"
        )


def _check_lengths(cfg: Any) -> None:
    # vLLM refuses a prompt longer than max_model_len and silently cuts a completion at it: a token
    # budget with no room for a prompt is a config mistake, not a run that learns nothing.
    limit = cfg.model.max_model_len
    for key, value in (
        ("actors.max_tokens", cfg.actors.max_tokens),
        ("eval.max_tokens", cfg.eval.max_tokens),
    ):
        if value >= limit:
            raise ConfigError(
                f"{key}={value} must be < model.max_model_len={limit} (prompt + completion must fit)"
            )


def _check_task(t: Any) -> None:
    if t.min_len > t.max_len:
        raise ConfigError(f"task.min_len={t.min_len} must be <= task.max_len={t.max_len}")
    from asyncrl.tasks.registry import TINY_TASKS  # no cycle: asyncrl.tasks never imports asyncrl.config

    if t.name not in TINY_TASKS:  # a plug-in may give the alphabet another meaning
        return
    if not t.alphabet:
        raise ConfigError(f"task.alphabet must not be empty for the tiny task {t.name!r}")
    bad = sorted({c for c in t.alphabet if c in TINY_RESERVED or c not in string.printable})
    if bad:
        raise ConfigError(
            f"task.alphabet={t.alphabet!r}: characters {bad!r} are not allowed; allowed: printable ASCII "
            f"except {', '.join(map(repr, TINY_RESERVED))} (the tiny tasks' prompt separators)"
        )


def _check_tiny_model(m: Any) -> None:
    if m.path:  # a real model: check_model_dir reads its config when a role starts
        return
    if m.chat_template == "on":
        raise ConfigError(
            "model.chat_template='on' needs a tokenizer with a chat template; the built-in tiny model "
            "(model.path empty) has none: allowed values here are 'auto', 'off'"
        )
    if m.max_model_len > m.tiny.max_position_embeddings:
        raise ConfigError(
            f"model.max_model_len={m.max_model_len} must be <= model.tiny.max_position_embeddings="
            f"{m.tiny.max_position_embeddings} (the built-in tiny model, model.path empty)"
        )


def _check_redis(r: Any) -> None:
    if r.url and not r.url.startswith(REDIS_SCHEMES):
        raise ConfigError(
            f"redis.url={r.url!r}: allowed schemes are {', '.join(REDIS_SCHEMES)} "
            "(unix sockets are not supported); empty = an embedded redis-server"
        )
    if bool(r.tls_certfile) != bool(r.tls_keyfile):
        raise ConfigError(
            "redis.tls_certfile and redis.tls_keyfile go together (mutual TLS): set both or neither"
        )
    files = [k for k in ("tls_ca_certs", "tls_certfile", "tls_keyfile") if getattr(r, k)]
    if files and not (r.tls or r.url.startswith("rediss://")):
        # Found only as a role built its client, with the connection's own parameter names.
        raise ConfigError(
            f"{', '.join('redis.' + k for k in files)} need TLS: set redis.tls=true or a rediss:// redis.url "
            f"(redis.url={r.url!r})"
        )


def check_model_dir(cfg: Any, model_dir: str | Path | None = None) -> None:
    """``model_dir`` (default ``model.path``; nothing to check when both are empty: the tiny model is
    built) must be a Hugging Face model directory whose tokenizer has a chat template when
    ``model.chat_template='on'`` and whose positions cover ``model.max_model_len``."""
    model_dir = model_dir or cfg.model.path
    if model_dir:
        _check_model_dir(cfg.model, Path(model_dir).expanduser(), str(model_dir))


def check_data_paths(cfg: Any) -> None:
    """``task.data_path`` and ``task.eval_data_path`` exist when set (roles that build the task)."""
    for key in ("data_path", "eval_data_path"):
        value = getattr(cfg.task, key)
        if value and not Path(value).expanduser().exists():
            raise ConfigError(
                f"task.{key}={value!r}: not found (allowed: a JSONL or Parquet file or a save_to_disk "
                "directory); data is never downloaded at run time"
            )


def _check_model_dir(m: Any, p: Path, given: str) -> None:
    where = f"model.path={given!r}" if given == m.path else f"model dir {given!r}"
    try:
        hf = json.loads((p / "config.json").read_text())
    except FileNotFoundError:
        raise ConfigError(
            f"{where}: no Hugging Face model directory at {p} (config.json missing); models are never "
            "downloaded at run time"
        ) from None
    except (OSError, ValueError) as e:
        raise ConfigError(f"{where}: {p / 'config.json'} is unreadable ({e})") from None
    if m.chat_template == "on" and not _has_chat_template(p):
        raise ConfigError(
            f"model.chat_template='on' but the tokenizer at {p} has no chat template "
            "(tokenizer_config.json, chat_template.jinja/.json): allowed values here are 'auto', 'off'"
        )
    limit = hf.get("max_position_embeddings") if isinstance(hf, dict) else None
    # rope_scaling can stretch the usable length past max_position_embeddings (vLLM honours it), and
    # VLLM_ALLOW_LONG_MAX_MODEL_LEN lifts vLLM's own check: only then is the limit not one to enforce.
    trusted = isinstance(limit, int) and not hf.get("rope_scaling")
    if trusted and not os.environ.get("VLLM_ALLOW_LONG_MAX_MODEL_LEN") and m.max_model_len > limit:
        raise ConfigError(
            f"model.max_model_len={m.max_model_len} must be <= {limit}, the max_position_embeddings of {p}"
        )


def _has_chat_template(p: Path) -> bool:
    if (p / "chat_template.jinja").exists() or (p / "chat_template.json").exists():
        return True
    try:
        tok = json.loads((p / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(tok, dict) and bool(tok.get("chat_template"))


def validate_task_name(name: str, key: str, registered: dict[str, Any] | None = None) -> None:
    """Reject a task name that names nothing, without importing a plug-in (that happens at role start).
    ``registered``: the installed plug-ins (asyncrl.tasks.registry.registered_entry_points) when the caller
    has scanned them already; else scanned here, once."""
    from asyncrl.tasks.registry import BUILTIN_TASKS, ENTRY_POINT_GROUP, registered_entry_points

    if name in BUILTIN_TASKS:
        return
    plugins = sorted(registered_entry_points() if registered is None else registered)
    if name in plugins:
        return
    module, _, attr = name.rpartition(":")
    if module and attr:
        if module.endswith(".py"):
            if Path(module).expanduser().is_file():
                return
            raise ConfigError(f"{key}={name!r}: file {module} not found")
        try:
            if importlib.util.find_spec(module) is not None:
                return
        except (ImportError, ValueError):
            pass
        raise ConfigError(
            f"{key}={name!r}: module {module!r} is not importable (installed, or on PYTHONPATH?)"
        )
    raise ConfigError(
        f"{key}={name!r} is not a known task; built-in tasks: {', '.join(BUILTIN_TASKS)}"
        + (f"; installed plug-ins ({ENTRY_POINT_GROUP}): {', '.join(plugins)}" if plugins else "")
        + "; or a factory 'pkg.module:make_task' / 'path/to/file.py:make_task'"
    )
