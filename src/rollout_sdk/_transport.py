"""ZMQ plumbing shared by the server and the client: the one place where ZMQ errors are mapped.

Sockets are plain (synchronous) pyzmq sockets used only with non-blocking calls; readiness comes from the
event loop watching the socket's file descriptor.  That descriptor is edge-like: it signals that the
socket's state *may* have changed, and any call on the socket (a send, reading EVENTS) can consume that
signal while a message waits.  So every operation is followed by a look at ``EVENTS``, and a waiting reader
is woken when ``POLLIN`` shows up there (:class:`_Readiness`).  Without that, a send on the same socket can
swallow the wake-up of a reply that already arrived, and the reply sits unread until the next message.

Both sides read the same way: wait until readable, then drain every message already there with
non-blocking receives (bench/dispatch.py: ~6x the throughput of one awaited ``recv`` per message at 256
concurrent requests).  Sends are non-blocking; a full high-water mark raises instead of blocking.

Sockets: the server binds a ROUTER on an ephemeral port; each client connects one DEALER per server.

Bounds on the wire: the ROUTER sets ``MAXMSGSIZE``, so libzmq drops (and disconnects) a peer whose frame is
larger than the server's largest limit before a byte of it reaches Python; the server checks the smaller
per-kind limit on the frame's length before decoding.  Each DEALER carries a fixed routing id, so a
reconnect keeps its identity (``ROUTER_HANDOVER``): replies and aborts still reach the requests it owns.

Authentication (when the server has a :class:`~rollout_sdk.auth.ServerAuth`): the ROUTER is a CURVE
server and a ZAP handler (pyzmq's ``ThreadAuthenticator``, one thread per server, started before the bind)
admits only the job's client keys, naming the key's role as the connection's User-Id.  ZMQ delivers no
message of a connection whose handshake failed, so an unauthenticated peer never reaches the event loop;
:meth:`RouterEndpoint.recv_batch_with_roles` reads each message's User-Id for the server's role check::

    ZMQ I/O thread ── CURVE handshake ──▶ ZAP thread (key -> role, or deny) ──▶ connection admitted
    event loop ..... recv_batch_with_roles: (frames, role) of admitted connections only
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from collections.abc import Callable
from typing import Any

import zmq
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85
from zmq.utils.monitor import parse_monitor_message

from ._aio import await_unless
from .auth import Credentials, ServerAuth
from .errors import AuthenticationError, ConfigError, ServerUnavailableError

__all__ = [
    "DealerChannel",
    "RouterEndpoint",
    "bind_router",
    "local_ip",
    "new_context",
]

log = logging.getLogger("rollout_sdk.transport")

_HWM = 1_000_000
#: a receive batch ends once it holds this many bytes (a Ping waits behind at most ~2 maximum-size frames)
_BATCH_BYTES = 8 << 20
# plain ints: zmq's flag enums make `events & POLLIN` measurably slower on the hot path
_POLLIN = int(zmq.POLLIN)
_POLLOUT = int(zmq.POLLOUT)
_EVENTS = int(zmq.EVENTS)
_NOBLOCK = int(zmq.NOBLOCK)
_SNDMORE_NOBLOCK = int(zmq.SNDMORE | zmq.NOBLOCK)


def new_context() -> zmq.Context[zmq.Socket[bytes]]:
    return zmq.Context()


def local_ip() -> str:
    """The address other hosts reach this one at (the interface of the default route)."""
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        s.connect(("10.255.255.255", 1))  # no packet is sent: this only picks a route
        return str(s.getsockname()[0])
    except OSError:
        return socket.gethostbyname(socket.gethostname())
    finally:
        s.close()


class _Readiness:
    """Wake a coroutine when a ZMQ socket has ``POLLIN`` (or another event) in its EVENTS."""

    def __init__(self, sock: zmq.Socket[bytes]) -> None:
        self._sock = sock
        self._event = asyncio.Event()
        self._fd = int(sock.getsockopt(zmq.FD))  # type: ignore[arg-type]
        self._loop: asyncio.AbstractEventLoop | None = None
        self._recheck_pending = False

    def _attach(self) -> None:
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
            self._loop.add_reader(self._fd, self._event.set)

    def detach(self) -> None:
        if self._loop is not None:
            self._loop.remove_reader(self._fd)
            self._loop = None

    def recheck(self) -> int:
        """Read EVENTS (which may consume the descriptor's signal) and re-arm the waiter if needed."""
        self._recheck_pending = False
        if self._sock.closed:  # a recheck scheduled by a last send (an Abort) before close
            return 0
        events: int = self._sock.getsockopt(_EVENTS)  # type: ignore[assignment]
        if events & _POLLIN:
            self._event.set()
        return events

    def recheck_soon(self) -> None:
        """After a send: one recheck at the end of this loop iteration covers every send made in it."""
        if not self._recheck_pending:
            self._recheck_pending = True
            if self._loop is not None:
                self._loop.call_soon(self.recheck)
            else:
                self.recheck()

    async def wait(self, flag: int = _POLLIN) -> None:
        self._attach()
        while True:
            self._event.clear()
            if self.recheck() & flag:
                return
            await self._event.wait()


class RouterEndpoint:
    """The server's ROUTER socket: drain-reads ``(identity, payload)`` pairs, sends without blocking."""

    def __init__(
        self,
        ctx: zmq.Context[zmq.Socket[bytes]],
        host: str,
        port: int,
        *,
        max_msg_bytes: int = -1,
        peer_timeout_s: float | None = None,
        auth: ServerAuth | None = None,
    ) -> None:
        self._sock = ctx.socket(zmq.ROUTER)
        self.zap: _ZapHandler | None = _secure_router(ctx, self._sock, auth) if auth is not None else None
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.SNDHWM, _HWM)
        self._sock.setsockopt(zmq.RCVHWM, _HWM)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        # clients pick unguessable routing ids (DealerChannel): one that reconnects with its id takes its
        # replies over from a stale connection, and nobody else can claim them
        self._sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        self._sock.setsockopt(zmq.MAXMSGSIZE, max_msg_bytes)  # -1: no limit
        if peer_timeout_s is not None:
            # ZMTP heartbeats, answered by the peer's libzmq I/O thread: a peer whose process stopped is
            # disconnected after peer_timeout_s; one whose event loop is merely blocked stays connected
            self._sock.setsockopt(zmq.HEARTBEAT_IVL, int(min(2.0, peer_timeout_s / 4) * 1000))
            self._sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(peer_timeout_s * 1000))
        #: why the last send() returned False: "gone" (the peer is not connected) or "full" (not reading)
        self.last_failure = ""
        try:
            if port == 0:
                self.port = self._sock.bind_to_random_port(f"tcp://{host}")
            else:
                self._sock.bind(f"tcp://{host}:{port}")
                # the port actually bound, as libzmq reports it (never the one asked for, blindly)
                self.port = int(self._sock.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[1])
        except zmq.ZMQError as exc:
            self._sock.close(0)
            if self.zap is not None:
                self.zap.stop()
            raise ConfigError("host/port", f"{host}:{port}", f"cannot bind: {exc}") from exc
        self.host = host
        self._ready = _Readiness(self._sock)

    async def recv_batch(self, max_n: int = 256, max_bytes: int = _BATCH_BYTES) -> list[list[bytes]]:
        """Wait for at least one message; return those ready, at most ``max_n`` (and about ``max_bytes``).

        The bound keeps peers fair: libzmq's ROUTER takes messages from its peers in turn, so a peer's
        Ping is read within ``max_n`` messages even while another peer floods (draining everything ready
        into one batch would put it behind the whole flood), and within a couple of maximum-size frames
        when the flood is of those."""
        out: list[list[bytes]] = []
        recv = self._sock.recv_multipart
        size = 0
        while True:
            try:
                out.append(recv(_NOBLOCK))
                size += len(out[-1][-1])
                if len(out) >= max_n or size >= max_bytes:
                    self._ready.recheck()
                    return out
            except zmq.Again:
                if out:
                    self._ready.recheck()
                    return out
                await self._ready.wait()

    async def recv_batch_with_roles(
        self, max_n: int = 256, max_bytes: int = _BATCH_BYTES
    ) -> list[tuple[list[bytes], str | None]]:
        """Like :meth:`recv_batch` (at most ``max_n``, about ``max_bytes``), with each message's ZAP User-Id
        (its role)."""
        out: list[tuple[list[bytes], str | None]] = []
        recv = self._sock.recv
        size = 0
        while True:
            # The routing id is copied as bytes; only the peer's last frame is taken as a zmq.Frame, the one
            # object that can read its connection's ZAP User-Id (recv_multipart(copy=False) built a Frame
            # per frame: +12,600 instructions a request on the loop, docs/benchmarks-changelog.md).  A
            # multipart message is delivered whole or not at all, so once its routing id is read, the rest
            # is there.
            try:
                ident = recv(_NOBLOCK)
            except zmq.Again:
                if out:
                    self._ready.recheck()
                    return out
                await self._ready.wait()
                continue
            frames = [ident]
            last = recv(_NOBLOCK, copy=False)
            while last.more:  # more than one frame: the server answers it with a ProtocolError
                frames.append(last.bytes)
                last = recv(_NOBLOCK, copy=False)
            frames.append(last.bytes)
            # the role of *this message's* connection, read from libzmq on every message (never cached by
            # routing id: a peer can take a routing id over, ROUTER_HANDOVER, but not another's key)
            try:
                role = str(last.get("User-Id"))
            except zmq.ZMQError:  # no User-Id (cannot happen behind our ZAP handler): a role that may do nothing
                role = ""
            out.append((frames, role))
            size += len(frames[-1])
            if len(out) >= max_n or size >= max_bytes:
                self._ready.recheck()
                return out

    def send(self, ident: bytes, payload: bytes) -> bool:
        """Send to one peer without blocking.  False when the peer is gone (the reply is dropped)."""
        try:
            # the two frames by hand: send_multipart does IntFlag arithmetic per frame (~3 us a reply).  A
            # ROUTER decides at the first frame (EHOSTUNREACH / EAGAIN); the second always follows it.
            self._sock.send(ident, _SNDMORE_NOBLOCK)
            self._sock.send(payload, _NOBLOCK)
            return True
        except zmq.ZMQError as exc:
            if exc.errno in (zmq.EHOSTUNREACH, zmq.EAGAIN):
                # EHOSTUNREACH: the peer disconnected; EAGAIN: it stopped reading (a million replies queued)
                self.last_failure = "gone" if exc.errno == zmq.EHOSTUNREACH else "full"
                return False
            raise
        finally:
            self._ready.recheck_soon()

    async def close(self, linger_s: float = 2.0) -> None:
        """Close; replies already queued get ``linger_s`` to reach their peers (the context's term()
        waits for them, so call that off the event loop)."""
        self._ready.detach()
        self._sock.close(linger=int(linger_s * 1000))
        if self.zap is not None:
            zap, self.zap = self.zap, None
            await asyncio.to_thread(zap.stop)


def bind_router(
    ctx: zmq.Context[zmq.Socket[bytes]],
    host: str,
    port: int = 0,
    *,
    max_msg_bytes: int = -1,
    peer_timeout_s: float | None = None,
    auth: ServerAuth | None = None,
) -> RouterEndpoint:
    return RouterEndpoint(ctx, host, port, max_msg_bytes=max_msg_bytes, peer_timeout_s=peer_timeout_s, auth=auth)


# -- authentication -------------------------------------------------------------------------------

_ZAP_DOMAIN = "rollout-sdk"
#: an unauthenticated peer that opens a connection and stalls is dropped after this long
_HANDSHAKE_IVL_MS = 10_000
_AUTH_EVENTS = (
    zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
)


class _ZapHandler:
    """pyzmq's ZAP authenticator (a thread of its own) admitting the job's client keys, each as its role.

    The thread answers one ZAP request per handshake with a dictionary lookup, so a flood of bogus
    handshakes costs the I/O and ZAP threads microseconds each and never touches the event loop.
    ``denied`` counts refused handshakes (written by the ZAP thread, read anywhere).
    """

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], auth: ServerAuth) -> None:
        roles = {z85_key: role for z85_key, role in auth.clients.items()}
        handler = self

        class _Authenticator(ThreadAuthenticator):
            def curve_user_id(self, client_public_key: bytes) -> str:
                return roles[z85.encode(client_public_key)]

        class _Keys:
            def callback(self, domain: str, key: bytes) -> bool:
                if key in roles:
                    return True
                handler.denied += 1
                if handler.denied <= 5 or handler.denied % 1000 == 0:
                    log.warning("refused a connection with an unknown CURVE key (%d refused so far)", handler.denied)
                return False

        self.denied = 0
        self._auth = _Authenticator(ctx, log=logging.getLogger("rollout_sdk.transport.zap"))
        self._auth.start()
        self._auth.configure_curve_callback(domain=_ZAP_DOMAIN, credentials_provider=_Keys())

    def stop(self) -> None:
        self._auth.stop()


def _secure_router(ctx: zmq.Context[zmq.Socket[bytes]], sock: zmq.Socket[bytes], auth: ServerAuth) -> _ZapHandler:
    zap = _ZapHandler(ctx, auth)  # the handler must exist before the first peer connects
    sock.setsockopt(zmq.CURVE_SERVER, 1)
    sock.setsockopt(zmq.CURVE_SECRETKEY, auth.keys.secret)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, auth.keys.public)
    sock.setsockopt(zmq.ZAP_DOMAIN, _ZAP_DOMAIN.encode())
    sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)  # no handler: refuse, never admit
    sock.setsockopt(zmq.HANDSHAKE_IVL, _HANDSHAKE_IVL_MS)
    return zap


def _secure_dealer(sock: zmq.Socket[bytes], creds: Credentials) -> None:
    sock.setsockopt(zmq.CURVE_SERVERKEY, creds.server_public)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, creds.keys.public)
    sock.setsockopt(zmq.CURVE_SECRETKEY, creds.keys.secret)
    sock.setsockopt(zmq.HANDSHAKE_IVL, _HANDSHAKE_IVL_MS)


def _auth_failure_text(address: str, event: int, creds: Credentials | None) -> str:
    if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        return f"server {address} refused this client's {creds.role if creds else ''} key (not a key of this job)"
    if creds is None:
        return f"server {address} requires authentication: {_HOW}"
    return f"handshake with {address} failed: the server does not use this job's keys (or no authentication)"


_HOW = (
    "pass credentials=Credentials.load(...) or set ROLLOUT_SDK_SECRET_FILE / ROLLOUT_SDK_CREDENTIALS (docs/security.md)"
)


class DealerChannel:
    """A client's DEALER connection to one server, with a monitor that reports a dropped connection.

    ``IMMEDIATE`` is set so that messages are never queued for a peer that is not connected: a send to a
    dead server fails at once (:class:`ServerUnavailableError`) instead of waiting for a reconnect.
    """

    def __init__(
        self, ctx: zmq.Context[zmq.Socket[bytes]], address: str, credentials: Credentials | None = None
    ) -> None:
        self.address = address
        self.credentials = credentials
        #: set when the handshake failed for want of (the right) keys; the connection will never work
        self.auth_failure: AuthenticationError | None = None
        self._auth_failed = asyncio.Event()
        self._sock = ctx.socket(zmq.DEALER)
        # The server keys requests by routing id; ZMQ's own ids are a predictable counter, so a peer could
        # claim a departed client's id (and its replies).  128 random bits cannot be guessed, and the id is
        # fixed across reconnects: the server keeps our requests (and our aborts reach them).
        self.routing_id = b"c" + os.urandom(15)
        self._sock.setsockopt(zmq.ROUTING_ID, self.routing_id)
        if credentials is not None:
            _secure_dealer(self._sock, credentials)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.SNDHWM, _HWM)
        self._sock.setsockopt(zmq.RCVHWM, _HWM)
        self._sock.setsockopt(zmq.IMMEDIATE, 1)
        self._sock.setsockopt(zmq.RECONNECT_IVL, 100)
        self._sock.setsockopt(zmq.RECONNECT_IVL_MAX, 2000)
        self._monitor = self._sock.get_monitor_socket(
            zmq.EVENT_CONNECTED
            | zmq.EVENT_DISCONNECTED
            | zmq.EVENT_MONITOR_STOPPED
            | zmq.EVENT_HANDSHAKE_SUCCEEDED
            | _AUTH_EVENTS
        )
        try:
            self._sock.connect(address)
        except zmq.ZMQError as exc:
            self._close_sockets(0)
            raise ConfigError("servers", address, f"not a ZMQ address: {exc}") from exc
        self._ready = _Readiness(self._sock)
        self._monitor_ready = _Readiness(self._monitor)
        self.closed = False

    async def wait_connected(self, timeout: float | None) -> bool:
        """Wait until a connection to the server exists (True) or the timeout passes (False).

        Raises :class:`AuthenticationError` as soon as a handshake fails for want of the right keys.
        """
        try:
            async with asyncio.timeout(timeout):
                await await_unless(self._ready.wait(_POLLOUT), self._auth_failed.wait(), error=self._auth_error)
            return True
        except TimeoutError:
            return False

    def _auth_error(self) -> BaseException:
        return self.auth_failure or AuthenticationError(f"the handshake with {self.address} failed")

    def send(self, payload: bytes) -> None:
        try:
            self._sock.send(payload, _NOBLOCK)
        except zmq.Again as exc:
            raise ServerUnavailableError(f"server {self.address} is not connected (or not reading)") from exc
        except zmq.ZMQError as exc:
            raise ServerUnavailableError(f"send to {self.address} failed: {exc}") from exc
        finally:
            self._ready.recheck_soon()

    async def recv_batch(self) -> list[bytes]:
        out: list[bytes] = []
        recv = self._sock.recv
        while True:
            try:
                out.append(recv(_NOBLOCK))
            except zmq.Again:
                if out:
                    self._ready.recheck()
                    return out
                await self._ready.wait()

    async def watch(self, on_event: Callable[[str], Any]) -> None:
        """Report ``connected`` / ``disconnected`` as the monitor sees them, until closed."""
        while True:
            await self._monitor_ready.wait()
            while True:
                try:
                    frames = self._monitor.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                event = parse_monitor_message(frames)["event"]
                if event == zmq.EVENT_MONITOR_STOPPED:
                    return
                if event & _AUTH_EVENTS:
                    self.auth_failure = AuthenticationError(_auth_failure_text(self.address, event, self.credentials))
                    self._auth_failed.set()
                    on_event("auth_failed")
                elif event == zmq.EVENT_DISCONNECTED:
                    on_event("disconnected")
                elif event == zmq.EVENT_CONNECTED:
                    on_event("connected")

    def _close_sockets(self, linger_ms: int) -> None:
        try:
            self._sock.disable_monitor()
        except zmq.ZMQError:
            pass
        self._monitor.close(0)
        self._sock.close(linger=linger_ms)

    async def close(self, linger_s: float = 0.5) -> None:
        """Close; messages already queued (a final Abort) get ``linger_s`` to leave."""
        if self.closed:
            return
        self.closed = True
        self._ready.detach()
        self._monitor_ready.detach()
        self._close_sockets(int(linger_s * 1000))
