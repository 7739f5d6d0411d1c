"""A stand-in for ``rollout_sdk.agents.parsers.get_reasoning_parser`` until that registry lands.

The gateway is written against the registry's interface: ``get_reasoning_parser(name).split(text)``
returns ``(reasoning, content)``.  ``"none"`` keeps the text whole; ``"think"`` splits a leading
``<think>...</think>`` block off (a text that opens a think block and never closes it is all reasoning:
the turn was cut inside it).  At merge this module becomes a re-export of the registry.
"""

from __future__ import annotations

from typing import Protocol

from ..errors import ConfigError

__all__ = ["ReasoningParser", "get_reasoning_parser"]


class ReasoningParser(Protocol):
    def split(self, text: str) -> tuple[str | None, str]: ...


class _NoReasoning:
    def split(self, text: str) -> tuple[str | None, str]:
        return None, text


class _Think:
    def split(self, text: str) -> tuple[str | None, str]:
        head = text.lstrip()
        if not head.startswith("<think>"):
            return None, text
        body = head[len("<think>") :]
        end = body.find("</think>")
        if end < 0:
            return body, ""
        return body[:end], body[end + len("</think>") :].lstrip("\n")


def get_reasoning_parser(name: str) -> ReasoningParser:
    if name == "none":
        return _NoReasoning()
    if name == "think":
        return _Think()
    raise ConfigError("reasoning_parser", name, "must be 'none' or 'think'")
