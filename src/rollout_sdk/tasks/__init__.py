"""Tasks a local model is trained on, on CPU, so that the demo and the RL example show real behaviour.

* :mod:`.calculator`: arithmetic delegated to a ``calculator`` tool in Qwen2.5's ``<tool_call>`` format
  (instances with a held-back split, the tool, the reward, the agent).
* :func:`ensure_tool_model`: a tiny Qwen2 (the embedded default's architecture, tokenizer and chat
  template) trained once to solve it; ``stage="undertrained"`` is the RL example's starting point.
"""

from __future__ import annotations

from .tool_model import ensure_tool_model

__all__ = ["ensure_tool_model"]
