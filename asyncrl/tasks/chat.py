"""Prompt text -> prompt token ids, through the model's chat template when it has one.

One function, :func:`prompt_token_ids`, used by the actors (what the engine is prompted with and
what goes into the wire record's ``prompt_ids``), by ``asyncrl eval`` and by the periodic eval. The
learner never re-tokenizes: it trains on the record's ``prompt_ids``, so actor and learner tokens are
identical by construction.

``mode`` (``model.chat_template``):

* ``auto``: use the template when the tokenizer has one (chat/instruct models), else plain text
  (the built-in tiny model has none: its prompts stay ``copy:ab=``);
* ``on``: require a template (error when the tokenizer has none);
* ``off``: always plain text.

With a template the prompt is ``[system (when system_prompt is set), user = text]`` rendered with
``add_generation_prompt=True``, so the completion is the assistant turn.
"""

from __future__ import annotations

from typing import Any

__all__ = ["CHAT_TEMPLATE_MODES", "uses_chat_template", "prompt_token_ids"]

CHAT_TEMPLATE_MODES = ("auto", "on", "off")


def uses_chat_template(tokenizer: Any, mode: str) -> bool:
    """Whether prompts are rendered with ``tokenizer``'s chat template under ``mode``."""
    if mode not in CHAT_TEMPLATE_MODES:
        raise ValueError(f"model.chat_template={mode!r}; allowed: {', '.join(CHAT_TEMPLATE_MODES)}")
    has = bool(getattr(tokenizer, "chat_template", None))
    if mode == "on" and not has:
        raise ValueError("model.chat_template=on but the model's tokenizer has no chat template")
    return has and mode != "off"


def prompt_token_ids(tokenizer: Any, text: str, mode: str = "auto", system_prompt: str = "") -> list[int]:
    """Token ids of the prompt ``text`` as the engine sees it (see the module doc)."""
    if not uses_chat_template(tokenizer, mode):
        return list(tokenizer(text)["input_ids"])
    messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    messages.append({"role": "user", "content": text})
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "keys"):  # BatchEncoding in newer transformers
        ids = ids["input_ids"]
    return [int(i) for i in ids]
