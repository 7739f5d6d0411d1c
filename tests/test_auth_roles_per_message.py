"""The role of every message is read from its own connection, on every message (issue 31 item 3).

The authenticated receive path reads each message's ZAP User-Id from libzmq with one ``zmq.Frame`` per
message (the last frame) instead of a Frame per frame.  What must not change with it: the role comes from
the key of the connection the message arrived on, never from its routing id (which a peer chooses, and can
take over with ROUTER_HANDOVER), messages of two roles read in one receive are told apart, and a message of
more than one frame still reaches the server whole, to be refused.  Peers are raw pyzmq DEALERs.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

import zmq
import zmq.asyncio

from rollout_sdk import JobSecret
from rollout_sdk._transport import bind_router, new_context
from rollout_sdk.auth import Credentials
from rollout_sdk.engines.fake import FakeEngine
from rollout_sdk.protocol import ControlReply, ErrorReply, Ping, Pong, SetWeightVersion, decode_server_message, encode
from rollout_sdk.server import EngineServer, ServerConfig


def _dealer(ctx: zmq.asyncio.Context, address: str, creds: Credentials, routing_id: bytes | None = None) -> Any:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if routing_id is not None:
        sock.setsockopt(zmq.ROUTING_ID, routing_id)
    sock.setsockopt(zmq.CURVE_SERVERKEY, creds.server_public)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, creds.keys.public)
    sock.setsockopt(zmq.CURVE_SECRETKEY, creds.keys.secret)
    sock.connect(address)
    return sock


async def _ask(sock: Any, msg: Any) -> Any:
    await sock.send(encode(msg))
    async with asyncio.timeout(30):
        return decode_server_message(await sock.recv())


async def test_two_roles_interleaved_each_message_carries_its_own_connections_role() -> None:
    secret = JobSecret.generate()
    ctx = new_context()
    endpoint = bind_router(ctx, "127.0.0.1", auth=secret.server_auth())
    actx = zmq.asyncio.Context()
    address = f"tcp://127.0.0.1:{endpoint.port}"
    socks = {role: _dealer(actx, address, secret.credentials(role)) for role in ("control", "generate")}
    try:
        n = 200
        for i in range(n):  # interleaved, so that receives mix both connections' messages
            for role, sock in socks.items():
                await sock.send(f"{role}:{i}".encode())
        seen: dict[str, list[int]] = {"control": [], "generate": []}
        async with asyncio.timeout(30):
            while sum(map(len, seen.values())) < 2 * n:
                for frames, got_role in await endpoint.recv_batch_with_roles(max_n=64):
                    assert len(frames) == 2 and len(frames[0]) > 0
                    sender, _, i = frames[1].decode().partition(":")
                    assert got_role == sender, (got_role, frames[1])
                    seen[sender].append(int(i))
        assert seen == {"control": list(range(n)), "generate": list(range(n))}
        # a message of three frames arrives whole, with its role
        await socks["generate"].send_multipart([b"a", b"b", b"c"])
        async with asyncio.timeout(30):
            [(frames, got_role)] = await endpoint.recv_batch_with_roles()
        assert frames[1:] == [b"a", b"b", b"c"] and got_role == "generate"
    finally:
        for sock in socks.values():
            sock.close(0)
        actx.term()
        await endpoint.close(0)
        await asyncio.to_thread(ctx.term)


async def test_a_generate_key_taking_over_a_control_clients_routing_id_gets_generate_rights_only() -> None:
    secret = JobSecret.generate()
    engine = FakeEngine()
    async with EngineServer(engine, ServerConfig(auth=secret.server_auth())) as server:
        actx = zmq.asyncio.Context()
        routing_id = b"c" + os.urandom(15)
        owner = _dealer(actx, server.address, secret.credentials("control"), routing_id)
        thief = None
        try:
            reply = await _ask(owner, SetWeightVersion("v1", 1))
            assert isinstance(reply, ControlReply) and engine.weight_version == 1
            # a generate-key peer that learned the control client's routing id takes it over (ROUTER_HANDOVER)
            thief = _dealer(actx, server.address, secret.credentials("generate"), routing_id)
            assert isinstance(await _ask(thief, Ping(1)), Pong)  # handshaken, served under that routing id
            for i in range(3):  # every message, not only the first of the connection, is checked
                reply = await _ask(thief, SetWeightVersion(f"v{i + 2}", 99))
                assert isinstance(reply, ErrorReply) and reply.code == "permission_denied", reply
            assert engine.weight_version == 1
            # a message of more than one frame from an authenticated peer: refused, and the server serves on
            await thief.send_multipart([encode(Ping(2)), b"extra"])
            async with asyncio.timeout(30):
                reply = decode_server_message(await thief.recv())
            assert isinstance(reply, ErrorReply) and reply.code == "protocol", reply
            assert isinstance(await _ask(thief, Ping(3)), Pong)
        finally:
            owner.close(0)
            if thief is not None:
                thief.close(0)
            actx.term()
