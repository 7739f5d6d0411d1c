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

from .auth import Credentials, JobSecret, ServerAuth
from .client import USE_CLIENT_DEFAULT, ClientConfig, ClientState, ClientStats, RolloutClient, ServerStatus
from .client.admission import AdmissionConfig, AdmissionController
from .client.policies import LeastLoad, Policy, RoundRobin
from .client.scheduler import SchedulerConfig
from .discovery import Discovery, EmbeddedServers, StaticServers
from .engines.base import Engine, EngineLoad
from .engines.cpu import CpuEngine, CpuEngineConfig
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
)
from .protocol import GenerateRequest, GenerateResult, SamplingParams
from .rollouts import Continuation, GenerateAgent, Group, ResultStream, RolloutBatch, RolloutStream
from .server import EngineServer, ServerConfig

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
    "__version__",
]
