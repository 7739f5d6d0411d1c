"""Reasoning split off a turn's text before its tool calls are parsed."""

from __future__ import annotations

from typing import Protocol, runtime_checkable


@runtime_checkable
class ReasoningParser(Protocol):
    """Splits a turn's text into its reasoning and its content.  ``split`` must not raise on any text.

    Returns ``(reasoning or None, content)``: ``None`` when the text holds no reasoning.  The agent loop
    and the gateway parse tool calls in the content only, so calls drafted while reasoning never run.
    """

    def split(self, text: str) -> tuple[str | None, str]:
        """``(reasoning or None, content)``."""
        ...


class NoReasoningParser:
    """For models that do not reason in their output: everything is content."""

    def split(self, text: str) -> tuple[str | None, str]:
        return None, text


class ThinkReasoningParser:
    """``<think>...</think>`` reasoning (Qwen3, QwQ, DeepSeek-R1 and their distillations).

    * ``before<think>R</think>after``: reasoning ``R``, content ``before`` + ``after``;
    * ``R</think>after`` (the template put ``<think>`` in the prompt): reasoning ``R``;
    * ``<think>R`` never closed (cut by the token limit): all of ``R`` is reasoning, no content after it;
    * no think tags: ``(None, text)``, the text unchanged;
    * tags after the point where the first tool call starts (``split(text, calls_at=...)``, given by
      :func:`split_reasoning`) are not reasoning: they are the call's text (``{"content": "</think>"}``).

    Reasoning and content are stripped of surrounding whitespace.  The first ``</think>`` ends the
    reasoning.  ``opened_by_prompt=True`` (name ``"think_open"``) is for templates that always open the
    block in the prompt: text without ``</think>`` is then all reasoning (a turn cut while thinking).
    """

    open_tag = "<think>"
    close_tag = "</think>"

    def __init__(self, *, opened_by_prompt: bool = False) -> None:
        self.opened_by_prompt = opened_by_prompt

    def split(self, text: str, *, calls_at: int = -1) -> tuple[str | None, str]:
        """``calls_at``: where the first tool call could start (the tool-call parser's ``call_start``;
        -1: nowhere, or not known).  A block is recognised only where the model opens one, before that:
        ``<think>`` or ``</think>`` inside a call's arguments is the argument's text, never reasoning.
        Calls after an opened ``<think>`` and before its ``</think>`` are drafts: reasoning."""
        if self.opened_by_prompt:  # the text starts inside the block: its first </think> ends it
            calls_at = -1
        limit = len(text) if calls_at < 0 else calls_at
        start = text.find(self.open_tag, 0, limit)
        close = text.find(self.close_tag, 0, limit)
        if start != -1 and (close == -1 or start < close):
            before = text[:start]
            body = start + len(self.open_tag)
            close = text.find(self.close_tag, body)
            if close == -1:
                return text[body:].strip(), before.strip()
            return text[body:close].strip(), (before + text[close + len(self.close_tag) :]).strip()
        if close != -1:
            return text[:close].strip(), text[close + len(self.close_tag) :].strip()
        if self.opened_by_prompt:
            return text.strip(), ""
        return None, text
