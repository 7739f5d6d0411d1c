"""The clients a server hears from: each one's fair share of the server, and the requests of a client that
has gone (orphans), aborted so their results do not go nowhere.

Not the client-side ``rollout_sdk.client.admission`` (a client's in-flight window per server): this is the
server refusing a client beyond its share.  The server owns one :class:`Peers` and calls it on its event
loop; one task of the server's task group runs :meth:`Peers.sweep`::

    client sweeper ... waits on: a timer; a client silent (no message, not even a heartbeat Ping) for
                        ``client_timeout_s`` is probed with a Pong: one still connected keeps its requests,
                        one whose connection is gone has them aborted

Fair share: at most ``max_requests`` requests are accepted in all, and one client at most
``max_requests`` / (clients that sent a GenerateRequest within ``FAIR_WINDOW_S`` or hold requests); beyond
either it is answered ``busy`` (ServerBusyError) without running anything.  A "client" is its credential
where authentication is on (the role of its CURVE key: throwaway identities with one key share that key's
share) and its ROUTER identity where it is off.  A Ping or any other message does not make a client count:
an identity that only pings dilutes nobody's share, and one that sent a request stops counting
``FAIR_WINDOW_S`` after it, once nothing of it is in flight.  The identities tracked for the orphan sweep
are bounded (``max_tracked``; the oldest that hold nothing are dropped first), and a silent one that holds
nothing is dropped at the next sweep without a probe.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Callable

from .._transport import RouterEndpoint
from ..errors import ServerBusyError
from ..protocol import Pong, ServerStats, encode

__all__ = ["FAIR_WINDOW_S", "Peers"]

#: a client that sent a GenerateRequest within this many seconds (or holds requests) counts for fair share
FAIR_WINDOW_S = 2.0

log = logging.getLogger("rollout_sdk.server")


class Peers:
    """Per-client request counts and last-heard times, keyed by the peer's ROUTER identity.

    ``abort_client(ident)`` aborts every request of that client on the engine and returns how many.
    """

    def __init__(
        self,
        server_id: str,
        *,
        max_requests: int,
        client_timeout_s: float,
        abort_client: Callable[[bytes], int],
        max_tracked: int | None = None,
    ) -> None:
        self._server_id = server_id
        self._max_requests = max_requests
        self._timeout = client_timeout_s
        self._abort_client = abort_client
        #: identities tracked at once (their last-heard times); more than the requests that can be held
        self.max_tracked = max(max_tracked if max_tracked is not None else max_requests + 4096, max_requests + 1)
        self._per_client: dict[bytes, int] = {}  # ident -> requests accepted and not yet answered
        # ident -> loop time of its last message, oldest first (bounded by max_tracked)
        self._last_seen: collections.OrderedDict[bytes, float] = collections.OrderedDict()
        self._per_share: dict[bytes, int] = {}  # fair-share key -> requests accepted and not yet answered
        # fair-share key -> loop time of its last GenerateRequest, oldest first: the clients counted
        self._recent: collections.OrderedDict[bytes, float] = collections.OrderedDict()
        self._ident_share: dict[bytes, bytes] = {}  # ident holding requests -> its fair-share key
        # clients whose requests were aborted as orphans and not heard from since: each of those aborts
        # answers ``abort`` to a peer that is gone, which must not forget (and log) the client again;
        # an ident leaves when the client speaks again or its last request is answered (bounded)
        self._forgotten: set[bytes] = set()

    def heard(self, ident: bytes, now: float) -> None:
        """The client sent a message (at loop time ``now``)."""
        seen = self._last_seen
        seen[ident] = now
        seen.move_to_end(ident)
        self._forgotten.discard(ident)
        while len(seen) > self.max_tracked:  # drop the oldest that hold nothing (fewer than max_tracked hold)
            old = next(iter(seen))
            if old in self._per_client:
                seen.move_to_end(old)  # kept, with its time (the sweep reads times, not the order)
            else:
                del seen[old]

    @property
    def tracked(self) -> int:
        """Identities tracked now (bounded by ``max_tracked``)."""
        return len(self._last_seen)

    @property
    def counted(self) -> int:
        """Clients counted for fair share now."""
        return len(self._recent)

    def holds(self, ident: bytes) -> bool:
        """Whether the client has requests accepted and not yet answered."""
        return ident in self._per_client

    def admit(self, ident: bytes, in_flight: int, now: float, share_key: bytes | None = None) -> None:
        """Raise ServerBusyError beyond the server's cap or this client's fair share of it.  ``share_key``
        is the client's credential (None: its identity)."""
        key = ident if share_key is None else share_key
        recent = self._recent
        recent[key] = now
        recent.move_to_end(key)
        while recent:  # stale clients stop counting, unless they still hold requests (they count as fresh)
            old, t = next(iter(recent.items()))
            if now - t <= FAIR_WINDOW_S:
                break
            del recent[old]
            if old in self._per_share:
                recent[old] = now
        cap = self._max_requests
        total = in_flight
        clients = max(1, len(recent))
        share = max(1, cap // clients)
        mine = self._per_share.get(key, 0)
        if total >= cap or mine >= share:
            raise ServerBusyError(
                f"server {self._server_id} is busy: {total}/{cap} requests accepted, this client holds {mine} "
                f"(fair share {share} of {clients} client(s))"
            )

    def accepted(self, ident: bytes, share_key: bytes | None = None) -> None:
        """A request of the client was accepted."""
        key = ident if share_key is None else share_key
        self._per_client[ident] = self._per_client.get(ident, 0) + 1
        self._per_share[key] = self._per_share.get(key, 0) + 1
        self._ident_share[ident] = key

    def answered(self, ident: bytes) -> None:
        """A request of the client was answered (or failed)."""
        key = self._ident_share.get(ident, ident)
        left = self._per_share.get(key, 1) - 1
        if left > 0:
            self._per_share[key] = left
        else:
            self._per_share.pop(key, None)
        left = self._per_client.get(ident, 1) - 1
        if left > 0:
            self._per_client[ident] = left
        else:
            self._per_client.pop(ident, None)
            self._ident_share.pop(ident, None)
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
            for ident in silent:  # holding nothing here: nothing to abort, no need to probe or track it
                if ident not in self._per_client:
                    del self._last_seen[ident]
            silent = [ident for ident in silent if ident in self._per_client]
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
