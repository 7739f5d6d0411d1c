"""Discovery without Ray: servers register in the torchrun job's c10d store; clients read it.

torchrun already runs a TCPStore for its workers (at ``MASTER_ADDR:MASTER_PORT``).  Keys (``{p}`` is the
job attempt's prefix, ``rollout_sdk/a<restart count>``, so a restarted job never reads stale entries)::

    rollout_sdk/latest        -> {p}                    set by global rank 0 first
    {p}/num_servers           -> number of DP servers   set by global rank 0
    {p}/server/<dp_rank>      -> ServerRecord (msgpack) set by each TP leader once it listens (again
                                                        after its engine is restarted)
    {p}/members               -> k                      counts registrations (store.add)
    {p}/member/<k>            -> ServerRecord           the k-th registration, in order
    {p}/shutdown              -> reason                 set by the driver (or an operator) to stop the job

Every value above is sealed with an HMAC of the job's store key over the key's name and the value
(:func:`seal`): the job's secret's when it has one (``ROLLOUT_SDK_SECRET_FILE``, docs/security.md), else a
key the job makes for itself at start and shares only with its own ranks (:data:`ENV_JOB_KEY_FILE`, a
0600 file).  The job acts on no store value that fails :func:`unseal` (a forged shutdown is ignored, a
forged server record fails discovery).  The store itself stays unauthenticated (torchrun's, on every
interface): anyone who reaches it can read these values and can delete or overwrite them (denial of
service), but cannot make the job act on a forgery.

A client waits for ``num_servers`` and then for every server key: a handshake, not sleep-and-poll; on
timeout the error names the DP ranks that never registered.  A client in another process needs only the
store address (``host:port``): ``RolloutClient(discovery=StoreDiscovery("10.0.0.1:29500"))``, or the
environment variable ``ROLLOUT_SDK_STORE``.  It verifies what it reads with the job's secret or
:data:`ENV_JOB_KEY_FILE`; with neither (started outside the job), with the key file of this user's live job
on this machine whose seal verifies the job's first record (``discovery/keyfiles.py``), else it refuses
the records with a :class:`DiscoveryError` that says how to pass the key: nothing unverified is trusted.

After open, :meth:`StoreDiscovery.watch` follows ``{p}/member/<k>`` for k past what open saw: each later
registration (a rank whose engine was restarted, a server that registers late) reaches the client, which
adds it (``RolloutClient`` does this by itself).  The watcher waits on the next key in a daemon thread, one
bounded wait at a time, so it never holds up shutdown.
"""

from __future__ import annotations

import asyncio
import datetime
import hashlib
import hmac
import logging
import os
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

import msgspec

from ..auth import ENV_SECRET_FILE, JobSecret
from ..errors import ConfigError, DiscoveryError
from .keyfiles import live_key_files

__all__ = [
    "ENV_JOB_KEY_FILE",
    "ServerRecord",
    "StoreDiscovery",
    "StoreKeys",
    "connect_store",
    "in_daemon_thread",
    "register_server",
    "seal",
    "unseal",
    "wait_keys",
]

T = TypeVar("T")

log = logging.getLogger("rollout_sdk.launch")

ROOT = "rollout_sdk"

#: the key a job without a secret makes for its store values (a 0600 file; set in its ranks' environment,
#: so their drivers and the processes they start verify the store with it); it authenticates nothing else
ENV_JOB_KEY_FILE = "ROLLOUT_SDK_JOB_KEY_FILE"


def job_key_from_env() -> JobSecret | None:
    """The per-job store key of a job without a secret, from :data:`ENV_JOB_KEY_FILE` (None: not set)."""
    path = os.environ.get(ENV_JOB_KEY_FILE)
    return JobSecret.read(path) if path else None


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
    #: the server process (``ServerInfo.incarnation``)
    incarnation: str = ""


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
    def members(self) -> str:
        return f"{self.prefix}/members"

    def member(self, k: int) -> str:
        return f"{self.prefix}/member/{k}"

    @property
    def shutdown(self) -> str:
        return f"{self.prefix}/shutdown"


_SEALED = b"rsdk-hmac1:"
_MAC_BYTES = 32


def _mac(key: bytes, name: str, body: bytes) -> bytes:
    return hmac.new(key, name.encode() + b"\0" + body, hashlib.sha256).digest()


def seal(key: bytes | None, name: str, body: bytes) -> bytes:
    """The value to store under ``name``: ``body`` with an HMAC bound to the key's name (``body`` as is
    when the job has no secret)."""
    if key is None:
        return body
    return _SEALED + _mac(key, name, body) + body


def unseal(key: bytes | None, name: str, data: bytes) -> bytes | None:
    """The body of a value read from ``name``; None when it is not sealed with ``key``.

    Without a key the seal is removed unchecked (only unit tests of the job read so);
    :class:`StoreDiscovery` never does: without a key it finds the job's or refuses (issue 36).
    """
    sealed = data.startswith(_SEALED) and len(data) >= len(_SEALED) + _MAC_BYTES
    if key is None:
        return data[len(_SEALED) + _MAC_BYTES :] if sealed else data
    if not sealed:
        return None
    mac, body = data[len(_SEALED) : len(_SEALED) + _MAC_BYTES], data[len(_SEALED) + _MAC_BYTES :]
    return body if hmac.compare_digest(mac, _mac(key, name, body)) else None


def register_server(store: Any, keys: StoreKeys, record: ServerRecord, key: bytes | None = None) -> int:
    """Publish a server (blocking: call from a thread): its DP slot, then the next membership event; each
    value sealed with the job's store key when there is one."""
    data = msgspec.msgpack.encode(record)
    slot = keys.server(record.dp_rank)
    store.set(slot, seal(key, slot, data))
    k = int(store.add(keys.members, 1))
    member = keys.member(k)
    store.set(member, seal(key, member, data))
    return k


def connect_store(address: str, timeout_s: float = 60.0) -> Any:
    """A client connection to the TCPStore at ``host:port`` (blocking; call from a thread)."""
    import torch.distributed as dist  # door: torch

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

    #: longest single wait of the watcher thread (it re-checks whether it is still wanted in between)
    watch_wait_s = 1.0
    #: how often the watcher asks the store for the next registration
    watch_poll_s = 0.2

    def __init__(
        self, store: str, *, num_servers: int | None = None, prefix: str = ROOT, secret: JobSecret | None = None
    ) -> None:
        self.store_address = store
        self.num_servers = num_servers
        self.root = prefix
        self.records: list[ServerRecord] = []
        self._keys: StoreKeys | None = None
        self._seen = 0
        self._watch_stop = threading.Event()
        self._watch_thread_handle: threading.Thread | None = None
        #: verifies what the job published (default: the job secret from the environment, else the per-job
        #: store key of a job without a secret, ``ROLLOUT_SDK_JOB_KEY_FILE``; with neither, the key file of
        #: this user's live job whose seal verifies the job's first record, found at open: ``_find_job_key``)
        self.secret = secret if secret is not None else (JobSecret.from_env() or job_key_from_env())

    def _get(self, store: Any, name: str) -> bytes:
        data = store.get(name)
        if self.secret is None:  # outside the job: its key where the job wrote it, or nothing is trusted
            self.secret = self._find_job_key(name, data)
        body = unseal(self.secret.store_key, name, data)
        if body is None:
            raise DiscoveryError(
                f"store entry {name!r} at {self.store_address} is not signed with this job's secret "
                "(another job, or someone forging it; docs/security.md)",
                missing=[name],
            )
        return body

    def _find_job_key(self, name: str, data: bytes) -> JobSecret:
        """The key of this user's live job whose seal verifies ``data`` (the job's first store value), from
        the job key files on this machine (``discovery/keyfiles.py``).  Fails closed: with none, a
        DiscoveryError says how to pass the key; a record nobody can verify is never trusted (issue 36)."""
        for path in live_key_files():
            try:
                key = JobSecret.read(path)
            except (OSError, ConfigError) as exc:
                log.warning("skipped job key file %s: %s", path, exc)
                continue
            if unseal(key.store_key, name, data) is not None:
                log.info("the job's store values verify with its key file %s", path)
                return key
        raise DiscoveryError(
            f"the store at {self.store_address} holds records this client cannot verify (no job secret, no "
            f"{ENV_JOB_KEY_FILE}, no key file of a live job of this user here): set {ENV_JOB_KEY_FILE} to the "
            f"job's key file (its ranks log the path) or {ENV_SECRET_FILE} to the job's secret",
            missing=[name],
        )

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
        keys = StoreKeys(self._get(store, latest).decode())
        num = self.num_servers
        if num is None:
            left = timeout - (time.monotonic() - t0)
            if wait_keys(store, [keys.num_servers], left):
                raise DiscoveryError("the job did not publish its number of servers", missing=[keys.num_servers])
            num = int(self._get(store, keys.num_servers))
        wanted = [keys.server(d) for d in range(num)]
        missing = wait_keys(store, wanted, timeout - (time.monotonic() - t0))
        if missing:
            ranks = sorted(int(k.rsplit("/", 1)[1]) for k in missing)
            raise DiscoveryError(
                f"{len(missing)} of {num} servers did not register within {timeout:.0f}s: DP ranks {ranks}",
                missing=[f"dp{r}" for r in ranks],
            )
        decoder = msgspec.msgpack.Decoder(ServerRecord)
        records = [decoder.decode(self._get(store, k)) for k in wanted]
        self._keys = keys
        self._seen = int(store.add(keys.members, 0))  # registrations so far: the watcher starts after them
        return records

    async def watch(self) -> AsyncIterator[str]:
        """Yield the address of every server that registers after :meth:`open` (restarts included).

        One watcher thread waits on the next ``{p}/member/<k>`` key, ``watch_wait_s`` at a time, and hands
        records over through a bounded queue; :meth:`close` stops it and joins it (a thread left inside a
        store call when the interpreter exits aborts the process).
        """
        assert self._keys is not None, "open() first"
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[ServerRecord] = asyncio.Queue(maxsize=1024)
        self._watch_stop.clear()
        thread = threading.Thread(target=self._watch_thread, args=(loop, queue), name="rollout-sdk-watch", daemon=True)
        self._watch_thread_handle = thread
        thread.start()
        while True:
            record = await queue.get()
            self.records.append(record)
            yield record.address

    def _watch_thread(self, loop: asyncio.AbstractEventLoop, queue: asyncio.Queue[ServerRecord]) -> None:
        assert self._keys is not None
        store = None
        try:
            store = connect_store(self.store_address)
            while not self._watch_stop.is_set():
                key = self._keys.member(self._seen + 1)
                if not store.check([key]):
                    # polled: a store.wait() that times out logs two c10d warnings ("likely a timeout")
                    # each round, which a healthy job must not print
                    self._watch_stop.wait(self.watch_poll_s)
                    continue
                body = unseal(self.secret.store_key if self.secret is not None else None, key, store.get(key))
                self._seen += 1
                if body is None:
                    log.warning("ignored a server registration %r not signed with the job secret", key)
                    continue
                record = msgspec.msgpack.decode(body, type=ServerRecord)
                while not self._watch_stop.is_set():
                    try:
                        asyncio.run_coroutine_threadsafe(queue.put(record), loop).result(self.watch_wait_s)
                        break
                    except TimeoutError:
                        continue  # the queue is full: the client is not keeping up; keep the record
                    except RuntimeError:
                        return  # the loop is closed
        except Exception as exc:  # the store went away (job ended): nothing more will register
            if not self._watch_stop.is_set():
                log.warning("store watch at %s stopped: %s", self.store_address, exc)
        finally:
            del store

    async def close(self) -> None:
        """Stop the watcher thread, if any (waits at most one ``watch_wait_s`` round for it)."""
        self._watch_stop.set()
        thread, self._watch_thread_handle = self._watch_thread_handle, None
        if thread is not None:
            await asyncio.to_thread(thread.join, self.watch_wait_s + 10.0)
