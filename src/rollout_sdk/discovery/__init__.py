"""How a client finds its servers.  Pluggable: anything with ``open`` and ``close`` will do.

* :class:`StaticServers` — addresses you already know (``RolloutClient(servers=[...])``).
* :class:`EmbeddedServers` — starts CPU-engine servers inside this process, on ephemeral loopback ports,
  and stops them on close: the embedded default of ``RolloutClient()``.  They authenticate with keys made
  for this process alone (a fresh job secret), which the client picks up from ``credentials``, so another
  local user cannot drive them.
* :class:`StoreDiscovery` (in :mod:`rollout_sdk.discovery.store`) — servers launched by torchrun that
  registered in the job's c10d store.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from .._aio import cancel_and_wait
from ..auth import Credentials, JobSecret
from ..errors import ConfigError

if TYPE_CHECKING:
    from ..protocol.engine_config import CpuEngineConfig

__all__ = ["Discovery", "EmbeddedServers", "StaticServers"]

log = logging.getLogger("rollout_sdk.discovery")

#: seconds between the lines that say the embedded engine is still starting
STILL_STARTING_EVERY_S = 4.0  # under 5 s with a tick's jitter on a busy machine (issue 37: no silence > ~5 s)


async def _say_still_starting() -> None:
    """While the embedded engine starts, a line every few seconds: no one waits in silence (issue 37).  A
    script with no logging set up shows only warnings (Python's last-resort handler), so there it is one,
    like the client's first line; where logging is configured (an application, the CLI) it is information."""
    t0 = time.perf_counter()
    level = logging.INFO if logging.getLogger().hasHandlers() else logging.WARNING
    while True:
        await asyncio.sleep(STILL_STARTING_EVERY_S)
        log.log(
            level,
            "the embedded CPU engine is still starting (%.0fs: importing torch, loading the model; slower on a "
            "busy machine)",
            time.perf_counter() - t0,
        )


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

    def __init__(
        self, engine: CpuEngineConfig | None = None, *, num_servers: int = 1, secret: JobSecret | None = None
    ) -> None:
        if num_servers < 1:
            raise ConfigError("num_servers", num_servers, "must be >= 1")
        self.engine = engine
        self.num_servers = num_servers
        #: the running ``EngineServer`` objects (engine-side, so named here only by what discovery uses)
        self.servers: list[Any] = []
        self._secret = secret
        #: control credentials for these servers (set by ``open``)
        self.credentials: Credentials | None = None

    async def open(self, timeout: float) -> list[str]:
        secret = self._secret or JobSecret.generate()
        auth = secret.server_auth()
        self.credentials = secret.credentials("control")

        ticker = asyncio.get_running_loop().create_task(_say_still_starting(), name="embedded-start-ticker")
        try:
            async with asyncio.timeout(timeout):
                # the seam to the engine side, by module name (the trainer's door imports none of it): it
                # imports torch (seconds; more on a busy machine), off the event loop, so the ticker can
                # say that the start goes on
                server_mod = await asyncio.to_thread(importlib.import_module, "rollout_sdk.server")
                engines = await asyncio.to_thread(importlib.import_module, "rollout_sdk.engines.cpu")
                for i in range(self.num_servers):
                    config = server_mod.ServerConfig(server_id=f"embedded-{i}", dp_rank=i, auth=auth, stall_warns=False)
                    server = server_mod.EngineServer(engines.CpuEngine(self.engine), config)
                    await server.__aenter__()
                    self.servers.append(server)
        except BaseException:
            await self.close()
            raise
        finally:
            await cancel_and_wait(ticker)
        return [s.address for s in self.servers]

    async def close(self) -> None:
        servers, self.servers = self.servers, []
        for s in servers:
            await s.aclose()
