"""How a client finds its servers.  Pluggable: anything with ``open`` and ``close`` will do.

* :class:`StaticServers` — addresses you already know (``RolloutClient(servers=[...])``).
* :class:`EmbeddedServers` — starts CPU-engine servers inside this process, on ephemeral ports, and
  stops them on close: the embedded default of ``RolloutClient()``.
* :class:`StoreDiscovery` (in :mod:`rollout_sdk.launch.discovery`) — servers launched by torchrun that
  registered in the job's c10d store.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from .errors import ConfigError

if TYPE_CHECKING:
    from .engines.cpu import CpuEngineConfig
    from .server import EngineServer

__all__ = ["Discovery", "EmbeddedServers", "StaticServers"]


@runtime_checkable
class Discovery(Protocol):
    """Finds servers: ``open`` returns their addresses, ``close`` releases what ``open`` started."""

    async def open(self, timeout: float) -> list[str]:
        """Return the servers' ZMQ addresses, waiting at most ``timeout`` seconds for them."""
        ...

    async def close(self) -> None:
        """Release whatever ``open`` started.  Idempotent."""
        ...

    # Optional: ``def watch(self) -> AsyncIterator[str]`` yielding the address of each server that appears
    # after ``open`` (StoreDiscovery has it); the client then adds each one by itself.


class StaticServers:
    """Servers at known addresses (``RolloutClient(servers=[...])``)."""

    def __init__(self, addresses: Sequence[str]) -> None:
        if isinstance(addresses, str):
            addresses = [addresses]
        if not addresses:
            raise ConfigError("servers", list(addresses), "needs at least one address")
        for a in addresses:
            if not isinstance(a, str) or "://" not in a:
                raise ConfigError("servers", a, "each address must look like 'tcp://host:port'")
        self.addresses = list(addresses)

    async def open(self, timeout: float) -> list[str]:
        return list(self.addresses)

    async def close(self) -> None:
        return None


class EmbeddedServers:
    """Run ``num_servers`` CPU-engine servers in this process (the embedded default)."""

    def __init__(self, engine: CpuEngineConfig | None = None, *, num_servers: int = 1) -> None:
        if num_servers < 1:
            raise ConfigError("num_servers", num_servers, "must be >= 1")
        self.engine = engine
        self.num_servers = num_servers
        self.servers: list[EngineServer] = []

    async def open(self, timeout: float) -> list[str]:
        from .engines.cpu import CpuEngine
        from .server import EngineServer, ServerConfig

        try:
            async with asyncio.timeout(timeout):
                for i in range(self.num_servers):
                    server = EngineServer(CpuEngine(self.engine), ServerConfig(server_id=f"embedded-{i}", dp_rank=i))
                    await server.__aenter__()
                    self.servers.append(server)
        except BaseException:
            await self.close()
            raise
        return [s.address for s in self.servers]

    async def close(self) -> None:
        servers, self.servers = self.servers, []
        for s in servers:
            await s.aclose()
