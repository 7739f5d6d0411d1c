"""Which engine a server runs: one registry of the backends, by name (``--engine cpu|fake|sglang``).

Both entry points that start a server (``rollout-sdk serve`` and the torchrun launcher) build their engine
here, so a backend is added, and its defaults are applied, in one place.  The backends import lazily: a
CPU server never imports sglang.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..errors import ConfigError
from ..protocol.engine_config import CpuEngineConfig
from .base import Engine
from .fake import FakeEngine, FakeEngineConfig

__all__ = ["ENGINE_KINDS", "EngineConfigs", "make_engine"]

#: the backends a server can run
ENGINE_KINDS = ("cpu", "fake", "sglang")


@dataclass(kw_only=True)
class EngineConfigs:
    """The configuration of each backend; ``make_engine`` uses the one it is asked for."""

    cpu: CpuEngineConfig = field(default_factory=CpuEngineConfig)
    fake: FakeEngineConfig = field(default_factory=FakeEngineConfig)
    #: SglangEngineConfig's fields (a dict: sglang's config imports nothing until the engine starts)
    sglang: dict[str, Any] = field(default_factory=dict)


def make_engine(
    kind: str, configs: EngineConfigs, *, model: str | None = None, sglang_defaults: Mapping[str, Any] | None = None
) -> Engine:
    """The engine of backend ``kind``: ``model`` (when given) replaces the configured model path;
    ``sglang_defaults`` fill SGLang fields the configuration leaves unset (the launcher's TP layout)."""
    if kind == "cpu":
        from .cpu import CpuEngine  # lazy: cli-start

        return CpuEngine(dataclasses.replace(configs.cpu, model_path=model) if model else configs.cpu)
    if kind == "fake":
        return FakeEngine(configs.fake)
    if kind == "sglang":
        from .sglang import SglangEngine, SglangEngineConfig  # lazy: cli-start

        fields = {**(sglang_defaults or {}), **configs.sglang}
        if model:
            fields["model_path"] = model
        if not fields.get("model_path"):
            raise ConfigError("--model", None, "is required with --engine sglang (a model directory or hub name)")
        return SglangEngine(SglangEngineConfig(**fields))
    raise ConfigError("engine", kind, f"must be one of {', '.join(ENGINE_KINDS)}")
