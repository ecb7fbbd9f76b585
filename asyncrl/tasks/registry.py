"""Finding a task by name: built-ins, installed plug-ins (entry points), or an import path.

``task.name`` is resolved in this order:

1. a built-in name (:data:`BUILTIN_TASKS`: the tiny tasks and ``gsm8k``);
2. a name registered by an installed package under the entry-point group :data:`ENTRY_POINT_GROUP`
   (``[project.entry-points."asyncrl.tasks"] mytask = "mypkg.tasks:make_task"``);
3. an import path ``pkg.module:factory`` (the module must be importable: installed, or on
   ``PYTHONPATH``), or a file path ``path/to/file.py:factory``.

A factory is ``factory(task_cfg, seed) -> Task`` (see :mod:`asyncrl.tasks.base` for the protocol);
``task_cfg`` is the run's :class:`asyncrl.config.TaskConfig` (its ``params`` dict carries the
plug-in's own options).

Invariant: resolving a built-in imports nothing beyond this package; a plug-in imports only what its
own module imports (the file is loaded in every actor process and in ``asyncrl eval``).
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Callable
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

from .base import Task
from .math import Gsm8kTask
from .tiny import AdditionTask, CopyTask, CountTask, EchoTask, ReverseTask, TinyTask

__all__ = [
    "ENTRY_POINT_GROUP",
    "BUILTIN_TASKS",
    "TINY_TASKS",
    "TaskNotFound",
    "registered_names",
    "resolve_factory",
    "make_task",
]

ENTRY_POINT_GROUP = "asyncrl.tasks"

TINY_TASKS: dict[str, type[TinyTask]] = {
    "copy": CopyTask,
    "reverse": ReverseTask,
    "count": CountTask,
    "addition": AdditionTask,
    "echo": EchoTask,
}


def _tiny_factory(cls: type[TinyTask]) -> Callable[[Any, int], Task]:
    def make(cfg: Any, seed: int) -> Task:
        return cls(cfg.num_prompts, seed, cfg.alphabet, cfg.min_len, cfg.max_len, eval_size=cfg.eval_size)

    return make


def _gsm8k(cfg: Any, seed: int) -> Task:
    return Gsm8kTask(cfg.data_path or None, eval_path=cfg.eval_data_path or None,
                     eval_fraction=cfg.eval_fraction, eval_size=cfg.eval_size, seed=seed)  # fmt: skip


BUILTIN_TASKS: dict[str, Callable[[Any, int], Task]] = {
    **{name: _tiny_factory(cls) for name, cls in TINY_TASKS.items()},
    "gsm8k": _gsm8k,
}


class TaskNotFound(ValueError):
    """``task.name`` names no built-in, no registered plug-in and no importable factory."""


def _registered() -> dict[str, Any]:
    return {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}


def registered_names() -> list[str]:
    """Task names installed packages register under :data:`ENTRY_POINT_GROUP` (not loaded)."""
    return sorted(_registered())


def _describe_known() -> str:
    plugins = sorted(_registered())
    text = f"built-in tasks: {', '.join(BUILTIN_TASKS)}"
    if plugins:
        text += f"; installed plug-ins ({ENTRY_POINT_GROUP}): {', '.join(plugins)}"
    return text + "; or an import path 'pkg.module:make_task' / 'path/to/file.py:make_task'"


def _load_module(spec: str) -> Any:
    if spec.endswith(".py"):
        path = Path(spec).expanduser().resolve()
        if not path.exists():
            raise TaskNotFound(f"task.name: file {path} not found")
        name = f"asyncrl_user_task_{abs(hash(str(path)))}"
        if name in sys.modules:
            return sys.modules[name]
        mod_spec = importlib.util.spec_from_file_location(name, path)
        assert mod_spec is not None and mod_spec.loader is not None
        module = importlib.util.module_from_spec(mod_spec)
        sys.modules[name] = module
        mod_spec.loader.exec_module(module)
        return module
    try:
        return importlib.import_module(spec)
    except ModuleNotFoundError as e:
        raise TaskNotFound(
            f"task.name: cannot import module {spec!r} ({e}); install it or put its directory on PYTHONPATH"
        ) from None


def resolve_factory(name: str) -> Callable[[Any, int], Task]:
    """The factory ``task.name`` refers to; :class:`TaskNotFound` (listing the choices) if none."""
    if name in BUILTIN_TASKS:
        return BUILTIN_TASKS[name]
    registered = _registered()
    if name in registered:
        return registered[name].load()
    if ":" not in name:
        raise TaskNotFound(f"task.name={name!r} is not a known task; {_describe_known()}")
    module_spec, _, attr = name.rpartition(":")
    if not module_spec or not attr:
        raise TaskNotFound(f"task.name={name!r}: expected 'module:factory'; {_describe_known()}")
    factory = getattr(_load_module(module_spec), attr, None)
    if not callable(factory):
        raise TaskNotFound(f"task.name={name!r}: {module_spec!r} has no callable {attr!r}")
    return factory


def make_task(task_cfg: Any, seed: int) -> Task:
    """The task named by ``task_cfg.name`` (a :class:`asyncrl.config.TaskConfig`), built for ``seed``."""
    task = resolve_factory(task_cfg.name)(task_cfg, seed)
    if not isinstance(task, Task):
        raise TypeError(
            f"task.name={task_cfg.name!r}: the factory returned {type(task).__name__}, not a Task"
        )
    return task
