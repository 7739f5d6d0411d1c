"""The gateway's listening socket, with a bound on open connections.

::

    accept ──▶ open connections < max_connections ? ──yes──▶ aiohttp's request handler
                                                   └─no───▶ "503 too_many_connections", closed at once

The other connection-level bounds are aiohttp's, set by the gateway (``Gateway._open``): a connection
idle, or still sending a request head, ``header_timeout_s`` after it opened or after its last answer is
closed (aiohttp's keep-alive timeout, which also covers a connection that never completes its headers);
a request body that has not fully arrived ``body_timeout_s`` after its handler started reading it is
answered ``408`` and the connection closed (``routes._read``; the body's unread rest drained for at most
``gateway.LINGER_S``, 2 s, as after any answer given before the whole body arrived).  aiohttp has no
accept-time hook, so the bound is a site whose protocol factory counts aiohttp's live connections.
"""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import msgspec
from aiohttp import web

from .errors import error_body

__all__ = ["BoundedSite"]


def _busy_response() -> bytes:
    body = msgspec.json.encode(
        error_body(
            503,
            "too many open connections to this gateway (max_connections); retry later",
            type="server_error",
            code="too_many_connections",
        )
    )
    head = (
        "HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\nRetry-After: 1\r\n\r\n"
    )
    return head.encode() + body


class _Refuse(asyncio.Protocol):
    """A connection beyond the bound: answered 503 and closed, without reading it."""

    RESPONSE = _busy_response()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.WriteTransport)
        transport.write(self.RESPONSE)
        transport.close()


class BoundedSite(web.SockSite):
    """A :class:`aiohttp.web.SockSite` that refuses connections beyond ``max_connections`` open ones."""

    def __init__(self, runner: web.AppRunner, sock: socket.socket, *, backlog: int, max_connections: int) -> None:
        super().__init__(runner, sock, backlog=backlog)
        self.max_connections = max_connections
        self.refused = 0

    async def start(self) -> None:
        self._runner._reg_site(self)  # what BaseSite.start does; SockSite.start would use aiohttp's factory
        server = self._runner.server
        assert server is not None

        def protocol() -> Any:
            if len(server.connections) >= self.max_connections:
                self.refused += 1
                return _Refuse()
            return server()

        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(protocol, sock=self._sock, backlog=self._backlog)
