"""Config keys that hold filesystem paths, and making them absolute.

A relative path is relative to the working directory of the command that reads it; a run dir's saved
``config.yaml`` holds them absolute (applied by asyncrl.launch.redacted), and the resume check and a
resumed sweep compare them absolute (``compare=True``).
"""

from __future__ import annotations

import copy
import os
from typing import Any

#: Config keys whose value is a filesystem path. A relative one is relative to the working directory of the
#: command that reads it, so a run dir's saved config.yaml holds them absolute (:func:`absolute_paths`,
#: applied by asyncrl.launch.redacted): `asyncrl export` / `asyncrl eval` of the run dir from another
#: directory read the run's own files. tests/unit/test_config_paths_abs.py checks that every schema field
#: named like a path is listed. ``task.name`` is one too when it names a file (:func:`path_text`).
PATH_KEYS = (
    "run.dir",
    "redis.tls_ca_certs",
    "redis.tls_certfile",
    "redis.tls_keyfile",
    "model.path",
    "model.tiny_cache_dir",
    "task.name",  # only a 'path/to/file.py:make_task' factory
    "task.data_path",
    "task.eval_data_path",
    "console.log_dir",
)


def path_text(key: str, value: Any) -> str:
    """The path in ``value`` of config key ``key`` ('' when there is none: not a path key, empty, or a
    ``task.name`` that names no ``.py`` file)."""
    if key not in PATH_KEYS or not isinstance(value, str) or not value:
        return ""
    if key == "task.name":
        file, sep, _ = value.rpartition(":")
        return file if sep and file.endswith(".py") else ""
    return value


def with_path(key: str, value: str, path: str) -> str:
    """``value`` of ``key`` with its path (:func:`path_text`) replaced by ``path``."""
    return f"{path}:{value.rpartition(':')[2]}" if key == "task.name" else path


def absolute_path_value(
    key: str, value: Any, base: str | os.PathLike | None = None, compare: bool = False
) -> Any:
    """``value`` of ``key`` with a relative path made absolute against ``base`` (default: the working
    directory). A path starting with ``~`` or already absolute is left as typed (neither depends on the
    working directory), unless ``compare``: then ``~`` is expanded and the path normalized (``/m/`` is
    ``/m``), for comparing two values. Any other value is returned as is."""
    path = path_text(key, value)
    if not path:
        return value
    if compare:
        path = os.path.expanduser(path)
    elif path.startswith("~") or os.path.isabs(path):
        return value
    return with_path(key, value, os.path.abspath(os.path.join(base or os.getcwd(), path)))


def absolute_paths(cfg: Any, base: str | os.PathLike | None = None) -> Any:
    """A copy of ``cfg`` with every relative path of :data:`PATH_KEYS` absolute (against ``base``,
    default the working directory): what a run dir's config.yaml holds."""
    out = copy.deepcopy(cfg)
    for key in PATH_KEYS:
        section, name = key.split(".")
        node = getattr(out, section)
        setattr(node, name, absolute_path_value(key, getattr(node, name), base))
    return out
