"""Finding a task by name: built-ins, installed plug-ins (entry points), or an import path.

``task.name`` is resolved in this order:

1. a built-in name (:data:`BUILTIN_TASKS`: the tiny tasks and ``gsm8k``);
2. a name registered by an installed package under the entry-point group :data:`ENTRY_POINT_GROUP`
   (``[project.entry-points."asyncrl.tasks"] mytask = "mypkg.tasks:make_task"``); a plug-in that
   registers a built-in's name is an error when that name is selected (it would otherwise be silently
   replaced by the built-in: :func:`check_task_config`);
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
import inspect
import sys
import traceback
from collections.abc import Callable
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

from .base import Prompt, Task, TaskDataError
from .length_check import check_prompt_lengths
from .math import Gsm8kTask
from .render_check import check_prompt_rendering, load_tokenizer
from .reward_check import check_reward_signature
from .tiny import AdditionTask, CopyTask, CountTask, EchoTask, ReverseTask, TinyTask

__all__ = [
    "ENTRY_POINT_GROUP",
    "BUILTIN_TASKS",
    "TINY_TASKS",
    "TaskNotFound",
    "DATA_KEYS",
    "check_task_config",
    "registered_entry_points",
    "registered_names",
    "resolve_factory",
    "make_task",
    "check_task",
    "require_eval_prompts",
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
    return Gsm8kTask(cfg.data_path or None, eval_path=cfg.eval_data_path or None, split=cfg.split,
                     eval_split=cfg.eval_split, eval_fraction=cfg.eval_fraction, eval_size=cfg.eval_size,
                     seed=seed)  # fmt: skip


BUILTIN_TASKS: dict[str, Callable[[Any, int], Task]] = {
    **{name: _tiny_factory(cls) for name, cls in TINY_TASKS.items()},
    "gsm8k": _gsm8k,
}


class TaskNotFound(ValueError):
    """``task.name`` names no built-in, no registered plug-in and no importable factory."""


#: ``task.*`` keys only data-backed tasks read. A tiny task generates its prompts from the seed, so a value
#: set here would be silently ignored (a user pointing ``task.data_path`` at their data would train on
#: generated strings): :func:`check_task_config` rejects it instead.
DATA_KEYS = ("data_path", "split", "eval_data_path", "eval_split", "eval_fraction", "prompt_column",
             "target_column", "params")  # fmt: skip


#: ``task.*`` keys of :data:`DATA_KEYS` that gsm8k does not read (its columns are fixed): rejected when set.
GSM8K_IGNORED_KEYS = ("prompt_column", "target_column", "params")


def _check_not_shadowed(name: str, key: str, registered: dict[str, Any] | None = None) -> None:
    """A plug-in registering a built-in's name would be silently replaced by the built-in (built-ins win
    the lookup, and its data and reward would be ignored): an error instead, with both ways out.
    ``registered``: the caller's :func:`registered_entry_points` (else scanned here, for a built-in only)."""
    if name not in BUILTIN_TASKS:
        return
    ep = (registered_entry_points() if registered is None else registered).get(name)
    if ep is not None:
        from asyncrl.config import ConfigError  # here, not at the top: asyncrl.config imports this module

        dist = getattr(getattr(ep, "dist", None), "name", None) or "an installed package"
        raise ConfigError(
            f"{key}={name!r} is a built-in task, but {dist} also registers {name!r} under the "
            f"{ENTRY_POINT_GROUP!r} entry-point group ({ep.value}); a plug-in cannot replace a built-in: "
            f"rename its entry point, or select the plug-in by its import path: {key}={ep.value!r}"
        )


def check_task_config(task_cfg: Any, prefix: str = "task.", registered: dict[str, Any] | None = None) -> None:
    """Reject a ``task`` section a built-in would silently misread; :class:`ConfigError` naming the key.

    * a built-in ``task.name`` that an installed plug-in also registers;
    * a tiny task with a non-default :data:`DATA_KEYS` value (tiny tasks read no data);
    * gsm8k with a non-default :data:`GSM8K_IGNORED_KEYS` value (it reads fixed columns).

    Reads entry-point metadata only (no plug-in module is imported), so config validation may call it.
    ``registered``: a :func:`registered_entry_points` the caller already has (else scanned here if needed).
    """
    name = task_cfg.name
    _check_not_shadowed(name, f"{prefix}name", registered)
    if name not in TINY_TASKS and name != "gsm8k":
        return
    # Here, not at the top: asyncrl.config imports this module (its task checks), so importing
    # asyncrl.tasks must not import asyncrl.config.
    from asyncrl.config import ConfigError, TaskConfig

    defaults = TaskConfig()
    for key in DATA_KEYS if name in TINY_TASKS else GSM8K_IGNORED_KEYS:
        value = getattr(task_cfg, key, getattr(defaults, key))
        if value == getattr(defaults, key):
            continue
        if name in TINY_TASKS:
            raise ConfigError(
                f"{prefix}{key}={value!r}: the built-in task {name!r} generates its prompts and does not "
                f"read {prefix}{key}; remove it, or use a task that reads data (gsm8k, or a plug-in: "
                "docs/custom_tasks.md)"
            )
        raise ConfigError(
            f"{prefix}{key}={value!r}: the built-in task 'gsm8k' reads the GSM8K columns 'question' and "
            f"'answer' (its final answer after '#### ') and no {prefix}{key}; rename the data's columns, "
            "remove the key, or use a plug-in task (docs/custom_tasks.md)"
        )


def registered_entry_points() -> dict[str, Any]:
    """Name -> entry point of each task installed packages register under :data:`ENTRY_POINT_GROUP` (not
    loaded). A scan of the installed distributions per call, not cached (a package installed since, or a
    directory added to ``sys.path``, is found): a caller that needs it more than once (config validation,
    :func:`make_task`) scans once and passes the result on."""
    return {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}


def registered_names(registered: dict[str, Any] | None = None) -> list[str]:
    """Task names installed packages register under :data:`ENTRY_POINT_GROUP` (not loaded); from
    ``registered`` (a :func:`registered_entry_points`) when given, else from a scan."""
    return sorted(registered_entry_points() if registered is None else registered)


def _describe_known(registered: dict[str, Any]) -> str:
    plugins = sorted(registered)
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


def resolve_factory(name: str, registered: dict[str, Any] | None = None) -> Callable[[Any, int], Task]:
    """The factory ``task.name`` refers to; :class:`TaskNotFound` (listing the choices) if none, a
    :class:`ConfigError` if a plug-in registers a built-in's name. ``registered``: as in
    :func:`check_task_config`."""
    registered = registered_entry_points() if registered is None else registered
    if name in BUILTIN_TASKS:
        _check_not_shadowed(name, "task.name", registered)
        return BUILTIN_TASKS[name]
    if name in registered:
        return registered[name].load()
    if ":" not in name:
        raise TaskNotFound(f"task.name={name!r} is not a known task; {_describe_known(registered)}")
    module_spec, _, attr = name.rpartition(":")
    if not module_spec or not attr:
        raise TaskNotFound(f"task.name={name!r}: expected 'module:factory'; {_describe_known(registered)}")
    factory = getattr(_load_module(module_spec), attr, None)
    if not callable(factory):
        raise TaskNotFound(f"task.name={name!r}: {module_spec!r} has no callable {attr!r}")
    return factory


#: What task.name must name, said where a user named something else (verl's custom_reward_function
#: users name their reward function).
FACTORY_HINT = ("task.name names a factory make_task(task_cfg, seed) -> Task; for a reward function "
                "reward(prompt, completion, metadata) over data rows, return "
                "asyncrl.tasks.dataset_task(task_cfg, seed, reward) from such a factory")  # fmt: skip


def make_task(task_cfg: Any, seed: int) -> Task:
    """The task named by ``task_cfg.name`` (a :class:`asyncrl.config.TaskConfig`), built for ``seed``."""
    registered = registered_entry_points()  # one scan for both: the shadowing check and the lookup
    check_task_config(task_cfg, registered=registered)
    factory = resolve_factory(task_cfg.name, registered)
    try:
        inspect.signature(factory).bind(task_cfg, seed)
    except TypeError as e:  # e.g. a reward function (prompt, completion, metadata) named as the task
        raise TaskNotFound(f"task.name={task_cfg.name!r}: cannot be called as a task factory ({e}); "
                           f"{FACTORY_HINT}") from None  # fmt: skip
    except ValueError:  # no signature to read (a builtin): call it and see
        pass
    task = factory(task_cfg, seed)
    if not isinstance(task, Task):
        raise TypeError(
            f"task.name={task_cfg.name!r}: the factory returned {type(task).__name__}, not a Task; {FACTORY_HINT}"
        )
    return task


def require_eval_prompts(task: Task, every: int = 0) -> list[Prompt]:
    """``task.eval_prompts``, or a :class:`ConfigError` (a ValueError; `asyncrl` prints it without a
    traceback) naming the keys that give the task an eval split. ``every``: the run's ``eval.every``
    when a periodic eval asks for them (named in the error, with its way out: 0), else 0 (``asyncrl eval``)."""
    if task.eval_prompts:
        return task.eval_prompts
    from asyncrl.config import ConfigError  # here, not at the top: asyncrl.config imports this module

    keys = ("set task.eval_data_path, task.eval_split (a saved DatasetDict) or task.eval_fraction > 0 (data "
            "tasks such as gsm8k), or task.eval_size > 0 (tiny tasks)")  # fmt: skip
    if not every:
        raise ConfigError(f"task {task.name!r} has no eval prompts: {keys}")
    raise ConfigError(
        f"eval.every={every} asks for a periodic eval, but task {task.name!r} has no eval prompts: {keys}; "
        "or set eval.every=0 (no periodic eval)"
    )


def check_task(cfg: Any, shard: bool = True, eval_prompts: bool | None = None) -> Task:
    """The run's task, built as each actor builds it (``make_task(cfg.task, cfg.run.seed)``: the data read,
    its columns and rows checked) and sharded over ``actors.num_actors`` (``shard=False``: one source, for
    a command without actors); called by the CLI before any role starts. Without it a bad data file or a
    plug-in bug surfaced inside the actors only after Redis, Ray and the learner had started (Ray
    retrying and printing each traceback), and left a run dir that the next run resumed from.

    ``eval_prompts``: whether the command needs eval prompts (``asyncrl eval``: True); None = when
    ``eval.every`` > 0 (the run's periodic eval, on actor 0). Without this check a run asked for a
    periodic eval by a task without eval prompts only logged a warning in actor 0 and ran without any.

    Raises what :func:`make_task` raises for a bad config or data (ConfigError, TaskNotFound,
    TaskDataError: each names its key or file), a ConfigError when eval prompts are needed and the task
    has none (:func:`require_eval_prompts`: before the chat-template check below, which loads the
    tokenizer), a ConfigError when the reward cannot be called as the actors call it
    (:func:`asyncrl.tasks.reward_check.check_reward_signature`), when the model's chat template refuses the
    first prompt (:func:`asyncrl.tasks.render_check.check_prompt_rendering`) or when every prompt is too long
    for ``model.max_model_len`` (:func:`asyncrl.tasks.length_check.check_prompt_lengths`, which warns when
    only some are); any other exception
    from the user's factory or prompt source becomes a one-line TaskDataError naming ``task.name`` and where it was raised.
    """
    from asyncrl.config import ConfigError  # here, not at the top: asyncrl.config imports this module

    key = f"task.name={cfg.task.name!r}"
    try:
        task = make_task(cfg.task, cfg.run.seed)
    except (ConfigError, TaskNotFound, TaskDataError):
        raise
    except Exception as e:
        raise TaskDataError(f"{key}: building the task failed: {_described(e)}") from e
    n = cfg.actors.num_actors if shard else 1  # `asyncrl eval` reads every eval prompt in one engine
    try:
        # What actor 0 does first: PromptSource refuses fewer prompts than shards.
        first = task.source(cfg.run.seed, 0, n).next()
    except Exception as e:
        raise TaskDataError(
            f"{key}: its prompt source for actors.num_actors={n} failed: {_described(e)}"
        ) from e
    needs_eval = bool(eval_prompts or (eval_prompts is None and cfg.eval.every > 0))
    if needs_eval:
        require_eval_prompts(task, 0 if eval_prompts else cfg.eval.every)
    # What the actors call for each completion: a reward with the wrong parameters failed every group.
    check_reward_signature(task, key)
    # Then what every actor does with each prompt: render it with the model's chat template, which may
    # refuse the config (a Gemma template and task.system_prompt: asyncrl.tasks.render_check), and
    # prompt it, which the engine refuses for a prompt too long (asyncrl.tasks.length_check).
    tokenizer = load_tokenizer(cfg, cfg.model.path) if cfg.model.path else None
    check_prompt_rendering(cfg, first, tokenizer)
    check_prompt_lengths(cfg, task, tokenizer, needs_eval)
    return task


def _described(e: BaseException) -> str:
    """``Type: message (at file:line)``, the line being where ``e`` was raised (in the user's plug-in, mostly):
    the CLI prints one line, not the traceback."""
    frames = traceback.extract_tb(e.__traceback__)
    where = f" (at {frames[-1].filename}:{frames[-1].lineno})" if frames else ""
    return f"{type(e).__name__}: {e}{where}"
