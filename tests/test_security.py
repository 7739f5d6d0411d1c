"""Authentication and roles: CURVE + ZAP on every connection, generate vs control, key files, defaults.

The attacker's peers are raw pyzmq sockets (no rollout-sdk code on their side).  They send every message
type the server decodes; the test then waits for the handshake's refusal (a monitor event, not a sleep)
and checks, through a legitimate control client, that nothing about the server changed: weight version,
pause state, memory state, and a victim's in-flight request, which still completes normally.
"""

from __future__ import annotations

import asyncio
import os
import stat
import subprocess
import sys
import typing
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from rollout_sdk import (
    AuthenticationError,
    ConfigError,
    Credentials,
    JobSecret,
    PermissionDeniedError,
    RolloutClient,
    SamplingParams,
)
from rollout_sdk.discovery.store import seal, unseal
from rollout_sdk.engines.fake import FakeEngine
from rollout_sdk.protocol import (
    Abort,
    ClientMessage,
    ControlReply,
    DestroyWeightGroup,
    ErrorReply,
    FlushCache,
    GenerateRequest,
    GenerateResult,
    GetInfo,
    InitWeightGroup,
    PauseGeneration,
    Ping,
    Pong,
    ReleaseMemory,
    ResumeGeneration,
    ResumeMemory,
    SessionHint,
    SessionHints,
    SetWeightVersion,
    TensorMeta,
    UpdateWeightsDistributed,
    UpdateWeightsFromIpc,
    decode_server_message,
    encode,
)
from rollout_sdk.server import EngineServer, ServerConfig

ROOT = Path(__file__).resolve().parent.parent
_META = [[TensorMeta("w", "float32", [4])]]

#: one message of every type the server's decoder admits (checked against the protocol's union below)
EVERY_MESSAGE: list[msgspec.Struct] = [
    GenerateRequest(input_ids=[1, 2, 3], sampling=SamplingParams(max_new_tokens=2), rid="evil"),
    Abort(""),
    Abort("victim"),
    Ping(1),
    GetInfo("c-info"),
    PauseGeneration("c-pause", "abort"),
    ResumeGeneration("c-resume"),
    FlushCache("c-flush"),
    ReleaseMemory("c-release"),
    ResumeMemory("c-resume-mem"),
    SetWeightVersion("c-version", 99),
    InitWeightGroup(call_id="c-init", master_address="127.0.0.1", master_port=1, rank_offset=1, world_size=2),
    UpdateWeightsDistributed(call_id="c-dist", group_name="rollout_weights", buckets=_META, version=7),
    UpdateWeightsFromIpc(call_id="c-ipc", handles=[b"\x00" * 8], buckets=_META, version=7),
    DestroyWeightGroup("c-destroy"),
    SessionHints("c-hints", [SessionHint(session_id="victim-session", ended=True)]),
]
#: what the generate role may send: requests, its aborts, pings, info, and its sessions' (advisory) hints
CONTROL_MESSAGES = [
    m for m in EVERY_MESSAGE if not isinstance(m, GenerateRequest | Abort | Ping | GetInfo | SessionHints)
]


def test_every_message_type_is_covered() -> None:
    assert {type(m) for m in EVERY_MESSAGE} == set(typing.get_args(ClientMessage))


# -- fixtures ----------------------------------------------------------------------------------------


class Guarded:
    """A CURVE server around a gated FakeEngine, a control client, and a victim request held in flight."""

    def __init__(self, server: EngineServer, engine: FakeEngine, gate: asyncio.Event, secret: JobSecret) -> None:
        self.server = server
        self.engine = engine
        self.gate = gate
        self.secret = secret

    def snapshot(self) -> dict[str, Any]:
        s = self.server.stats()
        return {
            "weight_version": self.engine.weight_version,
            "paused": self.engine.paused,
            "memory_released": set(self.engine.memory_released),
            "weights": dict(self.engine.weights),
            "in_flight": s.in_flight,
            "aborted": list(self.engine.aborted_rids),
            "seen": [r.rid for r in self.engine.requests_seen],
        }


@pytest.fixture
async def guarded() -> AsyncIterator[tuple[Guarded, RolloutClient, asyncio.Task[GenerateResult]]]:
    secret = JobSecret.generate()
    gate = asyncio.Event()
    engine = FakeEngine(gate=gate)
    async with EngineServer(engine, ServerConfig(auth=secret.server_auth())) as server:
        async with RolloutClient(servers=[server.address], credentials=secret.credentials("control")) as owner:
            victim = asyncio.ensure_future(owner.generate([5, 6, 7], sampling=SamplingParams(max_new_tokens=3)))
            await _until(lambda: server.stats().in_flight == 1)
            yield Guarded(server, engine, gate, secret), owner, victim
            victim.cancel()


async def _until(cond: Any, timeout: float = 30.0) -> None:
    async with asyncio.timeout(timeout):
        while not cond():
            await asyncio.sleep(0.01)


_FAILED = zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL


async def _attack(address: str, setup: Any) -> tuple[int, list[bytes]]:
    """Connect a raw DEALER (configured by ``setup``), queue every message type, wait for the handshake to
    fail; return the failure event and whatever the server sent back (nothing, if it is sound)."""
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    setup(sock)
    mon = sock.get_monitor_socket(_FAILED | zmq.EVENT_HANDSHAKE_SUCCEEDED)
    try:
        sock.connect(address)
        for msg in EVERY_MESSAGE:  # queued: sent the moment a handshake succeeds (it must not)
            await sock.send(encode(msg))
        async with asyncio.timeout(30):
            event = parse_monitor_message(await mon.recv_multipart())["event"]
        replies = []
        while await sock.poll(0):
            replies.append(await sock.recv())
        return event, replies
    finally:
        sock.disable_monitor()
        mon.close(0)
        sock.close(0)
        ctx.destroy(linger=0)  # closes what is left and terminates without waiting on a peer


def _no_keys(sock: zmq.Socket[Any]) -> None:
    pass


def _plain_password(sock: zmq.Socket[Any]) -> None:
    sock.setsockopt(zmq.PLAIN_USERNAME, b"admin")
    sock.setsockopt(zmq.PLAIN_PASSWORD, b"admin")


def _curve(creds: Credentials) -> Any:
    def setup(sock: zmq.Socket[Any]) -> None:
        sock.setsockopt(zmq.CURVE_SERVERKEY, creds.server_public)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, creds.keys.public)
        sock.setsockopt(zmq.CURVE_SECRETKEY, creds.keys.secret)

    return setup


def _fresh_keys(server_public: bytes) -> Credentials:
    """A well-formed CURVE key pair nobody authorized, aimed at the right server key."""
    public, secret = zmq.curve_keypair()
    from rollout_sdk.auth import KeyPair

    return Credentials(role="control", keys=KeyPair(public=public, secret=secret), server_public=server_public)


# -- unauthenticated and wrong-key peers -----------------------------------------------------------------


@pytest.mark.parametrize("peer", ["no keys", "PLAIN password", "another job's keys", "unknown client key"])
async def test_unauthenticated_peer_sending_every_message_changes_nothing(guarded, peer) -> None:
    g, owner, victim = guarded
    before = g.snapshot()
    refused_before = g.server.auth_refused
    setup = {
        "no keys": _no_keys,
        "PLAIN password": _plain_password,
        "another job's keys": _curve(JobSecret.generate().credentials("control")),
        "unknown client key": _curve(_fresh_keys(g.secret.keypair("server").public)),
    }[peer]
    event, replies = await _attack(g.server.address, setup)
    assert event & _FAILED, f"handshake did not fail (event {event})"
    assert replies == []
    if peer == "unknown client key":  # reached the ZAP handler, which refused it
        await _until(lambda: g.server.auth_refused == refused_before + 1)
    # the server's state, seen through its legitimate control client
    assert g.snapshot() == before
    assert (await owner.servers[0].fetch_stats()).weight_version == before["weight_version"]
    g.gate.set()  # the victim's request, in flight all along, completes untouched
    result = await victim
    assert (result.finish_reason, len(result.output_ids)) == ("length", 3)
    assert g.engine.weight_version == 0 and not g.engine.paused and not g.engine.memory_released


async def test_a_client_without_keys_gets_a_clear_authentication_error(guarded) -> None:
    g, _, _ = guarded
    with pytest.raises(AuthenticationError, match="requires authentication"):
        async with RolloutClient(servers=[g.server.address], connect_timeout_s=30):
            pass
    other = JobSecret.generate().credentials("control")
    with pytest.raises(AuthenticationError):
        async with RolloutClient(servers=[g.server.address], credentials=other, connect_timeout_s=30):
            pass
    stray = _fresh_keys(g.secret.keypair("server").public)
    with pytest.raises(AuthenticationError, match="refused this client's control key"):
        async with RolloutClient(servers=[g.server.address], credentials=stray, connect_timeout_s=30):
            pass


# -- roles ------------------------------------------------------------------------------------------


async def _raw_authenticated(address: str, creds: Credentials) -> tuple[zmq.asyncio.Context, zmq.asyncio.Socket]:
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    _curve(creds)(sock)
    sock.connect(address)
    return ctx, sock


async def _ask(sock: zmq.asyncio.Socket, msg: msgspec.Struct) -> Any:
    await sock.send(encode(msg))
    async with asyncio.timeout(30):
        return decode_server_message(await sock.recv())


async def test_generate_credential_is_refused_every_control_message(guarded) -> None:
    g, _, victim = guarded
    before = g.snapshot()
    ctx, sock = await _raw_authenticated(g.server.address, g.secret.credentials("generate"))
    try:
        for msg in CONTROL_MESSAGES:
            reply = await _ask(sock, msg)
            assert isinstance(reply, ErrorReply), (msg, reply)
            assert (reply.code, reply.call_id) == ("permission_denied", msg.call_id)  # type: ignore[attr-defined]
            assert type(msg).__name__ in reply.message
        assert g.snapshot() == before
        # what it may do: ping, ask who the server is (no pid, no model path), generate, abort its own
        assert isinstance(await _ask(sock, Ping(7)), Pong)
        info = await _ask(sock, GetInfo("i"))
        assert isinstance(info, ControlReply) and info.info is not None
        assert info.info.pid == 0 and "/" not in info.info.model
        await sock.send(encode(GenerateRequest(input_ids=[1, 2], sampling=SamplingParams(max_new_tokens=2), rid="g1")))
        await _until(lambda: g.server.stats().in_flight == 2)
        reply = await _ask(sock, Abort("g1"))
        assert isinstance(reply, GenerateResult) and (reply.rid, reply.finish_reason) == ("g1", "abort")
        # its abort-all reaches only its own requests: the victim is still in flight
        await sock.send(encode(Abort("")))
        assert isinstance(await _ask(sock, Ping(8)), Pong)
        assert g.server.stats().in_flight == 1
    finally:
        sock.close(0)
        ctx.destroy(linger=0)  # closes what is left and terminates without waiting on a peer
    g.gate.set()
    assert (await victim).finish_reason == "length"


async def test_generate_role_client_gets_typed_permission_errors(guarded) -> None:
    g, _, _ = guarded
    async with RolloutClient(servers=[g.server.address], credentials=g.secret.credentials("generate")) as worker:
        for call in (
            worker.pause(),
            worker.resume(),
            worker.flush_cache(),
            worker.release_memory(),
            worker.resume_memory(),
            worker.set_weight_version(5),
        ):
            with pytest.raises(PermissionDeniedError):
                await call
        g.gate.set()
        r = await worker.generate([1, 2, 3], sampling=SamplingParams(max_new_tokens=2))
        assert r.finish_reason == "length"
    assert g.engine.weight_version == 0 and not g.engine.paused


async def test_control_credential_may_do_everything(guarded) -> None:
    g, owner, victim = guarded
    await owner.set_weight_version(3)
    await owner.pause("abort")
    assert (await victim).finish_reason == "abort"
    await owner.resume()
    assert g.engine.weight_version == 3 and not g.engine.paused


# -- defaults -----------------------------------------------------------------------------------------


def test_a_bind_beyond_loopback_without_auth_is_refused_with_the_fix() -> None:
    for host in ("0.0.0.0", "10.1.2.3", "*", "::"):
        with pytest.raises(ConfigError, match="ROLLOUT_SDK_SECRET_FILE"):
            ServerConfig(host=host)
    for host in ("127.0.0.1", "127.0.0.2", "localhost", "::1"):
        ServerConfig(host=host)
    ServerConfig(host="0.0.0.0", auth=JobSecret.generate().server_auth())


def test_cli_serve_refuses_0000_without_a_secret_in_one_line(tmp_path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLOUT_SDK_SECRET")}
    out = subprocess.run(
        [sys.executable, "-m", "rollout_sdk", "serve", "--engine", "fake", "--host", "0.0.0.0"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "rollout-sdk secret" in lines[0] and "ROLLOUT_SDK_SECRET_FILE" in lines[0], out.stderr


async def test_embedded_default_needs_no_setup_and_refuses_other_local_peers() -> None:
    async with RolloutClient() as client:
        r = await client.generate([151644, 872, 198], sampling=SamplingParams(max_new_tokens=2))
        assert r.finish_reason in ("length", "stop")
        address = client.servers[0].address
        event, replies = await _attack(address, _no_keys)
        assert event & _FAILED and replies == []
        # the client's own connection is unaffected
        r = await client.generate([151644, 872, 198], sampling=SamplingParams(max_new_tokens=2))
        assert r.finish_reason in ("length", "stop")


# -- key material -----------------------------------------------------------------------------------


def test_secret_and_credentials_files_are_private_and_checked(tmp_path) -> None:
    secret = JobSecret.generate()
    path = tmp_path / "job.secret"
    secret.write(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert JobSecret.read(path).server_auth() == secret.server_auth()
    assert "hidden" in repr(secret) and secret._value.decode() not in repr(secret)
    with pytest.raises(FileExistsError):
        secret.write(path)  # never overwritten
    path.chmod(0o644)
    with pytest.raises(ConfigError, match="chmod 600"):
        JobSecret.read(path)
    with pytest.raises(ConfigError, match="chmod 600"):
        JobSecret.from_env({"ROLLOUT_SDK_SECRET_FILE": str(path)})
    with pytest.raises(ConfigError, match="at least 16 bytes"):
        JobSecret(b"short")
    creds = secret.credentials("generate")
    cpath = tmp_path / "worker.key"
    creds.save(cpath)
    assert stat.S_IMODE(cpath.stat().st_mode) == 0o600
    assert Credentials.load(cpath) == creds
    assert Credentials.from_env({"ROLLOUT_SDK_CREDENTIALS": str(cpath)}) == creds
    assert Credentials.from_env({"ROLLOUT_SDK_SECRET": secret._value.decode()}) == secret.credentials("control")
    cpath.chmod(0o640)
    with pytest.raises(ConfigError, match="readable by others"):
        Credentials.load(cpath)
    bad = tmp_path / "bad.key"
    os.close(os.open(bad, os.O_WRONLY | os.O_CREAT, 0o600))
    bad.write_text('{"role": "root", "public": "x", "secret": "y", "server_public": "z"}')
    with pytest.raises(ConfigError, match="credentials"):
        Credentials.load(bad)


def test_roles_have_distinct_keys_and_secrets_distinct_servers() -> None:
    a, b = JobSecret.generate(), JobSecret.generate()
    auth = a.server_auth()
    assert sorted(auth.clients.values()) == ["control", "generate"]
    assert a.credentials("generate").keys != a.credentials("control").keys
    assert a.credentials("control").server_public == auth.keys.public != b.server_auth().keys.public
    assert JobSecret(b"x" * 32).server_auth() == JobSecret(b"x" * 32).server_auth()  # derived, not random


def test_cli_writes_secret_and_credentials_files(tmp_path) -> None:
    secret, creds = tmp_path / "s", tmp_path / "c"
    run = [sys.executable, "-m", "rollout_sdk"]
    assert subprocess.run([*run, "secret", "--out", str(secret)], capture_output=True, timeout=60).returncode == 0
    out = subprocess.run(
        [*run, "credentials", "--role", "generate", "--out", str(creds), "--secret-file", str(secret)],
        capture_output=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert stat.S_IMODE(secret.stat().st_mode) == stat.S_IMODE(creds.stat().st_mode) == 0o600
    assert Credentials.load(creds) == JobSecret.read(secret).credentials("generate")


def test_store_values_are_sealed_to_their_key_name() -> None:
    key = JobSecret.generate().store_key
    sealed = seal(key, "p/shutdown", b"bye")
    assert unseal(key, "p/shutdown", sealed) == b"bye"
    assert unseal(key, "p/server/0", sealed) is None  # not replayable under another key
    assert unseal(key, "p/shutdown", b"bye") is None  # unsigned
    assert unseal(JobSecret.generate().store_key, "p/shutdown", sealed) is None  # another secret
    assert unseal(key, "p/shutdown", sealed[:-1] + b"X") is None  # tampered
    assert unseal(None, "p/shutdown", sealed) == b"bye"  # a reader without the secret strips it
    assert seal(None, "k", b"v") == b"v"


def test_client_routing_ids_are_random_so_no_peer_can_claim_anothers_replies() -> None:
    from rollout_sdk import _transport

    ctx = _transport.new_context()
    try:
        ids = set()
        for _ in range(3):
            ch = _transport.DealerChannel(ctx, "tcp://127.0.0.1:1")
            ids.add(ch.routing_id)
            asyncio.run(ch.close())
        assert len(ids) == 3 and all(len(i) == 16 and i[0] != 0 for i in ids)
    finally:
        ctx.destroy(linger=0)  # closes what is left and terminates without waiting on a peer


def test_authorize_refuses_unknown_roles_everything() -> None:
    from rollout_sdk.server import authorize

    for msg in EVERY_MESSAGE:
        authorize(msg, None)  # an unauthenticated loopback server: all allowed
        authorize(msg, "control")
        with pytest.raises(PermissionDeniedError):
            authorize(msg, "")
    for msg in CONTROL_MESSAGES:
        with pytest.raises(PermissionDeniedError):
            authorize(msg, "generate")
