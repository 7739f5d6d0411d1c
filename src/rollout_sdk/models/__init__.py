"""Models and tokenizers made locally (never downloaded): the embedded default's."""

from __future__ import annotations

from typing import Any

from .tiny import ensure_tiny_model

__all__ = ["ensure_tiny_model", "load_tokenizer"]


def load_tokenizer(path: str | None = None, *, home: str | None = None) -> Any:
    """A transformers tokenizer: ``path``'s, or the embedded tiny model's (Qwen2.5 token space and chat
    template, built offline).  Blocking (a second or two): call it off the event loop."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path or str(ensure_tiny_model(home)))
