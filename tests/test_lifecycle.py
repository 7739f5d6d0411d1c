"""One Lifecycle for the client, server, gateway and bridge: misuse raises a typed error naming the state."""

from __future__ import annotations

import pickle

import pytest

from rollout_sdk import ClientState, ClientStateError, EngineServer, LifecycleError, RolloutClient, ServerConfig
from rollout_sdk._aio import LifecycleGuard, LifecycleState
from rollout_sdk.engines.fake import FakeEngine


def test_transitions_and_misuse() -> None:
    life = LifecycleGuard("Thing")
    assert life.state is LifecycleState.UNOPENED
    with pytest.raises(LifecycleError, match="Thing is unopened: open it") as info:
        life.check_open("open it")
    assert info.value.state == "unopened"
    life.opening()
    with pytest.raises(LifecycleError, match=r"a Thing opens once \(this one is opening\)"):
        life.opening()
    life.opened()
    assert life.is_open
    life.check_open("unused")
    assert life.closing() is True
    assert life.closing() is False  # a second close has nothing to do
    life.closed()
    life.opened()  # a close that came meanwhile wins
    assert life.state is LifecycleState.CLOSED
    with pytest.raises(LifecycleError, match="Thing is closed") as info:
        life.check_open("gone")
    assert info.value.state == "closed"
    copy = pickle.loads(pickle.dumps(info.value))
    assert (type(copy), str(copy), copy.state) == (LifecycleError, str(info.value), "closed")


async def test_a_failed_open_tears_down_and_closes() -> None:
    life = LifecycleGuard("Thing", error=ClientStateError)
    seen: list[LifecycleState] = []

    async def start() -> None:
        raise OSError("no port")

    async def teardown() -> None:
        seen.append(life.state)

    with pytest.raises(OSError, match="no port"):
        await life.open_with(start, teardown)
    assert seen == [LifecycleState.CLOSING]
    assert life.state is LifecycleState.CLOSED
    with pytest.raises(ClientStateError, match="opens once"):
        await life.open_with(start, teardown)
    await life.close_with(teardown)  # closed already: nothing runs
    assert seen == [LifecycleState.CLOSING]


def test_the_client_state_is_the_shared_state() -> None:
    assert ClientState is LifecycleState
    assert issubclass(ClientStateError, LifecycleError)
    assert RolloutClient(servers=["tcp://127.0.0.1:9"]).state is ClientState.UNOPENED


async def test_a_server_serves_once() -> None:
    server = EngineServer(FakeEngine(), ServerConfig(server_id="fake-0"))  # type: ignore[arg-type]
    assert server.state is LifecycleState.UNOPENED
    async with server:
        assert server.state is LifecycleState.OPEN
        with pytest.raises(LifecycleError, match=r"a EngineServer opens once \(this one is open\)") as info:
            await server.serve()
        assert info.value.state == "open"
    assert server.state is LifecycleState.CLOSED
    with pytest.raises(LifecycleError, match="this one is closed"):
        await server.serve()


async def test_the_gateway_names_its_state() -> None:
    pytest.importorskip("aiohttp")
    from rollout_sdk.gateway import Gateway

    gw = Gateway(servers=["tcp://127.0.0.1:9"])
    with pytest.raises(ClientStateError, match="Gateway is unopened"):
        gw._check_open()
    await gw.aclose()
    with pytest.raises(ClientStateError, match="Gateway is closed"):
        gw._check_open()


def test_the_bridge_names_its_state() -> None:
    from rollout_sdk.integrations.bridge import RolloutBridge

    bridge = RolloutBridge(["tcp://127.0.0.1:9"])
    with pytest.raises(ClientStateError, match="RolloutBridge is unopened: open it first"):
        _ = bridge.client
    bridge.close()
    with pytest.raises(ClientStateError, match="RolloutBridge is closed"):
        _ = bridge.client
    with pytest.raises(ClientStateError, match="opens once"):
        bridge.open()


async def test_await_unless_with_a_timeout_keeps_a_result_and_cancels_the_rest() -> None:
    import asyncio

    from rollout_sdk._aio import await_unless

    queue: asyncio.Queue[int] = asyncio.Queue()
    never = asyncio.Event()
    assert await await_unless(queue.get(), never.wait(), timeout=0) is None  # nothing there: timed out
    queue.put_nowait(7)
    assert await await_unless(queue.get(), never.wait(), timeout=None) == 7
    stop = asyncio.Event()
    stop.set()
    queue.put_nowait(8)
    assert queue.qsize() == 1
    with pytest.raises(LookupError):
        await await_unless(asyncio.Event().wait(), stop.wait(), error=LookupError, timeout=30)
    got = await await_unless(queue.get(), never.wait(), timeout=0)
    assert got == 8 or queue.get_nowait() == 8  # taken and returned, or left in the queue: never lost
