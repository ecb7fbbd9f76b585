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

The tokenizer itself must load (:func:`load_tokenizer`), whether or not it has a chat template: every
actor loads it before its engine starts. A tokenizer that could not load (a corrupt ``tokenizer.json``)
used to skip this check without a word; each actor then failed on it, its loop restarts and
replacements printing transformers' traceback for minutes (``JSONDecodeError: Unterminated string
... (char 1719)``, naming no file), and the run ended 0 steps later with that line. Now it is one
ConfigError naming ``model.path`` and why (the tokenizer file that is not valid JSON, when one is not);
so is a directory without any tokenizer file, of which transformers silently makes an empty tokenizer.

Imports neither torch, vllm nor ray at module level: ``transformers`` (which loads torch, ~3 s) only
when a model directory's tokenizer is loaded (``model.path`` set; the tiny model has none to check).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .chat import Conversation, prompt_token_ids, uses_chat_template

__all__ = ["check_prompt_rendering", "load_tokenizer", "render_failure"]

#: Files a saved tokenizer has at least one of (save_pretrained always writes tokenizer_config.json).
TOKENIZER_FILES = ("tokenizer_config.json", "tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt")
#: The tokenizer files of a Hugging Face model directory that are JSON (named when one does not parse).
TOKENIZER_JSON = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                  "vocab.json", "chat_template.json")  # fmt: skip


def render_failure(cfg: Any, prompt_id: str, e: BaseException) -> str:
    """Why prompt ``prompt_id`` could not be rendered: the keys that shape the rendering, the error."""
    keys = f"model.chat_template={cfg.model.chat_template!r}"
    if cfg.task.system_prompt:
        keys += f", task.system_prompt={cfg.task.system_prompt!r}"
    return f"prompt {prompt_id!r} could not be rendered ({keys}): {type(e).__name__}: {e}"


def load_tokenizer(cfg: Any, model_dir: str) -> Any:
    """The tokenizer of ``model_dir`` as the actors load it, or a :class:`ConfigError` (one line) naming
    the key that points there (``model.path``, else the model dir given) and why it cannot load."""
    from asyncrl.config import ConfigError  # here, not at the top: asyncrl.config imports asyncrl.tasks

    where = f"model.path={model_dir!r}" if model_dir == cfg.model.path else f"model dir {model_dir!r}"
    p = Path(model_dir).expanduser()
    if not any((p / name).exists() for name in TOKENIZER_FILES):
        # transformers builds an empty tokenizer (a vocabulary of 1) from config.json alone, without a word.
        raise ConfigError(
            f"{where}: no tokenizer files there (none of {', '.join(TOKENIZER_FILES)}); every actor loads the "
            "tokenizer from the model directory: copy the model's tokenizer files into it"
        )
    from transformers import AutoTokenizer  # the actor's loader (asyncrl.actors.actor._start_engine)

    try:
        return AutoTokenizer.from_pretrained(str(p))
    except Exception as e:
        # transformers' own error names no file (a JSONDecodeError says where in which file it is not)
        bad = _unparsable_json(p)
        why = "; ".join(bad) if bad else f"{type(e).__name__}: {e}".splitlines()[0]
        fix = ("restore those files (copy them again from the model's source)" if bad else
               "fix the model directory so that transformers.AutoTokenizer.from_pretrained loads it")  # fmt: skip
        raise ConfigError(
            f"{where}: its tokenizer cannot be loaded ({why}); every actor loads it before its engine starts: {fix}"
        ) from None


def _unparsable_json(p: Path) -> list[str]:
    """The :data:`TOKENIZER_JSON` files of ``p`` that are not valid JSON (transformers' error names none)."""
    bad = []
    for name in TOKENIZER_JSON:
        try:
            json.loads((p / name).read_text(encoding="utf-8"))
        except FileNotFoundError:
            continue
        except (OSError, ValueError) as e:
            bad.append(f"{p / name} is not valid JSON ({e})")
    return bad


def check_prompt_rendering(
    cfg: Any, prompt: Any, tokenizer: Any = None, model_dir: str | None = None
) -> None:
    """Render ``prompt`` as the actors will; a :class:`ConfigError` (one line) if that fails.

    ``tokenizer``: the one the caller loaded already (``asyncrl eval``); else the tokenizer of
    ``model_dir`` (default ``model.path``) is loaded (:func:`load_tokenizer`: a ConfigError when it
    cannot be); the tiny model (``model.path`` empty) is built by asyncrl and has no template.
    """
    from asyncrl.config import ConfigError  # here, not at the top: asyncrl.config imports asyncrl.tasks

    model_dir = str(model_dir or cfg.model.path or "")
    if tokenizer is None:
        if not model_dir:
            _messages_unrendered(prompt, "the built-in tiny model has no chat template")
            _system_prompt_unused(cfg, "the built-in tiny model has no chat template")
            return
        tokenizer = load_tokenizer(cfg, model_dir)
    mode = cfg.model.chat_template
    if mode == "on" and not getattr(tokenizer, "chat_template", None):
        # Before rendering: its error, with task.system_prompt set, advised removing the system prompt.
        raise ConfigError(
            f"model.chat_template='on' but the tokenizer of {model_dir or 'the model'} has no chat template: "
            "set model.chat_template=auto (the template when there is one, else plain text) or off (plain "
            "text), or use a model whose tokenizer has a chat template"
            + (
                " (task.system_prompt needs one: with plain text, remove it)"
                if cfg.task.system_prompt
                else ""
            )
        )
    plain = not uses_chat_template(tokenizer, mode)
    why = ("model.chat_template='off'" if mode == "off"
           else f"the tokenizer of {model_dir or 'the model'} has no chat template")  # fmt: skip
    if plain:
        _messages_unrendered(prompt, why)
    try:
        prompt_token_ids(tokenizer, prompt.text, mode, cfg.task.system_prompt)
    except Exception as e:
        if cfg.task.system_prompt:
            fix = "remove task.system_prompt (or put its text into the prompts themselves)"
        elif isinstance(prompt.text, Conversation):  # plain text cannot render messages
            fix = "fix the model's chat template, or write the prompt column as plain strings"
        else:
            fix = "fix the model's chat template, or set model.chat_template=off (plain text)"
        where = f" of {model_dir}" if model_dir else ""
        raise ConfigError(
            f"the chat template{where} refuses the task's prompts: {render_failure(cfg, prompt.prompt_id, e)}; {fix}"
        ) from None
    if plain:
        _system_prompt_unused(cfg, why)


def _messages_unrendered(prompt: Any, why: str) -> None:
    """A ConfigError when the task's prompts are chat-message lists (verl / OpenRLHF rows) but are to be
    plain text (``why``): only a chat template renders messages."""
    from asyncrl.config import ConfigError

    if isinstance(prompt.text, Conversation):
        raise ConfigError(
            f"the task's prompts are chat-message lists (prompt {prompt.prompt_id!r}: task.prompt_column holds "
            f"[{{'role': ..., 'content': ...}}, ...]) but the prompts are plain text ({why}): use a model whose "
            "tokenizer has a chat template (model.chat_template=auto or on), or write the prompt column as "
            "plain strings"
        )


def _system_prompt_unused(cfg: Any, why: str) -> None:
    """A ConfigError when ``task.system_prompt`` is set but prompts are plain text (``why``): only a chat
    template has a system turn, so the text would be dropped without a word (a user's config silently
    ignored: the policy trains and is evaluated without the instruction the user wrote)."""
    from asyncrl.config import ConfigError

    if cfg.task.system_prompt:
        raise ConfigError(
            f"task.system_prompt={cfg.task.system_prompt!r} is set but the prompts are plain text ({why}): "
            "a system prompt needs a chat template; remove task.system_prompt (or put its text into the "
            "prompts themselves), or use a model whose tokenizer has a chat template"
        )
