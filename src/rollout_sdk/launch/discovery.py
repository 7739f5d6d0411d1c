"""Discovery without Ray: servers register in the torchrun job's c10d store; clients read it.

torchrun already runs a TCPStore for its workers (at ``MASTER_ADDR:MASTER_PORT``).  Keys (``{p}`` is the
job attempt's prefix, ``rollout_sdk/a<restart count>``, so a restarted job never reads stale entries)::

    rollout_sdk/latest        -> {p}                    set by global rank 0 first
    {p}/num_servers           -> number of DP servers   set by global rank 0
    {p}/server/<dp_rank>      -> ServerRecord (msgpack) set by each TP leader once it listens
    {p}/shutdown              -> reason                 set by the driver (or an operator) to stop the job

A client waits for ``num_servers`` and then for every server key: a handshake, not sleep-and-poll; on
timeout the error names the DP ranks that never registered.  A client in another process needs only the
store address (``host:port``): ``RolloutClient(discovery=StoreDiscovery("10.0.0.1:29500"))``, or the
environment variable ``ROLLOUT_SDK_STORE``.
"""

from __future__ import annotations

import asyncio
import datetime
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import msgspec

from ..errors import ConfigError, DiscoveryError

__all__ = ["ServerRecord", "StoreDiscovery", "StoreKeys", "connect_store", "in_daemon_thread", "wait_keys"]

T = TypeVar("T")

ROOT = "rollout_sdk"


class ServerRecord(msgspec.Struct, frozen=True, kw_only=True):
    """What a TP leader publishes about its server."""

    address: str
    dp_rank: int
    tp_size: int
    global_rank: int
    node_rank: int
    pid: int
    backend: str
    model: str
    #: the rank's Prometheus endpoint ("" when --metrics-port is not given)
    metrics_url: str = ""


class StoreKeys:
    def __init__(self, prefix: str) -> None:
        self.prefix = prefix

    @staticmethod
    def latest(root: str = ROOT) -> str:
        return f"{root}/latest"

    @property
    def num_servers(self) -> str:
        return f"{self.prefix}/num_servers"

    def server(self, dp_rank: int) -> str:
        return f"{self.prefix}/server/{dp_rank}"

    @property
    def shutdown(self) -> str:
        return f"{self.prefix}/shutdown"


def connect_store(address: str, timeout_s: float = 60.0) -> Any:
    """A client connection to the TCPStore at ``host:port`` (blocking; call from a thread)."""
    import torch.distributed as dist

    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ConfigError("store", address, "must be 'host:port'")
    return dist.TCPStore(  # type: ignore[attr-defined]
        host, int(port), is_master=False, wait_for_workers=False, timeout=datetime.timedelta(seconds=timeout_s)
    )


def wait_keys(store: Any, keys: list[str], timeout_s: float) -> list[str]:
    """Block until every key exists or ``timeout_s`` passes; return the keys still missing."""
    missing = [k for k in keys if not store.check([k])]
    if missing and timeout_s > 0:
        try:
            store.wait(missing, datetime.timedelta(seconds=min(timeout_s, 10 * 365 * 86400)))
        except Exception:  # the store's timeout
            pass
        missing = [k for k in missing if not store.check([k])]
    return missing


async def in_daemon_thread(fn: Callable[[], T]) -> T:
    """Run a blocking call (a store wait) in a daemon thread and await its result.

    Unlike ``asyncio.to_thread`` the thread never holds up interpreter exit: a store wait that outlives a
    cancelled caller simply ends with the process.
    """
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[T] = loop.create_future()

    def deliver(ok: bool, value: Any) -> None:
        if not fut.done():
            if ok:
                fut.set_result(value)
            else:
                fut.set_exception(value)

    def target() -> None:
        try:
            value = fn()
        except BaseException as exc:
            loop.call_soon_threadsafe(deliver, False, exc)
        else:
            loop.call_soon_threadsafe(deliver, True, value)

    threading.Thread(target=target, name="rollout-sdk-store", daemon=True).start()
    return await fut


class StoreDiscovery:
    """Find the servers of a torchrun job through its c10d store (``host:port``)."""

    def __init__(self, store: str, *, num_servers: int | None = None, prefix: str = ROOT) -> None:
        self.store_address = store
        self.num_servers = num_servers
        self.root = prefix
        self.records: list[ServerRecord] = []

    async def open(self, timeout: float) -> list[str]:
        self.records = await in_daemon_thread(lambda: self._discover(timeout))
        return [r.address for r in self.records]

    def _discover(self, timeout: float) -> list[ServerRecord]:
        t0 = time.monotonic()
        try:
            store = connect_store(self.store_address, timeout_s=max(1.0, timeout))
        except Exception as exc:
            raise DiscoveryError(f"cannot reach the job's store at {self.store_address}: {exc}") from exc
        latest = StoreKeys.latest(self.root)
        if wait_keys(store, [latest], timeout):
            raise DiscoveryError(
                f"no rollout-sdk job registered in the store at {self.store_address} within {timeout:.0f}s",
                missing=[latest],
            )
        keys = StoreKeys(store.get(latest).decode())
        num = self.num_servers
        if num is None:
            left = timeout - (time.monotonic() - t0)
            if wait_keys(store, [keys.num_servers], left):
                raise DiscoveryError("the job did not publish its number of servers", missing=[keys.num_servers])
            num = int(store.get(keys.num_servers))
        wanted = [keys.server(d) for d in range(num)]
        missing = wait_keys(store, wanted, timeout - (time.monotonic() - t0))
        if missing:
            ranks = sorted(int(k.rsplit("/", 1)[1]) for k in missing)
            raise DiscoveryError(
                f"{len(missing)} of {num} servers did not register within {timeout:.0f}s: DP ranks {ranks}",
                missing=[f"dp{r}" for r in ranks],
            )
        decoder = msgspec.msgpack.Decoder(ServerRecord)
        return [decoder.decode(store.get(k)) for k in wanted]

    async def close(self) -> None:
        return None
