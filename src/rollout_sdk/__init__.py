"""rollout-sdk: an asyncio-native rollout SDK for RL post-training of LLMs.  No Ray.

Importing this package starts nothing and loads the trainer's side only (the client, discovery, the
rollouts layer): no torch, no transformers, no server, engine or model module.  The engine side
(``rollout_sdk.server``, ``rollout_sdk.engines``, ``rollout_sdk.weights``) is its own door; its public
names here (``CpuEngine``, ``Engine``, ``EngineLoad``, ``EngineServer``, ``ServerConfig``) load it when
first named (PEP 562), so ``from rollout_sdk import CpuEngine`` works and a trainer that never names
them never pays for torch.

    import asyncio
    from rollout_sdk import RolloutClient, SamplingParams

    async def main():
        async with RolloutClient() as client:          # embedded CPU engine
            r = await client.generate([151644, 872, 198], sampling=SamplingParams(max_new_tokens=16))
            print(r.output_ids, r.logprobs)

    asyncio.run(main())
"""

import importlib

from .auth import Credentials, JobSecret, ServerAuth
from .client import USE_CLIENT_DEFAULT, ClientConfig, ClientState, ClientStats, RolloutClient, ServerStatus
from .client.admission import AdmissionConfig, AdmissionController
from .client.policies import LeastLoad, Policy, RoundRobin
from .client.scheduler import SchedulerConfig
from .discovery import Discovery, EmbeddedServers, StaticServers
from .errors import (
    AuthenticationError,
    ClientStateError,
    ConfigError,
    DiscoveryError,
    DuplicateRequestError,
    EngineBusyError,
    EngineDeadError,
    EngineError,
    EngineStartupError,
    InvalidRequestError,
    LifecycleError,
    MessageTooLargeError,
    NoServersError,
    PermissionDeniedError,
    PoisonRequestError,
    ProtocolError,
    QueueFullError,
    RemoteError,
    RequestFailedError,
    RequestTimeoutError,
    RolloutError,
    ServerBusyError,
    ServerShuttingDownError,
    ServerUnavailableError,
    StalenessError,
    StreamClosedError,
    TransportError,
    UnsupportedOperationError,
    WeightUpdateError,
    WeightVersionError,
)
from .protocol import GenerateRequest, GenerateResult, SamplingParams
from .protocol.engine_config import CpuEngineConfig
from .rollouts import Continuation, GenerateAgent, Group, ResultStream, RolloutBatch, RolloutStream

__version__ = "0.1.0"

__all__ = [
    "USE_CLIENT_DEFAULT",
    "AdmissionConfig",
    "AdmissionController",
    "AuthenticationError",
    "ClientConfig",
    "ClientState",
    "ClientStateError",
    "ClientStats",
    "ConfigError",
    "Continuation",
    "CpuEngine",
    "CpuEngineConfig",
    "Credentials",
    "Discovery",
    "DiscoveryError",
    "DuplicateRequestError",
    "EmbeddedServers",
    "Engine",
    "EngineBusyError",
    "EngineDeadError",
    "EngineError",
    "EngineLoad",
    "EngineServer",
    "EngineStartupError",
    "GenerateAgent",
    "GenerateRequest",
    "GenerateResult",
    "Group",
    "InvalidRequestError",
    "JobSecret",
    "LeastLoad",
    "LifecycleError",
    "MessageTooLargeError",
    "NoServersError",
    "PermissionDeniedError",
    "PoisonRequestError",
    "Policy",
    "ProtocolError",
    "QueueFullError",
    "RemoteError",
    "RequestFailedError",
    "RequestTimeoutError",
    "ResultStream",
    "RolloutBatch",
    "RolloutClient",
    "RolloutError",
    "RolloutStream",
    "RoundRobin",
    "SamplingParams",
    "SchedulerConfig",
    "ServerAuth",
    "ServerBusyError",
    "ServerConfig",
    "ServerShuttingDownError",
    "ServerStatus",
    "ServerUnavailableError",
    "StalenessError",
    "StaticServers",
    "StreamClosedError",
    "TransportError",
    "UnsupportedOperationError",
    "WeightUpdateError",
    "WeightVersionError",
    "__version__",
]

#: the engine side's public names and the module of each, imported when first named (PEP 562)
_ENGINE_SIDE = {
    "CpuEngine": "rollout_sdk.engines.cpu",
    "Engine": "rollout_sdk.engines.base",
    "EngineLoad": "rollout_sdk.engines.base",
    "EngineServer": "rollout_sdk.server",
    "ServerConfig": "rollout_sdk.server",
}


def __getattr__(name: str) -> object:
    """An engine-side name, imported on first use and then kept here (the next lookup is a plain one)."""
    module = _ENGINE_SIDE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_ENGINE_SIDE})
