"""``RolloutBridge``: a :class:`~rollout_sdk.RolloutClient` on its own event-loop thread, for synchronous
trainers (TRL, OpenRLHF, verl workers) that call rollouts from plain functions.

Concurrency::

    trainer thread(s) ── bridge.run(fn) ──▶ portal thread: one asyncio loop (anyio BlockingPortal)
                        blocks until fn(client) returns;     └─ RolloutClient (supervisor, connections)
                        its exception is re-raised here      └─ tasks started with bridge.start(fn)
    bridge.close(): cancels started tasks, closes the client, stops the loop and joins the thread.

The client is only ever touched on the portal's loop, so nothing in it needs a lock.  anyio's portal is
the well-kept version of "run a loop in a thread and submit coroutines to it" (docs/design.md).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import threading
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any, TypeVar

from anyio.from_thread import start_blocking_portal

from .._aio import LifecycleGuard, LifecycleState
from ..client import RolloutClient
from ..errors import ClientStateError

__all__ = ["RolloutBridge"]

T = TypeVar("T")


class RolloutBridge:
    """Open once (``with RolloutBridge(...) as bridge`` or :meth:`open`), close idempotently.

    Arguments are those of :class:`~rollout_sdk.RolloutClient` (servers, discovery, engine, options).
    """

    def __init__(self, servers: Sequence[str] | None = None, **client_kwargs: Any) -> None:
        self._servers = list(servers) if servers is not None else None
        self._client_kwargs = client_kwargs
        self._stack: contextlib.ExitStack | None = None
        self._portal: Any = None
        self._client: RolloutClient | None = None
        self._life = LifecycleGuard("RolloutBridge", error=ClientStateError)
        self._lock = threading.Lock()
        self._tasks: set[concurrent.futures.Future[Any]] = set()
        self._weight_sync_ready = False

    # -- lifecycle ---------------------------------------------------------------------------------

    def open(self) -> RolloutBridge:
        with self._lock:
            self._life.opening()
        stack = contextlib.ExitStack()
        try:
            self._portal = stack.enter_context(start_blocking_portal(backend="asyncio"))
            client = RolloutClient(self._servers, **self._client_kwargs)
            self._client = stack.enter_context(self._portal.wrap_async_context_manager(client))
        except BaseException:
            stack.close()
            self._life.closed()
            raise
        self._stack = stack
        self._life.opened()
        return self

    def close(self) -> None:
        """Cancel started tasks, close the client and stop the loop thread.  Idempotent."""
        with self._lock:
            started = self._life.state in (LifecycleState.OPENING, LifecycleState.OPEN)
            self._life.closed()  # at once: run() and start() refuse from here on
            if not started:
                return
        for fut in list(self._tasks):
            fut.cancel()
        for fut in list(self._tasks):
            with contextlib.suppress(BaseException):
                fut.result(timeout=30)
        if self._client is not None and self._weight_sync_ready:
            with contextlib.suppress(Exception):
                self._portal.call(self._client.close_weight_sync)
        stack, self._stack = self._stack, None
        if stack is not None:
            stack.close()

    def __enter__(self) -> RolloutBridge:
        return self.open()

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def client(self) -> RolloutClient:
        """The client; use it only inside functions passed to :meth:`run` / :meth:`start`."""
        self._life.check_open("open it first")
        assert self._client is not None
        return self._client

    # -- calls -------------------------------------------------------------------------------------

    def run(self, fn: Callable[[RolloutClient], Awaitable[T]]) -> T:
        """Run ``await fn(client)`` on the bridge's loop; block until it returns (or raise its error)."""
        client = self.client
        return self._portal.call(_call, fn, client)  # type: ignore[no-any-return]

    def start(self, fn: Callable[[RolloutClient], Awaitable[T]]) -> concurrent.futures.Future[T]:
        """Start ``fn(client)`` as a task on the bridge's loop; cancelled by :meth:`close`."""
        client = self.client
        fut: concurrent.futures.Future[T] = self._portal.start_task_soon(_call, fn, client)
        self._tasks.add(fut)
        fut.add_done_callback(self._tasks.discard)
        return fut

    def ensure_weight_sync(self, *, backend: str = "gloo", device: Any = None) -> None:
        """Join this process and every engine in a weight-update group, once (``backend``: gloo moves CPU
        tensors; nccl with ``device="cuda:N"`` moves CUDA ones)."""
        if self._weight_sync_ready:
            return

        async def init(client: RolloutClient) -> None:
            await client.init_weight_sync(backend=backend, device=device)

        self.run(init)
        self._weight_sync_ready = True

    def push_weights(
        self,
        named: Iterable[tuple[str, Any]],
        *,
        version: int,
        backend: str = "gloo",
        device: Any = None,
        **update_kwargs: Any,
    ) -> dict[str, float]:
        """Broadcast ``named`` (HF names, tensors) into every engine as ``version`` (joining the weight
        group first if needed); ``update_kwargs`` go to :meth:`RolloutClient.update_weights`."""
        # iterate here, on the caller's thread: FSDP full_tensor() collectives must run where the trainer runs
        tensors = [(name, t.detach()) for name, t in named]
        self.ensure_weight_sync(backend=backend, device=device)

        async def push(client: RolloutClient) -> dict[str, float]:
            return await client.update_weights(tensors, version=version, **update_kwargs)

        return self.run(push)


async def _call(fn: Callable[[RolloutClient], Awaitable[T]], client: RolloutClient) -> T:
    return await fn(client)
