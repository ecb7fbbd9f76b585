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

A :class:`Conversation` (a data row whose prompt column holds a verl / OpenRLHF message list,
``[{"role": ..., "content": ...}, ...]``) is rendered as those messages (``system_prompt`` prepended
when it has no system message of its own); it needs a chat template. It is a ``str`` (its last user
turn: what the reward function gets as ``prompt``) carrying ``.messages``, so every caller that renders
``prompt.text`` renders the whole conversation without knowing about it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["CHAT_TEMPLATE_MODES", "Conversation", "uses_chat_template", "prompt_messages", "prompt_token_ids"]

CHAT_TEMPLATE_MODES = ("auto", "on", "off")


class Conversation(str):
    """A message-list prompt: as a ``str`` its last user turn's content; ``messages`` the whole list
    (dicts with a string ``role`` and ``content``, checked by :func:`asyncrl.tasks.data.to_conversation`)."""

    messages: tuple[dict[str, Any], ...]

    def __new__(cls, messages: Sequence[dict[str, Any]]) -> Conversation:
        user = [m["content"] for m in messages if m.get("role") == "user"]
        obj = super().__new__(cls, user[-1] if user else "")
        obj.messages = tuple(dict(m) for m in messages)
        return obj

    def __reduce__(self) -> tuple[Any, ...]:
        return (Conversation, ([dict(m) for m in self.messages],))

    def __repr__(self) -> str:
        return f"Conversation({list(self.messages)!r})"


def uses_chat_template(tokenizer: Any, mode: str) -> bool:
    """Whether prompts are rendered with ``tokenizer``'s chat template under ``mode``."""
    if mode not in CHAT_TEMPLATE_MODES:
        raise ValueError(f"model.chat_template={mode!r}; allowed: {', '.join(CHAT_TEMPLATE_MODES)}")
    has = bool(getattr(tokenizer, "chat_template", None))
    if mode == "on" and not has:
        raise ValueError("model.chat_template=on but the model's tokenizer has no chat template")
    return has and mode != "off"


def prompt_messages(text: str, system_prompt: str = "") -> list[dict[str, Any]]:
    """The messages the chat template renders for prompt ``text`` (a str or a :class:`Conversation`)."""
    if isinstance(text, Conversation):
        messages = [dict(m) for m in text.messages]
        if system_prompt and not any(m.get("role") == "system" for m in messages):
            messages.insert(0, {"role": "system", "content": system_prompt})
        return messages
    messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    messages.append({"role": "user", "content": str(text)})
    return messages


def prompt_token_ids(tokenizer: Any, text: str, mode: str = "auto", system_prompt: str = "") -> list[int]:
    """Token ids of the prompt ``text`` as the engine sees it (see the module doc)."""
    if not uses_chat_template(tokenizer, mode):
        if isinstance(text, Conversation):
            raise ValueError(
                "a message-list prompt needs a chat template, and the prompts are plain text "
                f"(model.chat_template={mode!r})"
            )
        return list(tokenizer(text)["input_ids"])
    ids = tokenizer.apply_chat_template(
        prompt_messages(text, system_prompt), add_generation_prompt=True, tokenize=True
    )
    if isinstance(ids, dict) or hasattr(ids, "keys"):  # BatchEncoding in newer transformers
        ids = ids["input_ids"]
    return [int(i) for i in ids]
