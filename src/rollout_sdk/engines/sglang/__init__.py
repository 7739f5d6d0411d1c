"""The SGLang backend (GPU; sglang is imported lazily, on start).

:mod:`.engine` (lifecycle and generation), :mod:`.control` (the gate, pause, memory, weight updates),
:mod:`.config` (``SglangEngineConfig``, the one place SGLang's arguments are made).
"""

from .config import SglangEngineConfig
from .engine import SglangEngine

__all__ = ["SglangEngine", "SglangEngineConfig"]
