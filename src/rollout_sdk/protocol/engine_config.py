"""The embedded CPU engine's configuration, :class:`CpuEngineConfig`.

It sits here, below both sides, because both name it: the trainer tells the engine it starts what to run
(``RolloutClient(engine=...)``, the demos, the commands) and the engine side (``rollout_sdk.engines.cpu``)
runs it.  Keeping it out of the engine package keeps a trainer's ``import rollout_sdk`` free of torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError
from .checks import check_config_types

__all__ = ["CpuEngineConfig"]


@dataclass(frozen=True, kw_only=True)
class CpuEngineConfig:
    """Configuration of :class:`~rollout_sdk.engines.cpu.CpuEngine`."""

    #: a local HF model directory; None builds/uses the embedded tiny Qwen2 model
    model_path: str | None = None
    #: rows decoded together per step (the most requests the engine runs at once)
    max_running: int = 128
    #: padded prompt tokens prefilled per step (at least one request is always admitted)
    max_prefill_tokens: int = 4096
    #: "float32" or "bfloat16"
    dtype: str = "float32"
    #: torch intra-op threads of the engine's worker thread (its own: the process's default is left as it
    #: was); None: one for a small model (hidden size < 512, like the embedded tiny models: its ops are too
    #: small to split, and split ones wait on any busy core; engines/cpu/threads.py), torch's default else
    num_threads: int | None = None
    #: context length; None takes the model's max_position_embeddings
    max_context: int | None = None
    #: seeds the generators of requests that carry no seed
    seed: int = 0
    #: requests whose images are decoded and expanded at once (each holds its decoded pixels meanwhile:
    #: ~200-300 MB for 16 images of 4096 x 4096); more wait their turn
    max_image_expansions: int = 2
    #: tokens of KV the prefix cache keeps of finished requests, found again by token prefix (a request
    #: sharing a prefix computes only the rest; an agent session's ``keep_kv_s`` pins its context there
    #: through its tool wait); 0 or None: off
    prefix_cache_tokens: int | None = 32768
    #: where the embedded tiny model is built (default $ROLLOUT_SDK_HOME or ~/.cache/rollout_sdk)
    home: str | None = None

    def __post_init__(self) -> None:
        check_config_types(self)  # a mistyped value fails here, naming the field, not deep inside
        if self.max_running < 1:
            raise ConfigError("max_running", self.max_running, "must be >= 1")
        if self.num_threads is not None and self.num_threads < 1:
            raise ConfigError("num_threads", self.num_threads, "must be >= 1 (or None: chosen by model size)")
        if self.max_image_expansions < 1:
            raise ConfigError("max_image_expansions", self.max_image_expansions, "must be >= 1")
        if self.max_prefill_tokens < 1:
            raise ConfigError("max_prefill_tokens", self.max_prefill_tokens, "must be >= 1")
        if self.prefix_cache_tokens is not None and self.prefix_cache_tokens < 0:
            raise ConfigError("prefix_cache_tokens", self.prefix_cache_tokens, "must be >= 0 (0 or None: off)")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ConfigError("dtype", self.dtype, "must be float32, bfloat16 or float16")
