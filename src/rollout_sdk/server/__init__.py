"""The engine server: :class:`EngineServer` (``server.py``, the serving state machine), its
``ServerConfig`` (``config.py``), the clients it hears from (``peers.py``: fair share, orphans) and
large frames (``frames.py``: size limits, off-loop decoding)."""

from .config import ServerConfig
from .server import EngineServer, authorize

__all__ = ["EngineServer", "ServerConfig", "authorize"]
