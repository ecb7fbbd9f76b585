"""Prompts too long for the engines, counted at start instead of dead-lettered one by one at run time.

Why: vLLM refuses a prompt of ``model.max_model_len`` tokens or more (prompt plus at least one
generated token must fit), and cuts a completion at ``model.max_model_len``. Such a prompt was found
only when an actor drew it: its group was dead-lettered (``refused by the engine``), epoch after epoch,
and a data set whose prompts were all too long ran, with Redis, Ray, vLLM and the learner up, without
one learner step. :func:`check_prompt_lengths` (called by :func:`asyncrl.tasks.registry.check_task`
before any role starts) renders every training prompt (and the eval prompts when the command
evaluates) exactly as the actors do (:func:`asyncrl.tasks.chat.prompt_token_ids`, in batches) and:

* fails with a :class:`ConfigError` when **every** training prompt (or every eval prompt the command
  needs) is refused: nothing could be trained (or scored);
* warns, once, with the count, the first such prompt (its id and data row) and its length, and the keys
  (``model.max_model_len``, ``actors.max_tokens``) when only **some** are refused, or leave the
  completion less than ``actors.max_tokens`` (their completions are cut): a few long rows of a large
  data set must not stop a run. They are not dropped from the task: the prompt order is the run's
  (its resume depends on it), so a refused prompt costs one dead letter when its turn comes, never a
  learner step.

Imports neither torch, vllm nor ray at module level (the tokenizer comes loaded, or is the tiny model's).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from typing import Any

from .chat import Conversation, prompt_messages, prompt_token_ids, uses_chat_template

__all__ = ["check_prompt_lengths", "prompt_lengths"]

log = logging.getLogger(__name__)

#: Prompts rendered and tokenized per batch (the fast tokenizers encode a batch in parallel).
CHUNK = 1024
#: Tokens a tokenizer may add beyond one per byte of its input (BOS / EOS, SentencePiece's prefix space).
SLACK = 8


def prompt_lengths(
    tokenizer: Any, texts: Sequence[str], mode: str, system_prompt: str = "", at_least: int = 0
) -> list[int | None]:
    """``len(prompt_token_ids(tokenizer, text, mode, system_prompt))`` of each text, batched; None for a
    text the chat template refuses (the actors dead-letter it: asyncrl.tasks.render_check).

    ``at_least``: only lengths of ``at_least`` tokens or more matter; a prompt whose rendered text has
    fewer UTF-8 bytes than that (less :data:`SLACK`) is given that bound, not tokenized: every token of a
    byte-level BPE, SentencePiece or WordPiece vocabulary spells at least one byte (special tokens in the
    rendered template too), so it has no more tokens than that. Tokenizing 100k prompts took ~20 s on two
    cores; most prompts of most data sets are far below ``model.max_model_len``."""
    out: list[int | None] = []
    chat = uses_chat_template(tokenizer, mode)
    for start in range(0, len(texts), CHUNK):
        part = list(texts[start : start + CHUNK])
        try:
            if chat:  # as apply_chat_template(tokenize=True): rendered, then tokenized without specials
                rendered = tokenizer.apply_chat_template([prompt_messages(t, system_prompt) for t in part],
                                                         add_generation_prompt=True, tokenize=False)  # fmt: skip
            elif any(isinstance(t, Conversation) for t in part):
                raise ValueError("a message-list prompt as plain text")  # one by one below: None
            else:
                rendered = part
            lengths: list[int | None] = [len(r.encode()) + SLACK for r in rendered]
            todo = [k for k, n in enumerate(lengths) if n is not None and n >= at_least]
            if todo:
                enc = tokenizer(
                    [rendered[k] for k in todo], **({"add_special_tokens": False} if chat else {})
                )
                for k, ids in zip(todo, enc["input_ids"], strict=True):
                    lengths[k] = len(ids)
            out.extend(lengths)
        except Exception:  # a template that refuses some prompts: those, one by one
            for t in part:
                try:
                    out.append(len(prompt_token_ids(tokenizer, t, mode, system_prompt)))
                except Exception:
                    out.append(None)
    return out


def _where(prompt_id: str) -> str:
    """``prompt 'echo-17' (row 17)``: a data task's prompt ids end in the row's index in its file."""
    m = re.search(r"-(\d+)$", prompt_id)
    return f"prompt {prompt_id!r}" + (f" (row {m.group(1)})" if m else "")


def check_prompt_lengths(cfg: Any, task: Any, tokenizer: Any = None, eval_needed: bool = False) -> list[str]:
    """Check the lengths of ``task``'s training prompts (and eval prompts with ``eval_needed``) against
    ``model.max_model_len`` and ``actors.max_tokens`` (``eval.max_tokens``) as the module doc says. Returns
    the warnings it logged. ``tokenizer``: the model's (None: the built-in tiny model's)."""
    from asyncrl.config import ConfigError  # here, not at the top: asyncrl.config imports asyncrl.tasks

    limit, warnings = cfg.model.max_model_len, []
    if tokenizer is None:  # the built-in tiny model's (not one token per character: its split drops some)
        from asyncrl.tinymodel import build_tokenizer

        tokenizer = build_tokenizer()
    sets = [("training", task.prompts, "actors.max_tokens", cfg.actors.max_tokens)]
    if eval_needed and task.eval_prompts:
        eval_key = "eval.max_tokens" if cfg.eval.max_tokens else "actors.max_tokens"
        sets.append(("eval", task.eval_prompts, eval_key, cfg.eval.max_tokens or cfg.actors.max_tokens))
    for label, prompts, key, max_tokens in sets:
        texts = [p.text for p in prompts]
        floor = limit - max_tokens + 1  # the shortest prompt that matters: its completion is cut
        lengths = prompt_lengths(tokenizer, texts, cfg.model.chat_template, cfg.task.system_prompt, floor)
        n = len(prompts)
        refused = [(p, x) for p, x in zip(prompts, lengths, strict=True) if x is not None and x >= limit]
        cut = [
            (p, x)
            for p, x in zip(prompts, lengths, strict=True)
            if x is not None and limit - max_tokens < x < limit
        ]
        unrendered = [p for p, x in zip(prompts, lengths, strict=True) if x is None]
        keys = f"model.max_model_len={limit}"
        fate = ("each is dead-lettered when its turn comes, never trained" if label == "training"
                else "the eval skips each (its prompts_refused)")  # fmt: skip
        if refused and len(refused) == n:
            shortest = min(x for _, x in refused)
            raise ConfigError(
                f"all {n} {label} prompts of task {task.name!r} are too long for {keys}: the engine refuses a "
                f"prompt of max_model_len tokens or more (the shortest has {shortest}; first: "
                f"{_where(refused[0][0].prompt_id)}, {refused[0][1]} tokens); raise model.max_model_len to at "
                f"least {shortest + max_tokens} (the shortest + {key}={max_tokens}), or shorten the prompts"
            )
        if refused:
            p, x = refused[0]
            warnings.append(
                f"{len(refused)} of {n} {label} prompts of task {task.name!r} are too long for {keys} (the engine "
                f"refuses a prompt of max_model_len tokens or more): {fate}; first: {_where(p.prompt_id)}, {x} tokens; "
                f"raise model.max_model_len (to {max(x for _, x in refused) + max_tokens} for all: the longest + "
                f"{key}={max_tokens}), or drop or shorten those rows"
            )
        if cut:
            p, x = cut[0]
            warnings.append(
                f"{len(cut)} of {n} {label} prompts of task {task.name!r} leave less than {key}={max_tokens} tokens "
                f"for the completion within {keys} (their completions are cut at max_model_len); first: "
                f"{_where(p.prompt_id)}, {x} tokens (room for {limit - x}); raise model.max_model_len or lower {key}"
            )
        if unrendered:
            warnings.append(
                f"{len(unrendered)} of {n} {label} prompts of task {task.name!r} are refused by the chat template "
                f"(model.chat_template={cfg.model.chat_template!r}): {fate}; first: {_where(unrendered[0].prompt_id)}"
            )
    for w in warnings:
        log.warning("%s", w)
    return warnings
