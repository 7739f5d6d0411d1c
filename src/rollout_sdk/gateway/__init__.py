"""An OpenAI-compatible gateway: black-box agents train through rollout-sdk with exact tokens.

See docs/gateway.md.  Importing this package imports no HTTP stack and starts nothing; the ``gateway``
extra (aiohttp) is needed once a :class:`Gateway` opens.
"""

from .config import GatewayConfig
from .errors import GatewayError
from .gateway import Gateway, SessionHandle, read_trajectories
from .records import SessionRecord, TurnSlice, discounted_returns
from .sampling import SessionSampling
from .sessions import Session

__all__ = [
    "Gateway",
    "GatewayConfig",
    "GatewayError",
    "Session",
    "SessionHandle",
    "SessionRecord",
    "SessionSampling",
    "TurnSlice",
    "discounted_returns",
    "read_trajectories",
]
