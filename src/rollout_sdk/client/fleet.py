"""Fleet membership: which servers a :class:`~rollout_sdk.client.RolloutClient` routes to, and how
servers join and leave while it runs (docs/design.md, "Fleet membership").

The :class:`Fleet` owns the client's ZMQ context and every channel it opened, makes one
:class:`~rollout_sdk.client.connection.ServerConnection` per member, and keeps the scheduler's member list
(``scheduler.servers``) up to date.  Everything runs on the client's event loop::

    connection loops ... one task per member, in the client's supervisor task group (``start``); a
                          member that joins later gets its task there too
    join x N ........... add(address): a task owned by the client (``own``) per address being added;
                          concurrent adds of one address share it.  It handshakes, retires the dead
                          member a restarted server replaces, admits the newcomer, then routes to it
    replace ............ a new incarnation at a member's address (``on_replaced``): a task that retires
                          the old member and adds the new one
    discovery follower . follow(watch): in the supervisor task group; joins servers registered after
                          open (a restarted rank, a new node)

Admission: a member is routed to once it serves the fleet's weight version (:meth:`Fleet.weight_version`:
the newest the client pushed or an admitted member serves); until then ``admitted`` is False and
``admission`` says why.  Retired members (removed, or replaced by a restarted process) are kept, bounded,
for ``client.stats().retired``.  Channels are all closed by :meth:`Fleet.close`, whatever a cut-short join
or an interrupted retire left open (an open socket would keep the context's ``term()`` from returning).
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

from .. import _transport
from .._aio import cancel_and_wait
from ..auth import Credentials
from ..discovery import StaticServers
from ..errors import ConfigError
from .config import ClientConfig
from .connection import ServerConnection
from .scheduler import Scheduler

__all__ = ["Fleet"]

log = logging.getLogger("rollout_sdk.client")


class Fleet:
    """The members of one client and their lifecycle: join, admission, removal, replacement.

    The client passes what the fleet needs of it: ``own`` starts a task owned by the client (cancelled
    and awaited by ``aclose``; it raises ClientStateError unless the client is open), ``check_open``
    raises unless the client is open, ``is_open`` says whether it is, and ``pushed_version`` is the last
    weight version pushed through the client.
    """

    def __init__(
        self,
        scheduler: Scheduler,
        config: ClientConfig,
        *,
        own: Callable[[Coroutine[Any, Any, Any], str], asyncio.Task[Any]],
        check_open: Callable[[], None],
        is_open: Callable[[], bool],
        pushed_version: Callable[[], int],
    ) -> None:
        self._scheduler = scheduler
        self._config = config
        self._own = own
        self._check_open = check_open
        self._is_open = is_open
        self._pushed_version = pushed_version
        self._ctx: Any = None
        self._creds: Credentials | None = None
        self._member_seq = itertools.count()
        self._tg: asyncio.TaskGroup | None = None
        self._conn_tasks: dict[ServerConnection, asyncio.Task[None]] = {}
        #: every channel this client opened and has not closed: a join cut short by close (or a retire
        #: interrupted by cancellation) must not leave a socket open, or the context's term() never returns
        self._channels: list[_transport.DealerChannel] = []
        #: members that left for good, newest last
        self.retired: collections.deque[ServerConnection] = collections.deque(maxlen=256)
        self._joining: dict[str, asyncio.Task[ServerConnection]] = {}

    # -- sockets -----------------------------------------------------------------------------------

    def open(self, addresses: list[str], creds: Credentials | None) -> None:
        """Make the ZMQ context and a member for each address found at open."""
        self._ctx = _transport.new_context()
        self._creds = creds
        for addr in addresses:
            self._scheduler.add(self._new_connection(addr))

    async def close(self) -> None:
        """Close every channel (members, and any a cut-short join or retire left open), then the context."""
        for channel in self._channels:
            await channel.close()
        self._channels = []
        if self._ctx is not None:
            ctx, self._ctx = self._ctx, None
            await asyncio.to_thread(ctx.term)  # bounded by the sockets' linger

    def _new_connection(self, address: str) -> ServerConnection:
        cfg = self._config
        channel = _transport.DealerChannel(self._ctx, address, self._creds)
        self._channels = [c for c in self._channels if not c.closed] + [channel]
        conn = ServerConnection(
            next(self._member_seq),
            address,
            channel,
            on_change=self._on_server_change,
            heartbeat_interval_s=cfg.heartbeat_interval_s,
            heartbeat_timeout_s=cfg.heartbeat_timeout_s,
            on_replaced=self._on_replaced,
            admission=self._scheduler.config.admission_config(),
        )
        if self._tg is not None:
            self._start_connection(conn)
        return conn

    # -- connection loops --------------------------------------------------------------------------

    def start(self, tg: asyncio.TaskGroup) -> None:
        """Run every member's loops in ``tg`` (the client's supervisor), and those of later members."""
        self._tg = tg
        for conn in self._scheduler.servers:
            self._start_connection(conn)

    def stop(self) -> None:
        """The supervisor's task group has ended: later members get no task until the next start."""
        self._tg = None

    def _start_connection(self, conn: ServerConnection) -> None:
        assert self._tg is not None
        self._conn_tasks[conn] = self._tg.create_task(conn.run(), name=f"server-{conn.index}")

    # -- joining and leaving -----------------------------------------------------------------------

    async def add(self, address: str, timeout: float | None = None) -> ServerConnection:
        """The member at ``address`` once it has answered (see ``RolloutClient.add_server``)."""
        self._check_open()
        StaticServers([address])  # validates the address
        for conn in self._scheduler.servers:
            if conn.address == address and not conn.replaced:
                return conn
        task = self._joining.get(address)
        if task is None:
            task = self._own(self._join(address, timeout), f"join {address}")
            self._joining[address] = task
            task.add_done_callback(lambda _t: self._joining.pop(address, None))
        return await asyncio.shield(task)

    async def _join(self, address: str, timeout: float | None) -> ServerConnection:
        conn = self._new_connection(address)
        try:
            await conn.handshake(self._config.connect_timeout_s if timeout is None else timeout)
        except BaseException:
            await self._retire(conn, "did not answer when added")
            raise
        # a restarted server takes its slot: the dead member of that name leaves the fleet for good
        for old in list(self._scheduler.servers):
            if not old.alive and old.server_id == conn.server_id:
                await self._retire(old, f"replaced by {conn.address} ({conn.incarnation})")
        self._admit(conn)
        self._scheduler.add(conn)
        log.info(
            "server %s (%s, %s) joined: %s",
            conn.server_id,
            address,
            conn.incarnation,
            "admitted" if conn.admitted else conn.admission,
        )
        return conn

    async def remove(self, address: str, *, drain: bool = True, timeout: float | None = None) -> None:
        """Take the members at ``address`` out of the fleet (see ``RolloutClient.remove_server``)."""
        self._check_open()
        conns = [c for c in self._scheduler.servers if c.address == address]
        if not conns:
            raise ConfigError("address", address, "is not a server of this client")
        for conn in conns:
            conn.removing = True
            if drain and conn.alive:
                try:
                    async with asyncio.timeout(timeout):
                        await conn.wait_idle()
                except TimeoutError:
                    log.info(
                        "server %s: %d request(s) still running after %ss; moving them",
                        conn.server_id,
                        conn.in_flight,
                        timeout,
                    )
            await self._retire(conn, "removed from the fleet")

    async def _retire(self, conn: ServerConnection, reason: str) -> None:
        """Leave the fleet for good: what waits on it fails over, its loops stop, its socket closes."""
        conn.removing = True
        conn.abort_all()  # nothing keeps running there for this client
        conn.mark_dead(reason)
        conn.dead_reason = reason
        self._scheduler.remove(conn)
        task = self._conn_tasks.pop(conn, None)
        if task is not None:
            await cancel_and_wait(task)
        await conn.channel.close()
        self.retired.append(conn)

    def _on_replaced(self, conn: ServerConnection) -> None:
        """A new process answers at a member's address: retire the member, admit the newcomer."""
        if self._is_open():
            self._own(self._replace(conn), f"replace {conn.address}")

    async def _replace(self, conn: ServerConnection) -> None:
        await self._retire(conn, conn.dead_reason)
        try:
            await self.add(conn.address)
        except Exception as exc:
            log.warning("the new server at %s did not join: %s", conn.address, exc)

    async def follow(self, watch: Callable[[], AsyncIterator[str]]) -> None:
        """Servers that register after open (a restarted rank, a new node) join without anyone asking."""
        async for address in watch():
            known = any(c.address == address and c.alive for c in self._scheduler.servers)
            if not self._is_open() or known:
                continue  # a same-address restart is caught by its new incarnation (_on_replaced)
            self._own(self._join_quietly(address), f"join {address}")

    async def _join_quietly(self, address: str) -> None:
        try:
            await self.add(address)
        except Exception as exc:
            log.warning("server %s registered but did not join: %s", address, exc)

    # -- admission ---------------------------------------------------------------------------------

    def weight_version(self) -> int:
        """The weight version a server must serve to be routed to: the newest the client pushed or saw
        its admitted servers serve (another client may push weights)."""
        seen = [c.reported_version for c in self._scheduler.servers if c.alive and c.admitted]
        return max([self._pushed_version(), *seen])

    def _admit(self, conn: ServerConnection) -> None:
        want = self.weight_version()
        if conn.reported_version == want:
            conn.admitted, conn.admission = True, ""
        else:
            conn.admitted = False
            conn.admission = (
                f"serves weight version {conn.reported_version}, the fleet is at {want}: "
                "waits for the next update_weights()"
            )

    def _on_server_change(self, conn: ServerConnection) -> None:
        if conn.alive and not conn.admitted and conn in self._scheduler.servers:
            self._admit(conn)
        self._scheduler.on_server_change(conn)

    def admit_all(self) -> None:
        """Admit every live member that now serves the fleet's version (after an update_weights)."""
        for conn in self._scheduler.servers:
            if conn.alive and not conn.admitted:
                self._admit(conn)
                self._scheduler.on_server_change(conn)
