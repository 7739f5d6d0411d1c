"""rollout-sdk: an asyncio-native rollout SDK for RL post-training of LLMs.  No Ray.

Importing this package starts nothing and imports neither torch nor transformers; those load when an
engine starts.

    import asyncio
    from rollout_sdk import RolloutClient, SamplingParams

    async def main():
        async with RolloutClient() as client:          # embedded CPU engine
            r = await client.generate([151644, 872, 198], sampling=SamplingParams(max_new_tokens=16))
            print(r.output_ids, r.logprobs)

    asyncio.run(main())
"""

from ._stream import Group, ResultStream
from .client import ClientConfig, ClientStats, RolloutClient, ServerStatus
from .discovery import Discovery, EmbeddedServers, StaticServers
from .engines.base import Engine, EngineLoad
from .engines.cpu import CpuEngine, CpuEngineConfig
from .errors import (
    ClientStateError,
    ConfigError,
    DiscoveryError,
    DuplicateRequestError,
    EngineBusyError,
    EngineDeadError,
    EngineError,
    EngineStartupError,
    InvalidRequestError,
    MessageTooLargeError,
    NoServersError,
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
    TransportError,
    UnsupportedOperationError,
    WeightUpdateError,
)
from .partial import Continuation
from .policies import LeastLoad, Policy, RoundRobin
from .protocol import GenerateRequest, GenerateResult, SamplingParams
from .rollouts import GenerateAgent, RolloutBatch, RolloutStream
from .scheduler import SchedulerConfig
from .server import EngineServer, ServerConfig

__version__ = "0.1.0"

__all__ = [
    "ClientConfig",
    "ClientStateError",
    "ClientStats",
    "ConfigError",
    "Continuation",
    "CpuEngine",
    "CpuEngineConfig",
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
    "LeastLoad",
    "MessageTooLargeError",
    "NoServersError",
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
    "ServerBusyError",
    "ServerConfig",
    "ServerShuttingDownError",
    "ServerStatus",
    "ServerUnavailableError",
    "StalenessError",
    "StaticServers",
    "TransportError",
    "UnsupportedOperationError",
    "WeightUpdateError",
    "__version__",
]
