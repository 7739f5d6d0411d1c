"""Models and tokenizers made locally (never downloaded).

* :func:`ensure_tiny_model`: the embedded default, random weights from a fixed seed (seconds to build).
* :func:`ensure_tiny_vl_model`: a tiny Qwen2.5-VL-shaped vision-language model, the same way (:mod:`.tiny_vl`).
  (The tool model, the same architecture trained on a task, is :func:`rollout_sdk.tasks.ensure_tool_model`.)
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from .tiny import ensure_tiny_model
from .tiny_vl import ensure_tiny_vl_model

__all__ = ["ensure_tiny_model", "ensure_tiny_vl_model", "load_tokenizer", "quiet_weight_loading"]


def load_tokenizer(path: str | None = None, *, home: str | None = None) -> Any:
    """A transformers tokenizer: ``path``'s, or the embedded tiny model's (Qwen2.5 token space and chat
    template, built offline).  Blocking (a second or two): call it off the event loop."""
    from transformers import AutoTokenizer  # lazy: transformers

    return AutoTokenizer.from_pretrained(path or str(ensure_tiny_model(home)))


@contextlib.contextmanager
def quiet_weight_loading() -> Iterator[None]:
    """Hide transformers' "Loading weights" progress bar inside the block (a model load is a step of
    starting an engine, which logs its own start), and restore the setting after.

    The setting is process-wide: a load in another thread during the block is quiet too.
    """
    try:
        from transformers.utils import logging as hf_logging  # lazy: transformers
    except ImportError:  # pragma: no cover - transformers is a dependency
        yield
        return
    was = hf_logging.is_progress_bar_enabled()  # type: ignore[no-untyped-call]
    hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]
    try:
        yield
    finally:
        if was:
            hf_logging.enable_progress_bar()  # type: ignore[no-untyped-call]
