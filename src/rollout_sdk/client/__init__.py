"""The client: :class:`RolloutClient` (``client.py``), what it is told and where it is (``config.py``),
what it reports (``stats.py``), and its members joining and leaving (``fleet.py``)."""

from ..rollouts.generator import USE_CLIENT_DEFAULT
from .client import PauseMode as PauseMode  # the type aliases of pause= and method=, for annotations
from .client import RolloutClient
from .client import WeightMethod as WeightMethod
from .config import ClientConfig, ClientState
from .stats import ClientStats, ServerStatus

__all__ = ["USE_CLIENT_DEFAULT", "ClientConfig", "ClientState", "ClientStats", "RolloutClient", "ServerStatus"]
