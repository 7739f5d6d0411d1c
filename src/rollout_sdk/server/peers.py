"""The clients a server hears from: each one's fair share of the server, and the requests of a client that
has gone (orphans), aborted so their results do not go nowhere.

Not the client-side ``rollout_sdk.admission`` (a client's in-flight window per server): this is the
server refusing a client beyond its share.  The server owns one :class:`Peers` and calls it on its event
loop; one task of the server's task group runs :meth:`Peers.sweep`::

    client sweeper ... waits on: a timer; a client silent (no message, not even a heartbeat Ping) for
                        ``client_timeout_s`` is probed with a Pong: one still connected keeps its requests,
                        one whose connection is gone has them aborted

Fair share: at most ``max_requests`` requests are accepted in all, and one client at most
``max_requests`` / (clients heard from recently); beyond either it is answered ``busy``
(ServerBusyError) without running anything.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from .._transport import RouterEndpoint
from ..errors import ServerBusyError
from ..protocol import Pong, ServerStats, encode

__all__ = ["Peers"]

log = logging.getLogger("rollout_sdk.server")


class Peers:
    """Per-client request counts and last-heard times, keyed by the peer's ROUTER identity.

    ``abort_client(ident)`` aborts every request of that client on the engine and returns how many.
    """

    def __init__(
        self, server_id: str, *, max_requests: int, client_timeout_s: float, abort_client: Callable[[bytes], int]
    ) -> None:
        self._server_id = server_id
        self._max_requests = max_requests
        self._timeout = client_timeout_s
        self._abort_client = abort_client
        self._per_client: dict[bytes, int] = {}  # ident -> requests accepted and not yet answered
        self._last_seen: dict[bytes, float] = {}  # ident -> loop time of its last message
        # clients whose requests were aborted as orphans and not heard from since: each of those aborts
        # answers ``abort`` to a peer that is gone, which must not forget (and log) the client again;
        # an ident leaves when the client speaks again or its last request is answered (bounded)
        self._forgotten: set[bytes] = set()

    def heard(self, ident: bytes, now: float) -> None:
        """The client sent a message (at loop time ``now``)."""
        self._last_seen[ident] = now
        self._forgotten.discard(ident)

    def holds(self, ident: bytes) -> bool:
        """Whether the client has requests accepted and not yet answered."""
        return ident in self._per_client

    def admit(self, ident: bytes, in_flight: int) -> None:
        """Raise ServerBusyError beyond the server's cap or this client's fair share of it."""
        cap = self._max_requests
        total = in_flight
        clients = max(1, len(self._last_seen))
        share = max(1, cap // clients)
        mine = self._per_client.get(ident, 0)
        if total >= cap or mine >= share:
            raise ServerBusyError(
                f"server {self._server_id} is busy: {total}/{cap} requests accepted, this client holds {mine} "
                f"(fair share {share} of {clients} client(s))"
            )

    def accepted(self, ident: bytes) -> None:
        """A request of the client was accepted."""
        self._per_client[ident] = self._per_client.get(ident, 0) + 1

    def answered(self, ident: bytes) -> None:
        """A request of the client was answered (or failed)."""
        left = self._per_client.get(ident, 1) - 1
        if left > 0:
            self._per_client[ident] = left
        else:
            self._per_client.pop(ident, None)
            self._forgotten.discard(ident)

    def forget(self, ident: bytes, why: str) -> None:
        """The client is gone: abort what it left running (its results would go nowhere).  Once: the
        aborted requests' own undeliverable replies do not forget it again."""
        if ident in self._forgotten:
            return
        self._last_seen.pop(ident, None)
        if not self.holds(ident):
            return  # nothing of it runs here
        self._forgotten.add(ident)
        n = self._abort_client(ident)
        if n:
            log.warning("server %s: aborted %d request(s) of a client: %s", self._server_id, n, why)

    async def sweep(self, endpoint: RouterEndpoint, stats: Callable[[], ServerStats]) -> None:
        """A client silent for ``client_timeout_s`` is probed with a Pong: one still connected (its event
        loop blocked by a training step, say; libzmq answers the ZMTP heartbeats) keeps its requests; one
        whose connection is gone (closed, or dropped by the ZMTP heartbeat timeout) has them aborted."""
        timeout = self._timeout
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(min(1.0, timeout / 4))
            now = loop.time()
            silent = [ident for ident, seen in self._last_seen.items() if now - seen > timeout]
            if not silent:
                continue
            probe = encode(Pong(0, stats()))
            for ident in silent:
                if endpoint.send(ident, probe):
                    continue
                if endpoint.last_failure == "gone":
                    self.forget(ident, f"silent for {timeout:.0f}s and disconnected")
                else:
                    self._last_seen.pop(ident, None)  # connected but not reading: no longer counted
