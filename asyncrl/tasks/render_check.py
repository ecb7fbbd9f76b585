"""A prompt the model's chat template cannot render: found at start-up, and dead-lettered at run time.

Why: a chat template is code and may refuse what the config asks of it. Gemma's templates raise
``System role not supported`` for a ``task.system_prompt``; others insist on alternating turns or
read a variable only some prompts have. The actors render prompts (:func:`asyncrl.tasks.chat.
prompt_token_ids`) only once Ray, vLLM and the learner are up, and a template error there failed the
generation loop, whose restarts and replacements crash-looped for minutes with 0 learner steps (and
``asyncrl eval`` died with a Jinja traceback after its engine had started). So:

* :func:`check_prompt_rendering` renders the task's first prompt with the model's own tokenizer, the
  way every actor will, before any role starts (:func:`asyncrl.tasks.registry.check_task`, which
  ``asyncrl run``, ``serve-actors`` and ``eval`` of a model dir call; ``asyncrl eval`` of a run dir
  before its engine starts): a failure is one :class:`ConfigError` line naming the keys that apply;
* :func:`render_failure` is the reason a prompt that still fails at run time (a template that refuses
  only some prompts) is dead-lettered with, as an engine-refused prompt is.

Imports neither torch, vllm nor ray at module level: ``transformers`` (which loads torch, ~3 s) only
when a chat template will actually be applied.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .chat import prompt_token_ids

__all__ = ["check_prompt_rendering", "render_failure"]


def render_failure(cfg: Any, prompt_id: str, e: BaseException) -> str:
    """Why prompt ``prompt_id`` could not be rendered: the keys that shape the rendering, the error."""
    keys = f"model.chat_template={cfg.model.chat_template!r}"
    if cfg.task.system_prompt:
        keys += f", task.system_prompt={cfg.task.system_prompt!r}"
    return f"prompt {prompt_id!r} could not be rendered ({keys}): {type(e).__name__}: {e}"


def check_prompt_rendering(
    cfg: Any, prompt: Any, tokenizer: Any = None, model_dir: str | None = None
) -> None:
    """Render ``prompt`` as the actors will; a :class:`ConfigError` (one line) if that fails.

    ``tokenizer``: the one the caller loaded already (``asyncrl eval``); else the tokenizer of
    ``model_dir`` (default ``model.path``) is loaded, but only when a chat template applies: plain text
    is never refused, and the tiny model (``model.path`` empty) has no template.
    """
    from asyncrl.config import ConfigError  # here, not at the top: asyncrl.config imports asyncrl.tasks
    from asyncrl.config.checks import _has_chat_template  # the model-dir check's own notion of "has one"

    model_dir = str(model_dir or cfg.model.path or "")
    if tokenizer is None:
        path = Path(model_dir).expanduser()
        if not model_dir or cfg.model.chat_template == "off" or not _has_chat_template(path):
            return
        from transformers import AutoTokenizer  # the actor's loader (asyncrl.actors.actor._start_engine)

        try:
            tokenizer = AutoTokenizer.from_pretrained(str(path))
        except Exception:  # not this check's question (what the template makes of the config): no verdict
            return
    try:
        prompt_token_ids(tokenizer, prompt.text, cfg.model.chat_template, cfg.task.system_prompt)
    except Exception as e:
        if cfg.task.system_prompt:
            fix = ("remove task.system_prompt (or put its text into the prompts themselves), or set "
                   "model.chat_template=off (plain text)")  # fmt: skip
        else:
            fix = "fix the model's chat template, or set model.chat_template=off (plain text)"
        where = f" of {model_dir}" if model_dir else ""
        raise ConfigError(
            f"the chat template{where} refuses the task's prompts: {render_failure(cfg, prompt.prompt_id, e)}; {fix}"
        ) from None
