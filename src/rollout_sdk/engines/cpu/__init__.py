"""The CPU engine (HF transformers, continuous batching): the embedded default.

Split the way nano-vllm splits its engine: :mod:`.engine` (the Engine and its step loop),
:mod:`.scheduler` (waiting queue and admission), :mod:`.sequence` (one request, derived state as
properties), :mod:`.batch` (running rows and KV-cache surgery), :mod:`.model_runner` (model, step,
sampling, weights).
"""

from ...protocol.engine_config import CpuEngineConfig
from .engine import CpuEngine

__all__ = ["CpuEngine", "CpuEngineConfig"]
